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
    now[0] = 10.0
    callback.on_train_begin(None, None, control)
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


def test_a_run_of_one_step_says_its_time_is_the_first_step_only():
    clock = trl_runs.Clock(deadline_s=None, cpu=True)
    record = trl_runs.step_record(clock, False, 10.0, [60.0], [])
    assert record["step_s"] == 50.0 and record["first_step_only"]
    assert "first_step_only" not in trl_runs.step_record(clock, False, 10.0, [60.0, 80.0], [])
