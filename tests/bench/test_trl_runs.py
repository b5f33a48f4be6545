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


def test_a_try_that_runs_out_of_memory_after_a_step_keeps_its_step_times(monkeypatch, tmp_path):
    import argparse
    import json

    import torch

    now = [0.0]
    monkeypatch.setattr(trl_runs.time, "perf_counter", lambda: now[0])
    clock = trl_runs.Clock(deadline_s=None, cpu=True)

    def run(checkpointing: bool) -> dict:
        callback, times = trl_runs.step_clock(clock)
        clock.generate_s.clear()  # as time_generation does for each try
        start = clock.phase("trainer built")
        now[0] += 50.0
        clock.generate_s.append(40.0)
        callback.on_step_end(None, None, SimpleNamespace(should_training_stop=False))
        if not checkpointing:
            clock.generate_s.append(30.0)  # the second step's generation ended, then its update ran out of memory
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        now[0] += 20.0
        callback.on_step_end(None, None, SimpleNamespace(should_training_stop=False))
        return trl_runs.step_record(clock, checkpointing, start, times, [])

    path = tmp_path / "trl.json"
    assert trl_runs.run_modes(argparse.Namespace(checkpointing="auto", json=path), clock, run) == 0
    runs = json.loads(path.read_text())["runs"]
    assert runs[0]["error"].startswith("out of memory") and runs[0]["step_times_s_before_the_error"] == [50.0]
    assert runs[0]["generate_s"] == [40.0, 30.0]  # a lower bound of the steady step it did not finish
    assert runs[1]["step_times_s"] == [50.0, 20.0] and "step_times_s_before_the_error" not in runs[1]


def test_each_generate_call_is_timed_into_the_record(monkeypatch):
    """TRL generates a step's completions in one ``generate`` call; its time is in the record, so a run of one
    step still bounds its steps from below."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.generation.utils import GenerationMixin

    monkeypatch.setattr(GenerationMixin, "generate", GenerationMixin.generate)  # put back after the test
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    clock = trl_runs.Clock(deadline_s=None, cpu=True)
    clock.generate_s.append(9.0)  # a failed try's calls: emptied for the next
    trl_runs.time_generation(clock)
    trl_runs.time_generation(clock)  # a second try: wrapped once
    for _ in range(2):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert len(clock.generate_s) == 2 and all(0 < seconds < 9.0 for seconds in clock.generate_s)
    record = trl_runs.step_record(clock, False, 0.0, [1.0], [])
    assert record["generate_s"] == clock.generate_s


def test_a_generate_call_that_ends_writes_the_results_too(monkeypatch, tmp_path):
    """Ended from outside in its second step's update, a run still says how long that step's generation took."""
    import argparse
    import json

    from transformers.generation.utils import GenerationMixin

    monkeypatch.setattr(GenerationMixin, "generate", GenerationMixin.generate)  # put back after the test
    now = [0.0]
    monkeypatch.setattr(trl_runs.time, "perf_counter", lambda: now[0])

    class Model(GenerationMixin):  # stands in for a model: its generate takes 30 s of the clock
        pass

    monkeypatch.setattr(GenerationMixin, "generate", lambda self: now.__setitem__(0, now[0] + 30.0))
    clock = trl_runs.Clock(deadline_s=None, cpu=True)
    path = tmp_path / "trl.json"
    written = []

    def run(checkpointing: bool) -> dict:
        callback, times = trl_runs.step_clock(clock)
        trl_runs.time_generation(clock)
        clock.phase("trainer built")
        Model().generate()
        now[0] += 10.0
        callback.on_step_end(None, None, SimpleNamespace(should_training_stop=False))
        Model().generate()
        written.append(json.loads(path.read_text()))
        raise KeyboardInterrupt  # ended from outside

    try:
        trl_runs.run_modes(argparse.Namespace(checkpointing="off", json=path), clock, run)
    except KeyboardInterrupt:
        pass
    [best] = [record["best"] for record in written]
    assert best["step_times_s"] == [40.0] and best["generate_s"] == [30.0, 30.0]
