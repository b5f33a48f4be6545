"""SandboxClient and code_interpreter against a real SandboxFusion deployment (opt-in).

Set ``SANDBOX_FUSION_URL`` (e.g. ``http://127.0.0.1:8080``) to run these; without it they skip.
They check what docs/sandbox.md says was verified: success, stdout/stderr, an exception, a
timeout, stdin, files in and out, and threads under the tool's default memory limit.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from reinforge.agent.code_interpreter import CodeInterpreterTool
from reinforge.sandbox import RunCodeRequest, SandboxClient

URL = os.environ.get("SANDBOX_FUSION_URL", "")
pytestmark = pytest.mark.skipif(not URL, reason="set SANDBOX_FUSION_URL to a SandboxFusion deployment to run these")


@pytest.fixture(scope="module")
def client() -> SandboxClient:
    client = SandboxClient(URL)
    client.wait_until_healthy(10.0)
    return client


def test_success_with_stdout_and_stderr(client):
    response = client.run_code("import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)")
    assert response.status == "Success" and response.message == "" and response.compile_result is None
    run = response.run_result
    assert (run.status, run.return_code, run.stdout, run.stderr) == ("Finished", 0, "42\n", "warn\n")
    assert run.execution_time > 0 and response.files == {}
    assert SandboxClient(URL.rstrip("/") + "/run_code").run_code("print(1)").run_result.stdout == "1\n"


def test_an_exception_and_an_exit_code_are_failed(client):
    response = client.run_code("print('before')\n1 / 0")
    assert response.status == "Failed" and response.run_result.return_code == 1
    assert response.run_result.stdout == "before\n"
    assert response.run_result.stderr.startswith("Traceback") and "ZeroDivisionError" in response.run_result.stderr
    assert client.run_code("import sys; sys.exit(3)").run_result.return_code == 3


def test_a_timeout_keeps_what_was_printed(client):
    response = client.run_code("import time\nprint('start', flush=True)\ntime.sleep(10)", run_timeout=1)
    assert response.status == "Failed" and response.run_result.status == "TimeLimitExceeded"
    assert response.run_result.return_code is None and response.run_result.stdout == "start\n"
    assert 1.0 <= response.run_result.execution_time < 5.0


def test_stdin_and_files_in_and_out(client):
    assert client.run_code("print(input()[::-1])\nprint(input())", stdin="abc\nx\n").run_result.stdout == "cba\nx\n"
    response = client.run_code("import helper\nprint(open('data/x.txt').read(), helper.VALUE)",
                               files={"data/x.txt": b"hello", "helper.py": b"VALUE = 7\n"})
    assert response.status == "Success" and response.run_result.stdout == "hello 7\n"
    fetched = client.send(RunCodeRequest(code="open('out.txt', 'w').write('made')", fetch_files=["out.txt"]))
    assert fetched.files == {"out.txt": "bWFkZQ=="}


def test_a_rejected_request_is_a_sandbox_error_not_an_exception(client):
    response = client.run_code("print(1)", language="klingon")
    assert response.status == "SandboxError" and "HTTP 422" in response.message and response.run_result is None


def test_code_interpreter_reads_the_real_answers():
    tool = CodeInterpreterTool({"sandbox_url": URL, "run_timeout_s": 1})

    def run(code: str):
        return asyncio.run(tool.execute("instance", {"code": code}))

    assert run("```python\nprint(sum(range(101)))\n```").text == "5050"
    failed = run("print('before')\n1 / 0")
    assert failed.text.startswith("before\nTraceback") and failed.metrics == {"timeout": 0.0, "failed": 1.0}
    slow = run("import time\nprint('started', flush=True)\ntime.sleep(5)")
    assert slow.text.startswith("started\nTime limit exceeded") and slow.metrics["timeout"] == 1.0
    # The tool's default memory limit (-1) leaves threads usable; a positive one there would not.
    assert run("import threading\nt = threading.Thread(target=print, args=('thread',))\nt.start(); t.join()"
               ).text == "thread"
