"""Batching arrivals in the native engine: turns that arrive while others decode join a few at a time,
none waits past the bound, and the samples are the same token for token as when each joins at once."""

from __future__ import annotations

import asyncio

import pytest

from reinforge.rollout.base import Completion, GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine

NUM_TURNS = 3
MAX_TOKENS = [6, 8, 10, 12, 14, 16]
TOOL_STEPS = [2, 3, 2, 3, 2, 3]
TOOL_TOKENS = [5, 9]


@pytest.fixture(scope="module")
def qwen2(tiny):
    return tiny.build("qwen2", seed=2)


def make_engine(model, **kwargs) -> NativeEngine:
    return NativeEngine(model, eos_token_ids=[], max_model_len=160, block_size=8, max_num_seqs=16, **kwargs)


def turn_sampling(trajectory: int, turn: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS[trajectory] - turn, temperature=1.0, seed=100 * trajectory + turn)


def run_in_lockstep(engine: NativeEngine, prompts: list[list[int]], batch_arrivals: bool) -> list[list[int]]:
    """Each trajectory's turns, a tool between them that takes TOOL_STEPS engine steps; the engine stepped here.

    Returns each trajectory's context (prompt, turns and tool tokens); checks after every step that no
    waiting turn has waited more than the engine's bound.
    """
    engine.wake_up()
    contexts = [list(prompt) for prompt in prompts]
    turns_done = [0] * len(prompts)
    arrivals = dict.fromkeys(range(len(prompts)), 0)  # trajectory -> engine step at which its next turn arrives
    step = 0

    def finished(trajectory: int, completions: list[Completion]) -> None:
        contexts[trajectory] += completions[0].token_ids + TOOL_TOKENS
        turns_done[trajectory] += 1
        if turns_done[trajectory] < NUM_TURNS:
            arrivals[trajectory] = step + TOOL_STEPS[trajectory]

    while min(turns_done) < NUM_TURNS:
        for trajectory, arrival in list(arrivals.items()):
            if arrival <= step:
                del arrivals[trajectory]
                request = GenerationRequest(contexts[trajectory], turn_sampling(trajectory, turns_done[trajectory]))
                engine._submit(request, on_done=lambda completions, t=trajectory: finished(t, completions))
        engine._step(batch_arrivals)
        scheduler = engine.scheduler
        assert all(scheduler.num_decode_steps - seq.waiting_since <= scheduler.max_admission_wait
                   for seq in scheduler.waiting)
        step += 1
    return contexts


def test_batched_arrivals_give_the_same_samples_with_fewer_prefills(qwen2, tiny):
    prompts = tiny.prompts([12, 25, 17, 9, 30, 14])
    one_by_one = make_engine(qwen2)
    batched = make_engine(qwen2, max_admission_wait=4, admission_fraction=1.0)
    expected = run_in_lockstep(one_by_one, prompts, batch_arrivals=False)
    assert run_in_lockstep(batched, prompts, batch_arrivals=True) == expected
    assert one_by_one.counters.prefill_steps > batched.counters.prefill_steps >= NUM_TURNS
    assert batched.counters.prefill_steps < len(prompts) * NUM_TURNS  # some turns shared a prefill


def test_async_turns_with_batched_arrivals_are_the_turns_of_one_by_one_admission(qwen2, tiny):
    prompts = tiny.prompts([12, 25, 17, 9, 30, 14])
    expected = run_in_lockstep(make_engine(qwen2), prompts, batch_arrivals=False)
    engine = make_engine(qwen2, max_admission_wait=8, admission_fraction=0.5)

    async def trajectory(index: int) -> list[int]:
        context = list(prompts[index])
        for turn in range(NUM_TURNS):
            [completion] = await engine.generate_async(GenerationRequest(context, turn_sampling(index, turn)))
            context += completion.token_ids + TOOL_TOKENS
            await asyncio.sleep(0.002 * TOOL_STEPS[index])
        return context

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(trajectory(index) for index in range(len(prompts))))

    contexts = asyncio.run(main())
    assert contexts == expected
    assert not engine.scheduler.has_unfinished and engine.last_metrics["rollout/num_decode_steps"] > 0


def test_decode_steps_go_on_ahead_without_the_sequences_that_finished(qwen2, tiny):
    launches: list[tuple[int, bool]] = []  # (rows, launched ahead: input ids still on the device)

    class RecordingEngine(NativeEngine):
        def _launch_decode(self, seqs, next_input_ids=None):
            launches.append((len(seqs), next_input_ids is not None))
            return super()._launch_decode(seqs, next_input_ids)

    prompts = tiny.prompts([7, 19, 11])
    lengths = [8, 3, 6]  # the middle one ends first: the rows after it move up
    engine = RecordingEngine(qwen2, eos_token_ids=[], max_model_len=160, block_size=8, max_num_seqs=16)
    start = engine.counts()
    completions = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=length, temperature=0.0))
                                   for prompt, length in zip(prompts, lengths, strict=True)])
    for prompt, length, samples in zip(prompts, lengths, completions, strict=True):
        assert samples[0].token_ids == tiny.hf_greedy(qwen2, prompt, length)
    # the first token comes from the prefill; every decode step after the first is launched ahead, a finished
    # sequence running once more (its token dropped) before the next step leaves it out
    assert launches == [(3, False), (3, True), (3, True), (2, True), (2, True), (2, True), (1, True)]
    metrics = engine.last_metrics
    assert metrics["rollout/num_prefill_steps"] == 1 and metrics["rollout/num_decode_steps"] == len(launches)
    assert metrics["rollout/decode_batch_mean"] == 16 / 7
    assert engine.counts()["rollout/num_decode_rows"] - start["rollout/num_decode_rows"] == 16
    # the one prefill step's wall time, in the generate call's metrics as in the engine's totals
    assert 0 < metrics["rollout/prefill_s"] == engine.counts()["rollout/prefill_s"] - start["rollout/prefill_s"]


def test_arrivals_join_behind_the_step_in_flight_and_the_next_step_goes_on_ahead(qwen2, tiny):
    """An admitted turn's prefill is launched behind the decode step in flight, and the decode step after it
    (old and new rows) behind the prefill, its input ids still on the device: the pipeline never drains."""
    launches: list[tuple[str, int, bool]] = []  # (kind, rows, launched ahead)

    class RecordingEngine(NativeEngine):
        def _launch_decode(self, seqs, next_input_ids=None):
            launches.append(("decode", len(seqs), next_input_ids is not None))
            return super()._launch_decode(seqs, next_input_ids)

        def _run_prefill(self, step):
            launches.append(("prefill", len(step.seqs), False))
            return super()._run_prefill(step)

    prompts = tiny.prompts([12, 25, 17, 9, 30, 14])
    expected = run_in_lockstep(make_engine(qwen2), prompts, batch_arrivals=False)
    engine = RecordingEngine(qwen2, eos_token_ids=[], max_model_len=160, block_size=8, max_num_seqs=16,
                             max_admission_wait=4, admission_fraction=1.0)
    assert run_in_lockstep(engine, prompts, batch_arrivals=True) == expected
    joins = [index for index, launch in enumerate(launches[1:], 1) if launch[0] == "prefill"
             and index + 1 < len(launches) and launches[index - 1][0] == "decode"]
    assert joins, "no turn joined while others decoded"
    for index in joins:  # the decode step after a join continues at once, the new rows in it
        kind, _, ahead = launches[index + 1]
        assert kind == "decode" and ahead


def test_a_join_without_blocks_for_the_next_step_keeps_the_samples(qwen2, tiny, monkeypatch):
    """When the step after a join finds no free block for its look-ahead, it is launched after the prefill is read,
    and the samples stay those of one-by-one admission."""
    prompts = tiny.prompts([12, 25, 17, 9, 30, 14])
    expected = run_in_lockstep(make_engine(qwen2), prompts, batch_arrivals=False)
    engine = make_engine(qwen2, max_admission_wait=4, admission_fraction=1.0)
    engine.wake_up()
    calls = {"count": 0}
    reserve = engine.scheduler.reserve_lookahead

    def every_other(seqs):
        calls["count"] += 1
        return calls["count"] % 2 == 0 and reserve(seqs)

    monkeypatch.setattr(engine.scheduler, "reserve_lookahead", every_other)
    assert run_in_lockstep(engine, prompts, batch_arrivals=True) == expected
    assert calls["count"] > 10
