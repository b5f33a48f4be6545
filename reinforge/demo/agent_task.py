"""The agent demo's task: multiply two 3-digit numbers, with a calculator the model may call.

A problem is the user message ``"482*317"``; the answer is the product alone. No small model
multiplies 3-digit numbers in its head, but one can copy the expression into a calculator call
and copy the result back. The model calls the calculator in Hermes's format,
``<tool_call>{"name": "calc", "arguments": {"e": "482*317"}}</tool_call>``; its tokenizer (the
character tokenizer) has one token each for ``<tool_call>``, ``</tool_call>`` and the fixed parts
of the JSON, as a BPE vocabulary has for strings it sees often.

The SFT conversations the model starts from are flawed on purpose: only ``sft_tool_fraction``
of them (30%) use the calculator; the rest answer at once, from "memory", as a model imitating
answers it cannot compute does. The model learns both habits, and greedily it answers at once
and gets nearly every held-out product wrong. Sampled, it calls the calculator about a third of
the time and is then usually right; GRPO, rewarded only for the right final answer, learns to
call it every time.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from reinforge.demo.task import ASSETS_DIR

AGENT_MODEL_DIR = ASSETS_DIR / "agent_model"
"""The committed agent demo model (weights, config, tokenizer.json with the call tokens)."""
DATA_SOURCE = "multiply"
CALL_PREFIX = '{"name": "calc", "arguments": {"e": "'
CALL_SUFFIX = '"}}'
EXTRA_TOKENS = ("<tool_call>", "</tool_call>", CALL_PREFIX, CALL_SUFFIX)


def calc(e: str) -> str:
    """Evaluate a product or sum of integers.

    Args:
        e: An expression of digits joined by * + or -, such as 482*317.
    """
    if not e or set(e) - set("0123456789*+-") or "**" in e:
        raise ValueError("the calculator takes digits joined by * + or -")
    return str(eval(e))  # only digits and * + - reach this line


def compute_score(solution_str: str, ground_truth: str, **kwargs) -> dict:
    """1 when the response's last line (the final answer, after any tool turns) is the product."""
    answer = solution_str.strip().split("\n")[-1].strip()
    correct = answer == str(ground_truth)
    return {"score": 1.0 if correct else 0.0, "acc": correct}


def tool_call_text(expression: str) -> str:
    return f"<tool_call>{CALL_PREFIX}{expression}{CALL_SUFFIX}</tool_call>"


@dataclass(frozen=True)
class AgentDemoTask:
    digits: int = 3
    num_train: int = 4000
    num_test: int = 200
    num_sft: int = 20000
    sft_tool_fraction: float = 0.3
    """Share of SFT conversations that call the calculator; the rest answer at once (the flaw RL fixes)."""
    seed: int = 0
    max_prompt_length: int = 32
    max_response_length: int = 64
    """A call (about 12 tokens), the tool turn (about 24) and the answer (7)."""

    def problems(self) -> dict[str, list[tuple[int, int]]]:
        """Distinct train, test and SFT problems; the test ones are in neither of the others."""
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        rng = random.Random(self.seed)
        test: set[tuple[int, int]] = set()
        while len(test) < self.num_test:
            test.add((rng.randint(low, high), rng.randint(low, high)))
        splits: dict[str, list[tuple[int, int]]] = {"test": sorted(test)}
        for name, count in (("train", self.num_train), ("sft", self.num_sft)):
            splits[name] = []
            while len(splits[name]) < count:
                pair = (rng.randint(low, high), rng.randint(low, high))
                if pair not in test:
                    splits[name].append(pair)
        return splits

    def write(self, out_dir: str | Path) -> dict[str, str]:
        """train.jsonl and test.jsonl (RL rows, agent_name tool_agent), sft_train.jsonl (conversations)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        splits = self.problems()
        rng = random.Random(self.seed + 1)
        paths = {}
        for name in ("train", "test"):
            rows = [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"{a}*{b}"}],
                     "agent_name": "tool_agent", "reward_model": {"ground_truth": str(a * b)}, "extra_info": {}}
                    for a, b in splits[name]]
            paths[name] = str(_write_jsonl(out / f"{name}.jsonl", rows))
        conversations = []
        for a, b in splits["sft"]:
            question, answer = f"{a}*{b}", str(a * b)
            if rng.random() < self.sft_tool_fraction:
                messages = [{"role": "user", "content": question},
                            {"role": "assistant", "content": tool_call_text(question)},
                            {"role": "tool", "content": calc(question)},
                            {"role": "assistant", "content": answer}]
            else:
                messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            conversations.append({"messages": messages})
        paths["sft_train"] = str(_write_jsonl(out / "sft_train.jsonl", conversations))
        tools = out / "tools.yaml"
        tools.write_text("tools:\n  - class_name: reinforge.demo.agent_task.calc\n")
        paths["tools"] = str(tools)
        return paths


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


AGENT_TASK = AgentDemoTask()
