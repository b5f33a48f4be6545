"""The TRL scripts' step clock (benchmarks/trl_runs.py): its deadline is between steps, before a step that would
end past it."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import trl_runs  # noqa: E402


def test_training_stops_before_a_step_as_long_as_the_last_would_pass_the_deadline(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(trl_runs.time, "perf_counter", lambda: now[0])
    clock = trl_runs.Clock(deadline_s=100.0, cpu=True)
    callback, times = trl_runs.step_clock(clock)
    control = SimpleNamespace(should_training_stop=False)
    now[0] = 50.0  # a first step of 40 s: one more would end at 90 s, before the deadline
    callback.on_step_end(None, None, control)
    assert not control.should_training_stop
    now[0] = 80.0  # a second of 30 s: a third would end at 110 s, past it
    callback.on_step_end(None, None, control)
    assert control.should_training_stop and len(times) == 2 and clock.stopped_early
    record = trl_runs.step_record(clock, False, 10.0, times, [])
    assert record["stopped_at_deadline"] and record["step_times_s"] == [40.0, 30.0] and record["step_s"] == 30.0
    unbounded = trl_runs.Clock(deadline_s=None, cpu=True)
    assert not unbounded.would_pass(1e9) and not unbounded.passed()


def test_a_second_step_starts_whatever_the_first_took(monkeypatch):
    """The first step counts the warm-up from training's start (2 to 3.5 times the next), so it does not stop the
    run; only a passed deadline does."""
    now = [0.0]
    monkeypatch.setattr(trl_runs.time, "perf_counter", lambda: now[0])
    clock = trl_runs.Clock(deadline_s=100.0, cpu=True)
    callback, _ = trl_runs.step_clock(clock)
    control = SimpleNamespace(should_training_stop=False)
    now[0] = 90.0  # a first step of 80 s
    callback.on_step_end(None, None, control)
    assert not control.should_training_stop
    now[0] = 101.0
    callback.on_step_end(None, None, control)
    assert control.should_training_stop and not clock.stopped_early


def test_the_results_are_written_as_each_step_ends(monkeypatch, tmp_path):
    """A script ended from outside during its second step keeps its first in --json, written whole."""
    import argparse
    import json

    now = [0.0]
    monkeypatch.setattr(trl_runs.time, "perf_counter", lambda: now[0])
    clock = trl_runs.Clock(deadline_s=None, cpu=True)
    seen = []

    def run(checkpointing: bool) -> dict:
        callback, times = trl_runs.step_clock(clock)
        start = clock.phase("trainer built")
        for end in (70.0, 100.0):
            now[0] = end
            callback.on_step_end(None, None, SimpleNamespace(should_training_stop=False))
            seen.append(json.loads(path.read_text()))
        return trl_runs.step_record(clock, checkpointing, start, times, ["max_prompt_length"])

    path = tmp_path / "trl.json"
    assert trl_runs.run_modes(argparse.Namespace(checkpointing="off", json=path), clock, run) == 0
    assert seen[0]["best"]["step_times_s"] == [70.0] and seen[0]["best"]["first_step_only"]
    assert seen[1]["best"]["step_s"] == 30.0 and "first_step_only" not in seen[1]["best"]
    final = json.loads(path.read_text())
    assert final["best"]["ignored_settings"] == ["max_prompt_length"] and len(final["runs"]) == 1
    assert not list(tmp_path.glob("*.partial"))


def test_a_run_of_one_step_says_its_time_is_the_first_step_only():
    clock = trl_runs.Clock(deadline_s=None, cpu=True)
    record = trl_runs.step_record(clock, False, 10.0, [60.0], [])
    assert record["step_s"] == 50.0 and record["first_step_only"]
    assert "first_step_only" not in trl_runs.step_record(clock, False, 10.0, [60.0, 80.0], [])
