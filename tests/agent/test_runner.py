"""The agent runner's rollout metrics: which of them are totals that several workers add up."""

from reinforge.agent.runner import agent_totals


def test_the_agent_metrics_totals_are_named_for_several_workers_to_add_up():
    names = ["agent/tool_errors", "agent/budget_spent", "agent/tool/calc/calls", "num_turns/mean",
             "agent/num_tool_calls/mean", "timing_s/agent_loop/slowest/tool_calls"]
    assert agent_totals(names) == ("agent/tool_errors", "agent/budget_spent", "agent/tool/calc/calls")
