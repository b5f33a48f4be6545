"""One sample being generated: its tokens, log-probs, KV blocks and stop rules.

A request with n samples enters the scheduler as one waiting sequence standing for all n
(``num_samples``); its prefill runs once and then it forks into n running sequences. A request of
more samples than the engine's ``max_num_seqs`` enters as several, the k-th standing for samples
k x max_num_seqs onwards (its ``sample_index`` the first of them).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto

from reinforge.rollout.base import SamplingParams
from reinforge.rollout.native.block_manager import BlockKey
from reinforge.rollout.noise import sample_seed
from reinforge.rollout.stop_strings import StopStringMatcher


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, seq_id: int, request_key: int, sample_index: int, prompt_token_ids: list[int],
                 sampling: SamplingParams, request_seed: int, stop_token_ids: frozenset[int], max_model_len: int,
                 num_samples: int = 1, keep_prefix: bool = True,
                 decode: Callable[[list[int]], str] | None = None):
        """decode: token ids to text, for a sampling with stop strings."""
        self.seq_id = seq_id
        self.keep_prefix = keep_prefix
        """Register this sequence's full blocks in the prefix cache when it is released."""
        self.request_key = request_key
        self.sample_index = sample_index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.log_probs: list[float] = []
        self.top_log_probs: list[list[tuple[int, float]]] | None = [] if sampling.num_top_log_probs else None
        """Each sampled token's most likely alternatives (``SamplingParams.num_top_log_probs``), else None."""
        self.sampling = sampling
        self.request_seed = request_seed
        self.sample_seed = sample_seed(request_seed, sampling.first_sample + sample_index)
        self.stop_token_ids = stop_token_ids
        self.decode = decode
        self.stop_matcher = (StopStringMatcher(decode, sampling.stop)
                             if sampling.stop and decode and not sampling.ignore_eos else None)
        self.max_num_tokens = min(max_model_len, self.num_prompt_tokens + sampling.max_tokens)
        self.num_samples = num_samples
        """Samples this waiting sequence stands for: n before its first prefill, 1 after."""
        self.block_table: list[int] = []
        self.group_tables: list[list[int]] = []
        """The block tables of the cache's other layer groups (``Scheduler.pools`` 1..), each as long as
        ``block_table``; empty when every layer reads one table (see scheduler.py)."""
        self.block_keys: list[BlockKey] = []
        """Prefix-cache keys of this sequence's full blocks computed so far (see ``BlockManager.block_key_chain``)."""
        self.num_cached_tokens = 0
        """Leading tokens whose keys and values came from the prefix cache at this sequence's last prefill."""
        self.cache_epoch = 0
        """The block manager's epoch at this sequence's last prefill (see ``BlockManager.free``)."""
        self.row = -1
        """Row of this sequence in the runner's block-table array while it runs."""
        self.status = SequenceStatus.WAITING
        self.waiting_since = 0
        """The scheduler's decode-step count when this sequence last started waiting."""
        self.finish_reason = ""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def fork(self, seq_id: int, sample_index: int) -> Sequence:
        """Another sample of the same prompt, not yet holding blocks."""
        child = Sequence(seq_id, self.request_key, sample_index, self.token_ids, self.sampling, self.request_seed,
                         self.stop_token_ids, self.max_num_tokens, num_samples=1, keep_prefix=self.keep_prefix,
                         decode=self.decode)
        child.block_keys = list(self.block_keys)
        child.cache_epoch = self.cache_epoch
        return child

    def append(self, token_id: int, log_prob: float, top_log_probs: list[tuple[int, float]] | None = None) -> bool:
        """Add a sampled token (and its alternatives, when asked for); True when the sequence is now finished."""
        self.token_ids.append(token_id)
        self.log_probs.append(log_prob)
        if self.top_log_probs is not None:
            self.top_log_probs.append(top_log_probs)
        if token_id in self.stop_token_ids or (self.stop_matcher is not None and self.stop_matcher.add(token_id)):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_num_tokens:
            self.finish_reason = "length"
        return bool(self.finish_reason)
