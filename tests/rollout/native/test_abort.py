"""Aborting a request in the native engine: a caller that stops waiting takes its samples out wherever they stand,
their blocks are free at once (blocks another sequence holds stay its own), and every other request samples the
tokens it samples without the aborted one."""

from __future__ import annotations

import asyncio

import pytest

from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.native.sequence import SequenceStatus

BLOCK_SIZE = 8
ABORTED = 1


@pytest.fixture(scope="module")
def qwen2(tiny):
    return tiny.build("qwen2", seed=2)


@pytest.fixture(scope="module")
def prompts(tiny):
    """Requests 0 and 1 start with the two blocks of ``shared``, which a first request leaves in the prefix cache."""
    shared, first, zero, one, two = tiny.prompts([2 * BLOCK_SIZE, 3, 5, 7, 11])
    return shared + first, [shared + zero, shared + one, two]


PREEMPTING_NUM_KV_BLOCKS = 16
"""Few enough blocks that request 1, admitted last, is preempted as the samples grow."""


def make_engine(model, num_kv_blocks: int | None = None) -> NativeEngine:
    return NativeEngine(model, eos_token_ids=[], max_model_len=160, block_size=BLOCK_SIZE, max_num_seqs=16,
                        max_admission_wait=2, admission_fraction=8.0, num_kv_blocks=num_kv_blocks)


def sampling(index: int, num_samples: int) -> SamplingParams:
    return SamplingParams(max_tokens=12 if index == ABORTED else 16, temperature=1.0, seed=10 + index,
                          n=num_samples if index == ABORTED else 2)


def samples_held(engine: NativeEngine, key: int | None) -> list:
    scheduler = engine.scheduler
    return [seq for seq in [*scheduler.waiting, *scheduler.running] if seq.request_key == key]


def run_in_lockstep(engine: NativeEngine, prompts: tuple[list[int], list[list[int]]], abort_at: str | None,
                    num_samples: int = 1) -> dict[int, list[list[int]]]:
    """Requests 0 and 2 from the start, request 1 (unless ``abort_at`` is None) aborted as it stands ``abort_at``:
    incoming (submitted, never stepped), waiting (admitted, waiting for others to join its prefill), decoding (two
    tokens sampled) or preempted (a sample sent back to wait for its recompute, the others maybe running). Returns each finished request's samples; checks the blocks and requests the engine holds."""
    first, requests = prompts
    engine.generate([GenerationRequest(first, SamplingParams(max_tokens=1, temperature=0.0))])  # fills the cache
    engine.wake_up()
    done: dict[int, list[list[int]]] = {}

    def submit(index: int):
        request = GenerationRequest(requests[index], sampling(index, num_samples))
        return engine._submit(request, on_done=lambda completions: done.__setitem__(
            index, [completion.token_ids for completion in completions]))

    submit(0)
    submit(2)
    aborted = None
    if abort_at == "incoming":
        engine._abort(submit(ABORTED))
        aborted = "done"
    num_steps = 0
    while engine._step(batch_arrivals=True):
        num_steps += 1
        if abort_at is None or aborted == "done":
            continue
        if aborted is None:
            if num_steps == 3:  # requests 0 and 2 decode
                aborted = submit(ABORTED)
            continue
        held = samples_held(engine, aborted.key)
        if abort_at == "waiting" and held and held[0].status is SequenceStatus.WAITING:
            assert held[0].num_samples == num_samples and not held[0].block_table
        elif abort_at == "decoding" and len(held) == num_samples and all(seq.num_generated >= 2 for seq in held):
            pools = engine.scheduler.pools
            others = {block for seq in engine.scheduler.running if seq.request_key != aborted.key
                      for block in seq.block_table}
            own = {block for seq in held for block in seq.block_table}
            assert own & others and own - others  # it shares the cached blocks with request 0, and has its own
            used = pools[0].num_used_blocks
        elif abort_at == "preempted" and any(seq.status is SequenceStatus.WAITING and seq.num_generated for seq in held):
            assert engine.scheduler.num_preempted
        else:
            continue
        engine._abort(aborted)
        assert not samples_held(engine, aborted.key) and aborted.key not in engine._requests
        if abort_at == "decoding":  # freed at once, but for those request 0 holds
            assert pools[0].num_used_blocks == used - len(own - others)
            assert all(pools[0].ref_counts[block] >= 1 for block in own & others)
        aborted = "done"
    assert aborted in (None, "done"), "request 1 never reached the state it is aborted in"
    assert not engine.scheduler.has_unfinished and not engine._requests and engine._in_flight is None
    assert all(manager.num_free_blocks == manager.num_blocks for manager in engine.scheduler.pools)
    engine.sleep()
    return done


@pytest.mark.parametrize("num_samples", [1, 3])
@pytest.mark.parametrize("abort_at", ["incoming", "waiting", "decoding", "preempted"])
def test_an_aborted_request_frees_its_blocks_and_the_others_sample_as_without_it(qwen2, prompts, abort_at,
                                                                                 num_samples):
    num_kv_blocks = PREEMPTING_NUM_KV_BLOCKS if abort_at == "preempted" else None
    expected = run_in_lockstep(make_engine(qwen2, num_kv_blocks), prompts, None)
    done = run_in_lockstep(make_engine(qwen2, num_kv_blocks), prompts, abort_at, num_samples)
    assert done == expected and sorted(done) == [0, 2]


async def cancel_request_one(engine: NativeEngine, requests: list[list[int]],
                             tokens_of_aborted: list[int] | None = None) -> list:
    """Requests 0, 1 and 2 through ``generate_async``, request 1's caller cancelled once request 0 has streamed three
    tokens (``tokens_of_aborted``: request 1 streamed into it). Returns the three results, request 1's the
    cancellation."""
    aborted: asyncio.Task | None = None
    num_streamed = 0

    def on_token(*_) -> None:
        nonlocal num_streamed
        num_streamed += 1
        if num_streamed == 3 * 2:  # three tokens of each of request 0's two samples
            aborted.cancel()

    zero = asyncio.ensure_future(engine.generate_async(GenerationRequest(requests[0], sampling(0, 3)), on_token))
    aborted = asyncio.ensure_future(engine.generate_async(
        GenerationRequest(requests[ABORTED], sampling(ABORTED, 3)),
        (lambda _, token, *rest: tokens_of_aborted.append(token)) if tokens_of_aborted is not None else None))
    two = asyncio.ensure_future(engine.generate_async(GenerationRequest(requests[2], sampling(2, 3))))
    results = await asyncio.gather(zero, aborted, two, return_exceptions=True)
    assert isinstance(results[1], asyncio.CancelledError)
    return results


@pytest.mark.parametrize("streamed", [False, True])
def test_cancelling_generate_async_aborts_its_request(qwen2, prompts, streamed):
    """The caller of ``generate_async`` cancelled (as ``asyncio.wait_for`` or a client hanging up does) once request
    0 has streamed three tokens: request 1 stops there, and requests 0 and 2 get what they get without it."""
    expected = run_in_lockstep(make_engine(qwen2), prompts, None)
    engine = make_engine(qwen2)
    first, requests = prompts
    engine.generate([GenerationRequest(first, SamplingParams(max_tokens=1, temperature=0.0))])
    tokens_of_aborted: list[int] = []
    start = engine.counts()["rollout/num_decode_rows"]
    results = asyncio.run(cancel_request_one(engine, requests, tokens_of_aborted if streamed else None))
    assert {0: [sample.token_ids for sample in results[0]], 2: [sample.token_ids for sample in results[2]]} == expected
    num_decoded = engine.counts()["rollout/num_decode_rows"] - start
    # run to their ends, the samples would decode 15 tokens each (requests 0 and 2) and 11 (request 1): at least that
    assert num_decoded < 2 * 2 * 15 + 3 * 11
    assert not engine.scheduler.has_unfinished and not engine._requests
    assert all(manager.num_free_blocks == manager.num_blocks for manager in engine.scheduler.pools)
    assert len(tokens_of_aborted) < 3 * 12 if streamed else not tokens_of_aborted
    engine.sleep()


@pytest.mark.gpu
def test_a_cancelled_request_aborts_between_captured_decode_steps_on_the_gpu(tiny, prompts):
    """On a GPU (Triton kernels, CUDA graphs, each decode step launched before the last one's tokens are read): the
    cancelled request stops, the others run to their lengths, and every block is free afterwards."""
    model = tiny.build("qwen2", device="cuda", seed=2)
    engine = make_engine(model)
    first, requests = prompts
    engine.generate([GenerationRequest(first, SamplingParams(max_tokens=1, temperature=0.0))])
    results = asyncio.run(cancel_request_one(engine, requests))
    assert [len(sample.token_ids) for sample in results[0] + results[2]] == [16] * 4
    assert not engine.scheduler.has_unfinished and not engine._requests
    assert all(manager.num_free_blocks == manager.num_blocks for manager in engine.scheduler.pools)
    engine.sleep()
