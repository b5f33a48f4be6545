import pytest
import torch

from reinforge.config.schema import OverlongBufferConfig, RewardConfig
from reinforge.reward.manager import RewardManager
from reinforge.reward.overlong import overlong_penalty

from .test_manager import make_batch


def test_the_penalty_is_zero_before_the_buffer_and_linear_inside_it():
    lengths = torch.tensor([0, 60, 64, 65, 80, 96, 100])
    penalty = overlong_penalty(lengths, max_length=96, buffer=32, factor=2.0)
    # the buffer starts at 96 - 32 = 64 tokens: up to there nothing, -2 at 96, beyond keeps growing
    expected = torch.tensor([0.0, 0.0, 0.0, -1 / 32 * 2, -16 / 32 * 2, -2.0, -100 / 32 * 2 + 64 / 32 * 2])
    torch.testing.assert_close(penalty, expected)
    assert penalty.dtype == torch.float32
    assert overlong_penalty(torch.tensor([5]), 8, 8, 1.0).item() == pytest.approx(-5 / 8)  # buffer = whole budget


def test_a_buffer_outside_the_budget_is_refused(byte_tokenizer):
    with pytest.raises(ValueError, match=r"reward.overlong_buffer.len=0 must be in 1..data.max_response_length=8"):
        overlong_penalty(torch.tensor([1]), 8, 0, 1.0)
    config = RewardConfig(num_workers=0, overlong_buffer=OverlongBufferConfig(enable=True, len=4))
    with pytest.raises(ValueError, match=r"needs the RewardManager's max_response_length"):
        RewardManager(config, byte_tokenizer)


def test_the_manager_adds_the_penalty_and_counts_shaped_samples(byte_tokenizer):
    # lengths with EOS: "1"+eos = 2, "1234"+eos = 5, "1234567"+eos = 8 tokens under a budget of 8, buffer 4
    batch = make_batch(byte_tokenizer, ["1", "1234", "1234567"], ["1", "1234", "0"], ["arithmetic"] * 3,
                       response_len=8)
    config = RewardConfig(num_workers=0, overlong_buffer=OverlongBufferConfig(enable=True, len=4, penalty_factor=0.5))
    output = RewardManager(config, byte_tokenizer, max_response_length=8).score(batch)
    assert output.extras["overlong_penalty"] == [0.0, pytest.approx(-1 / 4 * 0.5), pytest.approx(-0.5)]
    torch.testing.assert_close(output.scores, torch.tensor([1.0, 1.0 - 0.125, -0.5]))
    assert output.token_level_scores.sum(-1).tolist() == pytest.approx(output.scores.tolist())
    assert output.metrics["reward/overlong/count"] == 2.0
    assert output.metrics["reward/overlong/fraction"] == pytest.approx(2 / 3)
