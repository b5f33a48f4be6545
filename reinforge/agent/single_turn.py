"""``single_turn``: one answer to the prompt, as a plain rollout gives."""

from __future__ import annotations

import time
from typing import Any

from reinforge.agent.loop import AgentLoop, AgentLoopOutput, register_agent_loop
from reinforge.rollout.base import SamplingParams


@register_agent_loop("single_turn")
class SingleTurnLoop(AgentLoop):
    async def run(self, sampling: SamplingParams, **row: Any) -> AgentLoopOutput:
        prompt_ids = list(row["prompt_ids"])
        start = time.perf_counter()
        images = row.get("multi_modal_inputs") or None
        completion = await self.context.client.generate(prompt_ids, sampling, str(row.get("request_id", "")),
                                                        **({"multi_modal_inputs": images} if images else {}))
        return AgentLoopOutput(
            multi_modal_inputs=images, prompt_ids=prompt_ids, response_ids=list(completion.token_ids),
            response_mask=[1] * len(completion.token_ids), response_log_probs=list(completion.log_probs),
            num_turns=2, finish_reason=completion.finish_reason,
            metrics={"generate_sequences": time.perf_counter() - start, "tool_calls": 0.0})
