"""The reward worker on several members: its counts add up over them, and padding rows count nowhere."""

import sys
from pathlib import Path

import pytest

from reinforge.config.schema import Config, RewardConfig
from reinforge.controller import WorkerGroup
from reinforge.workers import reward

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reward"))
from conftest import build_byte_tokenizer  # noqa: E402
from test_manager import make_batch  # noqa: E402

SCORER = '''
def exact(solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise RuntimeError("scorer exploded")
    return float(solution_str == ground_truth)
'''


@pytest.mark.parametrize("texts", [["raise", "7", "raise", "raise", "7"], ["7", "raise", "7"]])
def test_reward_counts_add_up_over_members_and_leave_out_the_padding_rows(tmp_path, monkeypatch, texts):
    """Five rows, or three, on two members (the second member's last row is a copy of the first row): reward/errors
    is the one-member count, not the members' mean, nor a count of the copy."""
    (tmp_path / "scorers.py").write_text(SCORER)
    tokenizer = build_byte_tokenizer()
    monkeypatch.setattr(reward, "load_tokenizer", lambda *args, **kwargs: tokenizer)
    config = Config()
    config.reward = RewardConfig(num_workers=0, custom_function=f"{tmp_path / 'scorers.py'}:exact")
    batch = make_batch(tokenizer, texts, ["7"] * len(texts), ["x"] * len(texts))
    counted = {}
    for members in (1, 2):
        group = WorkerGroup(reward.RewardWorker, config, num_members=members, timeout_s=30)
        try:
            scored = group.score(batch)
        finally:
            group.shutdown()
        assert len(scored) == len(texts)
        counted[members] = scored.meta["reward_metrics"]
    assert counted[2] == counted[1]
    assert counted[1]["reward/errors"] == texts.count("raise")
