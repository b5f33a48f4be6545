"""``calc_gsm8k_reward(answer)``: verl's GSM8K tool, the multi-turn GSM8K example's way to check an answer.

The model calls it with its answer; the tool scores ``#### <answer>`` with the gsm8k scorer in
flexible mode (as verl's tool does) against the row's ground truth, and says so in the tool
message. Its reward is 0 when a call scores higher than the trajectory's previous call and -0.05
when it does not, which discourages submitting the same answer again. The ground truth comes from the
row's ``extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth``, as in verl's data.

Tool config entry (``rollout.multi_turn.tool_config_path``); verl's
``verl.tools.gsm8k_tool.Gsm8kTool`` loads this class:

```yaml
tools:
  - class_name: reinforge.agent.gsm8k_tool.Gsm8kTool
```
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from reinforge.agent.tools import BaseTool, ToolResult
from reinforge.reward.scorers.gsm8k import score_gsm8k

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc_gsm8k_reward",
        "description": "Check an answer to the GSM8K problem: 1.0 when it is right, 0.0 otherwise.",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The final answer, digits only."}},
            "required": ["answer"],
        },
    },
}
NO_IMPROVEMENT_REWARD = -0.05


@dataclass
class _Attempts:
    ground_truth: str | None
    last_score: float = 0.0


class Gsm8kTool(BaseTool):
    """config: none is read (verl's ``type`` key may stay); schema: verl's, or ``SCHEMA`` when the entry has none."""

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None):
        super().__init__(config, schema or SCHEMA)
        self._instances: dict[str, _Attempts] = {}

    async def create(self, instance_id: str | None = None, ground_truth: Any = None, **create_kwargs: Any) -> str:
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = _Attempts(None if ground_truth is None else str(ground_truth))
        return instance_id

    async def execute(self, instance_id: str, arguments: dict[str, Any], **execute_kwargs: Any) -> ToolResult:
        attempts = self._instances[instance_id]
        answer = str(arguments.get("answer", ""))
        submitted = answer if answer.startswith("#### ") else f"#### {answer}"
        score = 0.0
        if attempts.ground_truth is not None:
            score = score_gsm8k(submitted, attempts.ground_truth, method="flexible")["score"]
        reward = 0.0 if score > attempts.last_score else NO_IMPROVEMENT_REWARD
        attempts.last_score = score
        return ToolResult(f"Current parsed answer={answer!r} reward={score}", reward, {"correct": score})

    async def release(self, instance_id: str) -> None:
        self._instances.pop(instance_id, None)
