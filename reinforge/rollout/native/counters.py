"""What the native engine counts over its life, and the metrics of a span between two readings.

``EngineCounters`` adds up prefix-cache hits, prefilled tokens, prefill and decode steps, the
sequences each decode step ran and the prefill steps' wall time; ``reading()`` turns them into
``rollout/*`` totals, and ``count_metrics`` of two readings gives a span's, with the prefix
cache's hit rate and the mean decode batch (a rollout's metrics, or one benchmark run's).
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
    metrics = {name: end[name] - start[name] for name in end}
    hits, computed = metrics["rollout/prefix_cache_hit_tokens"], metrics["rollout/prefill_tokens"]
    metrics["rollout/prefix_cache_hit_rate"] = hits / (hits + computed) if hits + computed else 0.0
    steps = metrics["rollout/num_decode_steps"]
    metrics["rollout/decode_batch_mean"] = metrics["rollout/num_decode_rows"] / steps if steps else 0.0
    return metrics
