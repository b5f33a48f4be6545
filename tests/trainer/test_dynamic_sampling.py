"""Dynamic sampling (DAPO) on batches built by hand: which groups are kept, truncation, the limit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reinforge.config.schema import FilterGroupsConfig
from reinforge.protocol import Batch
from reinforge.trainer.dynamic_sampling import collect_kept_groups, concat_generated, group_metric, kept_group_rows
from reinforge.trainer.run_loop import DataExhausted

PAD = 0
RESPONSE = 3


def scored_batch(groups: dict[str, list[float]], prompt_width: int) -> Batch:
    """A generated and scored batch: one uid per group, each sample's score on its last of 2 response tokens."""
    uids = [uid for uid, scores in groups.items() for _ in scores]
    scores = torch.tensor([score for values in groups.values() for score in values])
    rows = len(uids)
    prompts = torch.arange(1, rows * prompt_width + 1).reshape(rows, prompt_width)
    responses = torch.full((rows, RESPONSE), 7)
    response_mask = torch.tensor([[1, 1, 0]] * rows)
    attention_mask = torch.cat([torch.ones(rows, prompt_width, dtype=torch.long), response_mask], dim=1)
    token_level_scores = torch.zeros(rows, RESPONSE)
    token_level_scores[:, 1] = scores
    return Batch.from_dict(
        tensors={"prompts": prompts, "responses": responses, "response_mask": response_mask,
                 "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
                 "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask,
                 "token_level_scores": token_level_scores},
        non_tensors={"uid": uids, "reward_acc": [score > 0 for score in scores.tolist()]},
        meta={"reward_metrics": {"reward/errors": 1.0}})


def test_only_groups_whose_metric_varies_are_kept_and_a_group_of_one_always():
    batch = scored_batch({"a": [1, 1, 1], "b": [0, 1, 0], "c": [0, 0, 0], "d": [0.5], "e": [0, 0.2, 0]}, 2)
    rows, kept, groups = kept_group_rows(batch["uid"], group_metric(batch, "score"))
    assert (kept, groups) == (3, 5)
    assert [batch["uid"][row] for row in rows] == ["b"] * 3 + ["d"] + ["e"] * 3
    # on acc, e's samples are all wrong but for the one scored 0.2 > 0: still varies; d (one sample) kept
    rows, kept, _ = kept_group_rows(batch["uid"], group_metric(batch, "acc"))
    assert kept == 3
    batch["token_level_rewards"] = batch["token_level_scores"] * 0  # seq_final_reward: nothing varies
    assert kept_group_rows(batch["uid"], group_metric(batch, "seq_final_reward"))[1] == 1  # only d


def test_score_is_the_scorer_score_before_overlong_shaping():
    batch = scored_batch({"a": [1.0, 0.5]}, 2)
    batch.non_tensors["reward_overlong_penalty"] = np.array([0.0, -0.5], dtype=object)
    assert group_metric(batch, "seq_reward").tolist() == [1.0, 0.5]
    assert group_metric(batch, "score").tolist() == [1.0, 1.0]


def test_acc_without_an_acc_extra_is_the_score_as_in_verl():
    """verl's DAPO reward manager records acc = score for a scorer that returns a float (no acc of its own)."""
    batch = scored_batch({"a": [1.0, 0.0], "b": [0.5, 0.5]}, 2)
    del batch.non_tensors["reward_acc"]
    assert group_metric(batch, "acc").tolist() == [1.0, 0.0, 0.5, 0.5]
    batch.non_tensors["reward_acc"] = [True, None, None, False]  # a sample whose scorer failed has no acc either
    assert group_metric(batch, "acc").tolist() == [1.0, 0.0, 0.5, 0.0]


def test_kept_groups_accumulate_over_generation_batches_and_are_cut_to_exactly_the_batch():
    generation_batches = [
        scored_batch({"p0": [0, 0], "p1": [0, 1]}, prompt_width=2),  # keeps p1
        scored_batch({"p2": [1, 1], "p3": [1, 1]}, prompt_width=4),  # keeps none
        scored_batch({"p4": [1, 0], "p5": [0, 1]}, prompt_width=3),  # keeps p4, p5: one too many
    ]
    drawn = iter(generation_batches[1:])
    seen: list[Batch] = []

    def generate_scored(prompts: Batch) -> Batch:
        seen.append(prompts)
        return prompts

    batch, metrics = collect_kept_groups(generation_batches[0], lambda: next(drawn), generate_scored,
                                         FilterGroupsConfig(enable=True, metric="score"), num_groups=2,
                                         pad_token_id=PAD)
    assert len(seen) == 3
    assert list(batch["uid"]) == ["p1", "p1", "p4", "p4"]  # p5 was kept but is past train_batch_size
    assert metrics == {"train/num_gen_batches": 3.0, "train/num_kept_groups": 3.0,
                       "train/kept_group_fraction": 0.5}
    assert batch.meta["reward_metrics"]["reward/errors"] == 3.0  # counted over every generation batch
    # the prompts of different widths are left-padded to the widest (4), the sequences with them
    assert batch["prompts"].shape == (4, 4) and batch["input_ids"].shape == (4, 4 + RESPONSE)
    assert batch["prompts"][0].tolist() == [PAD, PAD, 5, 6]  # p1: rows 2-3 of the first batch
    assert batch["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 0]
    assert batch["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3, 0]
    assert batch["prompts"][2].tolist() == [PAD, 1, 2, 3]


def test_too_many_generation_batches_fail_with_the_fix_and_zero_means_no_limit():
    def all_equal() -> Batch:
        return scored_batch({f"p{next(counter)}": [1, 1]}, 2)

    counter = iter(range(100))
    config = FilterGroupsConfig(enable=True, metric="score", max_num_gen_batches=3)
    with pytest.raises(RuntimeError, match=r"kept 0 of the data.train_batch_size=1 prompt groups it needs after "
                                           r"algorithm.filter_groups.max_num_gen_batches=3 generation batches.*"
                                           r"\(0 means no limit\)"):
        collect_kept_groups(all_equal(), all_equal, lambda prompts: prompts, config, num_groups=1, pad_token_id=PAD)
    calls = iter([scored_batch({"x": [1, 1]}, 2)] * 20 + [scored_batch({"y": [0, 1]}, 2)])
    unlimited = FilterGroupsConfig(enable=True, metric="score", max_num_gen_batches=0)
    batch, metrics = collect_kept_groups(next(calls), lambda: next(calls), lambda prompts: prompts, unlimited,
                                         num_groups=1, pad_token_id=PAD)
    assert metrics["train/num_gen_batches"] == 21.0 and list(batch["uid"]) == ["y", "y"]


def test_a_step_without_a_limit_that_keeps_nothing_warns_at_10_20_40_generation_batches(caplog):
    """max_num_gen_batches=0 with a metric that never varies generates for ever; the log says so as it goes."""
    calls = iter([scored_batch({"x": [1, 1]}, 2)] * 45 + [scored_batch({"y": [0, 1]}, 2)])
    unlimited = FilterGroupsConfig(enable=True, metric="score", max_num_gen_batches=0)
    with caplog.at_level("WARNING", logger="reinforge.trainer.dynamic_sampling"):
        collect_kept_groups(next(calls), lambda: next(calls), lambda prompts: prompts, unlimited, num_groups=1,
                            pad_token_id=PAD)
    warned = [record.getMessage() for record in caplog.records]
    assert [message.split(" after ")[1].split(" ")[0] for message in warned] == ["10", "20", "40"]
    assert warned[0] == ("dynamic sampling has kept 0 of the data.train_batch_size=1 prompt groups one step needs after "
                         "10 generation batches, and algorithm.filter_groups.max_num_gen_batches=0 sets no limit (the "
                         "metric score was the same for every sample of the others): check the scorer, or set "
                         "max_num_gen_batches to stop the run")


def test_concat_fills_missing_extras_with_none():
    first, second = scored_batch({"a": [0, 1]}, 2), scored_batch({"b": [0, 1]}, 2)
    second.non_tensors["reward_pred"] = np.array(["1", "2"], dtype=object)
    merged = concat_generated([first, second], PAD)
    assert list(merged["reward_pred"]) == [None, None, "1", "2"]


def test_data_running_out_inside_a_step_says_what_the_step_had_kept_and_keeps_the_fix():
    def used_up() -> Batch:
        raise DataExhausted("dynamic sampling used up the data", "add data")

    first = scored_batch({"a": [0, 1], "b": [1, 1]}, 2)  # keeps a: one of the two groups needed
    with pytest.raises(DataExhausted) as error:
        collect_kept_groups(first, used_up, lambda prompts: prompts, FilterGroupsConfig(enable=True, metric="score"),
                            num_groups=2, pad_token_id=PAD)
    assert str(error.value) == ("dynamic sampling used up the data while the step in progress had kept only 1 of the "
                                "data.train_batch_size=2 prompt groups it needs (its 1 generation batch(es) are "
                                "dropped)")
    assert error.value.fix == "add data"


def test_the_engines_rollout_metrics_cover_every_generation_batch_of_the_step():
    """They were the first generation batch's alone, beside a timing_s/gen of them all."""
    first, second = scored_batch({"a": [1, 1]}, 2), scored_batch({"b": [0, 1]}, 2)
    first.meta["rollout_metrics"] = {"rollout/num_generated_tokens": 12.0, "rollout/time_s": 1.0,
                                     "rollout/tokens_per_s": 12.0, "rollout/kv_blocks_used_peak": 5.0,
                                     "timing_s/gen/engine": 1.0, "num_turns/mean": 2.0}
    second.meta["rollout_metrics"] = {"rollout/num_generated_tokens": 4.0, "rollout/time_s": 1.0,
                                      "rollout/tokens_per_s": 4.0, "rollout/kv_blocks_used_peak": 3.0,
                                      "timing_s/gen/engine": 0.5, "num_turns/mean": 3.0}
    batch, metrics = collect_kept_groups(first, lambda: second, lambda prompts: prompts,
                                         FilterGroupsConfig(enable=True, metric="score"), num_groups=1,
                                         pad_token_id=PAD)
    assert metrics["train/num_gen_batches"] == 2.0
    assert batch.meta["rollout_metrics"] == {"rollout/num_generated_tokens": 16.0, "rollout/time_s": 2.0,
                                             "rollout/tokens_per_s": 8.0, "rollout/kv_blocks_used_peak": 5.0,
                                             "timing_s/gen/engine": 1.5, "num_turns/mean": 2.5}


def test_the_agent_loops_metrics_cover_every_generation_batch_of_the_step():
    """num_turns/* and the tool counts were the first generation batch's alone, beside rollout/* of them all."""
    first, second = scored_batch({"a": [1, 1]}, 2), scored_batch({"b": [0, 1], "c": [1, 0]}, 2)
    first.meta["rollout_metrics"] = {
        "num_turns/min": 2.0, "num_turns/max": 3.0, "num_turns/mean": 2.5, "agent/num_tool_calls/mean": 1.0,
        "agent/tool_errors": 1.0, "agent/tool/code/runs": 2.0, "agent/budget_spent": 0.0,
        "timing_s/agent_loop/slowest/generate_sequences": 4.0, "timing_s/agent_loop/slowest/tool_calls": 1.0,
        "timing_s/agent_loop/slowest/response_length": 30.0}
    second.meta["rollout_metrics"] = {
        "num_turns/min": 1.0, "num_turns/max": 2.0, "num_turns/mean": 1.0, "agent/num_tool_calls/mean": 4.0,
        "agent/tool_errors": 2.0, "agent/tool/code/runs": 5.0, "agent/budget_spent": 1.0,
        "timing_s/agent_loop/slowest/generate_sequences": 6.0, "timing_s/agent_loop/slowest/tool_calls": 0.5,
        "timing_s/agent_loop/slowest/response_length": 50.0}
    batch, _ = collect_kept_groups(first, lambda: second, lambda prompts: prompts,
                                   FilterGroupsConfig(enable=True, metric="score"), num_groups=2, pad_token_id=PAD)
    assert batch.meta["rollout_metrics"] == {  # over the 2 + 4 samples generated
        "num_turns/min": 1.0, "num_turns/max": 3.0, "num_turns/mean": (2 * 2.5 + 4 * 1.0) / 6,
        "agent/num_tool_calls/mean": (2 * 1.0 + 4 * 4.0) / 6, "agent/tool_errors": 3.0,
        "agent/tool/code/runs": 7.0, "agent/budget_spent": 1.0,
        "timing_s/agent_loop/slowest/generate_sequences": 6.0, "timing_s/agent_loop/slowest/tool_calls": 0.5,
        "timing_s/agent_loop/slowest/response_length": 50.0}


def test_a_scores_mean_over_generation_batches_is_weighted_by_their_samples_and_counts_add_up():
    """reward_model/score/mean (and a judge's) was summed over the step's generation batches, as the counts are."""
    first, second = scored_batch({"a": [1, 1]}, 2), scored_batch({"b": [0, 1], "c": [1, 0]}, 2)
    first.meta["reward_metrics"] = {"reward/errors": 1.0, "reward_model/score/mean": 0.5}
    second.meta["reward_metrics"] = {"reward/errors": 2.0, "reward_model/score/mean": 2.0}
    batch, _ = collect_kept_groups(first, lambda: second, lambda prompts: prompts,
                                   FilterGroupsConfig(enable=True, metric="score"), num_groups=2, pad_token_id=PAD)
    assert batch.meta["reward_metrics"] == {"reward/errors": 3.0, "reward_model/score/mean": (2 * 0.5 + 4 * 2.0) / 6}
