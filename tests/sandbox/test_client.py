"""The client: retries with backoff on transient errors, a clear answer instead of a hang, both URL forms."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from reinforge.sandbox import SandboxClient


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_accepts_the_run_code_url_as_verl_configs_give_it(client):
    full = SandboxClient(client.url + "/run_code")
    assert full.run_code("print('via full url')").run_result.stdout == "via full url\n"


def test_retries_through_429_until_the_bucket_refills(start_server):
    server = start_server(rate_per_s=4.0, burst=1)
    client = SandboxClient(server.url, backoff_s=0.05, retry_budget_s=10)
    started = time.monotonic()
    outputs = [client.run_code(f"print({index})").run_result.stdout for index in range(3)]
    assert outputs == ["0\n", "1\n", "2\n"]
    assert time.monotonic() - started >= 0.4  # two refills of 0.25 s each were waited for, not failed


def test_retries_a_refused_connection_until_the_server_is_up(start_server):
    port = _free_port()
    threading.Timer(0.6, lambda: start_server(port=port)).start()
    response = SandboxClient(f"http://127.0.0.1:{port}", backoff_s=0.1).run_code("print('late server')")
    assert response.status == "Success" and response.run_result.stdout == "late server\n"


def test_gives_up_with_a_clear_message_when_nothing_listens():
    client = SandboxClient(f"http://127.0.0.1:{_free_port()}", retry_budget_s=0.2, backoff_s=0.01)
    response = client.run_code("print(1)")
    assert response.status == "SandboxError" and response.run_result is None
    assert "gave no result (ConnectionRefusedError" in response.message


def test_a_call_past_its_deadline_returns_instead_of_hanging(client):
    started = time.monotonic()
    response = client.run_code("import time; time.sleep(30)", run_timeout=30, timeout_s=1.0)
    assert time.monotonic() - started < 2.0
    assert response.status == "SandboxError" and "no answer within 1.0s" in response.message


def test_a_rejected_request_is_not_retried(client):
    started = time.monotonic()
    response = client.run_code("x", language="cobol")
    assert time.monotonic() - started < 1.0
    assert response.status == "SandboxError" and "HTTP 400" in response.message


def _fake_server(reply) -> str:
    """A server on a free port that answers each connection with ``reply(connection)``."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def accept() -> None:
        while True:
            connection, _ = listener.accept()
            threading.Thread(target=reply, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


def _trickle(connection: socket.socket) -> None:
    connection.recv(65536)
    try:  # headers at once, then one byte of the body every 0.2 s: every read is quick, the whole is not
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
        for _ in range(100):
            time.sleep(0.2)
            connection.sendall(b" ")
    except OSError:
        pass


def test_a_server_that_trickles_bytes_cannot_hold_the_caller_past_its_deadline():
    started = time.monotonic()
    response = SandboxClient(_fake_server(_trickle)).run_code("print(1)", timeout_s=1.0)
    assert time.monotonic() - started < 2.0
    assert response.status == "SandboxError" and "no answer within 1.0s" in response.message


def test_an_answer_not_in_the_run_code_shape_is_a_sandbox_error_not_an_exception():
    def reply(connection: socket.socket) -> None:
        connection.recv(65536)
        body = b'{"status": "Success", "run_result": "not an object"}'
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    response = SandboxClient(_fake_server(reply)).run_code("print(1)")
    assert response.status == "SandboxError" and "answered something unreadable" in response.message


def test_retry_after_as_a_date_is_retried_not_misread():
    calls = []

    def reply(connection: socket.socket) -> None:
        connection.recv(65536)
        calls.append(1)
        connection.sendall(b"HTTP/1.1 503 Busy\r\nRetry-After: Wed, 21 Oct 2015 07:28:00 GMT\r\n"
                           b"Content-Length: 2\r\n\r\n{}")

    response = SandboxClient(_fake_server(reply), retry_budget_s=0.3, backoff_s=0.01).run_code("print(1)")
    assert response.status == "SandboxError" and "HTTP 503" in response.message and len(calls) >= 3


def test_the_health_check_connects_directly_as_run_code_does(client, monkeypatch):
    """Before: urllib sent GET / through HTTP_PROXY, so a live sandbox read as down behind a dead proxy."""
    for name in ("HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{_free_port()}")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert client.run_code("print(1)").run_result.stdout == "1\n" and client.is_healthy()


FINISHED = b'{"status": "Success", "run_result": {"status": "Finished", "return_code": 0, "stdout": "ok\\n"}}'


def _answer_ok(connection: socket.socket) -> None:
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(FINISHED), FINISHED))


def test_refusals_are_retried_for_the_budget_in_seconds_not_a_count():
    """A loaded server refuses fast and often: ten quick 503s must not use up a call that has time left."""
    calls = []

    def reply(connection: socket.socket) -> None:
        connection.recv(65536)
        calls.append(1)
        if len(calls) <= 10:
            connection.sendall(b"HTTP/1.1 503 Busy\r\nRetry-After: 0\r\nContent-Length: 2\r\n\r\n{}")
        else:
            _answer_ok(connection)

    response = SandboxClient(_fake_server(reply), backoff_s=0.01, max_backoff_s=0.02).run_code("print(1)")
    assert response.status == "Success" and response.run_result.stdout == "ok\n", response.message
    assert len(calls) == 11


def test_retry_after_is_waited_for_and_the_budget_ends_the_call():
    started = time.monotonic()

    def reply(connection: socket.socket) -> None:
        connection.recv(65536)
        connection.sendall(b"HTTP/1.1 429 Slow down\r\nRetry-After: 1\r\nContent-Length: 2\r\n\r\n{}")

    response = SandboxClient(_fake_server(reply), backoff_s=0.01, retry_budget_s=2.5).run_code("print(1)")
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 3.0  # at least one Retry-After waited for, nothing past the budget
    assert response.status == "SandboxError" and "HTTP 429" in response.message
    assert "retry budget 2.5s" in response.message


@pytest.mark.parametrize("budget_s", [1e10, float("inf")])
def test_a_budget_of_forever_waits_instead_of_overflowing(budget_s):
    """A retry budget past what a lock's or a socket's timeout can hold means "as long as it takes"."""
    def reply(connection: socket.socket) -> None:
        connection.recv(65536)
        _answer_ok(connection)

    response = SandboxClient(_fake_server(reply), retry_budget_s=budget_s).run_code("print(1)")
    assert response.status == "Success" and response.run_result.stdout == "ok\n", response.message


def test_clients_of_one_url_share_one_limit_on_requests_in_flight():
    """Each tool of a run makes its own client: together they keep max_in_flight requests at the server, not each."""
    in_flight, most = [0], [0]
    lock = threading.Lock()

    def reply(connection: socket.socket) -> None:
        connection.recv(65536)
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.1)
        with lock:
            in_flight[0] -= 1
        _answer_ok(connection)

    url = _fake_server(reply)
    clients = [SandboxClient(url, max_in_flight=2) for _ in range(4)]
    clients.append(SandboxClient(url + "/run_code", max_in_flight=50))  # the same sandbox, the first client's limit
    results: list = []
    threads = [threading.Thread(target=lambda client=client: results.append(client.run_code("print(1)")))
               for client in clients for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert [result.status for result in results] == ["Success"] * 10
    assert most[0] == 2


@pytest.mark.slow
def test_an_overloaded_server_runs_every_program_through_the_client(start_server):
    """2 slots and 2 queue places for 10 programs at once: the server refuses most with 503 and Retry-After
    at first, and every one runs in the end."""
    server = start_server(max_concurrent=2, max_queued=2)
    outputs: dict[int, object] = {}

    def run(index: int) -> None:
        outputs[index] = SandboxClient(server.url).run_code(f"import time; time.sleep(0.2); print({index})")

    threads = [threading.Thread(target=run, args=(index,)) for index in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert {index: getattr(response.run_result, "stdout", response.message) for index, response in outputs.items()} \
        == {index: f"{index}\n" for index in range(10)}
