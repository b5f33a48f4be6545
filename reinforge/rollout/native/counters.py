"""What the native engine counts over its life, and the metrics of a span between two readings.

``EngineCounters`` adds up prefix-cache hits, prefilled tokens, prefill and decode steps, the
sequences each decode step ran and the prefill steps' wall time; ``reading()`` turns them into
``rollout/*`` totals, and ``count_metrics`` of two readings gives a span's, with the prefix
cache's hit rate and the mean decode batch (a rollout's metrics, or one benchmark run's).
``combine_spans`` turns the metrics of several rollouts (the async mode's segments) into one step's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from reinforge.rollout.native.sequence import Sequence


@dataclass
class EngineCounters:
    prefix_hit_tokens: int = 0
    """Prompt tokens read from the prefix cache instead of prefilled."""
    prefilled_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    """Sequences decoded, summed over the decode steps (their mean batch is rows / steps)."""
    prefill_seconds: float = 0.0
    """Wall time of the prefill steps, from launch to their tokens read back (the device is idle before one)."""

    def count_prefill(self, seqs: Iterable[Sequence]) -> None:
        self.prefill_steps += 1
        for seq in seqs:
            self.prefix_hit_tokens += seq.num_cached_tokens
            self.prefilled_tokens += seq.num_tokens - seq.num_cached_tokens

    def count_decode(self, num_rows: int) -> None:
        self.decode_steps += 1
        self.decode_rows += num_rows

    def reading(self) -> dict[str, float]:
        """The totals as ``rollout/prefix_cache_hit_tokens``, ``rollout/prefill_tokens``, ``rollout/num_prefill_steps``,
        ``rollout/num_decode_steps``, ``rollout/num_decode_rows`` and ``rollout/prefill_s``."""
        return {"rollout/prefix_cache_hit_tokens": float(self.prefix_hit_tokens),
                "rollout/prefill_tokens": float(self.prefilled_tokens),
                "rollout/num_prefill_steps": float(self.prefill_steps),
                "rollout/num_decode_steps": float(self.decode_steps),
                "rollout/num_decode_rows": float(self.decode_rows),
                "rollout/prefill_s": self.prefill_seconds}


def count_metrics(start: dict[str, float], end: dict[str, float]) -> dict[str, float]:
    """The counts between two readings, the prefix cache's hit rate (hit tokens over all prompt tokens) and the
    mean batch of the decode steps (``rollout/decode_batch_mean``)."""
    return with_rates({name: end[name] - start[name] for name in end})


def with_rates(counts: dict[str, float]) -> dict[str, float]:
    """``counts`` (a span's ``EngineCounters`` counts) with the prefix cache's hit rate (hit tokens over all prompt
    tokens) and the mean batch of the decode steps, in place."""
    hits, computed = counts.get("rollout/prefix_cache_hit_tokens", 0.0), counts["rollout/prefill_tokens"]
    counts["rollout/prefix_cache_hit_rate"] = hits / (hits + computed) if hits + computed else 0.0
    steps = counts["rollout/num_decode_steps"]
    counts["rollout/decode_batch_mean"] = counts.get("rollout/num_decode_rows", 0.0) / steps if steps else 0.0
    return counts


PEAK_METRICS = ("rollout/kv_blocks_total", "rollout/kv_blocks_used_peak", "rollout/kv_blocks_used_peak_share",
                "rollout/peak_memory_gb")
"""Span metrics whose combination is the largest value (a peak, or a pool's size), not the sum."""


def combine_spans(spans: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of several rollouts' spans as one span's: counts and seconds add up, peaks take the largest,
    and the rates (tokens a second, the prefix cache's hit rate, the mean decode batch) come from the sums."""
    total: dict[str, float] = {}
    for span in spans:
        for name, value in span.items():
            merged = max if name in PEAK_METRICS else (lambda a, b: a + b)
            total[name] = merged(total[name], value) if name in total else value
    if "rollout/num_generated_tokens" in total and "rollout/time_s" in total:
        seconds = total["rollout/time_s"]
        total["rollout/tokens_per_s"] = total["rollout/num_generated_tokens"] / seconds if seconds > 0 else 0.0
    return with_rates(total) if "rollout/prefill_tokens" in total and "rollout/num_decode_steps" in total else total
