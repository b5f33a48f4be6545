"""PNG charts of one or more runs' ``metrics.jsonl``: ``reinforge plot RUN_DIR [RUN_DIR ...]``, and the ``plots``
logger (in ``trainer.loggers`` by default), which draws a run's default charts into ``RUN_DIR/plots`` when it ends.

One chart per metric key: each run's raw points drawn faint, with an exponential moving
average over them (TensorBoard's debiased smoothing, so the line starts at the first point
rather than at zero). Several runs share each chart, named in the legend by their folder.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

from reinforge.atomic_files import replaced_atomically
from reinforge.tracking.backends import RunInfo, TrackingBackend, register_tracking_backend
from reinforge.tracking.jsonl import METRICS_FILE, read_json_lines, write_failure

logger = logging.getLogger(__name__)

DEFAULT_KEYS = [
    "critic/score/mean",
    "actor/kl_loss",
    "actor/reward_kl_penalty",
    "actor/ppo_kl",
    "actor/entropy",
    "response_length/mean",
    "agent/num_tool_calls/mean",
    "num_turns/mean",
    "train/loss",
    "accuracy",
    "margin",
    "rewards/accuracies",
    "rewards/margins",
]
"""Plotted when they exist: an RL run's reward, KL terms, entropy, length, and its agents' tool calls and turns; the
training loss of SFT, a reward model and DPO, a reward model's accuracy and margin and DPO's (TRL's names); with every
validation key."""

VALIDATION_PREFIXES = ("val-core/", "val/", "eval_")
"""Validation keys: RL's and SFT's (``val/``), and the reward model's and DPO's (TRL's ``eval_`` names)."""


def load_run_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Key -> (step, value) pairs sorted by step; a step logged twice keeps its last value."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no {METRICS_FILE}; is it a reinforge run folder with the jsonl logger on?")
    by_key: dict[str, dict[int, float]] = {}
    for record in read_json_lines(path):
        if "step" not in record:
            continue
        step = int(record["step"])
        for key, value in record.items():
            if key != "step" and value is None:  # a NaN or an infinity (jsonl writes them as null): a gap
                by_key.setdefault(key, {})[step] = float("nan")
            elif key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                by_key.setdefault(key, {})[step] = float(value)
    return {key: sorted(points.items()) for key, points in by_key.items()}


def smooth(values: list[float], smoothing: float) -> list[float]:
    """Debiased exponential moving average; ``smoothing`` in [0, 1), 0 leaves the values as they are."""
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing={smoothing} must be in [0, 1); 0.6 is a good start, 0 turns it off")
    smoothed, average, weight = [], 0.0, 0.0
    for value in values:
        if value != value:  # NaN: keep the average as it is
            smoothed.append(float("nan"))
            continue
        average = smoothing * average + (1 - smoothing) * value
        weight = smoothing * weight + (1 - smoothing)
        smoothed.append(average / weight)
    return smoothed


def default_keys(available: list[str]) -> list[str]:
    keys = [key for key in DEFAULT_KEYS if key in available]
    return keys + sorted(key for key in available if key.startswith(VALIDATION_PREFIXES))


def _run_labels(run_dirs: list[Path]) -> list[str]:
    names = [path.resolve().name for path in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{path.resolve().parent.name}/{path.resolve().name}" for path in run_dirs]


class NothingToPlot(ValueError):
    """The runs' ``metrics.jsonl`` hold no metric yet."""


def chart_file_names(keys: list[str]) -> dict[str, str]:
    """Key -> its chart's file name: the key with slashes as underscores, ``.png``; a key whose name another key
    of ``keys`` took already (``a/b`` and ``a_b``) gets ``-2``, ``-3``... rather than drawing over that chart."""
    names: dict[str, str] = {}
    taken: set[str] = set()
    for key in dict.fromkeys(keys):
        stem = key.replace("/", "_")
        name, number = f"{stem}.png", 1
        while name in taken:
            number += 1
            name = f"{stem}-{number}.png"
        names[key] = name
        taken.add(name)
    return names


def plot_runs(run_dirs: list[Path], out_dir: Path | None = None, keys: list[str] | None = None,
              smoothing: float = 0.6, runs: list[dict[str, list[tuple[int, float]]]] | None = None,
              folder_setting: str = "--out") -> list[Path]:
    """Write one PNG per metric key and return their paths.

    ``out_dir`` defaults to ``RUN_DIR/plots`` for one run, and to a ``plots`` folder next to the
    first run for several. Files are named after the key with slashes as underscores (``chart_file_names``). ``runs``: each
    run's ``load_run_metrics``, already read (None: read here). ``folder_setting``: what a failed write's line
    says to point elsewhere (the command's flag, or a training run's ``trainer.output_dir``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dirs = [Path(path) for path in run_dirs]
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run folder")
    smooth([], smoothing)  # validates smoothing before any work
    runs = [load_run_metrics(path) for path in run_dirs] if runs is None else runs
    available = list(dict.fromkeys(key for run in runs for key in run))
    if not available:
        files = ", ".join(str(path / METRICS_FILE) for path in run_dirs)
        raise NothingToPlot(f"{files} {'holds' if len(run_dirs) == 1 else 'hold'} no metrics yet (no step has ended); "
                            "draw the charts once the run has logged a step")
    if keys is None:
        keys = default_keys(available)
    else:
        keys = list(dict.fromkeys(keys))  # a key named twice is drawn once
        missing = [key for key in keys if key not in available]
        keys = [key for key in keys if key in available]
        if missing:
            import difflib

            guesses = {key: difflib.get_close_matches(key, available, n=1, cutoff=0.5) for key in missing}
            named = ", ".join(key + (f" (did you mean {guess[0]}?)" if guess else "") for key, guess in guesses.items())
            message = f"no run has the key{'s' if len(missing) > 1 else ''} {named}"
            if not keys:
                raise ValueError(f"{message}; the runs have: {', '.join(sorted(available))}")
            warnings.warn(f"{message}; skipping {'them' if len(missing) > 1 else 'it'}", stacklevel=2)
    if out_dir is None:
        out_dir = run_dirs[0] / "plots" if len(run_dirs) == 1 else run_dirs[0].resolve().parent / "plots"
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise write_failure(out_dir, error, "the plots' folder", folder_setting) from None

    written = []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    file_names = chart_file_names(keys)
    for key in keys:
        figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
        for index, (label, run) in enumerate(zip(_run_labels(run_dirs), runs, strict=True)):
            if key not in run:
                continue
            steps = [step for step, _ in run[key]]
            values = [value for _, value in run[key]]
            color = colors[index % len(colors)]
            axes.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            axes.plot(steps, smooth(values, smoothing), color=color, linewidth=2, label=label)
        axes.set_title(key)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        axes.legend(loc="best", fontsize="small")
        figure.tight_layout()
        path = out_dir / file_names[key]
        # written beside and renamed over: a run killed mid-write (a demo's plots are redrawn at each run) never
        # leaves a half-written PNG where the last good one was
        try:
            with replaced_atomically(path, durable=False) as temporary:
                figure.savefig(temporary, format="png")
        except OSError as error:
            raise write_failure(path, error, f"the plot of {key}", folder_setting) from None
        finally:
            plt.close(figure)
        written.append(path)
    return written


@register_tracking_backend("plots")
class PlotsBackend(TrackingBackend):
    """Draws the run's default charts (``default_keys``) from its whole ``metrics.jsonl`` into ``RUN_DIR/plots`` when
    the run ends, finished or stopped (a resumed run's charts start at its first step). A chart that cannot be drawn
    costs one warning line, never the run: its numbers are in ``metrics.jsonl``, and ``reinforge plot`` draws them."""

    MAX_CHARTS = 40
    """The most charts drawn when a run ends (a run of many validation sets has a chart for each of their keys)."""

    def __init__(self, run: RunInfo):
        self.run_dir = run.run_dir
        self.logged = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.logged = True

    def close(self) -> None:
        if not self.logged or not (self.run_dir / METRICS_FILE).is_file():
            return
        self.logged = False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a line cut by a kill is skipped, as plot_runs says
                run = load_run_metrics(self.run_dir)  # read once: the keys and the charts come from it
                keys = default_keys(list(run))
                if len(keys) > self.MAX_CHARTS:
                    logger.info("the plots logger draws the first %d of %d charts into %s (about 0.1 s each); "
                                "reinforge plot %s --keys ... draws others", self.MAX_CHARTS, len(keys),
                                self.run_dir / "plots", self.run_dir)
                    keys = keys[:self.MAX_CHARTS]
                if keys:
                    plot_runs([self.run_dir], keys=keys, runs=[run], folder_setting="trainer.output_dir")
        except Exception as error:  # noqa: BLE001 - the run's numbers are safe in metrics.jsonl
            logger.warning("the plots logger drew no charts into %s: %s; reinforge plot %s draws them from "
                           "metrics.jsonl", self.run_dir / "plots", error, self.run_dir)


def plot_main(argv: list[str]) -> int:
    """``reinforge plot RUN_DIR [RUN_DIR ...] [--out DIR] [--keys k1,k2] [--smoothing 0.6]``."""
    parser = argparse.ArgumentParser(prog="reinforge plot", description="Draw PNG charts from runs' metrics.jsonl.")
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the PNGs (default: RUN_DIR/plots, or plots/ next to the first run)")
    parser.add_argument("--keys", default=None, help="comma-separated metric keys (default: reward, KL, "
                                                     "entropy, response length, the training loss and every validation key, where present)")
    parser.add_argument("--smoothing", type=float, default=0.6, help="EMA weight in [0, 1); 0 turns it off")
    args = parser.parse_args(argv)
    keys = [key.strip() for key in args.keys.split(",") if key.strip()] if args.keys else None
    if keys == []:
        print(f"reinforge plot: --keys {args.keys!r} names no key; give metric keys separated by commas, or leave "
              "--keys out for the default charts", file=sys.stderr)
        return 2
    try:
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always")
            runs = [load_run_metrics(path) for path in args.run_dirs]
            written = plot_runs(args.run_dirs, args.out, keys, args.smoothing, runs=runs)
    except NothingToPlot as error:  # a run that has not ended a step yet
        print(f"reinforge plot: {error}", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as error:  # a folder that is no run, a key no run has: a usage error
        print(f"reinforge plot: {error}", file=sys.stderr)
        return 2
    for note in dict.fromkeys(str(note.message) for note in notes):  # a cut line of a run is named once
        print(f"reinforge plot: {note}", file=sys.stderr)
    if not written:
        available = sorted(dict.fromkeys(key for run in runs for key in run))
        print(f"reinforge plot: the runs have none of the keys charted by default (reward, KL, entropy, response "
              f"length, loss, validation); pass --keys with some of: {', '.join(available)}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0
