"""An agent written against the official ``openai`` client, trained through the endpoint, gives tool_agent's tokens.

The tiny model is random, so it never writes a Hermes call: tool_agent reads every turn as a call to ``echo`` with the
turn's first characters (a parser registered here), and the scripted openai agent does the same with the reply it
gets, sending ``echo:`` and those characters back as a tool message. Turns stop at any lowercase letter so they are
short. The same rows, seeds and engine must then give the same trajectories, token for token.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np
import pytest
import torch

from reinforge.agent import (
    AGENT_LOOPS,
    TOOL_PARSERS,
    AgentRunner,
    AsyncEngineClient,
    FunctionTool,
    ToolCall,
    register_tool_parser,
)
from reinforge.config.schema import MultiTurnConfig
from reinforge.rollout.base import SamplingParams
from reinforge.serve import register_openai_agent

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

LETTER_IDS = tuple(3 + byte for byte in range(ord("a"), ord("z") + 1))
EOS_TEXT = "<|im_end|>"


def echo(text: str) -> str:
    """Echo the text.

    Args:
        text: The text.
    """
    return "echo:" + text


async def echo_agent(base_url: str, row: dict) -> float:
    """Calls the model, answers each reply with echo's output, until the endpoint ends the trajectory."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages = list(row["raw_prompt"])
    calls = 0
    try:
        while True:
            response = await client.chat.completions.create(model="policy", messages=messages)
            calls += 1
            reply = response.choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            messages.append({"role": "tool", "content": echo((reply.content or "")[:4]), "tool_call_id": "0"})
    except openai.BadRequestError as error:
        assert error.code == "trajectory_ended", error
    finally:
        await client.close()
    return float(calls)


@pytest.fixture(autouse=True)
def registered():
    @register_tool_parser("test_every_turn_echo")
    class EveryTurn:
        def parse(self, text):
            return [ToolCall("echo", {"text": text.removesuffix(EOS_TEXT)[:4]})]

    register_openai_agent("test_echo_agent", echo_agent)
    yield
    del TOOL_PARSERS["test_every_turn_echo"], AGENT_LOOPS["test_echo_agent"]


@pytest.fixture
def engine_and_tokenizer(tiny_model_dir):
    from reinforge.models.loading import load_causal_lm, load_tokenizer
    from reinforge.rollout.native import NativeEngine

    tokenizer = load_tokenizer(str(tiny_model_dir))
    model = load_causal_lm(str(tiny_model_dir), dtype=torch.float32, device="cpu")
    engine = NativeEngine(model, eos_token_ids=[tokenizer.eos_token_id], max_model_len=256, num_kv_blocks=128,
                          device=torch.device("cpu"))
    return engine, tokenizer


def rows_for(tokenizer, agent_name: str, num_rows: int = 3) -> list[dict]:
    rows = []
    for index in range(num_rows):
        messages = [{"role": "user", "content": f"{index}+{index}"}]
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
        rows.append({"prompt_ids": list(prompt_ids), "raw_prompt": messages, "agent_name": agent_name,
                     "extra_info": {}, "request_id": f"u{index}/0"})
    return rows


def run_rows(engine, tokenizer, agent_name: str, config: MultiTurnConfig, max_tokens: int = 160):
    runner = AgentRunner(tokenizer, config, {"echo": FunctionTool(echo)})
    rows = rows_for(tokenizer, agent_name)
    samplings = [SamplingParams(max_tokens=max_tokens, seed=11 + index, stop_token_ids=LETTER_IDS)
                 for index in range(len(rows))]
    outputs = runner.run(rows, samplings, AsyncEngineClient(engine))
    engine.sleep()  # drops the prefix cache: the second run starts from the same engine state
    return outputs


@pytest.mark.parametrize("limits", [{"max_assistant_turns": 3}, {"max_user_turns": 2}, {}])
def test_an_openai_client_agent_gives_tool_agents_trajectories_token_for_token(engine_and_tokenizer, limits):
    engine, tokenizer = engine_and_tokenizer
    config = MultiTurnConfig(format="test_every_turn_echo", **limits)
    max_tokens = 160 if limits else 60  # without turn limits the budget ends the trajectory
    expected = run_rows(engine, tokenizer, "tool_agent", config, max_tokens)
    got = run_rows(engine, tokenizer, "test_echo_agent", config, max_tokens)
    for want, have in zip(expected, got, strict=True):
        assert have.prompt_ids == want.prompt_ids
        assert have.response_ids == want.response_ids
        assert have.response_mask == want.response_mask
        assert have.num_turns == want.num_turns
        assert have.finish_reason == want.finish_reason
        torch.testing.assert_close(torch.tensor(have.response_log_probs), torch.tensor(want.response_log_probs),
                                   atol=1e-5, rtol=0)
    assert any(output.num_turns > 2 for output in got)
    assert any(0 in output.response_mask for output in got)  # tool turns are in the trajectory, not trained
    calls = [output.reward_score for output in got]
    assert all(count == (output.num_turns) // 2 for count, output in zip(calls, got, strict=True))


AGENT_PY = '''
import openai


async def agent(base_url, row):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages = list(row["raw_prompt"])
    try:
        while True:
            reply = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message
            messages += [reply.model_dump(exclude_none=True), {"role": "tool", "content": "echo:" + (reply.content or "")[:4]}]
    except openai.BadRequestError:
        pass
    finally:
        await client.close()
    return "done"
'''


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native", "hf"])
def test_reinforge_train_trains_an_openai_agent_named_in_the_config(tiny_model_dir, tmp_path, backend):
    import json

    from reinforge.cli import main

    (tmp_path / "echo_agent.py").write_text(AGENT_PY)
    rows = [{"data_source": "x", "prompt": [{"role": "user", "content": f"{i}+{i}"}], "agent_name": "echo_client",
             "reward_model": {"ground_truth": str(2 * i)}, "extra_info": {}} for i in range(4)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    scorer = tmp_path / "score.py"
    scorer.write_text("def compute_score(solution_str, ground_truth, **kwargs):\n"
                      "    return float(solution_str.count('echo:'))\n")
    run_dir = tmp_path / "run"
    args = [f"model.path={tiny_model_dir}", f"data.train_files=[{data}]", "data.train_batch_size=2",
            "data.max_prompt_length=32", "data.max_response_length=96", "rollout.n=2", f"rollout.name={backend}",
            f"rollout.stop_token_ids=[{','.join(map(str, LETTER_IDS))}]",
            f"rollout.multi_turn.openai_agents={{echo_client: '{tmp_path / 'echo_agent.py'}:agent'}}",
            "rollout.multi_turn.max_assistant_turns=3", f"reward.custom_function={scorer}:compute_score",
            "reward.num_workers=0", f"trainer.output_dir={run_dir}", "trainer.loggers=[jsonl]",
            "trainer.total_steps=1", "trainer.val_before_train=false", "trainer.device=cpu"]
    try:
        assert main(["train", *args]) == 0
    finally:
        AGENT_LOOPS.pop("echo_client", None)
    (metrics,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics["num_turns/max"] > 2 and metrics["critic/score/mean"] > 0


COMMAND_AGENT = '''
import json, os, sys, urllib.request

row = json.load(sys.stdin)
body = json.dumps({"model": "policy", "messages": row["raw_prompt"]}).encode()
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body,
                                 {"Content-Type": "application/json"})
reply = json.loads(urllib.request.urlopen(request).read())["choices"][0]["message"]["content"]
if row["extra_info"].get("fail"):
    print("the agent broke", file=sys.stderr)
    sys.exit(3)
print("thinking...")
print(0.75 if reply == "fine" else 0.0)
'''


class FixedReply:
    """A token client answering every prompt with "fine" and the end-of-turn token."""

    def __init__(self, tokenizer):
        self.ids = list(tokenizer("fine", add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]

    async def generate(self, prompt_ids, sampling, request_id):
        from reinforge.rollout.base import Completion

        return Completion(self.ids, [-0.5] * len(self.ids), "stop")


def test_an_agent_command_gets_the_url_and_the_row_and_its_last_line_is_the_reward(tmp_path):
    from reinforge.agent import AgentContext, get_agent_loop
    from reinforge.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    (tmp_path / "agent.py").write_text(COMMAND_AGENT)
    register_openai_agent("test_command_agent", [sys.executable, str(tmp_path / "agent.py")])
    try:
        context = AgentContext(tokenizer, FixedReply(tokenizer), MultiTurnConfig())
        messages = [{"role": "user", "content": "hi"}]
        row = {"prompt_ids": [1], "raw_prompt": messages, "extra_info": {}, "request_id": "r/0"}
        output = asyncio.run(get_agent_loop("test_command_agent")(context).run(SamplingParams(max_tokens=20), **row))
        assert output.reward_score == 0.75
        assert output.prompt_ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                  return_dict=False)
        assert output.response_ids == FixedReply(tokenizer).ids and output.response_mask == [1] * 5
        with pytest.raises(RuntimeError, match=r"agent 'test_command_agent' raised RuntimeError: agent command "
                                               r".* exited with 3: the agent broke"):
            asyncio.run(get_agent_loop("test_command_agent")(context).run(
                SamplingParams(max_tokens=20), **(row | {"extra_info": {"fail": True}})))
    finally:
        del AGENT_LOOPS["test_command_agent"]


def test_configured_agents_are_registered_once_and_mistakes_are_refused_in_one_line(tmp_path):
    from reinforge.serve.agents import register_configured_agents

    (tmp_path / "agents.py").write_text("async def agent(base_url, row):\n    return 1.0\n\ndef plain(base_url, row):\n"
                                        "    return 1.0\n")
    config = MultiTurnConfig(openai_agents={"test_cfg_agent": f"{tmp_path / 'agents.py'}:agent",
                                            "test_cfg_command": f"cmd:{sys.executable} my_agent.py --fast"})
    try:
        register_configured_agents(config)
        register_configured_agents(config)  # the preflight, then a worker in the same process
        assert AGENT_LOOPS["test_cfg_command"].agent == (sys.executable, "my_agent.py", "--fast")
        (tmp_path / "agent.sh").write_text("echo 1\n")  # no executable bit
        for command in ("pyhton3 my_agent.py", str(tmp_path / "agent.sh")):  # found only at the first rollout
            with pytest.raises(ValueError, match=r"openai_agents.test_cfg_typo=.*: '.*' is neither a command on PATH "
                                                 r"nor an executable file; fix the command's name, or give its path"):
                register_configured_agents(MultiTurnConfig(openai_agents={"test_cfg_typo": f"cmd:{command}"}))
        with pytest.raises(ValueError, match=r"openai_agents.tool_agent: agent_name 'tool_agent' is already a "
                                             r"registered agent loop; pick another name"):
            register_configured_agents(MultiTurnConfig(openai_agents={"tool_agent": "cmd:true"}))
        with pytest.raises(ValueError, match=r"openai_agents.test_cfg_plain: .*:plain' is not an async function; "
                                             r"define it as `async def agent\(base_url, row\)`"):
            register_configured_agents(MultiTurnConfig(openai_agents={"test_cfg_plain": f"{tmp_path / 'agents.py'}:plain"}))
    finally:
        AGENT_LOOPS.pop("test_cfg_agent", None)
        AGENT_LOOPS.pop("test_cfg_command", None)


@pytest.mark.parametrize("cancelled_while", ["setting_up", "listening"])
def test_an_endpoint_whose_trajectories_are_all_cancelled_while_it_starts_is_closed(monkeypatch, cancelled_while):
    """Every trajectory cancelled while the shared endpoint starts: the start stops there and nothing stays listening
    (before, it went on and its socket stayed open, as no trajectory was left to close it)."""
    from types import SimpleNamespace

    from reinforge.models.tiny import build_char_tokenizer
    from reinforge.serve.agents import _SharedEndpoint
    from reinforge.serve.app import OpenAIEndpoint

    endpoints, starts = [], []
    start = OpenAIEndpoint.start
    gate = asyncio.Event()

    async def gated_start(self):
        endpoints.append(self)
        starts.append(asyncio.current_task())
        if cancelled_while == "listening":
            await start(self)
        await gate.wait()
        return await start(self) if cancelled_while == "setting_up" else self.base_url

    monkeypatch.setattr(OpenAIEndpoint, "start", gated_start)
    context = SimpleNamespace(tokenizer=build_char_tokenizer(), chat_template=None, config=MultiTurnConfig(),
                              renderer=object(), client=None)

    async def main():
        trajectories = [asyncio.ensure_future(_SharedEndpoint.acquire(context)) for _ in range(2)]
        for _ in range(100):
            if starts and (cancelled_while == "setting_up" or endpoints[0]._runner is not None):
                break
            await asyncio.sleep(0.01)
        for trajectory in trajectories:
            trajectory.cancel()
        await asyncio.gather(*trajectories, return_exceptions=True)
        gate.set()
        await asyncio.wait(starts, timeout=10)
        assert starts[0].done()

    asyncio.run(main())
    assert not _SharedEndpoint.endpoints and len(endpoints) == 1 and endpoints[0]._runner is None


def test_a_shared_endpoint_keeps_its_context_alive_so_no_other_context_takes_its_key():
    """Endpoints are found by ``id(context)``: while one is held its entry keeps the context, so a new context can
    never be given the same id and reach another rollout's endpoint."""
    import gc
    import weakref
    from types import SimpleNamespace

    from reinforge.models.tiny import build_char_tokenizer
    from reinforge.serve.agents import _SharedEndpoint

    class Context(SimpleNamespace):
        pass

    async def main():
        context = Context(tokenizer=build_char_tokenizer(), chat_template=None, config=MultiTurnConfig(),
                          renderer=object(), client=None)
        alive = weakref.ref(context)
        await _SharedEndpoint.acquire(context)
        del context
        gc.collect()
        assert alive() is not None and id(alive()) in _SharedEndpoint.endpoints
        await _SharedEndpoint.release(alive())
        gc.collect()
        assert alive() is None and not _SharedEndpoint.endpoints

    asyncio.run(main())


def test_an_agent_command_past_its_timeout_is_killed_with_the_processes_it_started(tmp_path):
    """Only the command itself was killed: ``sh run.sh`` (or ``uv run agent.py``) left the agent running, and the
    timeout waited for it to end on its own, as it held the command's output open."""
    import os
    import time

    from reinforge.serve.agents import run_agent_command

    pid_file = tmp_path / "pid"

    async def run() -> None:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await run_agent_command(["sh", "-c", f"sleep 30 & echo $! > {pid_file}; wait"], "http://x", {})
        assert time.monotonic() - started < 5
        status = f"/proc/{int(pid_file.read_text())}/status"
        deadline = time.monotonic() + 2
        while os.path.exists(status) and "\nState:\tZ" not in open(status).read():  # killed: gone, or unreaped
            assert time.monotonic() < deadline, "the agent's own process outlived its command"
            await asyncio.sleep(0.02)

    asyncio.run(run())


def test_an_agent_command_that_exits_is_not_waited_for_past_the_processes_it_left_running(tmp_path):
    """A background process started by the command kept its stdout open, and the rollout waited for it to end."""
    import os
    import time

    from reinforge.serve.agents import run_agent_command

    pid_file = tmp_path / "pid"
    row = {"text": "x" * 300_000}  # more than a pipe holds: the command exits without reading it

    async def run() -> float:
        return await run_agent_command(["sh", "-c", f"sleep 30 & echo $! > {pid_file}; echo 0.75"], "http://x", row)

    started = time.monotonic()
    assert asyncio.run(run()) == 0.75
    assert time.monotonic() - started < 10
    status = f"/proc/{int(pid_file.read_text())}/status"
    assert not os.path.exists(status) or "\nState:\tZ" in open(status).read()  # killed with the command's group


@pytest.mark.parametrize(("returned", "expected"), [
    (np.float32(0.5), 0.5), (np.int64(1), 1.0), (float("nan"), "returned the reward nan"),
    (float("-inf"), "returned the reward -inf")])
def test_an_agents_reward_is_any_real_number_and_a_non_finite_one_stops_the_rollout(returned, expected):
    """numpy's float32 and int64 were kept as a final answer (the reward manager scored the text instead); NaN and inf
    became the trajectory's reward and the group's advantages NaN."""
    from reinforge.agent import AgentContext, get_agent_loop
    from reinforge.models.tiny import build_char_tokenizer

    async def agent(base_url, row):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        await client.chat.completions.create(model="policy", messages=row["raw_prompt"])
        await client.close()
        return returned

    tokenizer = build_char_tokenizer()
    register_openai_agent("test_reward_agent", agent)
    try:
        context = AgentContext(tokenizer, FixedReply(tokenizer), MultiTurnConfig())
        row = {"prompt_ids": [1], "raw_prompt": [{"role": "user", "content": "hi"}], "extra_info": {},
               "request_id": "r/0"}
        run = get_agent_loop("test_reward_agent")(context).run(SamplingParams(max_tokens=20), **row)
        if isinstance(expected, str):
            with pytest.raises(RuntimeError, match=rf"agent 'test_reward_agent' {expected}, .* return a finite number"):
                asyncio.run(run)
        else:
            output = asyncio.run(run)
            assert output.reward_score == expected and "final_answer" not in output.extra
    finally:
        del AGENT_LOOPS["test_reward_agent"]


def test_an_agent_that_makes_no_call_is_named_and_one_past_its_timeout_says_so():
    from reinforge.agent import AgentContext, get_agent_loop
    from reinforge.models.tiny import build_char_tokenizer

    async def idle(base_url, row):
        await asyncio.sleep(float(row["extra_info"]["sleep"]))
        return 1.0

    tokenizer = build_char_tokenizer()
    register_openai_agent("test_idle_agent", idle, timeout_s=0.2)
    try:
        context = AgentContext(tokenizer, FixedReply(tokenizer), MultiTurnConfig())
        row = {"prompt_ids": [1], "raw_prompt": [{"role": "user", "content": "hi"}], "request_id": "r/0"}
        loop = get_agent_loop("test_idle_agent")
        with pytest.raises(RuntimeError, match=r"agent 'test_idle_agent' made no chat call through its base_url"):
            asyncio.run(loop(context).run(SamplingParams(max_tokens=20), **row, extra_info={"sleep": 0}))
        with pytest.raises(RuntimeError, match=r"agent 'test_idle_agent' made no chat call in its 0.2 s "
                                               r"\(rollout.multi_turn.openai_agent_timeout_s\)"):
            asyncio.run(loop(context).run(SamplingParams(max_tokens=20), **row, extra_info={"sleep": 5}))
    finally:
        del AGENT_LOOPS["test_idle_agent"]


def test_an_agent_that_blocks_the_event_loop_is_named_while_it_holds_it_and_in_its_error(monkeypatch, caplog):
    """A sync OpenAI client in an async agent waits on the endpoint its own blocked loop would answer: the rollout
    hung for the client's own timeout (600 s, three tries) past openai_agent_timeout_s, and its error read only
    'Request timed out'."""
    import time

    from reinforge.agent import AgentContext, get_agent_loop
    from reinforge.models.tiny import build_char_tokenizer
    from reinforge.serve import agents

    async def blocking(base_url, row):
        time.sleep(0.6)  # as openai.OpenAI(...).chat.completions.create would, waiting for this loop
        raise TimeoutError("Request timed out.")

    monkeypatch.setattr(agents, "BLOCKED_LOOP_S", 0.2)
    tokenizer = build_char_tokenizer()
    register_openai_agent("test_blocking_agent", blocking)
    try:
        context = AgentContext(tokenizer, FixedReply(tokenizer), MultiTurnConfig())
        row = {"prompt_ids": [1], "raw_prompt": [{"role": "user", "content": "hi"}], "request_id": "r/0"}
        with pytest.raises(RuntimeError, match=r"agent 'test_blocking_agent' raised TimeoutError: Request timed "
                                               r"out. after holding the event loop for \d+ s \(.*openai.AsyncOpenAI"):
            asyncio.run(get_agent_loop("test_blocking_agent")(context).run(SamplingParams(max_tokens=20), **row))
    finally:
        del AGENT_LOOPS["test_blocking_agent"]
    assert any("agent 'test_blocking_agent' has held the event loop for" in record.getMessage()
               for record in caplog.records)
    assert not agents.LoopWatch.watches


def test_a_trajectory_endpoint_holds_the_connections_of_hundreds_of_agents_while_its_loop_is_busy():
    """aiohttp listens with a backlog of 128: past it, while the event loop is busy (hundreds of agents making their
    clients), the system dropped new connections, and agents failed with ReadError or ConnectTimeout, which stopped
    the rollout."""
    import select
    import socket
    import time
    from pathlib import Path

    from reinforge.serve.app import OpenAIEndpoint

    somaxconn = Path("/proc/sys/net/core/somaxconn")
    if not somaxconn.exists() or int(somaxconn.read_text()) < 300:
        pytest.skip("the system caps a listening socket's backlog below 300 connections")

    async def connect_while_busy() -> int:
        endpoint = OpenAIEndpoint(None, max_concurrency=1 << 20)  # a rollout's trajectory endpoint
        port = int((await endpoint.start()).rsplit(":", 1)[1])
        sockets = []
        try:
            for _ in range(300):  # the loop accepts none of them meanwhile
                connection = socket.socket()
                connection.setblocking(False)
                connection.connect_ex(("127.0.0.1", port))
                sockets.append(connection)
            pending, deadline = set(sockets), time.monotonic() + 1.0
            while pending and time.monotonic() < deadline:
                pending -= set(select.select([], list(pending), [], 0.05)[1])
            return len(sockets) - len(pending)
        finally:
            for connection in sockets:
                connection.close()
            await endpoint.close()

    assert asyncio.run(connect_while_busy()) == 300


def test_many_agents_steps_in_one_round_of_the_loop_are_not_one_agent_holding_it(monkeypatch, caplog):
    import time

    from reinforge.agent import AgentContext, AgentRunner
    from reinforge.models.tiny import build_char_tokenizer
    from reinforge.serve import agents

    async def quick(base_url, row):
        time.sleep(0.05)  # as making an AsyncOpenAI client takes
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        await client.chat.completions.create(model="policy", messages=row["raw_prompt"])
        await client.close()
        return 1.0

    monkeypatch.setattr(agents, "BLOCKED_LOOP_S", 0.25)
    tokenizer = build_char_tokenizer()
    register_openai_agent("test_quick_agent", quick)
    try:
        rows = [{"prompt_ids": [1], "raw_prompt": [{"role": "user", "content": "hi"}], "request_id": f"r{index}/0",
                 "agent_name": "test_quick_agent"} for index in range(10)]
        runner = AgentRunner(tokenizer, MultiTurnConfig())
        outputs = runner.run(rows, [SamplingParams(max_tokens=20)] * 10, AgentContext(tokenizer, FixedReply(
            tokenizer), MultiTurnConfig()).client)
    finally:
        del AGENT_LOOPS["test_quick_agent"]
    assert [output.reward_score for output in outputs] == [1.0] * 10
    assert not any("held the event loop" in record.getMessage() for record in caplog.records)


def test_a_row_with_images_is_refused_by_an_openai_agent_in_one_line():
    """verl's rows keep their images out of the prompt's text ('<image>How many?'): the agent sent that text, and its
    answers were trained as answers to an image the model never saw."""
    from reinforge.agent import AgentContext, get_agent_loop
    from reinforge.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    register_openai_agent("test_image_row_agent", echo_agent)
    try:
        context = AgentContext(tokenizer, FixedReply(tokenizer), MultiTurnConfig())
        row = {"prompt_ids": [1], "raw_prompt": [{"role": "user", "content": "<image>How many?"}], "request_id": "u7/0",
               "extra_info": {}, "multi_modal_inputs": {"pixel_values": torch.zeros(4, 8),
                                                        "image_grid_thw": torch.tensor([[1, 2, 2]])}}
        with pytest.raises(ValueError, match=r"row 'u7' \(uid\) has images, but agent 'test_image_row_agent' talks to "
                                             r"the model through an endpoint that passes it text alone"):
            asyncio.run(get_agent_loop("test_image_row_agent")(context).run(SamplingParams(max_tokens=20), **row))
        output = asyncio.run(get_agent_loop("test_image_row_agent")(context).run(
            SamplingParams(max_tokens=20), **(row | {"multi_modal_inputs": {}})))  # a text row of the same batch
        assert output.response_ids
        # preflight refuses such a row from the data, before any model loads
        from reinforge.agent.checks import check_images_reach_agents

        check_images_reach_agents([("train row 0", "test_image_row_agent", False), ("train row 1", None, True)])
        with pytest.raises(ValueError, match=r"^train row 2 has images, but agent 'test_image_row_agent' talks to"):
            check_images_reach_agents([("train row 1", "tool_agent", True), ("train row 2", "test_image_row_agent",
                                                                            True)])
    finally:
        del AGENT_LOOPS["test_image_row_agent"]


def test_a_rewritten_history_that_outgrows_the_engines_context_ends_the_trajectory():
    """A call that rewrites its history is rendered whole: once that outgrew the engine's max_model_len the engine
    refused it, the call was a 500 and the rollout stopped. It now ends the trajectory ('length'), its last segment
    trained; a first prompt too long for the engine is named as such."""
    from types import SimpleNamespace

    from reinforge.agent import AgentContext, get_agent_loop
    from reinforge.models.tiny import build_char_tokenizer

    class EngineLimit(FixedReply):
        engine = SimpleNamespace(max_model_len=90)

        async def generate(self, prompt_ids, sampling, request_id, **images):
            if len(prompt_ids) >= self.engine.max_model_len:  # as the native engine refuses it
                raise ValueError(f"request {request_id!r} has a prompt of {len(prompt_ids)} tokens")
            return await super().generate(prompt_ids, sampling, request_id)

    async def rewriting(base_url, row):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        messages = list(row["raw_prompt"])
        try:
            for turn in range(20):  # a system line that names the turn: each call starts a new segment
                reply = (await client.chat.completions.create(model="policy", messages=[
                    {"role": "system", "content": f"turn {turn}"}, *messages])).choices[0].message
                messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        except openai.BadRequestError as error:
            assert error.code == "trajectory_ended", error
        finally:
            await client.close()
        return 1.0

    tokenizer = build_char_tokenizer()
    register_openai_agent("test_rewriting_agent", rewriting)
    try:
        context = AgentContext(tokenizer, EngineLimit(tokenizer), MultiTurnConfig())
        row = {"prompt_ids": [1], "raw_prompt": [{"role": "user", "content": "hi"}], "request_id": "r/0"}
        loop = get_agent_loop("test_rewriting_agent")
        output = asyncio.run(loop(context).run(SamplingParams(max_tokens=200), **row))
        assert output.finish_reason == "length" and output.metrics["num_segments"] > 1
        assert len(output.prompt_ids) + len(output.response_ids) < 90
        long_row = row | {"raw_prompt": [{"role": "user", "content": "hi" * 60}]}
        with pytest.raises(RuntimeError, match=r"agent 'test_rewriting_agent': its first call was refused, so there "
                                               r"is no trajectory to train: its prompt of \d+ tokens fills the "
                                               r"engine's context of 90"):
            asyncio.run(loop(context).run(SamplingParams(max_tokens=200), **long_row))
    finally:
        del AGENT_LOOPS["test_rewriting_agent"]


def test_a_rollouts_endpoint_lifts_the_soft_limit_of_open_files(monkeypatch):
    """Each trajectory's connection takes two open files: under a desktop's soft limit of 1,024, about 500 agents
    failed to connect (ConnectTimeout), and the rollout stopped."""
    import resource
    from types import SimpleNamespace

    from reinforge.models.tiny import build_char_tokenizer
    from reinforge.serve.agents import _SharedEndpoint

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip("the hard limit of open files is 256 or less")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        context = SimpleNamespace(tokenizer=build_char_tokenizer(), chat_template=None, config=MultiTurnConfig(),
                                  renderer=object(), client=None)

        async def main() -> None:
            await _SharedEndpoint.acquire(context)
            await _SharedEndpoint.release(context)

        asyncio.run(main())
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
