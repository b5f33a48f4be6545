"""The tool_agent state machine: errors become tool messages, every limit ends or cuts visibly."""

from __future__ import annotations

import asyncio

import pytest

from reinforge.agent import AgentContext, BaseTool, FunctionTool, ToolResult, ToolUnavailable, get_agent_loop
from reinforge.config.schema import MultiTurnConfig
from reinforge.rollout.base import SamplingParams


def echo(text: str) -> str:
    """Echo the text back.

    Args:
        text: What to echo.
    """
    return text


def broken(text: str) -> str:
    """Always fails.

    Args:
        text: Ignored.
    """
    raise RuntimeError("disk on fire")


class Scored(BaseTool):
    """Rewards each call 0.5; remembers create kwargs and releases."""

    created: list[dict] = []
    released: list[str] = []

    async def create(self, instance_id=None, **create_kwargs):
        Scored.created.append(create_kwargs)
        return await super().create(instance_id)

    async def execute(self, instance_id, arguments, **execute_kwargs):
        return ToolResult(f"ok {execute_kwargs.get('suffix', '')}".strip(), 0.5)

    async def release(self, instance_id):
        Scored.released.append(instance_id)


SCORED_SCHEMA = {"type": "function", "function": {"name": "scored", "description": "scores",
                                                   "parameters": {"type": "object", "properties": {}}}}


def call(name: str, **arguments) -> str:
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def run(tokenizer, client, config=MultiTurnConfig(), max_tokens=2000, tools=None, **row):
    tools = tools if tools is not None else {"echo": FunctionTool(echo), "broken": FunctionTool(broken)}
    context = AgentContext(tokenizer, client, config, tools)
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "go"}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    return asyncio.run(get_agent_loop("tool_agent")(context).run(SamplingParams(max_tokens=max_tokens, seed=3),
                                                                 prompt_ids=list(prompt_ids), **row))


def tool_texts(tokenizer, output) -> str:
    return tokenizer.decode([t for t, m in zip(output.response_ids, output.response_mask, strict=True) if not m])


def test_errors_become_tool_messages_and_the_loop_goes_on(chatml_tokenizer, scripted_client):
    script = [call("nope", x=1), call("broken", text="a"), "<tool_call>{bad json</tool_call>", "done"]
    output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, script))
    text = tool_texts(chatml_tokenizer, output)
    assert "Unknown tool 'nope'. Available tools: broken, echo." in text
    assert "Error running tool 'broken': RuntimeError: disk on fire" in text
    assert "Invalid JSON in tool call" in text
    assert output.metrics["tool_errors"] == 3 and output.metrics["num_tool_calls"] == 3
    assert output.finish_reason == "stop" and output.num_turns == 8
    assert output.extra["tool_rewards"] == [0.0, 0.0, 0.0]


def gone(text: str) -> str:
    """A tool whose service is down for good.

    Args:
        text: Ignored.
    """
    raise ToolUnavailable("the service stopped answering")


def test_a_tool_whose_service_is_gone_stops_the_trajectory_instead_of_becoming_a_message(chatml_tokenizer,
                                                                                           scripted_client):
    script = [call("echo", text="a"), call("gone", text="b"), "done"]
    tools = {"echo": FunctionTool(echo), "gone": FunctionTool(gone)}
    with pytest.raises(ToolUnavailable, match="the service stopped answering"):
        run(chatml_tokenizer, scripted_client(chatml_tokenizer, script), tools=tools)


def test_calls_past_max_parallel_calls_are_answered_and_counted(chatml_tokenizer, scripted_client):
    script = [call("echo", text="one") + "\n" + call("echo", text="two") + "\n" + call("echo", text="three"), "done"]
    output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, script), MultiTurnConfig(max_parallel_calls=2))
    text = tool_texts(chatml_tokenizer, output)
    assert "one" in text and "two" in text and "three" not in text
    assert text.count("Not run: at most 2 tool call(s) per turn are executed.") == 1
    assert output.metrics["num_tool_calls"] == 2 and output.metrics["tool_calls_cut"] == 1


def test_turn_limits_end_the_trajectory(chatml_tokenizer, scripted_client):
    script = [call("echo", text="a")] * 5
    output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, script), MultiTurnConfig(max_assistant_turns=2))
    assert output.num_turns == 4 and output.finish_reason == "max_turns"
    output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, script), MultiTurnConfig(max_user_turns=1))
    assert output.num_turns == 4 and output.finish_reason == "max_turns"


def test_one_budget_covers_model_and_tool_tokens(chatml_tokenizer, scripted_client):
    script = [call("echo", text="x" * 40)] * 20
    client = scripted_client(chatml_tokenizer, script)
    output = run(chatml_tokenizer, client, max_tokens=300)
    assert len(output.response_ids) <= 300
    # each turn asks for what is left of the budget
    for prompt, sampling in zip(client.prompts, client.samplings, strict=True):
        assert sampling.max_tokens == 300 - (len(prompt) - len(output.prompt_ids))
    assert output.finish_reason in ("tool_overflow", "length")
    assert output.metrics["tool_overflow"] == (output.finish_reason == "tool_overflow")
    # a tool turn that would overflow is left out: the trajectory ends with the model's own tokens
    assert output.response_mask[-1] == 1


def test_tool_output_is_cut_in_tokens_on_the_chosen_side(chatml_tokenizer, scripted_client):
    long_text = "".join(chr(ord("a") + i % 26) for i in range(100))
    for side, kept in (("right", long_text[:10]), ("left", long_text[-10:]),
                       ("middle", long_text[:5] + "...(truncated)..." + long_text[-5:])):
        output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("echo", text=long_text), "done"]),
                     MultiTurnConfig(max_tool_response_length=10, tool_response_truncate_side=side))
        assert f"<tool_response>\n{kept}\n</tool_response>" in tool_texts(chatml_tokenizer, output)
        assert output.metrics["tool_response_truncated"] == 1


def test_row_tools_kwargs_reach_create_and_execute_and_rewards_are_kept(chatml_tokenizer, scripted_client):
    Scored.created.clear()
    Scored.released.clear()
    tools = {"scored": Scored({}, SCORED_SCHEMA)}
    extra_info = {"tools_kwargs": {"scored": {"create_kwargs": {"answer": 7}, "execute_kwargs": {"suffix": "!"}}}}
    output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("scored"), call("scored"), "done"]),
                 tools=tools, extra_info=extra_info)
    assert Scored.created == [{"answer": 7}]  # one instance per trajectory
    assert len(Scored.released) == 1
    assert "ok !" in tool_texts(chatml_tokenizer, output)
    assert output.extra["tool_rewards"] == [0.5, 0.5]


def test_turn_seeds_differ_and_follow_the_trajectory_seed(chatml_tokenizer, scripted_client):
    client = scripted_client(chatml_tokenizer, [call("echo", text="a"), "done"])
    run(chatml_tokenizer, client)
    seeds = [sampling.seed for sampling in client.samplings]
    assert len(set(seeds)) == 2 and all(seed is not None for seed in seeds)
