"""The agent demo's task: multiply two 3-digit numbers, with a calculator the model may call.

A problem is the user message ``"482*317"``; the answer is the product alone. No small model
multiplies 3-digit numbers in its head, but one can call the calculator and copy its result.
The model calls it in Hermes's format, ``<tool_call>{"name": "calc", "arguments": {}}</tool_call>``;
the calculator reads the problem from the row (``extra_info.tools_kwargs.calc.execute_kwargs``),
so the model decides to call it and then has to copy the result. Its tokenizer (the character
tokenizer) has one token each for ``<tool_call>``, ``</tool_call>`` and the call's JSON, as a BPE
vocabulary has for strings it sees often.

The SFT conversations the model starts from are flawed on purpose: they all call the
calculator, but ``sft_rounded_fraction`` of them (60%) then answer with its result rounded to
hundreds ("152800" for 152794), as a model trained on sloppy transcripts does. The model learns
the call and the copy, and the habit of rounding: greedily it rounds, and gets almost every
held-out product wrong, while its sampled answers are often exact. GRPO, rewarded only for the
exact product, unlearns the rounding.
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
CALL_JSON = '{"name": "calc", "arguments": {}}'
TOOL_CALL = f"<tool_call>{CALL_JSON}</tool_call>"
EXTRA_TOKENS = ("<tool_call>", "</tool_call>", CALL_JSON)


def calc(e: str) -> str:
    """Evaluate a product or sum of integers.

    Args:
        e: An expression of digits joined by * + or -, such as 482*317 (the demo passes the row's problem).
    """
    if not e or set(e) - set("0123456789*+-") or "**" in e:
        raise ValueError("the calculator takes digits joined by * + or -")
    return str(eval(e))  # only digits and * + - reach this line


def rounded(value: int) -> str:
    return str(round(value, -2))


@dataclass(frozen=True)
class AgentDemoTask:
    digits: int = 3
    num_train: int = 4000
    num_test: int = 200
    num_sft: int = 20000
    sft_rounded_fraction: float = 0.6
    """Share of SFT conversations answered with the calculator's result rounded to hundreds (the flaw RL fixes)."""
    seed: int = 0
    max_prompt_length: int = 32
    max_response_length: int = 48
    """A call (4 tokens), the tool turn (about 24) and the answer (7)."""

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
        """train.jsonl and test.jsonl (RL rows, agent_name tool_agent), sft_train.jsonl (conversations), tools.yaml."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        splits = self.problems()
        rng = random.Random(self.seed + 1)
        paths = {}
        for name in ("train", "test"):
            rows = [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"{a}*{b}"}],
                     "agent_name": "tool_agent", "reward_model": {"ground_truth": str(a * b)},
                     "extra_info": {"tools_kwargs": {"calc": {"execute_kwargs": {"e": f"{a}*{b}"}}}}}
                    for a, b in splits[name]]
            paths[name] = str(_write_jsonl(out / f"{name}.jsonl", rows))
        conversations = []
        for a, b in splits["sft"]:
            question = f"{a}*{b}"
            answer = rounded(a * b) if rng.random() < self.sft_rounded_fraction else str(a * b)
            conversations.append({"messages": [{"role": "user", "content": question},
                                               {"role": "assistant", "content": TOOL_CALL},
                                               {"role": "tool", "content": calc(question)},
                                               {"role": "assistant", "content": answer}]})
        paths["sft_train"] = str(_write_jsonl(out / "sft_train.jsonl", conversations))
        tools = out / "tools.yaml"
        tools.write_text("tools:\n  - class_name: reinforge.demo.agent_task.calc\n")
        paths["tools"] = str(tools)
        return paths


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


AGENT_TASK = AgentDemoTask()
