"""``reinforge demo --vision`` (and ``make demo-vision``): a tiny vision-language model learns to count by GRPO.

Everything is built in the run folder, in minutes on two CPU cores: the pictures and questions of
``vision_task`` (verl's rows: PNG bytes in an ``images`` column, ``<image>`` in the prompt), a tiny
Qwen2.5-VL initialised at random (``models.tiny_vlm``), its SFT on conversations that answer one
too many more often than not (the flaw), and GRPO from the SFT model with the exact count as the
reward, its rollouts by the hf backend and its updates through the packed VLM path (the vision
tower frozen, as by default). Greedy held-out accuracy is validated before GRPO, during it and at
the end; the last line is ``demo-vision: held-out accuracy A% -> B%``.

The tiny model's ops are too small for more than one intra-op thread: the demo runs with one (a second
one only waits at OpenMP's barriers, and on a busy machine for a descheduled thread).
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass
from pathlib import Path

from reinforge.demo.runner import check_free_disk, prepare_run_dir, report_demo, train_and_measure
from reinforge.demo.vision_task import VISION_TASK, VisionDemoTask

ACCURACY_KEY = "val-core/count_red_squares/acc/mean@1"
REWARD_FILE = Path(__file__).with_name("vision_reward.py")


@dataclass(frozen=True)
class VisionDemoSettings:
    """SFT then GRPO (16 pictures x 8 samples a step) of a tiny Qwen2.5-VL, sized for two CPU cores."""

    arch: str = "qwen2_5_vl"
    sft_steps: int = 300
    sft_batch_size: int = 32
    sft_lr: float = 3e-3
    total_steps: int = 20
    train_batch_size: int = 16
    n: int = 8
    lr: float = 1e-3
    kl_loss_coef: float = 0.001
    test_every: int = 5
    save_every: int = 10
    num_val: int = 200
    seed: int = 1
    rollout: str = "hf"
    """transformers' generate; ``native`` runs the native engine's multimodal prefill (fast on a GPU)."""

    def sft_overrides(self, init_dir: Path, files: dict[str, str], run_dir: Path, device: str,
                      loggers: tuple[str, ...]) -> list[str]:
        return [f"model.path={init_dir}", f"data.train_files=[{files['sft_train']}]", "data.max_length=64",
                f"data.batch_size={self.sft_batch_size}", f"data.seed={self.seed}", f"trainer.seed={self.seed}",
                f"trainer.total_steps={self.sft_steps}", f"optim.lr={self.sft_lr}", "optim.schedule=cosine",
                "optim.warmup_steps=10", f"trainer.output_dir={run_dir}", "trainer.resume=never",
                f"trainer.save_every={self.sft_steps}", f"trainer.device={device}",
                f"trainer.loggers=[{','.join(loggers)}]"]

    def overrides(self, model_dir: Path, files: dict[str, str], run_dir: Path, task: VisionDemoTask, device: str,
                  loggers: tuple[str, ...]) -> list[str]:
        return [
            f"model.path={model_dir}", f"data.train_files=[{files['train']}]", f"data.val_files=[{files['test']}]",
            f"data.max_val_samples={self.num_val}", f"data.max_prompt_length={task.max_prompt_length}", f"data.max_response_length={task.max_response_length}",
            f"data.train_batch_size={self.train_batch_size}", f"data.seed={self.seed}",
            "algorithm.adv_estimator=grpo", f"rollout.n={self.n}", "rollout.temperature=1.0", f"rollout.name={self.rollout}",
            f"actor.optim.lr={self.lr}", "actor.use_kl_loss=true", f"actor.kl_loss_coef={self.kl_loss_coef}",
            "actor.loss_agg_mode=token-mean", f"trainer.output_dir={run_dir}", f"trainer.total_steps={self.total_steps}",
            f"trainer.test_every={self.test_every}", f"trainer.save_every={self.save_every}", "trainer.keep_last=1",
            f"trainer.seed={self.seed}", f"trainer.device={device}", f"trainer.loggers=[{','.join(loggers)}]",
            "trainer.resume=auto", "trainer.experiment_name=demo-vision",
            f"reward.custom_function={REWARD_FILE}:compute_score", "reward.num_workers=0",
        ]


def sft_model(run_dir: Path, files: dict[str, str], settings: VisionDemoSettings, device: str,
              loggers: tuple[str, ...]) -> Path:
    """The tiny VLM after SFT on the flawed conversations: ``run_dir/sft_model`` (built once, then reused)."""
    from reinforge.config import load_sft_config
    from reinforge.models import atomic_folder
    from reinforge.models.tiny_vlm import save_tiny_vlm
    from reinforge.trainer.sft_trainer import SFTTrainer

    out_dir = run_dir / "sft_model"
    if (out_dir / "config.json").is_file():
        return out_dir
    work = run_dir / "sft"
    shutil.rmtree(work, ignore_errors=True)
    init_dir = save_tiny_vlm(work / "init", settings.arch, seed=settings.seed)
    trainer = SFTTrainer(load_sft_config(None, settings.sft_overrides(init_dir, files, work / "run", device, loggers)))
    trainer.fit()
    with atomic_folder(out_dir) as staging:
        for path in trainer.final_model_dir().iterdir():
            shutil.copy2(path, staging / path.name)
    shutil.rmtree(work, ignore_errors=True)
    return out_dir


def run_vision_demo(run_dir: str | Path = "runs/demo-vision", *, settings: VisionDemoSettings = VisionDemoSettings(),
                    task: VisionDemoTask = VISION_TASK, device: str = "auto", fresh: bool = False,
                    loggers: tuple[str, ...] = ("console", "jsonl"), plots: bool = True) -> dict:
    """SFT, then GRPO, in ``run_dir``; returns {"before", "after", "seconds", "run_dir", ...} of the GRPO run."""
    import torch

    run_dir = Path(run_dir)
    check_free_disk(run_dir)
    note = prepare_run_dir(run_dir, fresh, settings.total_steps)
    if note:
        print(f"demo-vision: {note}", flush=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        files = task.write(run_dir / "data")
        model_dir = sft_model(run_dir, files, settings, device, loggers)
        return train_and_measure(run_dir, lambda: settings.overrides(model_dir, files, run_dir, task, device, loggers),
                                 settings.total_steps, ACCURACY_KEY, plots)
    finally:
        torch.set_num_threads(threads)


def vision_demo_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="reinforge demo --vision",
                                     description="Watch a tiny vision-language model learn to count by GRPO (CPU).")
    parser.add_argument("--out", type=Path, default=Path("runs/demo-vision"), help="the run folder")
    parser.add_argument("--steps", type=int, default=VisionDemoSettings.total_steps, help="GRPO steps")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    parser.add_argument("--fresh", action="store_true", help="start over instead of resuming an interrupted run")
    args = parser.parse_args(argv)
    settings = VisionDemoSettings(total_steps=args.steps, test_every=max(1, args.steps // 4),
                                  save_every=max(1, args.steps // 2))
    return report_demo("demo-vision", "`make demo-vision`", args.out,
                       lambda: run_vision_demo(args.out, settings=settings, device=args.device, fresh=args.fresh))
