"""Continuous batching: which sequences run in the next step, prefill or decode.

Each step is either a prefill of waiting sequences (first come, first served, while KV blocks,
sequence slots and the token budget allow) or one decode token for every running sequence.
A waiting request with n samples is prefilled once and forked into n sequences that share
its prompt blocks (the engine queues a request of more samples than ``max_num_seqs`` as several
waiting sequences of at most that many). When a decode step needs a block and none is free, the
most recently admitted sequence is preempted: its blocks are freed and it waits to be recomputed (its
prompt and generated tokens prefilled again), so the others keep going. Finished sequences
leave after the step that finished them, and waiting ones join at the next prefill. The samples of a request
that is aborted (``abort``: its caller stopped waiting) leave at once, waiting or running, their blocks freed. When every layer
slides, each decode step first gives back the blocks its sequences' windows have left behind. With prefix
caching, a released sequence's full blocks stay cached (see block_manager.py) and a waiting
sequence whose tokens start with cached blocks takes them and prefills only the rest
(``seq.num_cached_tokens``): the next turn of a multi-turn trajectory, or a preempted sequence.

Layer groups: a model whose layers attend through different windows (Gemma 2 and 3: sliding layers beside
full ones; Qwen2 with ``max_window_layers``) keeps one cache and one block pool per window (``pools``, the
first for ``block_manager``'s group, the others' tables in ``seq.group_tables``). Every table of a sequence
has the same length and grows at the same steps, so admission, growth and preemption ask every pool for its
blocks; a sliding group gives back the blocks behind its window as the sequence grows, so it holds at most its
window's blocks and the one being filled, while a full group keeps all. A prefix-cache hit takes the blocks
every pool has cached for the prefix (the shortest of the pools' matches), so a sliding group's pool, where
released blocks are soon reused, bounds the hits of such models. A model with one window (or none) has one pool.

Steps ahead: the engine launches a decode step and reads its tokens back only after launching
the next step, so the host's bookkeeping overlaps the device's work. ``schedule_ahead`` decides
that next step while a decode step is in flight, from the sequences as they stand before its
tokens are read: the waiting sequences' prefill when they should join (then
``schedule_behind_prefill`` gives the decode step of old and new rows launched behind it), or
else the next decode step of the sequences still running. A decode step scheduled ahead reserves
room for one token more than its sequences hold (``reserve_lookahead``); a sequence that finishes
in the step in flight runs in the step after it too (its token is dropped) and leaves the next.

Batching arrivals (``schedule(batch_arrivals=True)``, the engine's async path): a prefill step
stalls every running sequence for a whole forward, so requests that arrive one by one while
others decode (an agent's next turns, as tools return) are not prefilled one by one. They wait
until ``admission_due``: nothing is running, or they are many (``admission_fraction`` of the
running samples), or the oldest has waited ``max_admission_wait`` decode steps; then all of them
join at one prefill. Without it (``generate``'s batch of requests, all there from the start)
waiting sequences join at the first step there is room for them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from reinforge.rollout.native.block_manager import BlockManager
from reinforge.rollout.native.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledStep:
    """What the next forward runs.

    Prefill: ``seqs`` are the sequences to prefill and ``samples[i]`` the sequences that sample
    from ``seqs[i]``'s last logits (itself and its forks); ``block_copies`` lists the
    (source, destination) blocks to copy once the prefill has written the cache.
    Decode: ``seqs`` each sample one token.
    """

    is_prefill: bool
    seqs: list[Sequence]
    samples: list[list[Sequence]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    group_block_copies: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    """The block copies of the other layer groups' pools, by index in ``Scheduler.group_managers``."""
    continued_rows: list[int] | None = None
    """A decode step scheduled ahead: the rows of the step in flight that its first sequences continue, in order
    (each one's input is the token that row sampled, not yet read back); None for a step scheduled from the
    sequences' own tokens."""


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_admission_wait: int = 0, admission_fraction: float = 0.0,
                 group_managers: tuple[BlockManager, ...] = ()):
        """max_admission_wait: decode steps the oldest arrival may wait for others to join its prefill;
        admission_fraction: waiting samples, as a fraction of the running ones, that are prefilled at once
        (both only when batching arrivals; see the module docstring). The block manager's ``rope_switch_length``
        (LongRoPE) is where a sequence is prefilled again (``recompute``). group_managers: the pools of the other
        layer groups (see the module docstring), same block size."""
        self.block_manager = block_manager
        self.group_managers = group_managers
        self.pools = (block_manager, *group_managers)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_admission_wait = max_admission_wait
        self.admission_fraction = admission_fraction
        self.num_decode_steps = 0
        """Decode steps scheduled so far, look-ahead ones included: the clock of ``admission_due``."""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.num_preempted = 0
        self.num_recomputed = 0
        self.version = 0
        """Changes whenever the running set or its order does (lets the engine reuse per-batch tensors)."""
        self._next_seq_id = 0

    def new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``, which stands for at most ``max_num_seqs`` samples (the engine splits a request of more)."""
        assert seq.num_samples <= self.max_num_seqs, f"{seq.num_samples} samples in one waiting sequence"
        seq.waiting_since = self.num_decode_steps
        self.waiting.append(seq)

    def refusal(self, num_tokens: int, num_samples: int) -> str | None:
        """Why a waiting sequence of ``num_tokens`` tokens standing for ``num_samples`` samples is never admitted, not
        even with every slot and block free (one line), or None when it can be; at most ``max_num_seqs`` samples."""
        for manager in self.pools:
            copies = num_samples - 1 if num_tokens % manager.block_size else 0
            if manager.num_blocks_for(num_tokens) + copies > manager.num_blocks:
                return self._outgrows(num_tokens, num_samples, manager.num_blocks_for(num_tokens) + copies, manager)
        return None

    def _outgrows(self, num_tokens: int, num_samples: int, num_blocks: int, manager: BlockManager) -> str:
        pool = "" if not self.group_managers else " (the full-attention layers' pool)" \
            if manager.sliding_window is None else f" (the pool of the layers with window {manager.sliding_window})"
        return (f"a sequence of {num_tokens} tokens with n={num_samples} needs {num_blocks} KV blocks but the cache "
                f"has {manager.num_blocks}{pool}; raise gpu_memory_utilization (or num_kv_blocks), or shorten the prompt "
                "or max_tokens")

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_to_admit(self, seq: Sequence, cached: list[int], manager: BlockManager | None = None) -> int:
        """Free blocks of ``manager`` (default ``block_manager``) that admitting ``seq`` uses up, taking the cached
        blocks ``cached`` of its prefix."""
        manager = manager or self.block_manager
        num_copies = seq.num_samples - 1 if seq.num_tokens % manager.block_size else 0
        return manager.num_blocks_for(seq.num_tokens) - len(cached) + manager.num_blocks_taken(cached) + num_copies

    def admission_due(self) -> bool:
        """Whether the waiting sequences should be prefilled now rather than wait for more arrivals."""
        if not self.waiting:
            return False
        if not self.running:
            return True
        oldest = min(seq.waiting_since for seq in self.waiting)
        if self.num_decode_steps - oldest >= self.max_admission_wait:
            return True
        return sum(seq.num_samples for seq in self.waiting) >= self.admission_fraction * len(self.running)

    def schedule(self, batch_arrivals: bool = False) -> ScheduledStep | None:
        """The next step, or None when nothing is left to run. batch_arrivals: waiting sequences join only
        when ``admission_due`` (else only when there is room for them)."""
        if self.waiting and (not batch_arrivals or self.admission_due()):
            step = self.schedule_prefill()
            if step is not None:
                return step
        if not self.running:
            return None
        step = self._schedule_decode()
        if not step.seqs:  # every running sequence was preempted: one alone outgrows the cache (refused in one line)
            return self.schedule_prefill()
        return step

    def schedule_prefill(self) -> ScheduledStep | None:
        """A prefill of the waiting sequences that fit (first come, first served), or None when none fits."""
        step = ScheduledStep(is_prefill=True, seqs=[])
        num_tokens = 0
        num_running = len(self.running)
        while self.waiting:
            seq = self.waiting[0]
            if num_running + seq.num_samples > self.max_num_seqs:
                break
            cached = self.block_manager.match_prefix(seq.token_ids, seq.block_keys)
            group_cached = [manager.match_prefix(seq.token_ids, seq.block_keys) for manager in self.group_managers]
            if group_cached:  # a hit needs the prefix's blocks in every pool
                num_hit = min(len(cached), *(len(blocks) for blocks in group_cached))
                cached, group_cached = cached[:num_hit], [blocks[:num_hit] for blocks in group_cached]
            num_new = seq.num_tokens - len(cached) * self.block_manager.block_size
            # the whole context counts: a prefill after a cache hit gathers every cached key and value of its
            # sequences (attention.prefill_attention_with_prefix), as much memory as a full prefill's grid
            if step.seqs and num_tokens + seq.num_tokens > self.max_num_batched_tokens:
                break
            short = next((manager for manager, blocks in zip(self.pools, [cached, *group_cached], strict=True)
                          if not manager.can_allocate(self._blocks_to_admit(seq, blocks, manager))), None)
            if short is not None:
                if not self.running and not step.seqs:
                    raise RuntimeError(self._outgrows(seq.num_tokens, seq.num_samples,
                                                      self._blocks_to_admit(seq, [], short), short))
                break
            self.waiting.popleft()
            num_tokens += seq.num_tokens
            num_running += seq.num_samples
            seq.block_table = self.block_manager.allocate(seq.num_tokens, cached)
            seq.group_tables = [manager.allocate(seq.num_tokens, blocks)
                                for manager, blocks in zip(self.group_managers, group_cached, strict=True)]
            seq.num_cached_tokens = seq.num_tokens - num_new
            seq.cache_epoch = self.block_manager.epoch
            group = [seq]
            for offset in range(1, seq.num_samples):  # a request's later group starts at its own sample index
                child = seq.fork(self.new_seq_id(), seq.sample_index + offset)
                child.block_table, copy = self.block_manager.fork(seq.block_table, seq.num_tokens)
                if copy is not None:
                    step.block_copies.append(copy)
                for index, manager in enumerate(self.group_managers):
                    table, copy = manager.fork(seq.group_tables[index], seq.num_tokens)
                    child.group_tables.append(table)
                    if copy is not None:
                        step.group_block_copies.setdefault(index, []).append(copy)
                group.append(child)
            seq.num_samples = 1
            for member in group:
                self._start_running(member)
            step.seqs.append(seq)
            step.samples.append(group)
        return step if step.seqs else None

    def _start_running(self, seq: Sequence) -> None:
        self.version += 1
        seq.status = SequenceStatus.RUNNING
        seq.row = self.free_rows.pop()
        self.running.append(seq)

    def _release_out_of_window(self, seqs: list[Sequence]) -> None:
        """Blocks no query of ``seqs`` reads again go back to their pool (the pools of sliding layers; see
        block_manager.py). The step in flight, if any, decodes each sequence's last token, so its window starts
        no earlier."""
        manager = self.block_manager
        if manager.sliding_window is not None:
            for seq in seqs:
                manager.release_out_of_window(seq.block_table, len(seq.token_ids) - 1, seq.token_ids
                                              if seq.keep_prefix else None, seq.block_keys, seq.cache_epoch)
        for index, manager in enumerate(self.group_managers):
            if manager.sliding_window is not None:
                for seq in seqs:
                    manager.release_out_of_window(seq.group_tables[index], len(seq.token_ids) - 1, seq.token_ids
                                                  if seq.keep_prefix else None, seq.block_keys, seq.cache_epoch)

    def _can_allocate(self, num_blocks: int) -> bool:
        """Whether every pool has ``num_blocks`` free blocks."""
        return all(manager.can_allocate(num_blocks) for manager in self.pools)

    def _append_block(self, seq: Sequence) -> None:
        """Grow each of ``seq``'s tables by a block."""
        self.block_manager.append_block(seq.block_table)
        for manager, table in zip(self.group_managers, seq.group_tables, strict=True):
            manager.append_block(table)

    def _schedule_decode(self) -> ScheduledStep:
        """One decode token for every running sequence; a sequence grows (or preempts) in every pool at once."""
        self.num_decode_steps += 1
        self._release_out_of_window(self.running)
        block_size = self.block_manager.block_size
        growing = [seq for seq in self.running if len(seq.block_table) * block_size < seq.num_tokens]
        if self._can_allocate(len(growing)):
            for seq in growing:
                self._append_block(seq)
            return ScheduledStep(is_prefill=False, seqs=list(self.running))
        scheduled: list[Sequence] = []
        queue = deque(self.running)
        while queue:
            seq = queue.popleft()
            while self.block_manager.needs_block(seq.block_table, seq.num_tokens) and not self._can_allocate(1):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                if self.block_manager.needs_block(seq.block_table, seq.num_tokens):
                    self._append_block(seq)
                scheduled.append(seq)
        self.running = scheduled
        # a copy: sequences admitted while this step is in flight join ``running``, never the step's own list
        return ScheduledStep(is_prefill=False, seqs=list(scheduled))

    def schedule_ahead(self, in_flight: list[Sequence], batch_arrivals: bool = False) -> ScheduledStep | None:
        """The step to launch while a decode step of ``in_flight`` runs, before its tokens are read back.

        Waiting sequences join (when ``admission_due`` with batch_arrivals, else as soon as any waits) through a
        prefill of those that fit; the decode step behind it comes from ``schedule_behind_prefill``. Otherwise the
        next decode step of the sequences of ``in_flight`` still running, or None when every one of them ends with
        the step in flight or blocks ran short.
        """
        joining = self.admission_due() if batch_arrivals else bool(self.waiting)
        if joining:
            step = self.schedule_prefill()
            if step is not None:
                return step
        # the loops here and in the engine's read-back run over every sequence at every decode step, on the host,
        # while the device runs the step in flight: plain attribute reads, one pass (a slow host CPU sets the pace)
        running = SequenceStatus.RUNNING
        rows, continuing = [], []
        all_end = True  # every sequence ends with the step in flight
        switch = self.block_manager.rope_switch_length
        for row, seq in enumerate(in_flight):
            if seq.status is not running:  # it finished in the step read last
                continue
            if len(seq.token_ids) == switch:  # the token in flight crosses it: prefilled again once read back
                self.version += 1  # the rows change
                continue
            rows.append(row)
            continuing.append(seq)
            if all_end and len(seq.token_ids) + 1 < seq.max_num_tokens:
                all_end = False
        if all_end or not self.reserve_lookahead(continuing):
            return None
        return ScheduledStep(is_prefill=False, seqs=continuing, continued_rows=rows)

    def schedule_behind_prefill(self, in_flight: list[Sequence], prefilled: list[Sequence]) -> ScheduledStep | None:
        """The decode step launched behind a prefill scheduled ahead, before either is read back: the sequences of
        ``in_flight`` still running, then ``prefilled`` (the sequences that sampled from the prefill); None when
        blocks ran short (the next step is then scheduled once both are read).

        Scheduled only once the prefill is launched: reserving blocks for its sequences earlier would change the
        block tables the prefill reads."""
        running = SequenceStatus.RUNNING
        switch = self.block_manager.rope_switch_length
        if any(len(seq.token_ids) == switch for seq in prefilled):  # its token crosses it (see ``recompute``)
            return None
        rows = [row for row, seq in enumerate(in_flight) if seq.status is running]
        if switch is not None and any(len(in_flight[row].token_ids) == switch for row in rows):
            self.version += 1  # the rows change
            rows = [row for row in rows if len(in_flight[row].token_ids) != switch]
        seqs = [in_flight[row] for row in rows] + prefilled
        if not self.reserve_lookahead(seqs):
            return None
        return ScheduledStep(is_prefill=False, seqs=seqs, continued_rows=rows)

    def reserve_lookahead(self, seqs: list[Sequence]) -> bool:
        """Grow each sequence to hold one token more than it has, for a decode step launched before the
        previous one's tokens are read; False (nothing allocated) when the free blocks do not suffice."""
        self._release_out_of_window(seqs)
        block_size = self.block_manager.block_size
        growing = [seq for seq in seqs if len(seq.block_table) * block_size <= len(seq.token_ids)]  # every step
        if not self.block_manager.can_allocate(len(growing)):
            return False
        if self.group_managers:
            if not self._can_allocate(len(growing)):
                return False
            for seq in growing:
                self._append_block(seq)
            self.num_decode_steps += 1
            return True
        for seq in growing:
            self.block_manager.append_block(seq.block_table)
        self.num_decode_steps += 1
        return True

    def _release(self, seq: Sequence) -> None:
        # every token but the last has its keys and values in the cache (the last is decoded next, if ever)
        self.block_manager.free(seq.block_table, seq.token_ids if seq.keep_prefix else None, seq.num_tokens - 1,
                                seq.block_keys, seq.cache_epoch)
        for manager, table in zip(self.group_managers, seq.group_tables, strict=True):
            manager.free(table, seq.token_ids if seq.keep_prefix else None, seq.num_tokens - 1, seq.block_keys,
                         seq.cache_epoch)
        seq.num_cached_tokens = 0
        self.free_rows.append(seq.row)
        seq.row = -1

    def _preempt(self, seq: Sequence) -> None:
        self.version += 1
        self._release(seq)
        seq.seq_id = self.new_seq_id()  # a new id: re-admitted into its old row, it must not keep the runner's copy
        seq.status = SequenceStatus.WAITING
        seq.waiting_since = self.num_decode_steps
        self.waiting.appendleft(seq)
        self.num_preempted += 1

    def recompute(self, seqs: list[Sequence]) -> None:
        """Send running sequences whose tokens just reached LongRoPE's ``rope_switch_length`` + 1 back to be
        prefilled in full, as transformers' Phi-3 ``generate`` drops its cache there: every key is then computed
        with the long factors (rotary_tables.py). Their blocks are freed (the prefix cache keeps the short-factor
        ones apart) and they wait first in line; steps scheduled ahead leave them out (``schedule_ahead``)."""
        again = {seq.seq_id for seq in seqs}
        self.running = [seq for seq in self.running if seq.seq_id not in again]
        for seq in seqs:
            self.version += 1
            self._release(seq)
            seq.seq_id = self.new_seq_id()  # a new id: the runner's copy of its old block table is never reused
            seq.status = SequenceStatus.WAITING
            seq.waiting_since = self.num_decode_steps
            self.waiting.appendleft(seq)
            self.num_recomputed += 1

    def abort(self, request_key: int) -> int:
        """Drop every sample of the request ``request_key``, waiting or running, and free their blocks now; returns
        how many sequences were dropped. Blocks another sequence holds stay its own, and full blocks the prefix cache
        may keep are registered as when a sequence finishes. A step in flight that decodes a dropped sequence runs
        on: its token is never read (the sequence is no longer running), as for a sequence that finished in it."""
        waiting = [seq for seq in self.waiting if seq.request_key == request_key]
        running = [seq for seq in self.running if seq.request_key == request_key]
        if waiting:
            self.version += 1
            self.waiting = deque(seq for seq in self.waiting if seq.request_key != request_key)
        for seq in waiting:  # a waiting sequence holds no blocks (never admitted, or released when preempted)
            seq.status = SequenceStatus.FINISHED
        self.finish(running)  # their blocks freed, as a sequence's that finished
        return len(waiting) + len(running)

    def finish(self, finished: list[Sequence]) -> None:
        """Remove sequences that produced their last token this step and free their blocks."""
        if not finished:
            return
        self.version += 1
        for seq in finished:
            seq.status = SequenceStatus.FINISHED
            self._release(seq)
        done = {seq.seq_id for seq in finished}
        self.running = [seq for seq in self.running if seq.seq_id not in done]
