"""What the TRL scripts share: their step clock, their deadline, and the tries of each checkpointing mode.

``trl_grpo.py`` and ``trl_dpo.py`` import it as a sibling module (Python puts a script's own folder first on
``sys.path``). A run's step time is the median time between optimizer steps 2.. ; ``--checkpointing auto`` tries
without gradient checkpointing and, when that runs out of memory, with it, as TRL's users would; ``both`` runs
each and the faster one counts. ``--deadline-s`` bounds the script's steps: a run still training stops between
steps once the deadline has passed or a step as long as the last one would end past it, and reports the steps it
made (``stopped_at_deadline``); no further try starts. The first step is no such measure (it counts the data and
the warm-up from training's start, and took 2 to 3.5 times the next on the shapes measured), so a second step
always starts. The results are written (``--json``, replaced whole) as each step and each ``generate`` call ends,
so a script ended from outside keeps the steps it made and the generation of the step it was in. Each phase
(model loaded, trainer built, steps) is printed with its time as it ends, so the output of a script killed from
outside still says where it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MODES = {"auto": [False, True], "both": [False, True], "on": [True], "off": [False]}
"""The gradient checkpointing setting of each try, by ``--checkpointing``."""


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options every TRL script takes: checkpointing, deadline, CPU smoke mode and the results file."""
    parser.add_argument("--checkpointing", choices=list(MODES), default="auto")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="stop training after the step that passes this many seconds from the start")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU in float32 (a smoke test of the setup)")
    parser.add_argument("--json", type=Path, default=None)


def write_results(path: Path | None, results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Write the runs and the fastest finished one (``best``) to ``path`` whole (a new file renamed over the old:
    a reader never sees half of it); returns ``best``."""
    finished = [result for result in results if "step_s" in result]
    best = min(finished, key=lambda result: result["step_s"]) if finished else None
    if path is not None:
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps({"runs": results, "best": best}, indent=1))
        partial.replace(path)
    return best


def add_grpo_workload_options(parser: argparse.ArgumentParser, prompt_tokens_help: str | None = None) -> None:
    """The GRPO workload both GRPO scripts take: model folder, steps, batch shape and lengths, memory cap."""
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=16, help="completions per forward/backward")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=128, help=prompt_tokens_help)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="cap the process at this much GPU memory")


class Clock:
    """Seconds since the script started, the deadline, and one printed line per phase."""

    def __init__(self, deadline_s: float | None, cpu: bool) -> None:
        self.start = time.perf_counter()
        self.deadline_s, self.cpu = deadline_s, cpu
        self.stopped_early = False
        """A run stopped before a step that would have ended past the deadline."""
        self.marks: dict[str, float] = {}
        """Each phase's end (``perf_counter``), by name."""
        self.step_ends: list[float] = []
        """The running try's optimizer steps' ends (``step_clock``)."""
        self.on_progress: Callable[[], None] | None = None
        """Called as each step and each ``generate`` call ends (``run_modes`` writes the results so far)."""
        self.generate_s: list[float] = []
        """Seconds of each call of transformers' ``generate`` in the running try (``time_generation``)."""

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def passed(self) -> bool:
        return self.deadline_s is not None and self.elapsed() >= self.deadline_s

    def would_pass(self, seconds: float) -> bool:
        """Whether something taking ``seconds`` from now would end past the deadline."""
        return self.deadline_s is not None and self.elapsed() + seconds > self.deadline_s

    def phase(self, name: str) -> float:
        """Print that ``name`` ended; returns the time it ended."""
        now = time.perf_counter()
        print(f"trl: {name} at {now - self.start:.1f} s", flush=True)
        self.marks[name] = now
        return now

    def synchronize(self) -> None:
        if not self.cpu:
            torch.cuda.synchronize()


def time_generation(clock: Clock) -> None:
    """Time every call of transformers' ``generate`` (synchronized on both ends) into ``clock.generate_s``, emptied
    here for a new try. TRL generates a step's completions in one call, so a run that made one step still says how
    long its generation took: a step cannot be shorter than it."""
    from transformers.generation.utils import GenerationMixin

    clock.generate_s.clear()
    if getattr(GenerationMixin.generate, "timed_by_the_bench", False):
        return
    original = GenerationMixin.generate

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        clock.synchronize()
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            clock.synchronize()
            clock.generate_s.append(time.perf_counter() - start)
            if clock.on_progress is not None:  # a run ended in its next update keeps the generation's time
                clock.on_progress()

    generate.timed_by_the_bench = True
    GenerationMixin.generate = generate


def step_clock(clock: Clock) -> tuple[Any, list[float]]:
    """A transformers ``TrainerCallback`` that records the time of each optimizer step's end (after the device is
    done) into ``clock.step_ends``, calls ``clock.on_progress``, and stops training at the deadline, or before a
    step as long as the last one would end past it (so the script still writes its results in time; not after the
    first, which counts the warm-up), and the list it records into."""
    from transformers import TrainerCallback

    times: list[float] = []
    clock.step_ends = times

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.synchronize()
            times.append(clock.phase(f"step {len(times) + 1}"))
            if clock.on_progress is not None:
                clock.on_progress()
            last = times[-1] - times[-2] if len(times) > 1 else 0.0
            if clock.passed() or clock.would_pass(last):
                control.should_training_stop = True
                clock.stopped_early = not clock.passed()

    return StepTimes(), times


def known_settings(config_class: type, wanted: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The settings ``config_class`` (a TRL config dataclass) has, and the names of those it has not."""
    fields = {field.name for field in dataclasses.fields(config_class)}
    return {key: value for key, value in wanted.items() if key in fields}, sorted(set(wanted) - fields)


def reset_peak_memory(clock: Clock) -> None:
    if not clock.cpu:
        torch.cuda.reset_peak_memory_stats()


def step_record(clock: Clock, checkpointing: bool, start: float, times: list[float], ignored: list[str],
                **extra: Any) -> dict[str, Any]:
    """One run's result: its step times (from ``start``), their median from step 2, peak memory, what it ignored."""
    marks = [start, *times]
    step_times = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    record: dict[str, Any] = {"checkpointing": checkpointing, "step_times_s": step_times,
                              "peak_memory_gb": 0.0 if clock.cpu else torch.cuda.max_memory_allocated() / 2**30,
                              "ignored_settings": ignored, **extra}
    if clock.generate_s:
        record["generate_s"] = list(clock.generate_s)
    if step_times:
        record["step_s"] = statistics.median(step_times[1:] or step_times)
        if len(step_times) == 1:  # from train begin: its data, warm-up and one step, not a steady step
            record["first_step_only"] = True
    else:
        record["error"] = "no optimizer step finished"
    if clock.passed() or clock.stopped_early:
        record["stopped_at_deadline"] = True
    return record


def run_modes(args: argparse.Namespace, clock: Clock, run: Callable[[bool], dict[str, Any]]) -> int:
    """Run ``run(checkpointing)`` for each mode of ``args.checkpointing``; print and write the results (the best
    in ``best``); returns the script's exit status."""
    results: list[dict[str, Any]] = []

    def so_far(checkpointing: bool) -> dict[str, Any]:
        """The running try's record from the steps it has made."""
        return step_record(clock, checkpointing, clock.marks.get("trainer built", clock.start), clock.step_ends, [])

    for checkpointing in MODES[args.checkpointing]:
        clock.step_ends = []  # a try that fails before its first step has made none
        clock.on_progress = lambda mode=checkpointing: write_results(args.json, [*results, so_far(mode)])
        if args.checkpointing == "auto" and any("step_s" in result for result in results):
            break  # it fit without checkpointing
        if results and clock.passed():
            results.append({"checkpointing": checkpointing, "error": "not started: past the deadline"})
            break
        try:
            results.append(run(checkpointing))
        except torch.OutOfMemoryError as error:
            made = so_far(checkpointing)  # its steps and generate calls stay in the record of a try that then ran out
            results.append({"checkpointing": checkpointing, "error": f"out of memory: {str(error).splitlines()[0]}",
                            **({"step_times_s_before_the_error": made["step_times_s"]} if made["step_times_s"] else {}),
                            **({"generate_s": made["generate_s"]} if "generate_s" in made else {})})
        gc.collect()  # the failed trainer's cycles, before its memory goes back
        if not clock.cpu:
            torch.cuda.empty_cache()
        print(json.dumps(results[-1]), flush=True)
    clock.on_progress = None
    best = write_results(args.json, results)
    if best is None:
        print("trl: every run failed")
        return 1
    only = ", first step only: from training's start" if best.get("first_step_only") else ""
    print(f"trl: step {best['step_s']:.2f} s (checkpointing {'on' if best['checkpointing'] else 'off'}{only}), "
          f"peak {best['peak_memory_gb']:.1f} GiB")
    return 0
