"""The rollout-vs-trainer mismatch metrics."""

from __future__ import annotations

import math

import pytest
import torch

from reinforge.rollout.mismatch import rollout_mismatch_metrics


def test_the_log_prob_difference_keeps_its_scale_where_every_probability_is_small():
    """Probabilities near 1/vocab (a model that has not learnt yet) differ by ~1e-7 however far apart the log-probs
    are; the log-space difference shows the 1% gap."""
    rollout = torch.full((2, 3), math.log(1 / 150_000))
    training = rollout + torch.tensor([[0.01, -0.01, 0.0], [0.02, 0.0, 0.5]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    metrics = rollout_mismatch_metrics(training, rollout, mask)
    assert metrics["training/rollout_probs_diff_max"] < 2e-7
    assert metrics["training/rollout_log_probs_diff_max"] == pytest.approx(0.02, rel=1e-4)  # the masked 0.5 is left out
    assert metrics["training/rollout_log_probs_diff_mean"] == pytest.approx(0.04 / 5, rel=1e-4)
