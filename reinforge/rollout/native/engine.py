"""NativeEngine: reinforge's own rollout engine for the dense families of the architecture table.

Token ids in, token ids and per-token log-probs out. One scheduler serves two entry points:
``generate(requests)`` steps it until a batch is done, and ``await generate_async(request)``
adds one request and lets a background task step it while anything is pending
(``async_driver.py``), so agent loops submit requests one at a time and none waits for another.
Requests arriving that way while others decode are batched (``max_admission_wait``,
``admission_fraction``; see scheduler.py): each prefill step stalls every running sequence, so
arrivals join a few at a time rather than one prefill each. Each step (``_step``) is scheduled,
run and read back. Decode steps overlap: the next one is launched before the last one's tokens
are read back, also when sequences finished in between (the next step runs without them), while
arrivals wait, and when they join: their prefill is launched behind the step in flight and the
next decode step, new rows included, behind the prefill, so the device does not wait for the
host around a join (``Scheduler.schedule_ahead``). A ``generate_async`` caller that is cancelled (a timeout, a client
that hung up) aborts its request wherever it stands, all its samples: they stop, their KV blocks are freed before the
next step, and the other requests' samples are those they would be without it (``_abort``).

Prefix caching (``enable_prefix_caching``): a finished sequence's full KV blocks stay cached
while the engine is awake, and a request whose prompt starts with them prefills only the rest at
their positions, so a multi-turn trajectory's next turn computes only its new tokens (tool output
and template); samples are those of a full prefill, up to float rounding. The cache is dropped at
``sleep`` and whenever the weights change (``sync_weights``, ``add_to_weights``), so keys and
values of older weights are never reused. ``counts`` and the metrics
``rollout/prefix_cache_hit_tokens``, ``rollout/prefill_tokens`` and ``rollout/prefix_cache_hit_rate`` count it,
beside the steps (``rollout/num_prefill_steps``, ``rollout/num_decode_steps``, ``rollout/decode_batch_mean``).
``rollout/kv_blocks_total`` and ``rollout/kv_blocks_used_peak`` count the KV blocks of every pool (a model with
several windows keeps one per window), and ``rollout/kv_blocks_used_peak_share`` is the fullest pool's peak share.

Hybrid engine: the engine runs the trainer's model from its own copy of the weights (q|k|v and
gate|up concatenated, one matrix product each; see ``model.py``). ``wake_up`` makes the copy
(or refreshes it in place) and allocates the KV cache from a fraction of device memory;
``sync_weights`` refreshes the copy in place when it exists; ``sleep`` frees the copy, the KV
cache and the CUDA graphs into PyTorch's caching allocator, where the training step reuses the
memory (``empty_cache_on_sleep`` also returns it to the device), or, with
``free_on_sleep=False``, keeps them all, so graphs captured once serve every later rollout.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from reinforge.models.kv_layout import split_pool_blocks, window_pool_blocks
from reinforge.rollout.base import Completion, GenerationRequest, prompt_problem, sampling_problem
from reinforge.rollout.native import collector
from reinforge.rollout.native.async_driver import AsyncDriver, OnToken
from reinforge.rollout.native.block_manager import BlockManager
from reinforge.rollout.native.counters import EngineCounters, count_metrics
from reinforge.rollout.native.model import decoder_module, supports_model, unsupported_reason
from reinforge.rollout.native.model_runner import ModelRunner, to_device
from reinforge.rollout.native.requests import LaunchedStep, RequestState
from reinforge.rollout.native.sampling import Sampler, SamplingTensors
from reinforge.rollout.native.scheduler import ScheduledStep, Scheduler
from reinforge.rollout.native.sequence import Sequence, SequenceStatus
from reinforge.rollout.stop_strings import token_decoder

__all__ = ["NativeEngine", "supports_model"]

DEFAULT_CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


BLOCK_SIZE = 16
"""Tokens a KV cache block holds unless the engine is given another size."""


class NativeEngine:
    def __init__(self, model: nn.Module, *, eos_token_ids: list[int], max_model_len: int,
                 gpu_memory_utilization: float = 0.5, block_size: int = BLOCK_SIZE, max_num_seqs: int = 512,
                 max_num_batched_tokens: int = 16384, num_kv_blocks: int | None = None,
                 cuda_graph_batch_sizes: tuple[int, ...] = DEFAULT_CUDA_GRAPH_BATCH_SIZES,
                 enforce_eager: bool = False, use_triton: bool | None = None, seed: int = 0,
                 free_on_sleep: bool = True, empty_cache_on_sleep: bool = False, enable_prefix_caching: bool = True,
                 device: torch.device | None = None, max_admission_wait: int = 16,
                 admission_fraction: float = 0.0625, max_prefill_chunk_tokens: int | None = None,
                 kv_cache_dtype: str = "auto", weights_fixed: bool = False, kv_cache_bytes: int | None = None,
                 decode_products: str = "cublas", shared_prefix_decode: bool = False, tokenizer: Any = None):
        """Wrap ``model`` (an HF causal LM of a dense family of ``models.architectures``) for generation.

        gpu_memory_utilization: fraction of the device's total memory the process may hold while the
        KV cache is allocated (the cache gets what weights, optimizer state and a step's activations
        leave of it). num_kv_blocks overrides that sizing (and is needed on the CPU to go beyond
        max_num_seqs full-length sequences). max_num_seqs: the samples that run at once; a request of
        more samples runs them in groups of that many, each group prefilled on its own. use_triton
        defaults to True on CUDA when Triton is installed; enforce_eager turns CUDA graphs off. ``sleep`` hands the memory of the KV cache,
        the weight copies and the graphs back to PyTorch's caching allocator, where the training
        step of the same process reuses it without new device allocations; empty_cache_on_sleep also
        returns it to the device (for other processes sharing the GPU). With free_on_sleep=False,
        ``sleep`` keeps all three, so the next wake-up only refreshes the weight copies and no graph
        is captured again (the training step then has that much less memory). enable_prefix_caching keeps
        finished sequences' full KV blocks for requests that start with the same tokens (see the module docstring).
        device: where to generate, by default the model's; a model whose parameters are offloaded to the
        CPU between phases (``actor.param_offload``) names the accelerator here, and wake-up copies onto it.
        max_prefill_chunk_tokens: the most new tokens one prefill forward runs; a longer prefill (a long prompt, a
        preempted long sequence's recompute) runs in chunks, each over the ones before through the cache. None:
        max_num_batched_tokens, the step size the activation memory is reserved for. kv_cache_dtype: auto (the
        model dtype) or fp8 (e4m3 keys and values with a float32 scale per token and KV head, kv_quant.py; about
        twice the tokens in the same memory, each decode step reading half the bytes). weights_fixed: the caller
        says the model's weights never change while the engine lives (serving, benchmarks: nothing trains), so the
        engine reads every weight it would copy unchanged in place (the model's storage, not a copy of its own; the
        q|k|v and gate|up groups it concatenates stay copies): Qwen3-30B-A3B's experts then exist once on the device.
        decode_products: cublas, or timed (``rollout.decode_products``: swapped Triton kernels where timed faster).
        shared_prefix_decode: a decode step reads the blocks several sequences share (a prompt's n samples) once for
        all of them (``attention.SharedPrefix``; the Triton path's unsplit kernel).
        tokenizer: decodes the samples of requests with stop strings (``SamplingParams.stop``), which end at the
        token that completes one (``rollout/stop_strings.py``); without it such requests are refused.
        kv_cache_bytes: the KV cache's size in bytes (the memory planner's ``rollout.kv_cache_gib``), in place of
        gpu_memory_utilization's sizing; num_kv_blocks overrides it. A model whose full and sliding layers keep
        separate pools (Gemma 2 and 3) splits it between them by what each can use, so at long contexts the same
        bytes hold more sequences.
        max_admission_wait (decode steps) and admission_fraction (of the running samples) bound how long requests
        arriving through ``generate_async`` wait for others to join their prefill (see scheduler.py); 0 and 0.0
        prefill each at the first step after it arrives. The defaults (16, 1/16) are among the fastest pairs on the
        agent rollout benchmark on an H200, at four turn lengths.
        """
        if max_prefill_chunk_tokens is not None and max_prefill_chunk_tokens < 1:
            raise ValueError(f"max_prefill_chunk_tokens={max_prefill_chunk_tokens} must be at least 1 (or None: "
                             f"max_num_batched_tokens={max_num_batched_tokens})")
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"NativeEngine cannot run this model: {reason}; use the hf rollout backend for it")
        device = device or next(model.parameters()).device
        if use_triton is None:
            use_triton = device.type == "cuda" and _triton_available()
        use_graphs = device.type == "cuda" and use_triton and not enforce_eager
        self.model = model
        self.device = device
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = decoder_module(model).embed_tokens.weight.shape[0]
        """Prompt token ids must be below it (the rows of the input embedding)."""
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_kv_blocks = num_kv_blocks
        self.kv_cache_bytes = kv_cache_bytes
        self.free_on_sleep = free_on_sleep
        self.empty_cache_on_sleep = empty_cache_on_sleep
        self.enable_prefix_caching = enable_prefix_caching
        self.max_admission_wait = max_admission_wait
        self.admission_fraction = admission_fraction
        self.decode = token_decoder(tokenizer) if tokenizer is not None else None
        self.runner = ModelRunner(model, block_size=block_size, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len, use_triton=use_triton,
                                  cuda_graph_batch_sizes=list(cuda_graph_batch_sizes) if use_graphs else [],
                                  device=device,
                                  max_prefill_chunk_tokens=max_prefill_chunk_tokens or max_num_batched_tokens,
                                  kv_cache_dtype=kv_cache_dtype, weights_fixed=weights_fixed,
                                  decode_products=decode_products, shared_prefix_decode=shared_prefix_decode)
        self.sampler = Sampler(use_triton, softcap=self.runner.decoder.spec.final_softcap)
        self.scheduler: Scheduler | None = None
        self.last_metrics: dict[str, float] = {}
        self._seed_generator = np.random.default_rng(seed)
        self._incoming: queue.SimpleQueue[RequestState] = queue.SimpleQueue()
        self._aborted: queue.SimpleQueue[RequestState] = queue.SimpleQueue()
        """Requests whose callers stopped waiting, dropped before the next step (``_abort``)."""
        self._requests: dict[int, RequestState] = {}
        self._streams: dict[int, OnToken] = {}
        """The streamed requests' ``on_token`` by request key (empty unless a request streams)."""
        self._next_request_key = 0
        self._step_lock = threading.Lock()
        self._async_driver = AsyncDriver(submit=self._submit, step=lambda: self._step(batch_arrivals=True),
                                         has_work=self._has_work, fail_pending=self._fail_pending,
                                         measure=self._measure_async, abort=self._abort)
        self._num_generated_tokens = 0
        self.counters = EngineCounters()
        self._peak_blocks_used = 0
        self._peak_blocks_share = 0.0
        self._decode_sampling: tuple[int, SamplingTensors] | None = None
        """The running sequences' sampling parameters and the scheduler version they were made at (see ``wake_up``)."""
        self._in_flight: LaunchedStep | None = None

    # ---- hybrid-engine lifecycle -------------------------------------------------------------

    @property
    def is_awake(self) -> bool:
        return self.scheduler is not None

    reads_model_in_place = False
    """Generation reads the engine's own weight copies: the model may be resharded once ``wake_up`` returns."""

    def wake_up(self) -> None:
        """Copy the weights, allocate the KV cache if it was freed (and, at the first decode, capture CUDA graphs)."""
        if self.is_awake:
            return
        self.runner.load_weights()  # first: the KV cache is sized from the memory left after it
        if self.runner.kv_cache is None:
            self.runner.allocate_kv_cache(self._num_kv_blocks())
        self.runner.forget_block_tables()
        switch_length = self.runner.decoder.rotary.original_length
        windows = self.runner.group_windows
        if len(windows) == 1:  # one cache group: the window when every layer slides
            windows = [self.runner.decoder.sliding_window]
        managers = [BlockManager(num_blocks, self.block_size, self.enable_prefix_caching, window, switch_length)
                    for num_blocks, window in zip(self.runner.group_num_kv_blocks, windows, strict=True)]
        self.scheduler = Scheduler(managers[0], self.max_num_seqs, self.max_num_batched_tokens, self.max_admission_wait,
                                   self.admission_fraction, tuple(managers[1:]))
        # the new scheduler counts versions from 0 again: a decode step's parameters kept from the last wake-up could
        # carry the version of one of its steps and be sampled with (other temperatures, seeds and row counts)
        self._decode_sampling = None

    def sleep(self, abandon: bool = False) -> None:
        """Free the KV cache, the weight copies and the CUDA graphs (unless ``free_on_sleep`` is False; see ``__init__``).

        ``abandon``: generation failed (the error is on its way to the caller): drop the unfinished
        requests instead of refusing to sleep, so that the cleanup does not hide the error.
        """
        if abandon:
            with self._step_lock:
                self._in_flight = None
                self._take_requests()
                self.scheduler = None
        with self._step_lock:
            self._drop_aborted()
            waiting = self._keep_live_incoming()
        if waiting or (self.scheduler is not None and self.scheduler.has_unfinished):
            raise RuntimeError("sleep() was called while requests are still generating; await them first")
        with self._step_lock:
            if self._in_flight is not None:  # a look-ahead step of sequences that have all finished
                self._process(self._in_flight)
                self._in_flight = None
        self.scheduler = None
        if not self.free_on_sleep:
            return
        self.runner.free_kv_cache()
        self.runner.free_weights()
        if self.device.type == "cuda" and self.empty_cache_on_sleep:
            torch.cuda.empty_cache()

    def sync_weights(self, model: nn.Module) -> None:
        """Generate with ``model``'s current parameters.

        Loaded weight copies (awake, or asleep with ``free_on_sleep=False``) are overwritten in place now;
        freed ones are made by ``wake_up``. Either way the engine reads ``model`` only while copying.
        """
        self.model = model
        self.runner.set_model(model)
        self._invalidate_prefix_cache()

    def _invalidate_prefix_cache(self) -> None:
        """The weights changed: cached keys and values were computed with the old ones."""
        if self.scheduler is not None:
            with self._step_lock:
                for manager in self.scheduler.pools:
                    manager.reset_prefix_cache()

    @torch.no_grad()
    def add_to_weights(self, deltas: Iterable[tuple[nn.Module, Tensor]]) -> None:
        """Add each (linear layer of the synced model, float32 delta of its weight) to the engine's own copy.

        For a LoRA actor after ``wake_up``: the copy then holds the merged weights W + s B A, in place
        (graphs stay valid), while the model's own weights are never changed.
        """
        if self.runner.decoder.weights is None:
            raise RuntimeError("add_to_weights() needs the engine's weight copy; call it after wake_up()")
        slices = self.runner.decoder.weights.linear_slices(self.model)
        if self.runner.multimodal is not None:  # adapters on the vision tower's layers
            slices |= self.runner.multimodal.tower.linear_slices(self.model)
        for linear, delta in deltas:
            destination = slices[id(linear)]
            destination.copy_(destination.float().add_(delta))
        self._invalidate_prefix_cache()

    def _useful_blocks(self, window: int | None) -> int:
        """The most blocks a cache group whose layers attend through ``window`` can hold at once."""
        return window_pool_blocks(window, self.max_num_seqs, self.max_model_len, self.block_size)

    def _num_kv_blocks(self) -> int | list[int]:
        """The cache's blocks; with several layer groups, each group's (see ``_group_num_kv_blocks``)."""
        if len(self.runner.layer_groups) > 1:
            return self._group_num_kv_blocks()
        useful = self._useful_blocks(self.runner.decoder.sliding_window)
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        if self.kv_cache_bytes is not None:
            return max(-(-self.kv_cache_bytes // self.runner.kv_bytes_per_block()), 1)
        if self.device.type != "cuda":
            return useful
        return min(int(self._kv_cache_budget() // self.runner.kv_bytes_per_block()), useful)

    def _group_num_kv_blocks(self) -> list[int]:
        """Each layer group's blocks: a sliding group holds no more than the full group does, nor more than its
        windows of ``max_num_seqs`` sequences. num_kv_blocks (or a memory budget: kv_cache_bytes, or else
        gpu_memory_utilization's) sets the full group's count F; each other group gets min(F, what it can use), and
        from a memory budget F is the largest that fits (at least 1)."""
        runner = self.runner
        useful = [self._useful_blocks(window) for window in runner.group_windows]
        if self.num_kv_blocks is not None:
            return [min(self.num_kv_blocks, cap) if index else self.num_kv_blocks for index, cap in enumerate(useful)]
        if self.kv_cache_bytes is not None:
            budget = self.kv_cache_bytes
        elif self.device.type != "cuda":
            return useful
        else:
            budget = self._kv_cache_budget()
        return split_pool_blocks(budget, [runner.kv_bytes_per_block(group) for group in range(len(useful))], useful)

    def _kv_cache_budget(self) -> float:
        """Bytes of device memory the KV cache may take (see ``gpu_memory_utilization``), at least a block's."""
        free, total = torch.cuda.mem_get_info(self.device)
        # blocks the caching allocator holds but no tensor uses (the training step's) are free here too: the
        # cache is allocated from them, or, failing that, the allocator releases them and asks the device
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        config = self.runner.decoder.context.config  # the text config (a multimodal model keeps it inside)
        element_size = self.runner.decoder.dtype.itemsize
        # a prefill forward runs a step's new tokens, or a longer sequence's chunk where the chunks are larger
        forward_tokens = max(self.max_num_batched_tokens, min(self.runner.max_prefill_chunk_tokens, self.max_model_len))
        activations = (forward_tokens * (4 * config.intermediate_size + 8 * config.hidden_size)
                       * element_size + self.max_num_seqs * config.vocab_size * 16 + (256 << 20))
        budget = total * self.gpu_memory_utilization - (total - free) - activations
        if budget < self.runner.kv_bytes_per_block():
            raise RuntimeError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} leaves no room for the KV cache "
                f"({(total - free) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB already in use); raise it")
        return budget

    # ---- entry points -----------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """Completions for each request (``request.sampling.n`` of them), in request order.

        Python's garbage collector is paused meanwhile: the host's time per decode step is the step's
        budget, and a collection walking the sequences' lists would leave the device idle. No requests: no
        completions, and the engine is not woken (no weight copy, no KV cache).
        """
        if not requests:
            return []
        self.wake_up()
        states = [self._new_state(request) for request in requests]  # every request checked before any is queued
        for state in states:
            self._incoming.put(state)
        start = self._start_metrics()
        with collector.paused():
            while any(state.num_pending for state in states):
                if not self._step():
                    raise RuntimeError("the scheduler ran dry with requests still pending")
        self._finish_metrics(start)
        return [list(state.completions) for state in states]

    async def generate_async(self, request: GenerationRequest,
                             on_token: OnToken | None = None) -> list[Completion]:
        """The request's n completions; requests submitted concurrently are batched together. ``on_token``
        (streaming) gets ``(sample_index, token_id, log_prob, top_log_probs)`` on the event loop as each token is
        sampled (``top_log_probs``: its alternatives when ``sampling.num_top_log_probs`` asks, else None). Cancelling
        the caller aborts the request (``_abort``)."""
        self.wake_up()
        return await self._async_driver.generate(request, on_token)

    def _abort(self, state: RequestState) -> None:
        """Drop a request whose caller stopped waiting (``generate_async`` cancelled): its samples stop, waiting,
        prefilling or decoding, and free their blocks before the next step, or now when no step is running.
        The other requests' samples are those they would be without it. Callable from any thread."""
        state.aborted = True
        self._aborted.put(state)
        if self._step_lock.acquire(blocking=False):  # else the step running now drops it when it ends
            try:
                self._drop_aborted()
            finally:
                self._step_lock.release()

    def _drop_aborted(self) -> None:
        """Drop the aborted requests (under the step lock): not yet admitted ones are skipped at admission."""
        while not self._aborted.empty():
            state = self._aborted.get()
            key = state.key
            if key is None or self._requests.get(key) is not state:  # not admitted yet, or done or failed already
                continue
            del self._requests[key]
            self._streams.pop(key, None)
            if self.runner.multimodal is not None:
                self.runner.multimodal.discard(key)
            if self.scheduler is not None:
                self.scheduler.abort(key)

    def _keep_live_incoming(self) -> int:
        """Drop the aborted requests from the incoming queue (under the step lock) and count the others: requests
        submitted and not yet admitted, which the next step would run, after a sleep in the next round."""
        waiting = []
        while not self._incoming.empty():
            state = self._incoming.get()
            if not state.aborted:
                waiting.append(state)
        for state in waiting:
            self._incoming.put(state)
        return len(waiting)

    def _take_requests(self) -> list[RequestState]:
        """Every request the engine holds, admitted or still incoming; it holds none afterwards."""
        taken, self._requests = list(self._requests.values()), {}
        self._streams.clear()
        if self.runner.multimodal is not None:
            self.runner.multimodal.clear()
        while not self._incoming.empty():
            taken.append(self._incoming.get())
        return taken

    def _fail_pending(self, error: BaseException) -> None:
        """Hand ``error`` to every request the engine holds (admitted or still incoming) and drop them, with the
        scheduler's sequences and the step in flight: left there, the next request's step would run the sequence
        that failed again (and fail again, every request after it). The next ``wake_up`` makes a new scheduler."""
        with self._step_lock:
            taken = self._take_requests()
            self._in_flight = None
            self.scheduler = None
        for state in taken:
            if state.on_error is not None:
                state.on_error(error)

    def _has_work(self) -> bool:
        return (not self._incoming.empty() or self._in_flight is not None
                or (self.scheduler is not None and self.scheduler.has_unfinished))

    # ---- one step ---------------------------------------------------------------------------

    def _submit(self, request: GenerationRequest,
                on_done: Callable[[list[Completion]], None] | None = None,
                on_error: Callable[[BaseException], None] | None = None,
                on_token: OnToken | None = None) -> RequestState:
        state = self._new_state(request, on_done, on_error, on_token)
        self._incoming.put(state)
        return state

    def _new_state(self, request: GenerationRequest,
                   on_done: Callable[[list[Completion]], None] | None = None,
                   on_error: Callable[[BaseException], None] | None = None,
                   on_token: OnToken | None = None) -> RequestState:
        """The request's state, once it is checked (a ValueError of one line names what is wrong with it)."""
        sampling = request.sampling
        problem = prompt_problem(request.prompt_token_ids, self.vocab_size)
        if problem is not None:
            raise ValueError(f"request {request.request_id!r} has {problem}")
        if len(request.prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"request {request.request_id!r} has a prompt of {len(request.prompt_token_ids)} "
                             f"tokens, not shorter than max_model_len={self.max_model_len}; raise max_model_len")
        multimodal = self.runner.multimodal
        if request.multi_modal_inputs is not None and multimodal is None:
            raise ValueError(f"request {request.request_id!r} has images but {type(self.model).__name__} is a text "
                             "model; send its prompt without multi_modal_inputs")
        if sampling.n < 1 or sampling.max_tokens < 1:
            raise ValueError(f"request {request.request_id!r} asks for n={sampling.n}, "
                             f"max_tokens={sampling.max_tokens}; both must be at least 1")
        scheduler = self.scheduler  # None when a failed step of the async driver has just dropped it
        refusal = scheduler.refusal(len(request.prompt_token_ids), min(sampling.n, self.max_num_seqs)) \
            if scheduler is not None else None
        if refusal is not None:  # refused here, not inside a step: the engine would keep failing at it
            raise ValueError(f"request {request.request_id!r}: {refusal}")
        problem = sampling_problem(sampling)
        if problem is not None:
            raise ValueError(f"request {request.request_id!r} asks for {problem}")
        if sampling.stop and self.decode is None:
            raise ValueError(f"request {request.request_id!r} has stop strings {list(sampling.stop)} but the engine "
                             "has no tokenizer to read its samples' text; build NativeEngine with tokenizer=")
        seed = sampling.seed if sampling.seed is not None else int(self._seed_generator.integers(2**62))
        state = RequestState(request, seed, on_done, on_error, on_token)
        if request.multi_modal_inputs is not None:
            state.multimodal = multimodal.prepare(request)
        return state

    def _admit_incoming(self) -> None:
        while not self._incoming.empty():
            state = self._incoming.get()
            if state.aborted:
                continue
            key = self._next_request_key
            self._next_request_key += 1
            self._requests[key] = state
            state.key = key
            if state.on_token is not None:
                self._streams[key] = state.on_token
            request, sampling = state.request, state.request.sampling
            stops = frozenset() if sampling.ignore_eos else self.eos_token_ids | frozenset(sampling.stop_token_ids)
            prompt = request.prompt_token_ids
            if state.multimodal is not None:
                self.runner.multimodal.add(key, state.multimodal)
                prompt = state.multimodal.key_token_ids  # its image pad tokens named by their images
            # more samples than sequence slots: admitted in groups of max_num_seqs, each prefilled and forked alone
            for first in range(0, sampling.n, self.max_num_seqs):
                self.scheduler.add(Sequence(self.scheduler.new_seq_id(), key, first, prompt, sampling, state.seed,
                                            stops, self.max_model_len,
                                            num_samples=min(self.max_num_seqs, sampling.n - first),
                                            keep_prefix=request.keep_prefix, decode=self.decode))

    def _step(self, batch_arrivals: bool = False) -> bool:
        """Schedule a step, run it, and read back the steps that are done; False when there was nothing to run.

        A decode step is launched and left in flight: the next call schedules and launches the step after it
        (``Scheduler.schedule_ahead``) before it reads the first one's tokens back, so the host's bookkeeping
        overlaps the device's work. batch_arrivals (the async path): waiting requests join when the scheduler's
        ``admission_due`` says so, and decode steps keep being launched ahead until then.
        """
        with self._step_lock:
            if self.scheduler is None:  # asleep: a driver thread's last step can come after the caller's sleep()
                return False
            self._drop_aborted()
            self._admit_incoming()
            in_flight, self._in_flight = self._in_flight, None
            if in_flight is None:
                step = self.scheduler.schedule(batch_arrivals)
                if step is None:
                    return False
            else:
                step = self.scheduler.schedule_ahead(in_flight.seqs, batch_arrivals)
            prefill = self._run(step, in_flight)
            if in_flight is not None:
                self._process(in_flight)
            if prefill is not None:
                start = time.perf_counter()
                self._process(prefill)
                self.counters.prefill_seconds += time.perf_counter() - start
            return True

    def _run(self, step: ScheduledStep | None, in_flight: LaunchedStep | None) -> LaunchedStep | None:
        """Launch ``step`` on the device. A decode step is left in flight; a prefill is returned to be read back,
        and when it runs ahead of ``in_flight`` the next decode step (old and new rows) is launched behind it, its
        input ids the tokens both steps sampled, still on the device."""
        if step is None:
            return None
        if not step.is_prefill:
            next_input_ids = None if in_flight is None else self._continuing_tokens(in_flight, step.continued_rows)
            self._in_flight = self._launch_decode(step.seqs, next_input_ids)
            return None
        start = time.perf_counter()
        prefill = self._run_prefill(step)
        self.counters.prefill_seconds += time.perf_counter() - start
        if in_flight is not None:
            behind = self.scheduler.schedule_behind_prefill(in_flight.seqs, prefill.seqs)
            if behind is not None:
                tokens = torch.cat([self._continuing_tokens(in_flight, behind.continued_rows), prefill.tokens])
                self._in_flight = self._launch_decode(behind.seqs, tokens)
        return prefill

    @staticmethod
    def _continuing_tokens(launched: LaunchedStep, rows: list[int]) -> torch.Tensor:
        """The tokens ``rows`` of a launched step sampled (still on the device)."""
        if len(rows) == len(launched.seqs):
            return launched.tokens
        if not rows:
            return launched.tokens[:0]
        return launched.tokens[to_device(np.array(rows, dtype=np.int64), launched.tokens.device)]

    def _run_prefill(self, step: ScheduledStep) -> LaunchedStep:
        logits = self.runner.prefill(step.seqs)
        self.counters.count_prefill(step.seqs)
        self.runner.copy_blocks(step.block_copies)
        for group, copies in step.group_block_copies.items():
            self.runner.copy_blocks(copies, group + 1)
        sample_seqs = [seq for group in step.samples for seq in group]
        rows = [index for index, group in enumerate(step.samples) for _ in group]
        if len(rows) != len(step.seqs):
            logits = logits[torch.tensor(rows, device=logits.device)]
        params = SamplingTensors.from_sequences(sample_seqs, logits.device)
        positions = [seq.num_tokens for seq in sample_seqs]
        params.positions = to_device(np.array(positions, dtype=np.int64), logits.device)
        return LaunchedStep.sampled(sample_seqs, *self.sampler(logits, params), self._top(logits, params))

    def _launch_decode(self, seqs: list[Sequence], next_input_ids: torch.Tensor | None = None) -> LaunchedStep:
        logits = self.runner.decode(seqs, next_input_ids)
        self.counters.count_decode(len(seqs))
        version = self.scheduler.version
        if self._decode_sampling is None or self._decode_sampling[0] != version:
            self._decode_sampling = (version, SamplingTensors.from_sequences(seqs, logits.device))
        params = self._decode_sampling[1]
        params.positions = self.runner.last_decode_positions + 1
        return LaunchedStep.sampled(seqs, *self.sampler(logits, params), self._top(logits, params))

    def _top(self, logits: Tensor, params: SamplingTensors) -> tuple[Tensor, Tensor] | None:
        """The alternatives of each row's token, only when a row of the step asks for them."""
        return self.sampler.top_log_probs(logits, params) if params.num_top_log_probs else None

    def _process(self, launched: LaunchedStep) -> None:
        """Read a step's sampled tokens back, append them, and retire the sequences that finished."""
        finished = []
        tokens, log_probs = launched.read()
        tops = launched.read_top() or [None] * len(tokens)
        running = SequenceStatus.RUNNING
        appended = 0
        streams = self._streams
        switched, switch = [], self.scheduler.block_manager.rope_switch_length  # LongRoPE: see Scheduler.recompute
        for seq, token, log_prob, top in zip(launched.seqs, tokens, log_probs, tops, strict=True):
            if seq.status is not running:
                continue
            appended += 1
            if top is not None:  # the step's widest k, cut to this sequence's (None: it asks for none)
                top = top[:seq.sampling.num_top_log_probs] if seq.top_log_probs is not None else None
            if streams and seq.request_key in streams:
                streams[seq.request_key](seq.sample_index, token, log_prob, top)
            if seq.append(token, log_prob, top):
                finished.append(seq)
            elif switch is not None and len(seq.token_ids) == switch + 1:
                switched.append(seq)
        self._num_generated_tokens += appended
        self._note_blocks_used()
        self.scheduler.finish(finished)
        if switched:
            self.scheduler.recompute(switched)
        for seq in finished:
            state = self._requests[seq.request_key]
            if state.finish_sample(seq):
                del self._requests[seq.request_key]
                self._streams.pop(seq.request_key, None)
                if self.runner.multimodal is not None:
                    self.runner.multimodal.discard(seq.request_key)
                if state.on_done is not None:
                    state.on_done(list(state.completions))

    # ---- metrics ----------------------------------------------------------------------------

    def _note_blocks_used(self) -> None:
        """Keep the span's peaks of the blocks in use over every pool, and of the fullest pool's share of its blocks
        (the pool that preempts first; a model with several windows has one pool per window)."""
        pools = self.scheduler.pools
        self._peak_blocks_used = max(self._peak_blocks_used, sum(manager.num_used_blocks for manager in pools))
        self._peak_blocks_share = max(self._peak_blocks_share,
                                      max(manager.num_used_blocks / manager.num_blocks for manager in pools))

    def counts(self) -> dict[str, float]:
        """Totals over the engine's life (``EngineCounters.reading``); ``count_metrics`` of two readings gives a span's.
        A vision-language model's also count the images encoded and the vision tower's time (``rollout/vision_encode_s``)."""
        reading = self.counters.reading()
        if self.runner.multimodal is not None:
            reading["rollout/num_images_encoded"] = float(self.runner.multimodal.num_images_encoded)
            reading["rollout/vision_encode_s"] = self.runner.multimodal.encode_seconds
        return reading

    def _measure_async(self) -> Callable[[], None]:
        """Start the async driver's span of the rollout metrics; the function returned ends it (while awake)."""
        start = self._start_metrics()

        def finish() -> None:
            if self.scheduler is not None:
                self._finish_metrics(start)

        return finish

    def _start_metrics(self) -> tuple[float, int, int, float, dict[str, float]]:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._peak_blocks_used, self._peak_blocks_share = 0, 0.0
        return (time.perf_counter(), self._num_generated_tokens, self.scheduler.num_preempted,
                self.runner.capture_seconds, self.counts())

    def _finish_metrics(self, start: tuple[float, int, int, float, dict[str, float]]) -> None:
        start_time, start_tokens, start_preempted, start_capture, start_counts = start
        elapsed = time.perf_counter() - start_time
        num_tokens = self._num_generated_tokens - start_tokens
        scheduler = self.scheduler
        metrics = {
            "rollout/tokens_per_s": num_tokens / elapsed if elapsed > 0 else 0.0,
            "rollout/num_generated_tokens": float(num_tokens),
            "rollout/time_s": elapsed,
            "rollout/num_preempted": float(scheduler.num_preempted - start_preempted),
            "rollout/kv_blocks_total": float(sum(manager.num_blocks for manager in scheduler.pools)),
            "rollout/kv_blocks_used_peak": float(self._peak_blocks_used),
            "rollout/kv_blocks_used_peak_share": self._peak_blocks_share,
            "rollout/cuda_graph_capture_s": self.runner.capture_seconds - start_capture,
        }
        metrics |= count_metrics(start_counts, self.counts())
        if self.device.type == "cuda":
            metrics["rollout/peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.last_metrics = metrics
