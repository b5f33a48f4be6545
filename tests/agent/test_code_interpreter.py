"""code_interpreter through the real sandbox: output as the model reads it, errors and time limits as text."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from reinforge.agent import load_tool_config
from reinforge.agent.code_interpreter import CodeInterpreterTool, strip_code_fence
from reinforge.sandbox import SandboxSettings
from reinforge.sandbox.server import SandboxServer


@pytest.fixture(scope="module")
def sandbox_url():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install -y bubblewrap)")
    server = SandboxServer(SandboxSettings(port=0, max_concurrent=2,
                                           uid_base=62000 + (os.getpid() % 2000) * 16)).start()
    yield server.url
    server.close()


def _run(tool: CodeInterpreterTool, code: str):
    return asyncio.run(tool.execute("instance", {"code": code}))


def test_loaded_from_a_tool_config_and_runs_code(sandbox_url, tmp_path):
    (tmp_path / "tools.yaml").write_text(
        "tools:\n  - class_name: reinforge.agent.code_interpreter.CodeInterpreterTool\n"
        f"    config: {{sandbox_url: {sandbox_url}, run_timeout_s: 1}}\n")
    tool = load_tool_config(tmp_path / "tools.yaml")["code_interpreter"]
    assert tool.schema["function"]["parameters"]["required"] == ["code"]
    result = _run(tool, "```python\nprint(sum(range(101)))\n```")
    assert result.text == "5050" and result.metrics == {"timeout": 0.0, "failed": 0.0}


def test_errors_and_time_limits_read_as_text(sandbox_url):
    tool = CodeInterpreterTool({"sandbox_url": sandbox_url, "run_timeout_s": 1})
    failed = _run(tool, "print('before')\n1 / 0")
    assert failed.text.startswith("before\nTraceback") and "ZeroDivisionError" in failed.text
    assert failed.metrics["failed"] == 1.0
    slow = _run(tool, "import time\nprint('started', flush=True)\ntime.sleep(5)")
    assert slow.text.startswith("started\nTime limit exceeded: the code was stopped after 1.0 s")
    assert _run(tool, "x = 1").text == "(no output)"
    assert _run(tool, "import sys; sys.exit(3)").text == "The process exited with code 3."


def test_an_unreachable_sandbox_is_a_tool_message_not_an_exception():
    tool = CodeInterpreterTool({"sandbox_url": "http://127.0.0.1:9", "retry_budget_s": 0.5})
    result = _run(tool, "print(1)")
    assert result.text.startswith("The code was not run: the code sandbox at http://127.0.0.1:9 gave no result")
    assert result.metrics == {"tool_error": 1.0, "sandbox_error": 1.0, "service_error": 1.0}
    with pytest.raises(ValueError, match="needs config.sandbox_url"):
        CodeInterpreterTool({})


def test_code_holding_a_lone_surrogate_is_the_models_mistake_not_a_sandbox_failure():
    # the sandbox refuses such a request (400), which counted as the sandbox failing: enough in a row stop the run
    tool = CodeInterpreterTool({"sandbox_url": "http://127.0.0.1:9", "retry_budget_s": 0.5,
                                "max_failures_in_a_row": 1})
    result = _run(tool, "print('\udcff')")
    assert result.text == "The code was not run: it holds '\\udcff' at position 7, which is not a character."
    assert result.metrics == {"tool_error": 1.0}


@pytest.mark.parametrize(("config", "error"), [
    ({"run_timeout": 5}, "has unknown keys run_timeout; the keys are sandbox_url, run_timeout_s"),  # before: default 10 s
    ({"run_timeout_s": "ten"}, "run_timeout_s='ten' is not a number"),  # before: "could not convert string to float"
    ({"run_timeout_s": 0}, "run_timeout_s=0 must be above 0.0"),  # before: every call a time limit
    ({"call_timeout_s": 5}, "call_timeout_s=5 must be above run_timeout_s (10.0)"),  # before: "not run" at 5 s
    ({"retry_budget_s": -1}, "retry_budget_s=-1 must be at least 0.0"),  # no attempt: every call "not run"
    ({"max_concurrent_calls": 0}, "max_concurrent_calls=0 must be at least 1"),  # before: "max_workers must be ..."
    ({"memory_limit_mb": "1g"}, "memory_limit_mb='1g' is not an integer"),
])
def test_a_config_that_cannot_work_is_refused_naming_the_key(config, error):
    with pytest.raises(ValueError, match=re.escape(f"code_interpreter config {error}")):
        CodeInterpreterTool({"sandbox_url": "http://127.0.0.1:9", **config})
    assert CodeInterpreterTool({"sandbox_url": "http://127.0.0.1:9", "type": "native"}).run_timeout_s == 10.0


def test_the_tools_own_timeout_is_below_the_loops_and_a_config_where_it_is_not_is_refused(tmp_path):
    """The default was 350 s against the loop's 300 s: the loop's "did not answer" always came first, and the tool's
    own message (its time limit, why the code was not run) never reached the model."""
    from reinforge.agent.tool_config import load_tools
    from reinforge.config.schema import MultiTurnConfig

    loop = MultiTurnConfig().tool_timeout_s
    assert CodeInterpreterTool({"sandbox_url": "http://127.0.0.1:9"}).call_timeout_s < loop
    assert CodeInterpreterTool({"sandbox_url": "http://127.0.0.1:9", "run_timeout_s": 60}).call_timeout_s < loop
    assert CodeInterpreterTool({"sandbox_url": "http://127.0.0.1:9", "retry_budget_s": 0}).call_timeout_s == 50.0
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: reinforge.agent.code_interpreter.CodeInterpreterTool\n"
                    "    config: {sandbox_url: http://127.0.0.1:9, call_timeout_s: 350}\n")
    with pytest.raises(ValueError, match=re.escape(
            f"tool 'code_interpreter' of {path} has call_timeout_s=350, not below rollout.multi_turn.tool_timeout_s=300, "
            "so the loop would end each slow call before the tool's own timeout could tell the model why; set "
            "call_timeout_s below 300 in the tool's config")) as error:
        load_tools(MultiTurnConfig(tool_config_path=str(path)))
    assert "raise rollout.multi_turn.tool_timeout_s above 350" in str(error.value) and "\n" not in str(error.value)
    for loop_timeout in (None, 351.0):  # no loop timeout, or one above the tool's
        assert load_tools(MultiTurnConfig(tool_config_path=str(path), tool_timeout_s=loop_timeout))
    path.write_text("tools:\n  - class_name: reinforge.agent.code_interpreter.CodeInterpreterTool\n"
                    "    config: {sandbox_url: http://127.0.0.1:9}\n")
    assert load_tools(MultiTurnConfig(tool_config_path=str(path)))["code_interpreter"].call_timeout_s == 280.0


def test_the_check_before_training_passes_on_a_running_sandbox_and_names_a_dead_one(sandbox_url):
    CodeInterpreterTool({"sandbox_url": sandbox_url}).check()
    with pytest.raises(ValueError, match=r"sandbox does not work: the code sandbox at http://127.0.0.1:9 gave no "
                                         r"result .*start one with `reinforge sandbox serve`"):
        CodeInterpreterTool({"sandbox_url": "http://127.0.0.1:9"}).check()


def test_a_sandbox_that_fails_many_calls_in_a_row_stops_the_run_and_a_success_resets_the_count(sandbox_url):
    from reinforge.agent import ToolUnavailable
    from reinforge.sandbox import SandboxClient

    tool = CodeInterpreterTool({"sandbox_url": "http://127.0.0.1:9", "retry_budget_s": 0, "max_failures_in_a_row": 2})
    assert _run(tool, "print(1)").metrics["sandbox_error"] == 1.0  # the first failure is a message
    tool.client = SandboxClient(sandbox_url)  # the sandbox comes back: a call that runs resets the count
    assert _run(tool, "print(2)").text == "2"
    tool.client = SandboxClient("http://127.0.0.1:9", retry_budget_s=0)
    assert _run(tool, "print(3)").metrics["sandbox_error"] == 1.0
    with pytest.raises(ToolUnavailable, match=r"failed 2 calls in a row, .*run the same command again"):
        _run(tool, "print(4)")
    # code that fails is the model's doing, not the sandbox's: it never counts
    tool = CodeInterpreterTool({"sandbox_url": sandbox_url, "max_failures_in_a_row": 1})
    assert "ZeroDivisionError" in _run(tool, "1 / 0").text and "ZeroDivisionError" in _run(tool, "1 / 0").text


def test_calls_queued_behind_busy_ones_still_answer_by_their_own_deadline():
    listener = socket.socket()  # accepts and never answers
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    tool = CodeInterpreterTool({"sandbox_url": f"http://127.0.0.1:{listener.getsockname()[1]}",
                                "max_concurrent_calls": 1, "run_timeout_s": 0.5, "call_timeout_s": 1.0})

    async def three_at_once():
        return await asyncio.gather(*(tool.execute(f"instance-{index}", {"code": "print(1)"}) for index in range(3)))

    started = time.monotonic()
    results = asyncio.run(three_at_once())
    assert time.monotonic() - started < 1.8  # not three deadlines one after another
    assert all(result.text.startswith("The code was not run: ") for result in results)
    assert "no answer within 1.0s" in results[0].text
    listener.close()


def test_code_fences_are_stripped_only_when_they_wrap_the_code():
    assert strip_code_fence("```py\nx = 1\n```") == "x = 1"
    assert strip_code_fence("x = '```'") == "x = '```'"


# Answers recorded from a real SandboxFusion server (bytedance/SandboxFusion 469de08, isolation none).
SANDBOXFUSION_TIMEOUT = {
    "status": "Failed", "message": "", "compile_result": None, "executor_pod_name": None, "files": {},
    "run_result": {"status": "TimeLimitExceeded", "execution_time": 1.0003669261932373, "return_code": None,
                   "stdout": "start\n", "stderr": ""}}
SANDBOXFUSION_EXCEPTION = {
    "status": "Failed", "message": "", "compile_result": None, "executor_pod_name": None, "files": {},
    "run_result": {"status": "Finished", "execution_time": 0.23, "return_code": 1, "stdout": "before\n",
                   "stderr": 'Traceback (most recent call last):\n  File "/tmp/tmpu8pfk5wh/tmp8bzd3l8o.py", line 2, '
                             "in <module>\n    1/0\n    ~^~\nZeroDivisionError: division by zero\n"}}


@pytest.fixture()
def replaying_server():
    """An HTTP server that answers /run_code with recorded SandboxFusion answers, in order, and keeps the requests."""
    answers, requests = [], []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            body = json.dumps(answers.pop(0)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", answers, requests
    server.shutdown()
    server.server_close()


def test_reads_sandboxfusion_answers_and_leaves_the_memory_limit_to_it(replaying_server):
    url, answers, requests = replaying_server
    answers += [SANDBOXFUSION_TIMEOUT, SANDBOXFUSION_EXCEPTION]
    tool = CodeInterpreterTool({"sandbox_url": url + "/run_code", "run_timeout_s": 1})
    slow = _run(tool, "import time\nprint('start', flush=True)\ntime.sleep(10)")
    assert slow.text == "start\nTime limit exceeded: the code was stopped after 1.0 s."
    assert slow.metrics == {"timeout": 1.0, "failed": 1.0}
    failed = _run(tool, "print('before')\n1/0")
    assert failed.text.startswith("before\nTraceback") and failed.text.endswith("ZeroDivisionError: division by zero")
    # SandboxFusion turns a positive memory_limit_MB into the stack limit as well, so no thread could start.
    assert [request["memory_limit_MB"] for request in requests] == [-1, -1]
    assert requests[0]["run_timeout"] == 1.0 and requests[0]["language"] == "python"
