"""Rebuild the demo model from scratch: ``python -m reinforge.demo.build [--out DIR]``.

A randomly initialised small Qwen2 with the character tokenizer is fine-tuned by the SFT
trainer on the demo task's training conversations, whose answers carry a deliberate flaw (a
share of them has the wrong sign; see ``reinforge.demo.task``). It learns to subtract and
learns the flaw, so it gets only part of the held-out problems right greedily while its sampled
answers are often right: room for RL to improve it. Everything is seeded, so a rebuild on the
CPU reproduces the committed model's accuracy within a few points (on the same machine and
torch build, byte for byte). Takes about fifteen minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from reinforge.demo.task import MODEL, MODEL_CARD, MODEL_DIR, TASK, DemoModel, DemoTask

BUILD_COMMAND = "python -m reinforge.demo.build"
ACCURACY_KEY = "val-core/arithmetic/acc/mean@1"


@dataclass(frozen=True)
class SFTBudget:
    steps: int = 2500
    batch_size: int = 64
    lr: float = 1e-3
    schedule: str = "cosine"
    warmup_steps: int = 20
    seed: int = 1


SFT = SFTBudget()


def held_out_accuracy(model_dir: Path, test_file: str, task: DemoTask = TASK, device: str = "cpu") -> float:
    """Greedy accuracy of the model on the held-out problems."""
    from reinforge.config import load_config
    from reinforge.trainer.evaluate import evaluate

    config = load_config(None, [f"model.path={model_dir}", f"data.val_files=[{test_file}]",
                                f"data.max_prompt_length={task.max_prompt_length}",
                                f"data.max_response_length={task.max_response_length}", f"trainer.device={device}",
                                "reward.num_workers=0"])
    return evaluate(config)[ACCURACY_KEY]


def build_demo_model(out_dir: str | Path = MODEL_DIR, *, task: DemoTask = TASK, model: DemoModel = MODEL,
                     budget: SFTBudget = SFT, work_dir: str | Path | None = None, device: str = "cpu",
                     loggers: tuple[str, ...] = ("console", "jsonl")) -> dict:
    """Initialise, fine-tune and measure the demo model; write it to ``out_dir`` atomically. Returns its card."""
    from reinforge.models import save_tiny_model

    started = time.perf_counter()
    with work_folder(work_dir, "reinforge-demo-build-") as work:
        files = task.write(work / "data")
        init_dir = save_tiny_model(work / "init", **asdict(model))
        return fine_tune_and_write(out_dir, init_dir, files["sft_train"], work / "sft", max_length=128, budget=budget,
                                   device=device, loggers=loggers,
                                   measure=lambda sft_model: held_out_accuracy(sft_model, files["test"], task, device),
                                   card={"task": asdict(task), "model": asdict(model)}, started=started,
                                   rebuild_command=BUILD_COMMAND)


@contextlib.contextmanager
def work_folder(work_dir: str | Path | None, prefix: str) -> Iterator[Path]:
    """``work_dir`` (kept), or a temporary folder named ``prefix...`` that is removed on leaving."""
    if work_dir is not None:
        yield Path(work_dir)
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as temporary:
        yield Path(temporary)


def fine_tune_and_write(out_dir: str | Path, init_dir: Path, train_file: str, run_dir: Path, *, max_length: int,
                        budget: SFTBudget, device: str, loggers: tuple[str, ...],
                        measure: Callable[[Path], float], card: dict, started: float, rebuild_command: str) -> dict:
    """SFT of the model at ``init_dir`` on ``train_file`` (a run in ``run_dir``); the result, measured by ``measure``,
    is written to ``out_dir`` atomically with its model card (``card`` plus accuracy, budget and build time)."""
    from reinforge.config import load_sft_config
    from reinforge.models import atomic_folder
    from reinforge.trainer.sft_trainer import SFTTrainer

    config = load_sft_config(None, [
        f"model.path={init_dir}", f"data.train_files=[{train_file}]", f"data.max_length={max_length}",
        f"data.batch_size={budget.batch_size}", f"data.seed={budget.seed}", f"trainer.seed={budget.seed}",
        f"trainer.total_steps={budget.steps}", f"optim.lr={budget.lr}", f"optim.schedule={budget.schedule}",
        f"optim.warmup_steps={budget.warmup_steps}", f"trainer.output_dir={run_dir}",
        "trainer.resume=never", f"trainer.device={device}", f"trainer.loggers=[{','.join(loggers)}]"])
    trainer = SFTTrainer(config)
    last = trainer.fit()
    sft_model = trainer.final_model_dir()
    card = {"held_out_accuracy": measure(sft_model), "sft_steps": budget.steps, "sft_final_loss": last.get("train/loss"),
            **card, "sft": asdict(budget), "build_seconds": round(time.perf_counter() - started, 1),
            "rebuild_command": rebuild_command}
    with atomic_folder(out_dir) as staging:
        for path in sft_model.iterdir():
            shutil.copy2(path, staging / path.name)
        (staging / MODEL_CARD).write_text(json.dumps(card, indent=2) + "\n")
    return card


def build_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=BUILD_COMMAND, description="Rebuild the demo model from scratch by SFT.")
    parser.add_argument("--out", type=Path, default=MODEL_DIR, help=f"the model folder to write (default: {MODEL_DIR})")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the data and the SFT run here")
    parser.add_argument("--device", default="cpu", help="cpu (reproduces the committed model) or cuda")
    args = parser.parse_args(argv)
    card = build_demo_model(args.out, work_dir=args.work_dir, device=args.device)
    print(f"demo model written to {args.out}: held-out accuracy {100 * card['held_out_accuracy']:.1f}% "
          f"after {card['sft_steps']} SFT steps ({card['build_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    sys.exit(build_main(sys.argv[1:]))
