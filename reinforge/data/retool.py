"""Math problems for the ReTool recipe: ``reinforge data retool --src DIR --out DIR``.

ReTool (Feng et al., 2025) trains a model to interleave reasoning with code it runs in a
sandbox. Each GSM8K question becomes a row answered by the ``tool_agent`` loop (which offers
the ``code_interpreter`` tool from ``rollout.multi_turn.tool_config_path``), asking for the final
answer in ``\\boxed{}``, which is what the ``gsm8k_boxed`` scorer reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reinforge.data.gsm8k import convert_gsm8k, extract_final_answer

DATA_SOURCE = "gsm8k_boxed"
AGENT_NAME = "tool_agent"
INSTRUCTION = ("Solve the problem step by step. You may call the code_interpreter tool to run Python code; "
               "you will see what it prints. Put your final answer in \\boxed{}.")


def make_retool_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """One row in the RL schema, for the tool_agent loop."""
    return {
        "data_source": DATA_SOURCE,
        "agent_name": AGENT_NAME,
        "prompt": [{"role": "user", "content": f"{question}\n\n{INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_final_answer(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def convert_retool(src_dir: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """GSM8K's ``train.jsonl``/``test.jsonl`` under ``src_dir`` as ReTool rows in ``out_dir``/{train,test}.parquet."""
    return convert_gsm8k(src_dir, out_dir, make_row=make_retool_row)
