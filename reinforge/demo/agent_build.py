"""Rebuild the agent demo model from scratch: ``python -m reinforge.demo.agent_build [--out DIR]``.

A randomly initialised small Qwen2 with the character tokenizer (plus the call tokens of
``agent_task``) is fine-tuned by the SFT trainer on the task's conversations, of which 60%
call the calculator (see ``reinforge.demo.agent_task``). It learns the call format, to copy the
expression into the call and the result into its answer, and the habit of answering at once.
Everything is seeded, so a rebuild on the CPU reproduces the committed model.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from reinforge.demo.agent_task import AGENT_MODEL_DIR, AGENT_TASK, DATA_SOURCE, EXTRA_TOKENS, AgentDemoTask
from reinforge.demo.build import SFTBudget, fine_tune_and_write, work_folder
from reinforge.demo.task import DemoModel

BUILD_COMMAND = "python -m reinforge.demo.agent_build"
ACCURACY_KEY = f"val-core/{DATA_SOURCE}/acc/mean@1"
AGENT_MODEL = DemoModel(hidden_size=96, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=256)


AGENT_SFT = SFTBudget(steps=700, batch_size=32, lr=3e-3)


def agent_overrides(model_dir: Path, files: dict[str, str], task: AgentDemoTask, device: str) -> list[str]:
    """What evaluation and the RL run of the agent demo share: data lengths, the tool, the scorer, the engine."""
    return [f"model.path={model_dir}", f"data.max_prompt_length={task.max_prompt_length}",
            f"data.max_response_length={task.max_response_length}", f"trainer.device={device}",
            f"rollout.multi_turn.tool_config_path={files['tools']}", "rollout.multi_turn.max_assistant_turns=2",
            f"reward.custom_function={Path(__file__).with_name('agent_reward.py')}:compute_score",
            "reward.num_workers=0"]


def held_out_accuracy(model_dir: Path, files: dict[str, str], task: AgentDemoTask = AGENT_TASK,
                      device: str = "cpu") -> float:
    from reinforge.config import load_config
    from reinforge.trainer.evaluate import evaluate

    config = load_config(None, [*agent_overrides(model_dir, files, task, device), f"data.val_files=[{files['test']}]"])
    return evaluate(config)[ACCURACY_KEY]


def build_agent_model(out_dir: str | Path = AGENT_MODEL_DIR, *, task: AgentDemoTask = AGENT_TASK,
                      model: DemoModel = AGENT_MODEL, budget: SFTBudget = AGENT_SFT,
                      work_dir: str | Path | None = None, device: str = "cpu",
                      loggers: tuple[str, ...] = ("console", "jsonl")) -> dict:
    """Initialise, fine-tune and measure the agent demo model; write it to ``out_dir`` atomically. Returns its card."""
    from reinforge.models import save_tiny_model

    started = time.perf_counter()
    with work_folder(work_dir, "reinforge-agent-build-") as work:
        files = task.write(work / "data")
        init_dir = save_tiny_model(work / "init", extra_tokens=EXTRA_TOKENS, **asdict(model))
        return fine_tune_and_write(out_dir, init_dir, files["sft_train"], work / "sft", max_length=72, budget=budget,
                                   device=device, loggers=loggers,
                                   measure=lambda sft_model: held_out_accuracy(sft_model, files, task, device),
                                   card={"task": asdict(task), "model": asdict(model)}, started=started,
                                   rebuild_command=BUILD_COMMAND)


def build_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=BUILD_COMMAND, description="Rebuild the agent demo model by SFT.")
    parser.add_argument("--out", type=Path, default=AGENT_MODEL_DIR, help="the model folder to write")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the data and the SFT run here")
    parser.add_argument("--steps", type=int, default=AGENT_SFT.steps, help="SFT steps")
    parser.add_argument("--device", default="cpu", help="cpu (reproduces the committed model) or cuda")
    args = parser.parse_args(argv)
    budget = replace(AGENT_SFT, steps=args.steps)
    card = build_agent_model(args.out, work_dir=args.work_dir, device=args.device, budget=budget)
    print(f"agent demo model written to {args.out}: held-out accuracy {100 * card['held_out_accuracy']:.1f}% "
          f"after {card['sft_steps']} SFT steps ({card['build_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    sys.exit(build_main(sys.argv[1:]))
