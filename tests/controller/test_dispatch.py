import pytest
import torch

from reinforge.controller.dispatch import average_metrics, collect_results, plan_member_calls
from reinforge.controller.register import Dispatch, Execute, MethodSpec
from reinforge.protocol import Batch

DP = MethodSpec(Dispatch.DP_COMPUTE, Execute.ALL)


def test_dp_plan_splits_batches_and_broadcasts_the_rest():
    batch = Batch.from_dict({"x": torch.arange(5)})
    plan = plan_member_calls(DP, "f", 2, (batch, 0.5), {"flag": True})
    assert plan.num_padding == 1 and plan.chunk_size == 3
    (args0, kwargs0), (args1, kwargs1) = plan.member_arguments
    assert args0[0]["x"].tolist() == [0, 1, 2] and args1[0]["x"].tolist() == [3, 4, 0]
    assert args0[1] == args1[1] == 0.5 and kwargs0 == kwargs1 == {"flag": True}


def test_dp_plan_needs_a_batch_and_equal_rows():
    with pytest.raises(TypeError, match="got no Batch argument"):
        plan_member_calls(DP, "f", 2, (1,), {})
    a, b = Batch.from_dict({"x": torch.arange(4)}), Batch.from_dict({"x": torch.arange(3)})
    with pytest.raises(ValueError, match="differ in rows"):
        plan_member_calls(DP, "f", 2, (a,), {"other": b})



def test_dp_gather_leaves_out_a_share_of_padding_alone_whatever_its_columns():
    """Five rows on four members: the last member's share is padding alone; its placeholder rows, which lack a column
    only real rows get (a scorer's extras), are dropped without being concatenated."""
    batch = Batch.from_dict({"x": torch.arange(5)})
    plan = plan_member_calls(DP, "f", 4, (batch,), {})
    results = [Batch.from_dict({"y": chunk["x"] * 10}, {"acc": [True] * len(chunk)})
               for (chunk,), _ in plan.member_arguments[:3]]
    results.append(Batch.from_dict({"y": torch.zeros(2, dtype=torch.long)}))
    merged = collect_results(DP, plan, "f", results)
    assert merged["y"].tolist() == [0, 10, 20, 30, 40] and merged["acc"].tolist() == [True] * 5


def test_the_metrics_of_a_share_of_padding_alone_are_left_out():
    """Its generation time, near 0, pulled the members' mean time down, and its minimum the minimum."""
    plan = plan_member_calls(DP, "generate", 4, (Batch.from_dict({"x": torch.arange(5)}),), {})
    members = [Batch.from_dict({"y": torch.arange(2)}) for _ in range(4)]
    for seconds, member in zip((2.0, 4.0, 3.0, 0.01), members, strict=True):
        member.meta["rollout_metrics"] = {"timing_s/gen": seconds, "response_length/min": seconds}
    merged = collect_results(DP, plan, "generate", members).meta["rollout_metrics"]
    assert merged == {"timing_s/gen": 3.0, "response_length/min": 2.0}

def test_dp_gather_of_shares_whose_columns_differ_fills_an_optional_one_and_names_any_other():
    """Member 1's rows have a column member 0's lack: one named in meta empty_values gets the empty value on member
    0's rows; one not named stops the gather with a line naming the method, the column and the member."""
    from reinforge.protocol import EMPTY_VALUES

    plan = plan_member_calls(DP, "score", 2, (Batch.from_dict({"x": torch.arange(4)}),), {})
    shares = [Batch.from_dict({"y": chunk["x"]}) for (chunk,), _ in plan.member_arguments]
    shares[1]["acc"] = [True, False]
    with pytest.raises(ValueError, match=r"score is DP_COMPUTE.*rank k's.*'acc' is missing from batches \[0\]"):
        collect_results(DP, plan, "score", shares)
    shares[1].meta[EMPTY_VALUES] = {"acc": None}
    assert collect_results(DP, plan, "score", shares)["acc"].tolist() == [None, None, True, False]


def test_dp_gather_of_tuples_concatenates_batches_and_averages_metrics():
    batch = Batch.from_dict({"x": torch.arange(3)})
    plan = plan_member_calls(DP, "f", 2, (batch,), {})
    results = [(Batch.from_dict({"y": torch.tensor([0, 1])}, meta={"from": 0, "rollout_metrics": {
                    "tokens_per_s": 10.0, "peak_memory_gb": 3.0}}), {"loss": 1.0, "name": "a", "grad_max": 1.0}),
               (Batch.from_dict({"y": torch.tensor([2, 0])}, meta={"from": 1, "rollout_metrics": {
                    "tokens_per_s": 30.0, "peak_memory_gb": 5.0}}), {"loss": torch.tensor(3.0), "grad_max": 4.0})]
    merged_batch, merged_metrics = collect_results(DP, plan, "f", results)
    assert merged_batch["y"].tolist() == [0, 1, 2]
    # a dict of metrics in meta is merged over the members; other meta values come from rank 0
    assert merged_batch.meta == {"from": 0, "rollout_metrics": {"tokens_per_s": 20.0, "peak_memory_gb": 5.0}}
    assert merged_metrics == {"loss": 2.0, "name": "a", "grad_max": 4.0}


def test_dp_gather_rejects_outputs_that_do_not_match_inputs_row_for_row():
    plan = plan_member_calls(DP, "f", 2, (Batch.from_dict({"x": torch.arange(3)}),), {})
    results = [Batch.from_dict({"y": torch.arange(2)}), Batch.from_dict({"y": torch.arange(1)})]
    with pytest.raises(ValueError, match="rank 1 returned a Batch of 1 rows for its 2 input rows"):
        collect_results(DP, plan, "f", results)


def test_all_to_all_needs_one_element_per_member():
    spec = MethodSpec(Dispatch.ALL_TO_ALL, Execute.ALL)
    plan = plan_member_calls(spec, "f", 2, ([1, 2],), {"tag": ["a", "b"]})
    assert plan.member_arguments == [((1,), {"tag": "a"}), ((2,), {"tag": "b"})]
    with pytest.raises(ValueError, match="argument 0 must be a list with one element per member"):
        plan_member_calls(spec, "f", 2, ([1, 2, 3],), {})


def test_average_metrics_keeps_keys_of_some_members():
    assert average_metrics([{"a": 1, "b": 2.0}, {"a": 3}]) == {"a": 2.0, "b": 2.0}


def test_totals_a_member_names_are_added_up_over_the_members():
    plan = plan_member_calls(DP, "generate", 2, (Batch.from_dict({"x": torch.arange(4)}),), {})
    members = [Batch.from_dict({"y": torch.arange(2)}), Batch.from_dict({"y": torch.arange(2)})]
    for errors, turns, slowest, member in zip((3.0, 1.0), (2.0, 4.0), (5.0, 9.0), members, strict=True):
        member.meta["rollout_metrics"] = {"agent/tool_errors": errors, "num_turns/mean": turns,
                                          "timing_s/agent_loop/slowest/tool_calls": slowest}
        member.meta["summed_metrics"] = ("agent/tool_errors",)
    merged = collect_results(DP, plan, "generate", members).meta["rollout_metrics"]
    assert merged == {"agent/tool_errors": 4.0, "num_turns/mean": 3.0, "timing_s/agent_loop/slowest/tool_calls": 9.0}


def test_means_a_member_names_are_weighted_by_its_rows_that_count():
    """Three rows on two members (the second's last row is padding): a fraction over each member's rows that count
    becomes the fraction over the three rows, not the members' mean."""
    plan = plan_member_calls(DP, "score", 2, (Batch.from_dict({"x": torch.arange(3)}),), {})
    members = [Batch.from_dict({"y": torch.arange(2)}), Batch.from_dict({"y": torch.arange(2)})]
    for fraction, member in zip((0.5, 1.0), members, strict=True):
        member.meta["reward_metrics"] = {"overlong/fraction": fraction, "time_s": fraction}
        member.meta["row_means"] = ("overlong/fraction",)
    merged = collect_results(DP, plan, "score", members).meta["reward_metrics"]
    assert merged == {"overlong/fraction": pytest.approx(2 / 3), "time_s": 0.75}


def test_the_slowest_trajectorys_figures_come_from_one_member():
    """Each member reports its own slowest trajectory; the gathered figures are the slowest one's, not a mix."""
    members = [{"timing_s/agent_loop/slowest/generate_sequences": 10.0, "timing_s/agent_loop/slowest/prompt_length": 50.0},
               {"timing_s/agent_loop/slowest/generate_sequences": 5.0, "timing_s/agent_loop/slowest/prompt_length": 200.0},
               {"other": 1.0}]
    assert average_metrics(members) == {"timing_s/agent_loop/slowest/generate_sequences": 10.0,
                                        "timing_s/agent_loop/slowest/prompt_length": 50.0, "other": 1.0}


def test_the_slowest_member_is_the_one_whose_trajectory_took_longest_in_all():
    """A trajectory's time is its generation and its tool calls, as agent_metrics picks each member's slowest."""
    prefix = "timing_s/agent_loop/slowest/"
    members = [{f"{prefix}generate_sequences": 5.0, f"{prefix}tool_calls": 100.0, f"{prefix}prompt_length": 50.0},
               {f"{prefix}generate_sequences": 6.0, f"{prefix}tool_calls": 0.0, f"{prefix}prompt_length": 200.0}]
    assert average_metrics(members) == members[0]
