"""Continuous batching without a model: admission, forks, finishing and preemption."""

from __future__ import annotations

from reinforge.rollout.base import SamplingParams
from reinforge.rollout.native.block_manager import BlockManager
from reinforge.rollout.native.scheduler import Scheduler
from reinforge.rollout.native.sequence import Sequence, SequenceStatus


def make_seq(scheduler: Scheduler, prompt_len: int, max_tokens: int = 4, n: int = 1) -> Sequence:
    return Sequence(scheduler.new_seq_id(), 0, 0, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens, n=n),
                    request_seed=1, stop_token_ids=frozenset(), max_model_len=64, num_samples=n)


def sample_all(seqs: list[Sequence]) -> list[Sequence]:
    """Append one token to each sequence; return the finished ones."""
    return [seq for seq in seqs if seq.append(7, -1.0)]


def test_waiting_sequences_join_when_slots_free_up():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    short, long_, late = make_seq(scheduler, 3, max_tokens=1), make_seq(scheduler, 5, max_tokens=3), make_seq(scheduler, 2)
    for seq in (short, long_, late):
        scheduler.add(seq)
    step = scheduler.schedule()
    assert step.is_prefill and step.seqs == [short, long_]  # only two slots
    scheduler.finish(sample_all(step.seqs))
    assert short.status is SequenceStatus.FINISHED and short.finish_reason == "length"
    step = scheduler.schedule()
    assert step.is_prefill and step.seqs == [late]  # joins as soon as a slot is free
    scheduler.finish(sample_all(step.seqs))
    step = scheduler.schedule()
    assert not step.is_prefill and step.seqs == [long_, late]
    while step is not None:
        scheduler.finish(sample_all(step.seqs))
        step = scheduler.schedule()
    assert long_.num_generated == 3 and late.num_generated == 4
    assert scheduler.block_manager.num_free_blocks == 64 and not scheduler.has_unfinished


def test_n_samples_fork_after_one_prefill():
    scheduler = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=100)
    scheduler.add(make_seq(scheduler, 6, n=3))
    step = scheduler.schedule()
    assert len(step.seqs) == 1 and len(step.samples[0]) == 3
    assert [seq.sample_index for seq in step.samples[0]] == [0, 1, 2]
    assert len(step.block_copies) == 2  # the half-full second block is copied for each fork
    first_blocks = {seq.block_table[0] for seq in step.samples[0]}
    assert len(first_blocks) == 1 and scheduler.block_manager.ref_counts[first_blocks.pop()] == 3
    assert scheduler.block_manager.num_used_blocks == 2 + 2


def test_preemption_frees_blocks_and_recomputes_later():
    scheduler = Scheduler(BlockManager(4, 4), max_num_seqs=4, max_num_batched_tokens=100)
    first, second = make_seq(scheduler, 4, max_tokens=6), make_seq(scheduler, 4, max_tokens=6)
    scheduler.add(first)
    scheduler.add(second)
    step = scheduler.schedule()
    assert step.seqs == [first, second]
    scheduler.finish(sample_all(step.seqs))
    step = scheduler.schedule()  # each needs a second block: 2 used + 2 free
    scheduler.finish(sample_all(step.seqs))
    for _ in range(3):
        scheduler.finish(sample_all(scheduler.schedule().seqs))
    step = scheduler.schedule()  # both need a third block, none is free: the later one is preempted
    assert step.seqs == [first] and scheduler.num_preempted == 1
    assert second.status is SequenceStatus.WAITING and second.block_table == []
    while scheduler.has_unfinished:
        step = scheduler.schedule()
        scheduler.finish(sample_all(step.seqs))
    assert first.num_generated == 6 and second.num_generated == 6
    assert scheduler.block_manager.num_free_blocks == 4


def decode_once(scheduler: Scheduler, batch_arrivals: bool = True) -> None:
    step = scheduler.schedule(batch_arrivals)
    assert not step.is_prefill
    scheduler.finish(sample_all(step.seqs))


def decoding_scheduler(num_running: int, max_admission_wait: int,
                       admission_fraction: float) -> tuple[Scheduler, list[Sequence]]:
    """A scheduler whose ``num_running`` sequences (3-token prompts, 20 tokens each) are prefilled and decoding."""
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=16, max_num_batched_tokens=100,
                          max_admission_wait=max_admission_wait, admission_fraction=admission_fraction)
    running = [make_seq(scheduler, 3, max_tokens=20) for _ in range(num_running)]
    for seq in running:
        scheduler.add(seq)
    assert scheduler.schedule(batch_arrivals=True).seqs == running  # nothing runs: admitted at once
    scheduler.finish(sample_all(running))
    return scheduler, running


def test_arrivals_during_decode_wait_to_join_one_prefill():
    scheduler, running = decoding_scheduler(8, max_admission_wait=4, admission_fraction=0.5)
    first, second = make_seq(scheduler, 5), make_seq(scheduler, 6)
    scheduler.add(first)
    for decode_steps in range(4):
        if decode_steps == 2:
            scheduler.add(second)
        assert not scheduler.admission_due()
        decode_once(scheduler)  # the running sequences go on; the arrivals wait
    assert first.status is SequenceStatus.WAITING and scheduler.admission_due()
    step = scheduler.schedule(batch_arrivals=True)  # the first waited 4 decode steps: both join one prefill
    assert step.is_prefill and step.seqs == [first, second]
    assert [seq.num_generated for seq in running] == [5] * 8


def test_many_arrivals_join_at_once_and_without_batching_at_the_next_step():
    scheduler, _ = decoding_scheduler(4, max_admission_wait=100, admission_fraction=0.5)
    lone = make_seq(scheduler, 5)
    scheduler.add(lone)
    decode_once(scheduler)
    step = scheduler.schedule(batch_arrivals=False)  # generate()'s batch: it joins as soon as there is room
    assert step.is_prefill and step.seqs == [lone]
    scheduler.finish(sample_all(step.seqs))
    pair = [make_seq(scheduler, 4), make_seq(scheduler, 4, n=2)]
    scheduler.add(pair[0])
    decode_once(scheduler)
    scheduler.add(pair[1])  # 3 waiting samples >= 0.5 * 5 running
    step = scheduler.schedule(batch_arrivals=True)
    assert step.is_prefill and step.seqs == pair


def test_look_ahead_steps_count_toward_the_wait():
    scheduler, running = decoding_scheduler(4, max_admission_wait=2, admission_fraction=1.0)
    scheduler.add(make_seq(scheduler, 5))
    assert scheduler.reserve_lookahead(running) and not scheduler.admission_due()
    assert scheduler.reserve_lookahead(running) and scheduler.admission_due()


def test_the_step_ahead_continues_the_rows_still_running_and_reserves_their_next_block():
    scheduler = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=100)
    seqs = [make_seq(scheduler, 3, max_tokens=max_tokens) for max_tokens in (6, 2, 6)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.finish(sample_all(scheduler.schedule().seqs))  # the prefill: 4 tokens each, one full block
    in_flight = scheduler.schedule()
    assert not in_flight.is_prefill and in_flight.continued_rows is None
    scheduler.finish(sample_all(in_flight.seqs))  # read back: the middle one is done
    decode_steps = scheduler.num_decode_steps
    step = scheduler.schedule_ahead(in_flight.seqs)
    assert not step.is_prefill and step.seqs == [seqs[0], seqs[2]] and step.continued_rows == [0, 2]
    # 5 tokens and one more on the device: each holds room for the 6th, and the step counts toward the wait
    assert [len(seq.block_table) for seq in step.seqs] == [2, 2] and scheduler.num_decode_steps == decode_steps + 1


def test_no_step_ahead_when_every_sequence_ends_with_the_step_in_flight_or_blocks_run_short():
    scheduler = Scheduler(BlockManager(2, 4), max_num_seqs=4, max_num_batched_tokens=100)
    ending = make_seq(scheduler, 3, max_tokens=2)
    scheduler.add(ending)
    scheduler.finish(sample_all(scheduler.schedule().seqs))
    assert scheduler.schedule_ahead(scheduler.schedule().seqs) is None  # its last token is the one in flight
    scheduler.finish(sample_all([ending]))
    for _ in range(2):
        scheduler.add(make_seq(scheduler, 3, max_tokens=6))
    scheduler.finish(sample_all(scheduler.schedule().seqs))
    in_flight = scheduler.schedule()  # both blocks in use, and each sequence needs a second one ahead
    assert scheduler.schedule_ahead(in_flight.seqs) is None and scheduler.block_manager.num_free_blocks == 0


def test_arrivals_join_ahead_and_the_decode_step_behind_them_takes_old_and_new_rows():
    scheduler, running = decoding_scheduler(3, max_admission_wait=100, admission_fraction=1.0)
    in_flight = scheduler.schedule()
    arrival = make_seq(scheduler, 5, n=2)
    scheduler.add(arrival)
    step = scheduler.schedule_ahead(in_flight.seqs, batch_arrivals=False)  # generate()'s batch: it joins at once
    assert step.is_prefill and step.seqs == [arrival]
    scheduler.finish([running[1]])  # as if it had finished in the step read back last
    behind = scheduler.schedule_behind_prefill(in_flight.seqs, step.samples[0])
    assert not behind.is_prefill and behind.continued_rows == [0, 2]
    assert behind.seqs == [running[0], running[2], *step.samples[0]]


def test_arrivals_that_are_not_due_wait_while_decode_steps_go_on_ahead():
    scheduler, running = decoding_scheduler(3, max_admission_wait=2, admission_fraction=1.0)
    in_flight = scheduler.schedule(batch_arrivals=True)
    arrival = make_seq(scheduler, 5)
    scheduler.add(arrival)
    step = in_flight
    for _ in range(2):  # 1 waiting sample < 1.0 * 3 running, and it has waited fewer than 2 decode steps
        step = scheduler.schedule_ahead(step.seqs, batch_arrivals=True)
        assert not step.is_prefill and step.seqs == running and arrival.status is SequenceStatus.WAITING
    step = scheduler.schedule_ahead(step.seqs, batch_arrivals=True)  # the two steps ahead count toward its wait
    assert step.is_prefill and step.seqs == [arrival]
