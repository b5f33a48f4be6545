"""The console backend (one compact line of key metrics per step) and the trainer's progress bar.

Both print through one ``rich`` console, so metric lines scroll above a live progress bar.
The full set of metrics goes to ``metrics.jsonl``; the console shows the few a person watches.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from reinforge.tracking.backends import RunInfo, TrackingBackend, register_tracking_backend

CONSOLE_KEYS: dict[str, str] = {
    "critic/score/mean": "score",
    "train/loss": "loss",
    "actor/pg_loss": "pg_loss",
    "actor/kl_loss": "kl_loss",
    "actor/reward_kl_penalty": "reward_kl",
    "actor/ppo_kl": "ppo_kl",
    "actor/entropy": "entropy",
    "actor/grad_norm": "grad_norm",
    "critic/vf_loss": "vf_loss",
    "response_length/mean": "resp_len",
    "perf/time_per_step": "s/step",
}
"""Metric key -> short label, in the order the console line shows them."""

MAX_FALLBACK_KEYS = 8


def format_value(value: float) -> str:
    return f"{value:.4g}"


def summarize_metrics(metrics: Mapping[str, float]) -> list[tuple[str, float]]:
    """(label, value) pairs for the console: the known keys, then validation means; else the first few keys."""
    shown = [(label, metrics[key]) for key, label in CONSOLE_KEYS.items() if key in metrics]
    validation = [key for key in metrics if key.startswith(("val-core/", "val/"))]
    means = [key for key in validation if "/mean@" in key] or validation
    shown += [(key.split("/", 1)[1], metrics[key]) for key in means]
    if not shown:
        shown = [(key, value) for key, value in list(metrics.items())[:MAX_FALLBACK_KEYS]]
    return shown


@register_tracking_backend("console")
class ConsoleBackend(TrackingBackend):
    def __init__(self, run: RunInfo):
        self.console = run.console

    def log(self, metrics: dict[str, float], step: int) -> None:
        parts = [f"[bold]step {step}[/bold]"]
        # a label holds a data source's name (val-core/<data_source>/...), which rich would read as markup
        parts += [f"{escape(label)} [cyan]{format_value(value)}[/cyan]" for label, value in summarize_metrics(metrics)]
        self.console.print(" │ ".join(parts), highlight=False, soft_wrap=True)


class StepProgress:
    """A progress bar over training steps: ``with tracker.progress(total, initial=step) as bar: bar.advance(metrics)``.

    When ``enabled`` is False (no console backend) it keeps count and draws nothing.
    """

    def __init__(self, console: Console, total_steps: int, initial: int = 0, enabled: bool = True):
        self.total_steps = total_steps
        self.completed = initial
        self.enabled = enabled
        self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[summary]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                  console=console, disable=not enabled, transient=False)
        self._task = self._progress.add_task("train", total=total_steps, completed=initial, summary="")

    def advance(self, metrics: Mapping[str, float] | None = None, steps: int = 1) -> None:
        """One more step done; ``metrics`` puts the step's score (or first key metric) next to the bar."""
        self.completed += steps
        summary = ""
        if metrics:
            shown = summarize_metrics(metrics)
            if shown:
                label, value = shown[0]
                summary = escape(f"{label} {format_value(float(value))}")
        self._progress.update(self._task, advance=steps, summary=summary)

    def __enter__(self) -> StepProgress:
        if self.enabled:  # a disabled rich Progress still ends its live display with a newline (rich 13.0)
            self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> Any:
        if self.enabled:
            self._progress.stop()
        return None
