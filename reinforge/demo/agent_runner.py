"""``reinforge demo --agent`` (and ``make demo-agent``): a small model learns by GRPO to use a calculator.

The agent demo model was fine-tuned on multiplication conversations that all call the
calculator and of which 60% then answer with its result rounded to hundreds (see
``reinforge.demo.agent_task``): greedily it rounds, and gets nearly every held-out product of
two 3-digit numbers wrong; sampled at temperature 1 it often copies the exact result. GRPO,
rewarded only for the exact product, unlearns the rounding, and held-out accuracy rises by tens
of points.

The rows name the ``tool_agent`` loop; the calculator is a typed Python function listed in the
run's ``data/tools.yaml``. It validates (greedy, multi-turn) before training, every quarter of
the run, plots the run (held-out accuracy, reward, tool calls and turns per step) into
``RUN/plots`` and copies the final model to ``RUN/final_model``. Its last line is
``demo-agent: held-out accuracy A% -> B%``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from reinforge.demo.agent_build import ACCURACY_KEY, agent_overrides
from reinforge.demo.agent_task import AGENT_MODEL_DIR, AGENT_TASK, AgentDemoTask
from reinforge.demo.runner import (
    check_free_disk,
    check_model,
    prepare_run_dir,
    report_demo,
    train_and_measure,
)

OPENAI_AGENT = "calc_openai"


@dataclass(frozen=True)
class AgentDemoSettings:
    """GRPO with multi-turn rollouts, 16 prompts x 8 samples a step, sized for two CPU cores.

    Measured on our shared 2-core CPU: held-out accuracy 14.5% -> 80% in 16 steps (31 s); 32 steps
    end at 79%: the errors left are copies of the result that go wrong, which the reward does not
    find often enough in this budget.
    """

    total_steps: int = 16
    train_batch_size: int = 16
    n: int = 8
    lr: float = 5e-4
    kl_loss_coef: float = 0.001
    test_every: int = 4
    save_every: int = 8
    num_val: int = 200
    seed: int = 1
    rollout: str = "native"
    """The native engine batches the turns of all trajectories continuously; hf works too, more slowly."""
    openai: bool = False
    """Rows run ``agent_openai.calc_agent``, the same agent written against the openai client, through the endpoint."""

    def overrides(self, model_dir: Path, files: dict[str, str], run_dir: Path, task: AgentDemoTask, device: str,
                  loggers: tuple[str, ...]) -> list[str]:
        return [
            *agent_overrides(model_dir, files, task, device),
            f"data.train_files=[{files['train']}]", f"data.val_files=[{files['test']}]",
            f"data.max_val_samples={self.num_val}", f"data.train_batch_size={self.train_batch_size}",
            f"data.seed={self.seed}", "algorithm.adv_estimator=grpo", f"rollout.n={self.n}", "rollout.temperature=1.0",
            f"rollout.name={self.rollout}", f"actor.optim.lr={self.lr}", "actor.use_kl_loss=true",
            f"actor.kl_loss_coef={self.kl_loss_coef}", "actor.loss_agg_mode=token-mean",
            f"trainer.output_dir={run_dir}", f"trainer.total_steps={self.total_steps}",
            f"trainer.test_every={self.test_every}", f"trainer.save_every={self.save_every}", "trainer.keep_last=1",
            f"trainer.seed={self.seed}", f"trainer.loggers=[{','.join(loggers)}]", "trainer.resume=auto",
            "trainer.experiment_name=demo-agent",
            *([f"rollout.multi_turn.openai_agents={{{OPENAI_AGENT}: reinforge.demo.agent_openai.calc_agent}}"]
              if self.openai else []),
        ]


def run_agent_demo(run_dir: str | Path = "runs/demo-agent", *, model_dir: str | Path = AGENT_MODEL_DIR,
                   settings: AgentDemoSettings = AgentDemoSettings(), task: AgentDemoTask = AGENT_TASK,
                   device: str = "auto", fresh: bool = False, loggers: tuple[str, ...] = ("console", "jsonl"),
                   plots: bool = True) -> dict:
    """Run the agent demo end to end; returns {"before", "after", "seconds", "run_dir", ...}."""
    run_dir, model_dir = Path(run_dir), Path(model_dir)
    check_model(model_dir)
    check_free_disk(run_dir)
    note = prepare_run_dir(run_dir, fresh, settings.total_steps)
    if note:
        print(f"demo-agent: {note}", flush=True)
    def overrides() -> list[str]:
        files = task.write(run_dir / "data")
        if settings.openai:  # the same rows, run by the openai-client agent
            for split in ("train", "test"):
                path = Path(files[split])
                path.write_text(path.read_text().replace('"agent_name": "tool_agent"', f'"agent_name": "{OPENAI_AGENT}"'))
        return settings.overrides(model_dir, files, run_dir, task, device, loggers)

    return train_and_measure(run_dir, overrides, settings.total_steps, ACCURACY_KEY, plots)


def agent_demo_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="reinforge demo --agent",
                                     description="Watch a small model learn to use a calculator by GRPO (CPU).")
    parser.add_argument("--out", type=Path, default=Path("runs/demo-agent"), help="the run folder")
    parser.add_argument("--steps", type=int, default=AgentDemoSettings.total_steps, help="GRPO steps")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    parser.add_argument("--fresh", action="store_true", help="start over instead of resuming an interrupted run")
    parser.add_argument("--openai", action="store_true",
                        help="run the calculator agent written against the openai client, through the endpoint")
    parser.add_argument("--rebuild-model", action="store_true",
                        help="first rebuild the agent demo model by SFT, then run the demo")
    args = parser.parse_args(argv)

    def run() -> dict:
        if args.rebuild_model:
            from reinforge.demo.agent_build import build_agent_model

            card = build_agent_model(AGENT_MODEL_DIR)
            print(f"demo-agent: rebuilt the model in {AGENT_MODEL_DIR}: held-out accuracy "
                  f"{100 * card['held_out_accuracy']:.1f}%", flush=True)
        settings = AgentDemoSettings(total_steps=args.steps, test_every=max(1, args.steps // 4),
                                     save_every=max(1, args.steps // 2), openai=args.openai)
        return run_agent_demo(args.out, settings=settings, device=args.device, fresh=args.fresh)

    return report_demo("demo-agent", "`make demo-agent`", args.out, run)
