"""``reinforge demo`` (and ``make demo``): GRPO from the committed demo model, before and after.

The demo model was fine-tuned on subtraction conversations of which about 60% carry the wrong
sign (see ``reinforge.demo.task``): it can subtract, but its greedy answer usually starts with
a minus sign, so it gets only part of the held-out problems right. Sampling at temperature 1
often gives the right answer, and GRPO, rewarded only by exact match with the true answer,
moves the model's preference to it in a few dozen steps; held-out accuracy rises by tens of
points in a few minutes on two CPU cores.

It writes the arithmetic task's data into the run folder, runs the RL trainer with the task's
reward (greedy held-out accuracy is validated before training, every few steps, and at the
end), draws the run's plots into ``RUN/plots`` and copies the final model to
``RUN/final_model``. Its last line is ``demo: held-out accuracy A% -> B%``.

Before starting it checks what usually goes wrong and says what to do: a model folder that
is half-written (an interrupted rebuild, a partial checkout), too little free disk, or a run
folder left by an earlier demo. An interrupted run resumes from its last checkpoint by
default (``--fresh`` starts over); a finished one is moved aside to ``RUN-previous``.
"""

from __future__ import annotations

import argparse
import errno
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from reinforge.demo.build import ACCURACY_KEY
from reinforge.demo.task import MODEL_DIR, TASK, DemoTask

RESULT_FILE = "demo_result.json"
REQUIRED_FREE_MB = 200
"""Checkpoints (two kept), the final model, data and plots take about 60 MB; the rest is margin."""


class DemoError(RuntimeError):
    """Something a person must fix before the demo can run; the message says what and how."""


@dataclass(frozen=True)
class DemoSettings:
    """The GRPO run of the demo, tuned to finish in minutes on two CPU cores.

    32 prompts x 8 samples a step at temperature 1; measured on a 2-core CPU, held-out accuracy
    climbs from the model's 18% to about 90% within the first 10 of the 40 steps.
    """

    total_steps: int = 40
    train_batch_size: int = 32
    n: int = 8
    lr: float = 1e-4
    kl_loss_coef: float = 0.001
    test_every: int = 10
    save_every: int = 10
    seed: int = 1

    def overrides(self, model_dir: Path, data: dict[str, str], run_dir: Path, task: DemoTask, device: str,
                  loggers: tuple[str, ...]) -> list[str]:
        return [
            f"model.path={model_dir}", f"data.train_files=[{data['train']}]", f"data.val_files=[{data['test']}]",
            f"data.max_prompt_length={task.max_prompt_length}", f"data.max_response_length={task.max_response_length}",
            f"data.train_batch_size={self.train_batch_size}", f"data.seed={self.seed}",
            "algorithm.adv_estimator=grpo", f"rollout.n={self.n}", "rollout.temperature=1.0",
            f"actor.optim.lr={self.lr}", "actor.use_kl_loss=true", f"actor.kl_loss_coef={self.kl_loss_coef}",
            "actor.kl_loss_type=low_var_kl", "actor.loss_agg_mode=token-mean",
            f"trainer.output_dir={run_dir}", f"trainer.total_steps={self.total_steps}",
            f"trainer.test_every={self.test_every}", f"trainer.save_every={self.save_every}", "trainer.keep_last=1",
            f"trainer.seed={self.seed}", f"trainer.device={device}", f"trainer.loggers=[{','.join(loggers)}]",
            "trainer.resume=auto", "trainer.experiment_name=demo",
            # the arithmetic scorer takes microseconds: scoring in this process beats starting scorer processes
            "reward.num_workers=0",
        ]


# ---- checks before the run ------------------------------------------------------------------
def check_model(model_dir: Path) -> None:
    """Raise DemoError if the demo model folder is missing, half-written or unreadable."""
    from reinforge.models import check_model_folder

    fix = ("restore the committed files with `git checkout -- reinforge/demo/assets` or rebuild the model with "
           "`reinforge demo --rebuild-model` (about 15 minutes on two CPU cores)")
    try:
        check_model_folder(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            raise FileNotFoundError(f"model folder {model_dir} has no tokenizer.json")
        weights = model_dir / "model.safetensors"
        if weights.is_file():
            from safetensors import safe_open

            with safe_open(str(weights), framework="pt") as handle:
                for name in handle.keys():  # reading every tensor catches a file cut short
                    handle.get_tensor(name)
    except FileNotFoundError as error:
        raise DemoError(f"the demo model is incomplete: {error}; {fix}") from None
    except Exception as error:  # a truncated or corrupt safetensors file fails in many ways
        raise DemoError(f"the demo model's weights in {model_dir} cannot be read ({type(error).__name__}: "
                        f"{error}); the file is probably half-written; {fix}") from None


def check_free_disk(run_dir: Path, required_mb: int = REQUIRED_FREE_MB) -> None:
    from reinforge.trainer.preflight import free_disk_bytes

    free_mb = free_disk_bytes(run_dir) / 2**20
    if free_mb < required_mb:
        raise DemoError(f"only {free_mb:.0f} MB are free on the disk of {run_dir}; the demo needs about "
                        f"{required_mb} MB for its checkpoints, final model and plots; free some space or pass "
                        "--out DIR on another disk")


def prepare_run_dir(run_dir: Path, fresh: bool, total_steps: int) -> str:
    """Make ``run_dir`` ready and say what happened to an earlier run there (one line, or ''). A folder that a live
    run holds (its ``.lock``) is left as it is: ``RunFolderInUse`` names the run."""
    if not run_dir.exists():
        return ""
    from reinforge.trainer.run_folder import RunLock

    RunLock(run_dir).acquire().release()  # before anything of the folder is moved or removed
    latest = _latest_step(run_dir)
    if (run_dir / RESULT_FILE).is_file() or (latest is not None and latest >= total_steps):
        previous = run_dir.with_name(run_dir.name + "-previous")
        shutil.rmtree(previous, ignore_errors=True)
        run_dir.rename(previous)
        return f"{run_dir} held a finished demo run; it moved to {previous} and a new run starts"
    if fresh or latest is None:
        shutil.rmtree(run_dir)
        if fresh:
            return f"--fresh: removed the earlier run in {run_dir}"
        return f"the earlier run in {run_dir} stopped before its first checkpoint; starting over"
    return (f"resuming the interrupted demo run in {run_dir} from step {latest} of {total_steps} "
            "(pass --fresh to start over)")


def _latest_step(run_dir: Path) -> int | None:
    from reinforge.trainer.checkpoint import CheckpointManager, load_trainer_state

    latest = CheckpointManager(run_dir, keep_last=1).latest()
    return None if latest is None else int(load_trainer_state(latest)["step"])


# ---- the run ----------------------------------------------------------------------------------
def accuracy_before_and_after(run_dir: Path, accuracy_key: str = ACCURACY_KEY) -> tuple[float, float]:
    from reinforge.tracking.plots import load_run_metrics

    points = load_run_metrics(run_dir).get(accuracy_key)
    if not points:
        raise DemoError(f"{run_dir}/metrics.jsonl has no {accuracy_key}; the run did not validate")
    return points[0][1], points[-1][1]


def run_demo(run_dir: str | Path = "runs/demo", *, model_dir: str | Path = MODEL_DIR,
             settings: DemoSettings = DemoSettings(), task: DemoTask = TASK, device: str = "auto",
             fresh: bool = False, loggers: tuple[str, ...] = ("console", "jsonl"), plots: bool = True) -> dict:
    """Run the demo end to end; returns {"before", "after", "seconds", "run_dir", ...}."""
    run_dir, model_dir = Path(run_dir), Path(model_dir)
    check_model(model_dir)
    check_free_disk(run_dir)
    note = prepare_run_dir(run_dir, fresh, settings.total_steps)
    if note:
        print(f"demo: {note}", flush=True)
    return train_and_measure(
        run_dir, lambda: settings.overrides(model_dir, task.write(run_dir / "data"), run_dir, task, device, loggers),
        settings.total_steps, ACCURACY_KEY, plots)


def train_and_measure(run_dir: Path, overrides: Callable[[], list[str]], total_steps: int, accuracy_key: str,
                      plots: bool) -> dict:
    """The RL run of a demo (config from ``overrides()``, which may write the data) in ``run_dir``: its held-out
    accuracy before and after, ``final_model/``, plots and the result file. Returns the result."""
    started = time.perf_counter()
    try:
        from reinforge.config import load_config
        from reinforge.models import atomic_folder
        from reinforge.trainer.rl_trainer import RLTrainer

        config = load_config(None, overrides())
        try:
            trainer = RLTrainer(config)  # picks (and validates) the checkpoint to resume from
            trainer.fit()
        except ValueError as error:
            if "checkpoint" in str(error):
                raise DemoError(f"cannot resume the earlier run in {run_dir}: {error}; pass --fresh to start "
                                "over") from None
            raise
        before, after = accuracy_before_and_after(run_dir, accuracy_key)
        final_model = run_dir / "final_model"
        with atomic_folder(final_model) as staging:
            for path in (trainer.checkpoints.latest() / "hf").iterdir():
                shutil.copy2(path, staging / path.name)
        written = []
        if plots:
            from reinforge.tracking.plots import plot_runs

            written = plot_runs([run_dir])
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise DemoError(f"the disk of {run_dir} filled up during the demo; free some space and run it again "
                            "(it resumes from its last checkpoint)") from None
        raise
    result = {"before": before, "after": after, "seconds": round(time.perf_counter() - started, 1),
              "steps": total_steps, "run_dir": str(run_dir), "final_model": str(final_model),
              "plots": [str(path) for path in written]}
    (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
    return result


def demo_main(argv: list[str]) -> int:
    """``reinforge demo``; ``--agent`` and ``--vision`` go to ``agent_runner.agent_demo_main`` and
    ``vision_runner.vision_demo_main`` (cli.py chooses)."""
    parser = argparse.ArgumentParser(prog="reinforge demo",
                                     description="Watch a small model learn arithmetic by GRPO (CPU-friendly).")
    parser.add_argument("--agent", action="store_true",
                        help="the agent demo instead: a model learns to call a calculator (see --agent --help)")
    parser.add_argument("--vision", action="store_true",
                        help="the vision demo instead: a tiny vision-language model learns to count red squares "
                             "(see --vision --help)")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="the run folder (default: runs/demo)")
    parser.add_argument("--steps", type=int, default=DemoSettings.total_steps, help="GRPO steps")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    parser.add_argument("--fresh", action="store_true", help="start over instead of resuming an interrupted run")
    parser.add_argument("--rebuild-model", action="store_true",
                        help="first rebuild the demo model from scratch by SFT (about 15 minutes on two CPU cores), "
                             "then run the demo")
    args = parser.parse_args(argv)

    def run() -> dict:
        if args.rebuild_model:
            from reinforge.demo.build import build_demo_model

            card = build_demo_model(MODEL_DIR)
            print(f"demo: rebuilt the demo model in {MODEL_DIR}: held-out accuracy "
                  f"{100 * card['held_out_accuracy']:.1f}%", flush=True)
        return run_demo(args.out, settings=DemoSettings(total_steps=args.steps), device=args.device, fresh=args.fresh)

    return report_demo("demo", "`make demo` (or `reinforge demo`)", args.out, run)


def report_demo(name: str, resume_command: str, out: Path, run: Callable[[], dict]) -> int:
    """Run a demo (``run`` returns ``train_and_measure``'s result) and print its closing lines, the last one
    ``NAME: held-out accuracy A% -> B%``; a ``DemoError`` is one line and exit 1, Ctrl-C says how to resume (130)."""
    try:
        result = run()
    except DemoError as error:
        print(f"{name}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted; run {resume_command} again to resume {out} from its last "
              "checkpoint, or add --fresh to start over", file=sys.stderr)
        return 130
    print(f"{name}: {result['steps']} GRPO steps in {result['seconds']:.0f} s; run folder {result['run_dir']} "
          f"(metrics.jsonl, final_model/, plots/)")
    print(f"{name}: held-out accuracy {100 * result['before']:.0f}% -> {100 * result['after']:.0f}%")
    return 0
