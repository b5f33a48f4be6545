"""The tool_agent state machine: errors become tool messages, every limit ends or cuts visibly."""

from __future__ import annotations

import asyncio

import pytest

from reinforge.agent import (
    AgentContext,
    BaseTool,
    FunctionTool,
    ToolResult,
    ToolUnavailable,
    agent_metrics,
    get_agent_loop,
)
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


def test_arguments_a_function_cannot_take_are_the_models_mistake_not_a_failing_tool(chatml_tokenizer, scripted_client):
    from reinforge.agent.runner import tool_call_counts

    script = [call("echo", text=3), call("echo", text="a", loud=True), call("echo"), call("echo", text="a"), "done"]
    output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, script))
    text = tool_texts(chatml_tokenizer, output)
    assert "Invalid arguments for tool 'echo': argument 'text' is 3, not of type string." in text
    assert "Invalid arguments for tool 'echo': missing required argument(s) 'text'." in text
    assert "got an unexpected keyword argument 'loud'; it takes 'text'" in text
    # the tool answered the one call that reached it; the three it never saw are not counted as it failing
    assert output.metrics["tool_errors"] == 3 and output.metrics["tool_raised"] == 0
    assert tool_call_counts(output) == (1, 0)
    # an argument the row supplies (execute_kwargs) is no missing one
    output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("echo"), "done"]),
                 extra_info={"tools_kwargs": {"echo": {"execute_kwargs": {"text": "from the row"}}}})
    assert "from the row" in tool_texts(chatml_tokenizer, output) and output.metrics["tool_errors"] == 0


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
    # the middle side's note (17 tokens of this byte-level tokenizer) counts in the limit: 27 keep 5 + 5
    for side, limit, kept in (("right", 10, long_text[:10]), ("left", 10, long_text[-10:]),
                              ("middle", 27, long_text[:5] + "...(truncated)..." + long_text[-5:])):
        output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("echo", text=long_text), "done"]),
                     MultiTurnConfig(max_tool_response_length=limit, tool_response_truncate_side=side))
        assert f"<tool_response>\n{kept}\n</tool_response>" in tool_texts(chatml_tokenizer, output)
        assert output.metrics["tool_response_truncated"] == 1


def test_a_cut_through_a_multi_byte_character_leaves_no_half_of_it(chatml_tokenizer, scripted_client):
    text = "\u00e9" * 50  # two bytes, two tokens each
    assert len(chatml_tokenizer.encode(text, add_special_tokens=False)) == 100
    for side, limit, kept in (("right", 11, "\u00e9" * 5), ("left", 11, "\u00e9" * 5),
                              ("middle", 28, "\u00e9" * 3 + "...(truncated)..." + "\u00e9" * 2)):
        output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("echo", text=text), "done"]),
                     MultiTurnConfig(max_tool_response_length=limit, tool_response_truncate_side=side))
        assert f"<tool_response>\n{kept}\n</tool_response>" in tool_texts(chatml_tokenizer, output), side


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


class Verl(BaseTool):
    """Returns verl's (text, reward, metrics) tuple; a number as text on request; NaN rewards on request."""

    async def execute(self, instance_id, arguments, **execute_kwargs):
        if arguments.get("nan"):
            return "x", float("nan"), {}
        return (123 if arguments.get("number") else "tuple ok"), 0.25, {"seen": 1.0}


VERL_SCHEMA = {"type": "function", "function": {"name": "verl", "description": "verl-style",
                                                 "parameters": {"type": "object", "properties": {}}}}


def test_a_tool_may_return_verls_tuple_and_a_non_finite_reward_is_a_tool_error(chatml_tokenizer, scripted_client):
    tools = {"verl": Verl({}, VERL_SCHEMA)}
    output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("verl"), call("verl", number=True),
                                                                      call("verl", nan=True), "done"]), tools=tools)
    text = tool_texts(chatml_tokenizer, output)
    assert "tuple ok" in text and "<tool_response>\n123\n</tool_response>" in text
    assert "non-finite reward nan" in text
    assert output.extra["tool_rewards"] == [0.25, 0.25, 0.0]
    assert output.metrics["tool_errors"] == 1 and output.metrics["tool_raised"] == 1


def hangs(text: str) -> str:
    """Never answers in time.

    Args:
        text: Ignored.
    """
    import time

    time.sleep(30)
    return text


def test_a_tool_that_does_not_answer_in_time_is_answered_for_and_the_run_does_not_wait(chatml_tokenizer,
                                                                                        scripted_client):
    import time

    start = time.perf_counter()
    output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("hangs", text="a"), "done"]),
                 MultiTurnConfig(tool_timeout_s=0.3), tools={"hangs": FunctionTool(hangs)})
    assert time.perf_counter() - start < 10  # asyncio.run returned without joining the tool's thread
    assert "Tool 'hangs' did not answer within 0.3 s." in tool_texts(chatml_tokenizer, output)
    assert output.metrics["tool_raised"] == 1 and output.finish_reason == "stop"


class Counted(BaseTool):
    created = 0
    released = 0

    async def create(self, instance_id=None, **create_kwargs):
        await asyncio.sleep(0.05)  # calls of one turn all ask for the instance meanwhile
        Counted.created += 1
        return await super().create(instance_id)

    async def execute(self, instance_id, arguments, **execute_kwargs):
        return ToolResult(instance_id)

    async def release(self, instance_id):
        Counted.released += 1


def test_parallel_calls_of_one_tool_share_one_instance(chatml_tokenizer, scripted_client):
    Counted.created = Counted.released = 0
    schema = {"type": "function", "function": {"name": "counted", "description": "c",
                                                "parameters": {"type": "object", "properties": {}}}}
    output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("counted") * 3, "done"]),
                 MultiTurnConfig(max_parallel_calls=3), tools={"counted": Counted({}, schema)})
    assert output.metrics["num_tool_calls"] == 3
    assert Counted.created == 1 and Counted.released == 1


class SlowToCreate(BaseTool):
    live: set[str] = set()

    async def create(self, instance_id=None, **create_kwargs):
        await asyncio.sleep(0.2)  # past the call's timeout
        instance = await super().create(instance_id)
        SlowToCreate.live.add(instance)
        return instance

    async def execute(self, instance_id, arguments, **execute_kwargs):
        return ToolResult("ok")

    async def release(self, instance_id):
        SlowToCreate.live.discard(instance_id)


def test_an_instance_created_after_its_call_timed_out_is_released_once_it_exists(chatml_tokenizer, scripted_client):
    # the create goes on after its call timed out and the trajectory ended, while the step's other trajectories
    # keep the event loop running: its instance was never released, and such instances piled up step after step
    SlowToCreate.live.clear()
    schema = {"type": "function", "function": {"name": "slow", "description": "s",
                                                "parameters": {"type": "object", "properties": {}}}}
    context = AgentContext(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("slow"), "done"]),
                           MultiTurnConfig(tool_timeout_s=0.05), {"slow": SlowToCreate({}, schema)})
    prompt_ids = chatml_tokenizer.apply_chat_template([{"role": "user", "content": "go"}], add_generation_prompt=True,
                                                      tokenize=True, return_dict=False)

    async def step():
        output = await get_agent_loop("tool_agent")(context).run(SamplingParams(max_tokens=2000, seed=3),
                                                                 prompt_ids=list(prompt_ids))
        live_at_the_end = set(SlowToCreate.live)
        await asyncio.sleep(0.4)  # another trajectory of the step still running
        return output, live_at_the_end

    output, live_at_the_end = asyncio.run(step())
    assert "Tool 'slow' did not answer within 0.05 s." in tool_texts(chatml_tokenizer, output)
    assert live_at_the_end == set() and SlowToCreate.live == set()


class NeverReleases(BaseTool):
    async def execute(self, instance_id, arguments, **execute_kwargs):
        return ToolResult("ok")

    async def release(self, instance_id):
        await asyncio.sleep(3600)


def test_a_release_that_never_returns_does_not_hold_the_trajectory(chatml_tokenizer, scripted_client):
    schema = {"type": "function", "function": {"name": "stuck", "description": "s",
                                                "parameters": {"type": "object", "properties": {}}}}
    context = AgentContext(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("stuck"), "done"]),
                           MultiTurnConfig(tool_timeout_s=0.1), {"stuck": NeverReleases({}, schema)})
    prompt_ids = chatml_tokenizer.apply_chat_template([{"role": "user", "content": "go"}], add_generation_prompt=True,
                                                      tokenize=True, return_dict=False)

    async def step():
        run = get_agent_loop("tool_agent")(context).run(SamplingParams(max_tokens=2000, seed=3),
                                                        prompt_ids=list(prompt_ids))
        return await asyncio.wait_for(run, 5)  # the trajectory waited for the release for ever

    output = asyncio.run(step())
    assert output.finish_reason == "stop" and "ok" in tool_texts(chatml_tokenizer, output)


class StopsAtToolCall:
    """A client whose turns end at a stop token (rollout.stop_token_ids), not at the end-of-turn token."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns = tokenizer, list(turns)

    async def generate(self, prompt_ids, sampling, request_id):
        from reinforge.rollout.base import Completion

        ids = list(self.tokenizer(self.turns.pop(0), add_special_tokens=False)["input_ids"])
        return Completion(ids, [-0.5] * len(ids), "stop")


def test_a_turn_ended_by_a_stop_token_is_closed_as_the_template_closes_it(chatml_tokenizer):
    output = run(chatml_tokenizer, StopsAtToolCall(chatml_tokenizer, [call("echo", text="hi"), "done"]))
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": call("echo", text="hi")},
                {"role": "tool", "content": "hi"}, {"role": "assistant", "content": "done"}]
    whole = chatml_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    stream = output.prompt_ids + output.response_ids
    assert stream == list(whole)[:len(stream)]  # the last turn ends at "done" (no end-of-turn sampled)
    eos = chatml_tokenizer.convert_tokens_to_ids("<|im_end|>")
    first_eos = output.response_ids.index(eos)
    assert output.response_mask[first_eos] == 0  # the closing token was not sampled


def test_an_answer_that_ends_on_the_budgets_last_token_stopped_and_did_not_run_out(chatml_tokenizer, scripted_client):
    sampled = len(chatml_tokenizer("done", add_special_tokens=False)["input_ids"]) + 1  # and its end-of-turn token
    output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, ["done"]), max_tokens=sampled)
    assert len(output.response_ids) == sampled
    assert output.finish_reason == "stop" and agent_metrics([output])["agent/budget_spent"] == 0
    output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, ["done"]), max_tokens=sampled - 1)
    assert output.finish_reason == "length"


class Odd(BaseTool):
    """Returns or raises what the call asks for; release exits."""

    async def execute(self, instance_id, arguments, **execute_kwargs):
        kind = arguments["kind"]
        if kind == "no_metrics":
            return ToolResult("fine", 1.0, None)
        if kind == "text_metrics":
            return "x", 0.0, {"tool_raised": "yes"}
        if kind == "own_metrics":
            return "x", None, {"hits": 2}
        if kind == "own_timeout":
            raise TimeoutError("the socket timed out")
        if kind == "exit":
            raise SystemExit(3)
        if kind == "bytes":
            return b"caf\xc3\xa9"
        return "x" * 300_000  # one long word, which a tokenizer takes seconds over

    async def release(self, instance_id):
        raise SystemExit(4)


ODD_SCHEMA = {"type": "function", "function": {"name": "odd", "description": "odd",
                                                "parameters": {"type": "object", "properties": {}}}}


def test_odd_tool_results_become_messages_or_metrics_and_never_stop_the_loop(chatml_tokenizer, scripted_client):
    kinds = ["no_metrics", "text_metrics", "own_metrics", "own_metrics", "own_timeout", "exit", "bytes"]
    output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("odd", kind=kind) for kind in kinds]
                                                   + ["done"]), tools={"odd": Odd({}, ODD_SCHEMA)})
    text = tool_texts(chatml_tokenizer, output)
    assert "<tool_response>\nfine\n</tool_response>" in text
    assert "ValueError: the tool returned metrics {'tool_raised': 'yes'}; they must map names to numbers" in text
    assert "TimeoutError: the socket timed out" in text and "did not answer" not in text
    assert "RuntimeError: the tool called exit(3)" in text
    assert "<tool_response>\ncaf\u00e9\n</tool_response>" in text
    assert output.finish_reason == "stop" and output.metrics["tool_raised"] == 3
    assert output.metrics["tool/odd/hits"] == 4 and agent_metrics([output, output])["agent/tool/odd/hits"] == 8


class ChecksBadly(BaseTool):
    def arguments_problem(self, arguments, execute_kwargs):
        return "needs " + arguments["missing"]  # a bug in the tool's own check

    async def execute(self, instance_id, arguments, **execute_kwargs):
        return ToolResult("ran")


def test_a_tool_whose_argument_check_raises_fails_its_call_not_the_rollout(chatml_tokenizer, scripted_client):
    schema = {"type": "function", "function": {"name": "checks", "description": "c",
                                                "parameters": {"type": "object", "properties": {}}}}
    output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("checks"), "done"]),
                 tools={"checks": ChecksBadly({}, schema)})
    assert "Error running tool 'checks': KeyError: 'missing'" in tool_texts(chatml_tokenizer, output)
    assert output.metrics["tool_raised"] == 1 and output.finish_reason == "stop"


def test_lone_surrogates_in_a_tool_output_are_shown_as_replacement_characters(chatml_tokenizer, scripted_client):
    # a tool's surrogateescape'd bytes, or an escape the model wrote in its call's JSON that the tool echoes: the
    # tokenizer refused the text and the whole rollout stopped
    turns = ['<tool_call>{"name": "echo", "arguments": {"text": "a\\udcff b \\ud83d\\ude00"}}</tool_call>', "done"]
    output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, turns))
    assert "<tool_response>\na\ufffd b \U0001f600\n</tool_response>" in tool_texts(chatml_tokenizer, output)
    assert output.finish_reason == "stop" and output.metrics["tool_errors"] == 0


class CancelledInside(BaseTool):
    async def execute(self, instance_id, arguments, **execute_kwargs):
        if arguments.get("wait"):
            await asyncio.sleep(30)
        request = asyncio.ensure_future(asyncio.sleep(30))  # a request its library cancels
        asyncio.get_running_loop().call_later(0.01, request.cancel)
        return await request


def test_a_cancelled_error_of_the_tools_own_fails_its_call_and_a_cancelled_trajectory_still_stops(chatml_tokenizer,
                                                                                                  scripted_client):
    schema = {"type": "function", "function": {"name": "cancels", "description": "c",
                                                "parameters": {"type": "object", "properties": {}}}}
    tools = {"cancels": CancelledInside({}, schema)}
    output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("cancels"), "done"]), tools=tools)
    assert "the tool raised CancelledError" in tool_texts(chatml_tokenizer, output)  # it stopped the whole rollout
    assert output.metrics["tool_raised"] == 1 and output.finish_reason == "stop"

    context = AgentContext(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("cancels", wait=True), "done"]),
                           MultiTurnConfig(), tools)

    async def cancelled_meanwhile():
        trajectory = asyncio.ensure_future(get_agent_loop("tool_agent")(context).run(
            SamplingParams(max_tokens=2000, seed=3), prompt_ids=[1, 2, 3]))
        await asyncio.sleep(0.2)
        trajectory.cancel()
        await trajectory

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(asyncio.wait_for(cancelled_meanwhile(), 10))


def test_a_huge_tool_output_is_cut_without_tokenizing_all_of_it(chatml_tokenizer, scripted_client):
    import time

    start = time.perf_counter()
    for side, limit in (("right", 16), ("left", 16), ("middle", 40), ("middle", 5)):
        output = run(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("odd", kind="huge"), "done"]),
                     MultiTurnConfig(max_tool_response_length=limit, tool_response_truncate_side=side),
                     tools={"odd": Odd({}, ODD_SCHEMA)})
        response = tool_texts(chatml_tokenizer, output).split("<tool_response>\n")[1].split("\n</tool_response>")[0]
        assert len(chatml_tokenizer(response, add_special_tokens=False)["input_ids"]) <= limit, (side, limit)
        assert output.metrics["tool_response_truncated"] == 1
    assert time.perf_counter() - start < 5  # tokenizing the whole 300,000 characters took some 30 s


class ServiceDown(BaseTool):
    """Answers every call with its service's failure, as the code interpreter does when its sandbox is down."""

    async def execute(self, instance_id, arguments, **execute_kwargs):
        return ToolResult("The code was not run: connection refused", None, {"tool_error": 1.0, "service_error": 1.0})


def test_calls_the_service_did_not_run_count_as_failed_tool_calls(chatml_tokenizer, scripted_client):
    from reinforge.agent.runner import failed_tools, tool_call_counts

    schema = {"type": "function", "function": {"name": "down", "description": "down",
                                               "parameters": {"type": "object", "properties": {}}}}
    tools = {"down": ServiceDown({}, schema), "echo": FunctionTool(echo), "broken": FunctionTool(broken)}
    down = run(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("down"), call("broken", text="a"), "done"]),
               tools=tools)
    assert down.metrics["tool_service_errors"] == 1 and down.metrics["tool_raised"] == 1
    assert "agent/tool/down/service_error" not in agent_metrics([down])
    assert tool_call_counts(down) == (2, 2)
    answered = run(chatml_tokenizer, scripted_client(chatml_tokenizer, [call("down"), call("echo", text="a"), "done"]),
                   tools=tools)
    assert tool_call_counts(answered) == (2, 1)
    silent = run(chatml_tokenizer, scripted_client(chatml_tokenizer, ["done"]), tools=tools)
    assert tool_call_counts(silent) == (0, 0)

    # every trajectory's calls failed, or at least TOOL_FAILURE_MIN_CALLS calls all failed: the rollout is not trained
    assert failed_tools([(2, 2), (1, 1)]).startswith("every one of the 3 tool calls of the rollout")
    assert failed_tools([(2, 2), (2, 1)]) is None  # one call answered
    assert failed_tools([(2, 2), (0, 0)]) is None  # a trajectory that called no tool is a sample like any other
    assert failed_tools([(8, 8), (0, 0)]) is not None
    assert failed_tools([(0, 0), (0, 0)]) is None
