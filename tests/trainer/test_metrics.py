"""A step's batch metrics (trainer.metrics) with verl's names and definitions."""

import torch

from reinforge.protocol import Batch
from reinforge.trainer.metrics import compute_data_metrics


def batch_with(returns: torch.Tensor, values: torch.Tensor) -> Batch:
    rows, width = returns.shape
    mask = torch.ones(rows, width)
    mask[0, -1] = 0
    return Batch.from_dict(tensors={
        "response_mask": mask, "prompts": torch.ones(rows, 2, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(rows, 2), mask], 1).long(),
        "token_level_scores": torch.zeros(rows, width), "token_level_rewards": torch.zeros(rows, width),
        "advantages": torch.zeros(rows, width), "returns": returns, "values": values})


def test_explained_variance_is_verls():
    generator = torch.Generator().manual_seed(0)
    returns, values = torch.randn(3, 5, generator=generator), torch.randn(3, 5, generator=generator)
    valid = batch_with(returns, values)["response_mask"].bool()
    expected = 1 - (returns[valid] - values[valid]).var() / (returns[valid].var() + 1e-5)
    metrics = compute_data_metrics(batch_with(returns, values), max_response_length=5)
    assert abs(metrics["critic/vf_explained_var"] - float(expected)) < 1e-6
    assert compute_data_metrics(batch_with(returns, returns.clone()), 5)["critic/vf_explained_var"] == 1.0


def test_equal_returns_do_not_divide_by_their_rounding_noise():
    """Every reward 0: returns equal up to float rounding; the value head's errors are not blown up by 1e14."""
    returns = torch.tensor([[1.2e-7, -1.2e-7, 0.0, 0.0, 0.0]] * 3)
    values = 0.001 * torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    metrics = compute_data_metrics(batch_with(returns, values), max_response_length=5)
    assert -1.0 < metrics["critic/vf_explained_var"] < 1.0  # 1 - 1e-6 / (1e-14 + 1e-5), not 1 - 1e-6 / 1e-14
