"""The HTTP contract (SandboxFusion's /run_code), back-pressure, and refusing to start without isolation."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import reinforge
from reinforge.cli import main
from reinforge.sandbox import SandboxClient, SandboxSettings
from reinforge.sandbox.isolation import IsolationError, UidRange
from reinforge.sandbox.protocol import MIN_MEMORY_MB
from reinforge.sandbox.server import SandboxServer, _Handler


def _post(url: str, body: bytes) -> tuple[int, dict, dict]:
    request = urllib.request.Request(url + "/run_code", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read()), dict(answer.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)


def test_health_and_ping(sandbox_server):
    with urllib.request.urlopen(sandbox_server.url + "/", timeout=5) as answer:
        health = json.loads(answer.read())
    assert answer.status == 200 and health["isolation"] == "bubblewrap" and health["slots"] == 2
    with urllib.request.urlopen(sandbox_server.url + "/v1/ping", timeout=5) as answer:
        assert json.loads(answer.read()) == "pong"


def test_run_code_answers_in_sandboxfusions_shape(sandbox_server):
    files = {"data/numbers.txt": base64.b64encode(b"3 4").decode(), "helper.py": base64.b64encode(b"K = 10").decode()}
    code = "import sys, helper\na, b = map(int, open('data/numbers.txt').read().split())\nprint(a * b + helper.K, sys.stdin.read())"
    status, body, _ = _post(sandbox_server.url, json.dumps({
        "code": code, "language": "python", "stdin": "from stdin", "files": files, "compile_timeout": 10,
        "run_timeout": 5, "memory_limit_MB": 512, "fetch_files": []}).encode())
    assert status == 200
    assert set(body) == {"status", "message", "compile_result", "run_result", "files"}
    assert body["status"] == "Success" and body["compile_result"] is None
    run = body["run_result"]
    assert set(run) == {"status", "execution_time", "return_code", "stdout", "stderr"}
    assert (run["status"], run["return_code"], run["stdout"]) == ("Finished", 0, "22 from stdin\n")


@pytest.mark.parametrize(("code", "language", "status", "run_status", "return_code"), [
    ("raise ValueError('no')", "python", "Failed", "Finished", 1),
    ("echo $((6 * 7)); exit 3", "bash", "Failed", "Finished", 3),
    ("import time; time.sleep(10)", "python", "Failed", "TimeLimitExceeded", None),
    # 128 + SIGXCPU from a program that used no CPU time is its own exit code (before: "CPU time limit exceeded")
    ("import sys; sys.exit(152)", "python", "Failed", "Finished", 152),
])
def test_failures_follow_sandboxfusions_status_rules(client, code, language, status, run_status, return_code):
    # a second for the sleeper; the others get time to start on a machine busy with other tests
    response = client.run_code(code, language, run_timeout=1 if run_status == "TimeLimitExceeded" else 20)
    assert (response.status, response.run_result.status, response.run_result.return_code) == (
        status, run_status, return_code)


def test_a_program_stopped_at_its_cpu_limit_is_a_time_limit():
    from reinforge.sandbox.runner import SIGXCPU_EXIT, _Outcome, _result

    def outcome(cpu_seconds: float | None) -> _Outcome:
        return _Outcome(status_json=bytearray(b'{"exit-code": %d}\n' % SIGXCPU_EXIT), cpu_seconds=cpu_seconds)

    settings = SandboxSettings()
    assert _result(outcome(3.2), True, settings, cpu_limit_s=3).status == "TimeLimitExceeded"
    assert _result(outcome(None), True, settings, cpu_limit_s=3).status == "TimeLimitExceeded"
    assert (_result(outcome(0.1), True, settings, cpu_limit_s=3).return_code) == SIGXCPU_EXIT


@pytest.mark.parametrize(("body", "detail"), [
    (b"not json", "not JSON"),
    (b'{"language": "python"}', "'code' is missing"),
    (b'{"code": "x", "language": "cobol"}', "language='cobol' is not supported"),
    (b'{"code": "x", "language": "python", "files": {"/etc/cron.d/x": "eA=="}}', "leaves the working folder"),
    (b'{"code": "x", "language": "python", "files": {"../x": "eA=="}}', "leaves the working folder"),
    (b'{"code": "x", "language": "python", "files": {"x": "%%%"}}', "not valid base64"),
    (b'{"code": "x", "language": "python", "run_timeout": "10"}', "run_timeout='10' is not a number"),
    (b'{"code": "x", "language": "python", "run_timeout": NaN}', "run_timeout=nan is not a finite number"),
    (b'{"code": "x", "language": "python", "memory_limit_MB": Infinity}', "memory_limit_MB=inf is not a finite"),
    (b'{"code": "x", "language": "python", "memory_limit_MB": 1e400}', "memory_limit_MB=inf is not a finite"),
    (b'{"code": "x", "language": "python", "files": {"a": "eA==", "a/b/c": "eA=="}}', "'a' is a file and also"),
    (b"[" * 100_000, "not JSON"),
    (b'{"code": "print(1)\\ud800", "language": "python"}', "'code' holds '\\ud800' at position 8"),
    (b'{"code": "x", "language": "python", "stdin": "\\udfff"}', "'stdin' holds"),
    (b'{"code": "x", "language": "python", "files": {"\\udfff": "eA=="}}', "a files key holds"),
    (b'{"code": "x", "language": "python", "files": {"' + b"a" * 256 + b'": "eA=="}}', "is too long"),  # before: 200
    (b'{"code": "x", "language": "python", "files": {"' + b"a/" * 2001 + b'a": "eA=="}}', "is too long"),
    # integers JSON allows but no float holds (before: the handler raised and the connection closed unanswered)
    (b'{"code": "x", "language": "python", "run_timeout": 1' + b"0" * 400 + b"}", "run_timeout=1000"),
    (b'{"code": "x", "language": "python", "memory_limit_MB": 1' + b"0" * 400 + b"}", "too large a number"),
    (b'{"code": "x", "language": "python", "run_timeout": 1' + b"0" * 5000 + b"}", "over 4300 digits"),
    # before: a 200 whose stderr was the loader's "libc.so.6: failed to map segment from shared object"
    (b'{"code": "x", "language": "python", "memory_limit_MB": 8}', "memory_limit_MB=8 is too little for a program "
                                                                   "to start (python3 needs about 14 MB); send at "
                                                                   "least 32, or -1 for the server's default"),
])
def test_bad_requests_are_400_with_a_reason(sandbox_server, body, detail):
    status, answer, _ = _post(sandbox_server.url, body)
    assert status == 400 and detail in answer["detail"]


def test_the_least_memory_limit_accepted_runs_python_with_its_standard_library(client):
    """MIN_MEMORY_MB is the measured minimum (about 14 MB for python3) with room to spare, under the rlimit and,
    where the server has them, the slot's cgroups."""
    code = "import json, re, collections, fractions, decimal, itertools\nprint(json.dumps([6 * 7]))"
    response = client.run_code(code, memory_limit_mb=MIN_MEMORY_MB)
    assert (response.status, response.run_result.stdout) == ("Success", "[42]\n"), response
    assert client.run_code("echo 42", "bash", memory_limit_mb=MIN_MEMORY_MB).run_result.stdout == "42\n"


def _raw(url: str, request: bytes, timeout_s: float = 10) -> bytes:
    """Send ``request`` as is on a fresh connection; everything the server answers before closing it."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as connection:
        connection.sendall(request)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize(("headers", "status"), [
    (b"Content-Length: abc\r\n", b"400"), (b"Content-Length: -5\r\n", b"400"),
    (b"Transfer-Encoding: chunked\r\n", b"411")])
def test_bad_content_length_is_answered_and_the_connection_closed(sandbox_server, headers, status):
    answer = _raw(sandbox_server.url, b"POST /run_code HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n{}")
    assert answer.startswith(b"HTTP/1.1 " + status), answer
    assert b"Content-Length" in answer.split(b"\r\n\r\n")[1] or status == b"411"


def test_a_client_that_stops_mid_body_is_dropped(monkeypatch, sandbox_server):
    assert _Handler.timeout is not None and 0 < _Handler.timeout <= 120  # else such a client holds a thread forever
    monkeypatch.setattr(_Handler, "timeout", 0.5)
    started = time.monotonic()
    answer = _raw(sandbox_server.url, b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    assert answer == b"" and time.monotonic() - started < 5
    assert SandboxClient(sandbox_server.url).run_code("print(1)").run_result.stdout == "1\n"


def test_rate_limit_answers_429_with_retry_after(start_server):
    server = start_server(rate_per_s=0.05, burst=2)  # a token in 20 s: none comes back while two programs run
    body = json.dumps({"code": "print(1)", "language": "python"}).encode()
    codes = [_post(server.url, body) for _ in range(3)]
    assert [code for code, _, _ in codes] == [200, 200, 429]
    # the next token is at most 1 / 0.05 s away: less as the two runs took time, and part of it refilled
    assert 1 <= int(codes[2][2]["Retry-After"]) <= 20 and "rate limit" in codes[2][1]["detail"]


def test_a_request_over_the_rate_limit_or_past_a_full_queue_is_refused_before_its_body_is_read(start_server):
    """Bodies were read in full (up to 16 MiB each) before the rate limit and the queue were looked at."""
    headers_only = b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"
    limited = start_server(isolation="none", rate_per_s=0.01, burst=1)
    assert limited.bucket.take() == 0.0  # the one token goes
    answer = _raw(limited.url, headers_only, timeout_s=3)  # the body never comes: only a refusal unread answers
    assert answer.startswith(b"HTTP/1.1 429") and b"Retry-After" in answer and b"rate limit" in answer, answer
    busy = start_server(isolation="none", max_concurrent=1, max_queued=1, rate_per_s=0)
    slot = busy.slots.acquire(1.0)
    waiter = threading.Thread(target=lambda: busy.slots.release(busy.slots.acquire(5.0)))
    waiter.start()
    while busy.slots.stats() != {"free_slots": 0, "queued": 1}:
        time.sleep(0.01)
    answer = _raw(busy.url, headers_only, timeout_s=3)
    busy.slots.release(slot)
    waiter.join()
    assert answer.startswith(b"HTTP/1.1 503") and b"queued" in answer, answer


def test_a_client_sending_a_large_body_before_reading_gets_the_refusal_not_a_reset(start_server):
    """The refusal answered before the body was read, then the connection closed with the body unread: the client,
    still sending, saw a broken pipe or a reset instead of the 429 and its Retry-After."""
    from reinforge.sandbox.client import _post as client_post

    server = start_server(isolation="none", rate_per_s=0.01, burst=1)
    assert server.bucket.take() == 0.0  # the one token goes
    payload = json.dumps({"code": "#" * 4_000_000, "language": "python"}).encode()
    for _ in range(3):
        status, retry_after, body = client_post(f"{server.url}/run_code", payload, 10)
        assert status == 429 and int(retry_after) >= 1 and b"rate limit" in body


def test_connections_past_the_limit_are_answered_503_at_once_and_hold_no_thread(start_server):
    """Each connection held a thread for as long as it stayed open, idle or sending its headers a byte at a time:
    thousands of them held thousands of threads."""
    from reinforge.sandbox.server import connection_limit

    server = start_server(isolation="none", max_concurrent=1, max_queued=1)
    limit = connection_limit(server.settings)
    host, port = server.url.removeprefix("http://").split(":")
    threads = threading.active_count()
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(limit + 30)]
    try:
        started = time.monotonic()
        refused = _raw(server.url, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", timeout_s=5)
        assert refused.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in refused, refused
        assert time.monotonic() - started < 2
        assert threading.active_count() - threads <= limit + 2
    finally:
        for connection in idle:
            connection.close()
    deadline = time.monotonic() + 10  # the idle connections' threads see them closed, and let their places go
    status = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    while not (answer := _raw(server.url, status)).startswith(b"HTTP/1.1 200") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert answer.startswith(b"HTTP/1.1 200"), answer


def test_expect_100_continue_is_answered_by_the_refusal_or_once_the_request_is_admitted(start_server):
    """"100 Continue" went out before the rate limit was looked at, so the client sent its body to be refused."""
    server = start_server(isolation="none", rate_per_s=0.01, burst=1)
    body = json.dumps({"code": "print(6 * 7)", "language": "python"}).encode()
    head = (b"POST /run_code HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as connection:
        connection.sendall(head)
        assert connection.recv(4096).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")  # the one token: go on
        connection.sendall(body)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") and b'"stdout": "42\\n"' in answer, answer
    answer = _raw(server.url, head, timeout_s=3)  # no token left: the refusal, and no body is waited for
    assert answer.startswith(b"HTTP/1.1 429"), answer


def test_a_body_trickled_in_past_its_deadline_is_dropped(monkeypatch, start_server):
    """Each byte within the idle timeout kept a thread reading one body for ever."""
    import reinforge.sandbox.server as server_module

    monkeypatch.setattr(server_module, "BODY_DEADLINE_S", 0.5, raising=False)
    server = start_server(isolation="none", rate_per_s=0)
    host, port = server.url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=5) as connection:
        connection.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        with pytest.raises(OSError):  # the server closes the connection: a write fails, or the read ends
            while time.monotonic() - started < 4:
                connection.sendall(b" ")
                time.sleep(0.1)
                connection.setblocking(False)
                try:
                    if connection.recv(1) == b"":
                        raise ConnectionResetError("closed")
                except BlockingIOError:
                    pass
                finally:
                    connection.setblocking(True)
    assert time.monotonic() - started < 3


def test_full_queue_answers_503_at_once(start_server):
    server = start_server(max_concurrent=1, max_queued=1)
    body = json.dumps({"code": "import time; time.sleep(1.5)", "language": "python"}).encode()
    answers: list[int] = []
    threads = [threading.Thread(target=lambda: answers.append(_post(server.url, body)[0])) for _ in range(2)]
    for thread in threads:
        thread.start()
    # one runs, one waits in the queue: a third finds the queue full
    while server.slots.stats() != {"free_slots": 0, "queued": 1}:
        threading.Event().wait(0.01)
    status, answer, headers = _post(server.url, body)
    for thread in threads:
        thread.join()
    assert status == 503 and "queued" in answer["detail"] and headers["Retry-After"] == "1"
    assert answers == [200, 200]


def test_two_servers_given_the_same_user_ids_do_not_kill_each_others_programs(start_server):
    if os.geteuid() != 0:
        pytest.skip("slots run as user ids of their own only when the server is root")
    first, second = start_server(), start_server()  # the same uid_base
    assert second.settings.uid_base >= first.settings.uid_base + first.settings.num_slots
    answers = {}
    running = threading.Thread(target=lambda: answers.update(long=SandboxClient(second.url).run_code(
        "import time\nprint('started', flush=True)\ntime.sleep(2)\nprint('done')")))
    running.start()
    while second.slots.stats()["free_slots"] == second.settings.num_slots:
        time.sleep(0.01)
    time.sleep(0.5)
    assert SandboxClient(first.url).run_code("print(1)").run_result.stdout == "1\n"  # then cleans its slot's ids
    running.join()
    assert answers["long"].run_result.stdout == "started\ndone\n", answers["long"]


def test_user_ids_of_this_host_are_never_a_slots():
    """A slot's clean-up kills every process of its id: --uid-base 0 (before: accepted) killed every root process.

    Checked on the settings and the id range, never by starting such a server: a regression would kill this machine.
    """
    with pytest.raises(ValueError, match="uid_base=0 is not a user id for sandboxed programs"):
        SandboxSettings(uid_base=0)
    root_range = UidRange(0, 2)  # root's id, and uid 1 of the passwd database, are passed over
    root_range.release()
    assert root_range.base >= 2
    if os.geteuid() != 0:
        pytest.skip("only root can start a process as another user id")
    base = 62000 + (os.getpid() % 2000) * 16 + 8
    squatter = subprocess.Popen(["sleep", "30"], user=base + 1)  # a process of this host with an id in the range
    held = UidRange(base, 2)
    try:
        assert held.base >= base + 2
    finally:
        held.release()
        squatter.kill()
        squatter.wait()


def test_a_taken_or_impossible_port_is_one_line_naming_it(sandbox_server, capsys):
    port = sandbox_server.url.rsplit(":", 1)[1]
    assert main(["sandbox", "serve", "--port", port]) == 2
    assert f"cannot listen on 127.0.0.1:{port} (Address already in use); pass another --port" in capsys.readouterr().err
    with pytest.raises(ValueError, match="port=99999 is not a TCP port"):
        SandboxSettings(port=99999)


@pytest.mark.parametrize(("setting", "error"), [
    ({"max_run_timeout_s": 0}, "max_run_timeout_s=0 must be above 0 seconds"),  # before: every program timed out
    ({"queue_timeout_s": -1}, "queue_timeout_s=-1 must be above 0 seconds"),  # before: every queued request a 503
    ({"max_request_bytes": 0}, "max_request_bytes=0 must be at least 1"),  # before: every request a 413
    # before: every program failed at start-up with the dynamic loader's error
    ({"default_memory_mb": 10}, "default_memory_mb=10 is too little for a program to start (python3 needs about "
                                "14 MB); set it to at least 32"),
    ({"max_memory_mb": 0}, "max_memory_mb=0 is too little for a program to start"),
])
def test_settings_under_which_nothing_can_run_are_refused(setting, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        SandboxSettings(**setting)


def test_refuses_to_start_without_bwrap(monkeypatch, capsys, caplog):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(IsolationError, match="apt-get install -y bubblewrap.*--unsafe-no-isolation"):
        SandboxServer(SandboxSettings(port=0))
    assert main(["sandbox", "serve", "--port", "0"]) == 2
    assert "bubblewrap (bwrap) is not installed" in capsys.readouterr().err
    assert "cgroups" not in caplog.text  # the one reason given is the missing bwrap


def test_an_interpreter_outside_the_sandboxs_folders_names_the_flag_that_shows_it(start_server, tmp_path, capsys):
    """A conda or venv python is not inside the sandbox (only /usr and --read-only-path folders are): the refusal
    said "not found" and pointed at user namespaces."""
    python = tmp_path / "env" / "bin" / "python3"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    with pytest.raises(IsolationError, match=re.escape(f"--read-only-path {tmp_path / 'env'}")):
        start_server(python=str(python))
    assert main(["sandbox", "serve", "--port", "0", "--python", str(python)]) == 2
    assert "user namespaces" not in capsys.readouterr().err


def test_unsafe_mode_runs_code_without_isolation(monkeypatch, start_server):
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap: the flag is what lets it start
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:  # readable by the slot's user id
        Path(folder).chmod(0o755)
        (Path(folder) / "visible.txt").write_text("host file")
        server = start_server(isolation="none")
        status, body, _ = _post(server.url, json.dumps(
            {"code": f"print(open({folder + '/visible.txt'!r}).read())", "language": "python"}).encode())
    assert status == 200 and body["run_result"]["stdout"] == "host file\n"
    # a file named as the program is a file beside it, not the program (before: it replaced the code)
    response = SandboxClient(server.url).run_code("print(open('main.py').read())", files={"main.py": b"print('file')"})
    assert response.run_result.stdout == "print('file')\n", response


@pytest.mark.parametrize(("code", "return_code"), [
    ("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\nprint('ran on')", 128 + 15),
    ("import signal, time\nsignal.alarm(1)\ntime.sleep(5)\nprint('ran on')", 128 + 14),
])
def test_a_signal_the_program_sends_itself_ends_it_as_on_any_machine(client, code, return_code):
    started = time.monotonic()
    response = client.run_code(code, run_timeout=5)
    assert (response.status, response.run_result.status, response.run_result.return_code) == (
        "Failed", "Finished", return_code), response
    assert "ran on" not in response.run_result.stdout and time.monotonic() - started < 3


def test_blas_libraries_start_one_thread_not_one_per_host_cpu(client):
    """Threads count against the 64-process limit: OpenBLAS's thread per CPU would fail numpy's import on a big host."""
    code = "import os\nprint([os.environ.get(name) for name in ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS')])"
    assert client.run_code(code).run_result.stdout == "['1', '1']\n"


def test_a_thread_pool_starts_under_the_default_memory_limit(client):
    """glibc reserves a 64 MiB malloc arena per thread, which counts against the address-space limit: under the
    default 1 GiB a 16-thread pool failed ("can't start new thread") after 14 threads."""
    code = ("from concurrent.futures import ThreadPoolExecutor\nimport threading\nbarrier = threading.Barrier(32)\n"
            "with ThreadPoolExecutor(32) as pool:\n    print(sum(pool.map(lambda i: barrier.wait() * 0 + i, range(32))))")
    response = client.run_code(code)
    assert response.run_result.stdout == "496\n", response


def test_what_a_python_program_printed_before_its_timeout_is_kept_without_a_flush(client):
    """Python buffers stdout written to a pipe, so a program killed at its timeout lost what it had printed (the
    model saw no output at all); PYTHONUNBUFFERED=1 writes each print through."""
    code = "import sys, time\nprint('step 1')\nsys.stdout.write('step 2\\n')\nprint('warn', file=sys.stderr)\ntime.sleep(30)"
    response = client.run_code(code, run_timeout=1)
    assert response.run_result.status == "TimeLimitExceeded", response
    assert (response.run_result.stdout, response.run_result.stderr) == ("step 1\nstep 2\n", "warn\n")
    bash = client.run_code("python3 -c \"print('from bash')\nimport time; time.sleep(30)\"", "bash", run_timeout=1)
    assert bash.run_result.stdout == "from bash\n"


def test_a_program_that_closes_its_output_still_meets_its_deadline(client):
    code = "import os, time\nprint('before', flush=True)\nos.close(1)\nos.close(2)\ntime.sleep(30)\n"
    response = client.run_code(code, run_timeout=1)
    assert response.run_result.status == "TimeLimitExceeded" and response.run_result.stdout == "before\n"
    assert response.run_result.execution_time < 3


def test_the_serve_command_serves(tmp_path):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(reinforge.__file__).resolve().parents[1])}
    server = subprocess.Popen([sys.executable, "-m", "reinforge", "sandbox", "serve", "--port", str(port),
                               "--uid-base", str(62000 + (os.getpid() % 2000) * 16)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        client = SandboxClient(f"http://127.0.0.1:{port}")
        client.wait_until_healthy(timeout_s=60)
        assert client.run_code("print('served')").run_result.stdout == "served\n"
    finally:
        server.terminate()
        server.wait(timeout=10)
    left = [str(group) for group in Path("/sys/fs/cgroup").glob(f"**/reinforge-sandbox-{server.pid}-*")]
    assert left == [], f"a terminated server left its cgroups: {left}"
