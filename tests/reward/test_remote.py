"""The remote reward against a real HTTP server: OpenRLHF's /get_reward contract and the json one, retries that
honour Retry-After, failures that fall back and are counted, and one-line errors naming the URL."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from reinforge.reward.remote import RemoteReward, RemoteRewardError, RemoteSample, request_body


@pytest.fixture
def server() -> Iterator[Callable]:
    """``server(handle)`` starts an endpoint whose POST answers are ``handle(body, calls) -> (status, dict or raw
    bytes, headers)``; it returns the URL."""
    started = []

    def start(handle) -> str:
        calls: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                calls.append(body)
                status, answer, headers = handle(body, calls)
                data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()  # bytes: sent as they are
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                if "Content-Length" not in headers:  # a handler may announce more than it sends
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        start.calls = calls
        return f"http://127.0.0.1:{httpd.server_address[1]}/get_reward"

    yield start
    for httpd in started:
        httpd.shutdown()


SAMPLES = [RemoteSample(f"Q{index}:", f" answer {index}", ground_truth=str(index), data_source="toy",
                        extra_info={"index": index}) for index in range(5)]


def length_scores(body, calls):
    return 200, {"scores": [float(len(query)) for query in body["query"]]}, {}


def test_openrlhf_contract_in_batches_in_order(server):
    url = server(length_scores)
    client = RemoteReward(url, batch_size=2, max_concurrency=3)
    result = client.score(SAMPLES)
    assert result.scores == [float(len(f"Q{i}: answer {i}")) for i in range(5)]
    assert result.requests == 3 and result.failed == 0 and result.retries == 0
    bodies = sorted(server.calls, key=lambda body: body["prompts"][0])
    assert bodies[0] == {"query": ["Q0: answer 0", "Q1: answer 1"], "prompts": ["Q0:", "Q1:"], "labels": ["0", "1"]}


def test_rewards_key_and_the_json_protocol(server):
    url = server(lambda body, calls: (200, {"rewards": [1.0] * len(body.get("query", body.get("samples")))}, {}))
    assert RemoteReward(url).score(SAMPLES[:2]).scores == [1.0, 1.0]
    body = request_body(SAMPLES[:1], "json")
    assert body == {"samples": [{"prompt": "Q0:", "response": " answer 0", "ground_truth": "0", "data_source": "toy",
                                 "extra_info": {"index": 0}}]}


def test_busy_answers_are_retried_after_retry_after(server):
    def busy_twice(body, calls):
        if len(calls) <= 2:
            return 429, {"error": "busy"}, {"Retry-After": "0"}
        return length_scores(body, calls)

    result = RemoteReward(server(busy_twice), batch_size=8, max_retries=3, backoff_s=0.0).score(SAMPLES[:1])
    assert result.retries == 2 and result.failed == 0 and result.scores == [12.0]


def test_a_request_that_fails_for_good_falls_back_and_is_counted(server):
    def second_fails(body, calls):
        if body["prompts"][0] == "Q2:":
            return 400, {"error": "bad label"}, {}
        return length_scores(body, calls)

    result = RemoteReward(server(second_fails), batch_size=2, fallback_score=-5.0).score(SAMPLES)
    assert result.failed == 2
    assert result.scores[2:4] == [-5.0, -5.0] and result.scores[0] == 12.0
    assert result.metrics(1.0)["reward/remote/failed"] == 2.0


def test_a_batch_that_no_request_scored_stops_in_one_line(server):
    url = server(lambda body, calls: (200, {"scores": [1.0]}, {}))  # one score for two samples
    with pytest.raises(RemoteRewardError) as error:
        RemoteReward(url, batch_size=2).score(SAMPLES[:2])
    assert str(error.value) == (f"the remote reward scored none of 2 samples: {url} answered 1 scores for 2 samples; "
                                "check that the endpoint is up (reward.remote.url) and answers as "
                                "reward.remote.protocol=openrlhf says")
    down = "http://127.0.0.1:9/get_reward"  # the discard port: nothing listens
    with pytest.raises(RemoteRewardError, match=r"http://127.0.0.1:9/get_reward failed 2 times, last: .*max_retries=1"):
        RemoteReward(down, max_retries=1, backoff_s=0.0, timeout_s=2.0).score(SAMPLES[:1])


def test_bad_urls_and_non_numbers_are_named(server):
    with pytest.raises(ValueError, match="reward.remote.url has 'localhost:5000', which is not an http"):
        RemoteReward("localhost:5000")
    url = server(lambda body, calls: (200, {"scores": [{"value": 1.0}]}, {}))
    with pytest.raises(RemoteRewardError, match="answered a score that is not a number"):
        RemoteReward(url).score(SAMPLES[:1])


@pytest.mark.parametrize("score", ["0.5", ["0.5"], "high"])
def test_a_score_sent_as_a_string_stops_the_run_naming_the_server_and_the_sample(server, score):
    """"0.5" was read as 0.5 (a reward function's string score is refused: float("42") would take an extracted answer
    for a score), and a word fell back as a failed request."""
    url = server(lambda body, calls: (200, {"scores": [1.0] if body["prompts"] == ["Q0:"] else [score]}, {}))
    with pytest.raises(TypeError) as refusal:
        RemoteReward(url, batch_size=1, max_retries=3, backoff_s=0.0).score(SAMPLES[:2])
    shown = score[0] if isinstance(score, list) else score
    assert str(refusal.value) == (f"{url} answered the string {shown!r} as the score of sample 1 (prompt 'Q1:'); answer "
                                  'a JSON number for each sample (0.5, not "0.5")')
    assert isinstance(refusal.value, RemoteRewardError) and len(server.calls) == 2  # not retried


def test_requests_spread_over_several_urls(server):
    first, second = server(length_scores), server(length_scores)
    client = RemoteReward(f"{first}, {second}", batch_size=1)
    assert client.urls == [first, second]
    assert client.score(SAMPLES[:4]).requests == 4


def test_an_answer_cut_short_is_retried_like_a_dropped_connection(server):
    good = json.dumps({"scores": [1.0] * len(SAMPLES)}).encode()

    def cut_once(body, calls):  # the first answer announces more bytes than it sends, then the connection closes
        if len(calls) == 1:
            return 200, good[:5], {"Content-Length": str(len(good) + 10), "Connection": "close"}
        return 200, good, {}

    url = server(cut_once)
    result = RemoteReward(url, batch_size=len(SAMPLES), max_retries=2, backoff_s=0.0).score(SAMPLES)
    assert result.scores == [1.0] * len(SAMPLES) and result.retries == 1 and len(server.calls) == 2


def test_an_answer_that_is_not_utf8_is_named_as_not_json(server):
    url = server(lambda body, calls: (200, b"\xff\xfe{}", {}))
    with pytest.raises(RemoteRewardError, match="answered with something that is not JSON"):
        RemoteReward(url, max_retries=0, backoff_s=0.0).score(SAMPLES)


def test_retries_count_only_the_retries_a_failed_request_made(server):
    def refuse_the_first_chunk(body, calls):
        if body["query"][0].startswith("Q0"):
            return 400, {"error": "bad field"}, {}
        return length_scores(body, calls)

    url = server(refuse_the_first_chunk)
    result = RemoteReward(url, batch_size=3, max_retries=5, backoff_s=0.0).score(SAMPLES)
    assert result.failed == 3 and result.retries == 0  # a 400 is not retried


def test_a_parquet_columns_object_arrays_are_sent_as_plain_json():
    import numpy as np

    nested = RemoteSample("Q:", " A", ground_truth=np.array([np.array([1, 2]), np.array([3])], dtype=object),
                          data_source="toy", extra_info={"tests": np.array([{"n": np.int64(4)}], dtype=object)})
    body = request_body([nested], "json")
    assert json.loads(json.dumps(body))["samples"][0] == {
        "prompt": "Q:", "response": " A", "ground_truth": [[1, 2], [3]], "data_source": "toy",
        "extra_info": {"tests": [{"n": 4}]}}
    assert request_body([nested], "openrlhf")["labels"] == [[[1, 2], [3]]]


@pytest.mark.parametrize("trickled", ["status line", "body"])
def test_timeout_s_bounds_the_whole_request_against_a_server_that_trickles(trickled):
    """A socket's timeout bounds each wait for bytes: a server sending one every 0.1 s held a request for as long as
    it liked. timeout_s is the whole request's: connect, send, and the whole answer."""
    body = json.dumps({"scores": [1.0]}).encode()
    answer = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + body
    quick = answer.index(b"\r\n\r\n") + 4 if trickled == "body" else 0

    listener = socket.create_server(("127.0.0.1", 0))

    def trickle() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            try:
                connection.sendall(answer[:quick])
                for index in range(quick, len(answer)):
                    time.sleep(0.1)
                    connection.sendall(answer[index:index + 1])
            except OSError:  # the client gave up
                pass

    threading.Thread(target=trickle, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/get_reward"
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match=rf"^the remote reward scored none of 1 samples: {url} failed once, "
                                                r"last: no whole answer within timeout_s: a slow or trickling server "
                                                r"\(timeout_s=0.5, max_retries=0\); "):
        RemoteReward(url, timeout_s=0.5, max_retries=0).score(SAMPLES[:1])
    assert time.monotonic() - start < 1.5  # the whole answer would take 3 s or more
    listener.close()


@pytest.mark.parametrize("server_does", ["hold the answer", "ask to retry later"])
def test_close_ends_the_requests_under_way_at_once(server_does):
    """The trainer closes the scorer when it stops (Ctrl-C, another role's error): a request waiting for a slow
    answer, or in its backoff before a retry, ends then. Left running, the interpreter's exit waits for its thread
    (timeout_s and the retries: minutes) after the command printed its last line."""
    listener = socket.create_server(("127.0.0.1", 0))
    asked = threading.Event()

    def answer() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            if server_does == "ask to retry later":
                connection.sendall(b"HTTP/1.0 503 Busy\r\nRetry-After: 60\r\nContent-Length: 0\r\n\r\n")
            asked.set()
            connection.recv(1)  # until the client hangs up

    threading.Thread(target=answer, daemon=True).start()
    reward = RemoteReward(f"http://127.0.0.1:{listener.getsockname()[1]}/get_reward", timeout_s=60.0, max_retries=1)
    outcome: list[BaseException] = []

    def score() -> None:
        try:
            reward.score(SAMPLES[:1])
        except BaseException as error:  # noqa: BLE001 - checked below
            outcome.append(error)

    caller = threading.Thread(target=score, daemon=True)
    caller.start()
    assert asked.wait(10)
    reward.close()
    caller.join(5)
    for thread in list(reward.pool._threads):
        thread.join(5)
    listener.close()
    assert not caller.is_alive() and not any(thread.is_alive() for thread in reward.pool._threads)
    assert len(outcome) == 1 and isinstance(outcome[0], RemoteRewardError)
