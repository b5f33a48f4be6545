"""The reward worker on several members: its counts add up over them, and padding rows count nowhere."""

import sys
from pathlib import Path

import pytest

from reinforge.config.schema import Config, RewardConfig
from reinforge.controller import WorkerGroup
from reinforge.protocol import Batch
from reinforge.reward.manager import ScorerFailure
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


@pytest.mark.parametrize("texts", [["raise", "7", "raise", "raise", "7"], ["7", "raise", "7"],
                                   ["7" * 11, "7", "7"]])
def test_reward_counts_add_up_over_members_and_leave_out_the_padding_rows(tmp_path, monkeypatch, texts):
    """Five rows, or three, on two members (the second member's last row is a copy of the first row): reward/errors
    and reward/overlong/count are the one-member counts, not the members' mean, nor counts of the copy, and
    reward/overlong/fraction is over the rows."""
    (tmp_path / "scorers.py").write_text(SCORER)
    tokenizer = build_byte_tokenizer()
    monkeypatch.setattr(reward, "load_tokenizer", lambda *args, **kwargs: tokenizer)
    config = Config()
    config.data.max_response_length = 12
    config.reward = RewardConfig(num_workers=0, custom_function=f"{tmp_path / 'scorers.py'}:exact")
    config.reward.overlong_buffer.enable, config.reward.overlong_buffer.len = True, 8
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
    assert counted[1]["reward/overlong/fraction"] == counted[1]["reward/overlong/count"] / len(texts)


def _group_scores(tmp_path, monkeypatch, texts, members):
    """``RLTrainer.score`` and validation's scoring of ``texts`` on a reward group of ``members``: the rows, scored,
    or the exception that stopped them."""
    from reinforge.trainer.rl_trainer import RLTrainer
    from reinforge.trainer.validation import run_validation

    (tmp_path / "scorers.py").write_text(SCORER)
    tokenizer = build_byte_tokenizer()
    monkeypatch.setattr(reward, "load_tokenizer", lambda *args, **kwargs: tokenizer)
    config = Config()
    config.reward = RewardConfig(num_workers=0, custom_function=f"{tmp_path / 'scorers.py'}:exact")
    batch = make_batch(tokenizer, texts, ["7"] * len(texts), ["x"] * len(texts))
    batch["uid"] = [f"u{index}" for index in range(len(texts))]
    trainer = RLTrainer.__new__(RLTrainer)
    trainer.reward_model = trainer.model_scorer = None
    trainer.reward = WorkerGroup(reward.RewardWorker, config, num_members=members, timeout_s=30)
    outcomes = []
    try:
        for call in (lambda: trainer.score(batch),
                     lambda: run_validation([batch], 1, None, 0, lambda rows, *_: Batch(), trainer.reward.score)):
            try:
                outcomes.append(call())
            except Exception as error:  # noqa: BLE001 - the outcome compared
                outcomes.append(error)
    finally:
        trainer.reward.shutdown()
    return outcomes


def test_a_member_whose_rows_all_failed_does_not_stop_a_batch_where_others_scored(tmp_path, monkeypatch):
    """["raise", "raise", "7", "7"] on two members: the first member's rows all fail, the batch's do not; it goes on
    with reward/errors=2, as on one member, and the members' failure reports do not reach the batch."""
    for members in (1, 2):
        scored, validation = _group_scores(tmp_path, monkeypatch, ["raise", "raise", "7", "7"], members)
        assert scored.meta["reward_metrics"]["reward/errors"] == 2
        assert scored["token_level_scores"].sum(-1).tolist() == [0.0, 0.0, 1.0, 1.0]
        assert reward.SCORER_FAILURES not in scored and reward.SCORER_FAILURES not in scored.meta
        assert validation["val-core/x/reward/mean@1"] == 0.5


@pytest.mark.parametrize("texts", [["raise"] * 4, ["raise"] * 3])
def test_a_batch_where_every_row_failed_stops_with_the_one_member_line(tmp_path, monkeypatch, texts):
    """Every row failed (three rows: the second member's padding row too): on two members the trainer raises the
    ScorerFailure one member raises itself, word for word."""
    alone = _group_scores(tmp_path, monkeypatch, texts, 1)
    split = _group_scores(tmp_path, monkeypatch, texts, 2)
    for one, two in zip(alone, split, strict=True):
        assert isinstance(one.__cause__, ScorerFailure) and isinstance(two, ScorerFailure)
        assert str(two) == str(one.__cause__)
        assert f"failed on all {len(texts)} samples" in str(two) and "raised RuntimeError: scorer exploded" in str(two)


@pytest.mark.parametrize(("rows", "members"), [(3, 2), (4, 3)])
def test_a_members_padding_rows_call_no_scorer(monkeypatch, rows, members):
    """Rows that do not split evenly (the last member's share padding alone, or ending with it): each row reaches
    the scorers once, a sample's one and a batch's one, as on one member; a scorer with side effects (a sandbox, a
    paid endpoint) does not run twice for the row a padding row copies."""
    tokenizer = build_byte_tokenizer()
    monkeypatch.setattr(reward, "load_tokenizer", lambda *args, **kwargs: tokenizer)
    calls: list[str] = []

    def per_sample(solution_str, ground_truth, extra_info=None):
        calls.append(solution_str)
        return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth}

    def per_batch(completions, **kwargs):
        calls.extend(completions)
        return [1.0] * len(completions)

    config = Config()
    config.reward = RewardConfig(num_workers=0)
    texts = [str(row) for row in range(rows)]
    batch = make_batch(tokenizer, texts, ["0"] * rows, ["x"] * rows)
    for group_members in (1, members):
        calls.clear()
        group = WorkerGroup(reward.RewardWorker, config, [per_sample, per_batch], num_members=group_members,
                            timeout_s=30)
        try:
            scored = group.score(batch)
        finally:
            group.shutdown()
        assert sorted(calls) == sorted(texts * 2)
        assert scored["token_level_scores"].sum(-1).tolist() == [2.0] + [1.0] * (rows - 1)
        assert scored["rewards/per_sample"].tolist() == [1.0] + [0.0] * (rows - 1)
        assert scored["reward_acc"].tolist() == [True] + [False] * (rows - 1)


@pytest.mark.parametrize("texts", [["b", "b", "a", "a"], ["a", "a", "b", "b"]])
def test_extras_and_logged_values_of_some_rows_gather_as_on_one_member(monkeypatch, texts):
    """A scorer that returns extras (acc) only for some rows, and a batch function that logs a value only for some:
    on two members one share has the columns and the other not; gathered, each row without one has None (an extra)
    or NaN (a value its call logged none of), as a row without one has on one member."""
    import math

    tokenizer = build_byte_tokenizer()
    monkeypatch.setattr(reward, "load_tokenizer", lambda *args, **kwargs: tokenizer)

    def per_sample(solution_str, ground_truth, extra_info=None):
        return {"score": 1.0, "acc": True} if solution_str == "a" else 0.0

    def logged(completions, log_metric, **kwargs):
        if "a" in completions:
            log_metric("a_seen", 1.0)
        return [0.0] * len(completions)

    config = Config()
    config.reward = RewardConfig(num_workers=0)
    batch = make_batch(tokenizer, texts, ["0"] * 4, ["x"] * 4)
    group = WorkerGroup(reward.RewardWorker, config, [per_sample, logged], num_members=2, timeout_s=30)
    try:
        scored = reward.raise_if_every_row_failed(group.score(batch))
    finally:
        group.shutdown()
    assert scored["reward_acc"].tolist() == [True if text == "a" else None for text in texts]
    assert [math.isnan(value) for value in scored["logged_metric/a_seen"]] == [text == "b" for text in texts]
    assert scored["token_level_scores"].sum(-1).tolist() == [float(text == "a") for text in texts]
