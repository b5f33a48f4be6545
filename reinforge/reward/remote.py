"""A remote reward: the samples POSTed to a user's HTTP endpoint, which answers with their scores.

Two contracts (``reward.remote.protocol``):
- ``openrlhf``, OpenRLHF's ``/get_reward``: body ``{"query": [...], "prompts": [...], "labels": [...]}``
  (``query`` is the prompt and the response decoded together, special tokens kept; ``labels`` the rows'
  ground truths), answer ``{"scores": [...]}`` or ``{"rewards": [...]}`` (``scores`` preferred), one
  number per sample.
- ``json``: body ``{"samples": [{"prompt", "response", "ground_truth", "data_source", "extra_info"}, ...]}``,
  answer ``{"scores": [...]}``.

The batch goes out in requests of ``batch_size`` samples, spread over the URLs (a comma-separated
``url``) in turn, at most ``max_concurrency`` in flight. A request gets ``timeout_s`` in all, to connect, send
and read the whole answer (``RequestDeadline``: a server that trickles its answer a byte at a time is cut off
there too); a connection error, a timeout or a 429/5xx answer is retried up to ``max_retries`` times with
exponential backoff (a ``Retry-After`` header is honoured). A request that still fails gives its samples
``fallback_score``, counted in ``reward/remote/failed``; a batch whose every request failed stops the run with
one line naming the URL and the last error, since nothing could be learned from it. A score sent as a string
(``"0.5"``) stops the run at once, as a reward function's string score does: it is a server's answer of the
wrong kind, not a passing failure. ``close`` ends the requests under way at once (their connections shut, their
backoff cut short): the process can then exit without waiting for them.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

PROTOCOLS = ("openrlhf", "json")
"""The values of reward.remote.protocol."""

RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})
MAX_BACKOFF_S = 30.0


def authorization_headers(api_key_env: str | None) -> dict[str, str]:
    """``Authorization: Bearer`` with the value of the environment variable ``api_key_env`` (reward.remote.api_key_env);
    none without one. A variable that is unset or empty is refused in one line (before any model loads: preflight)."""
    if api_key_env is None:
        return {}
    key = os.environ.get(api_key_env, "").strip()
    if not key:
        raise ValueError(f"reward.remote.api_key_env={api_key_env} but the environment variable {api_key_env} is "
                         f"{'empty' if api_key_env in os.environ else 'not set'}; export {api_key_env}=<the endpoint's "
                         "key> before the run, or remove reward.remote.api_key_env")
    return {"Authorization": f"Bearer {key}"}


class RemoteRewardError(RuntimeError):
    """A request to the reward endpoint failed for good (after its retries)."""

    retries: int = 0
    """The retries the request used before failing (metrics)."""


class RemoteScoreTypeError(RemoteRewardError, TypeError):
    """The endpoint answered a score of the wrong kind (a string): the run stops, no sample falls back."""


@dataclass
class RemoteSample:
    prompt: str
    response: str
    ground_truth: Any = None
    data_source: str | None = None
    extra_info: dict = field(default_factory=dict)


def split_urls(url: str) -> list[str]:
    urls = [part.strip() for part in url.split(",") if part.strip()]
    for item in urls:
        if not item.startswith(("http://", "https://")):
            raise ValueError(f"reward.remote.url has {item!r}, which is not an http:// or https:// URL")
    return urls


def _jsonable(value: Any) -> Any:
    """Ground truths and extras as JSON can carry them (numpy values and arrays as plain numbers and lists, the
    arrays and numbers inside a parquet column's object arrays too)."""
    if hasattr(value, "tolist"):
        converted = value.tolist()
        return converted if converted is value else _jsonable(converted)
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def request_body(samples: list[RemoteSample], protocol: str) -> dict[str, Any]:
    if protocol == "openrlhf":
        return {"query": [sample.prompt + sample.response for sample in samples],
                "prompts": [sample.prompt for sample in samples],
                "labels": [_jsonable(sample.ground_truth) for sample in samples]}
    if protocol == "json":
        return {"samples": [{"prompt": sample.prompt, "response": sample.response,
                             "ground_truth": _jsonable(sample.ground_truth), "data_source": sample.data_source,
                             "extra_info": _jsonable(sample.extra_info)} for sample in samples]}
    raise ValueError(f"reward.remote.protocol={protocol!r} is not one of {', '.join(PROTOCOLS)}")


def scores_of(reply: Any, samples: list[RemoteSample], url: str, first: int = 0) -> list[float]:
    """The scores in an endpoint's answer for ``samples`` (the batch's from index ``first`` on); RemoteRewardError
    naming the URL where the answer is not one, RemoteScoreTypeError where a score is a string."""
    if not isinstance(reply, dict):
        raise RemoteRewardError(f"{url} answered {type(reply).__name__}, not a JSON object with 'scores'")
    values = reply.get("scores", reply.get("rewards"))
    if not isinstance(values, list):
        raise RemoteRewardError(f"{url} answered without a 'scores' (or 'rewards') list: keys {sorted(reply)[:5]}")
    if len(values) != len(samples):
        raise RemoteRewardError(f"{url} answered {len(values)} scores for {len(samples)} samples")
    values = [value[0] if isinstance(value, list) and value else value for value in values]
    for position, value in enumerate(values):
        if isinstance(value, str):  # float("42") would take an extracted answer for its score
            raise RemoteScoreTypeError(
                f"{url} answered the string {value!r} as the score of sample {first + position} (prompt "
                f"{samples[position].prompt[:40]!r}); answer a JSON number for each sample (0.5, not \"0.5\")")
    try:
        scores = [float(value) for value in values]
    except (TypeError, ValueError, IndexError) as error:
        raise RemoteRewardError(f"{url} answered a score that is not a number ({error})") from None
    bad = next((score for score in scores if not math.isfinite(score)), None)
    if bad is not None:
        raise RemoteRewardError(f"{url} answered the score {bad}; scores must be finite numbers")
    return scores


def _retry_after(error: urllib.error.HTTPError) -> float | None:
    value = error.headers.get("Retry-After") if error.headers is not None else None
    try:
        return max(float(value), 0.0) if value is not None else None
    except ValueError:
        return None


class RequestDeadline:
    """Closes a request's connection once ``seconds`` have passed since it was made, whatever the request is doing.

    A socket's timeout bounds each wait for bytes, so a server that sends a byte now and then holds a request for
    ever. ``opener()`` makes its connections through ``watch``; a timer shuts each one down at the deadline (the
    read under way then ends), and ``expired`` says why it ended.
    """

    def __init__(self, seconds: float):
        self.seconds, self.expired = seconds, False
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.timer = threading.Timer(seconds, self._expire)
        self.timer.daemon = True
        self.timer.start()

    def expire(self) -> None:
        """End the request now, as its deadline would."""
        self.timer.cancel()
        self._expire()

    def _expire(self) -> None:
        with self.lock:
            self.expired = True
            for sock in self.sockets:
                _shut_down(sock)

    def watch(self, connection: http.client.HTTPConnection) -> http.client.HTTPConnection:
        """``connection`` with its socket (the TCP one, under TLS too) shut down at the deadline: http.client makes
        it through the connection's ``_create_connection``, before any TLS handshake."""
        create = connection._create_connection

        def create_watched(*args: Any, **kwargs: Any) -> socket.socket:
            sock = create(*args, **kwargs)
            with self.lock:
                self.sockets.append(sock)
                if self.expired:
                    _shut_down(sock)
            return sock

        connection._create_connection = create_watched
        return connection

    def opener(self) -> urllib.request.OpenerDirector:
        """urllib's opener (proxies, redirects, HTTPS) whose connections are watched."""
        handlers = [WatchedHTTPHandler(), WatchedHTTPSHandler()]
        for handler in handlers:
            handler.deadline = self
        return urllib.request.build_opener(*handlers)

    def cancel(self) -> None:
        self.timer.cancel()

    def error(self) -> TimeoutError:
        return TimeoutError("no whole answer within timeout_s: a slow or trickling server")


class WatchedConnections:
    """A urllib handler's part that makes its connections through ``deadline.watch``."""

    deadline: RequestDeadline

    def do_open(self, http_class: Any, request: Any, **kwargs: Any) -> Any:
        deadline = self.deadline
        return super().do_open(  # type: ignore[misc]
            lambda *args, **options: deadline.watch(http_class(*args, **options)), request, **kwargs)


class WatchedHTTPHandler(WatchedConnections, urllib.request.HTTPHandler):
    pass


class WatchedHTTPSHandler(WatchedConnections, urllib.request.HTTPSHandler):
    pass


def _shut_down(sock: socket.socket) -> None:
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the TCP socket itself, under an SSL one too
    except OSError:  # already closed
        pass


@dataclass
class RemoteScores:
    scores: list[float]
    failed: int
    """Samples whose request failed for good (each scored fallback_score)."""
    retries: int
    requests: int

    def metrics(self, seconds: float) -> dict[str, float]:
        return {"reward/remote/requests": float(self.requests), "reward/remote/retries": float(self.retries),
                "reward/remote/failed": float(self.failed), "reward/remote/time_s": seconds}


class RemoteReward:
    """Scores samples at ``url`` (see the module docstring); one instance per run, shared by its steps."""

    def __init__(self, url: str, protocol: str = "openrlhf", batch_size: int = 32, max_concurrency: int = 8,
                 timeout_s: float = 180.0, max_retries: int = 5, fallback_score: float = 0.0,
                 headers: dict[str, str] | None = None, backoff_s: float = 1.0):
        self.urls = split_urls(url)
        if not self.urls:
            raise ValueError("reward.remote.url is empty; set it to the endpoint, e.g. http://host:5000/get_reward")
        if protocol not in PROTOCOLS:
            raise ValueError(f"reward.remote.protocol={protocol!r} is not one of {', '.join(PROTOCOLS)}")
        self.protocol, self.batch_size, self.timeout_s = protocol, max(batch_size, 1), timeout_s
        self.max_retries, self.fallback_score, self.backoff_s = max_retries, fallback_score, backoff_s
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.pool = ThreadPoolExecutor(max_workers=max(max_concurrency, 1), thread_name_prefix="remote-reward")
        self.closed = threading.Event()
        self._deadlines: set[RequestDeadline] = set()
        self._deadlines_lock = threading.Lock()

    def close(self) -> None:
        """Stop: the requests under way end now (the interpreter's exit waits for the pool's threads)."""
        self.closed.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self._deadlines_lock:
            deadlines = list(self._deadlines)
        for deadline in deadlines:
            deadline.expire()

    def _post_once(self, url: str, body: bytes) -> Any:
        """One request, its whole answer within ``timeout_s`` (TimeoutError past it)."""
        request = urllib.request.Request(url, data=body, headers=self.headers, method="POST")
        deadline = RequestDeadline(self.timeout_s)
        with self._deadlines_lock:
            self._deadlines.add(deadline)
        if self.closed.is_set():  # closed as this request began: close() may not have seen its deadline
            deadline.expire()
        try:
            with deadline.opener().open(request, timeout=self.timeout_s) as answer:
                data = answer.read()
        except (OSError, http.client.HTTPException):
            if deadline.expired:  # the deadline closed the connection under the read
                raise deadline.error() from None
            raise
        finally:
            deadline.cancel()
            with self._deadlines_lock:
                self._deadlines.discard(deadline)
        if deadline.expired:  # an answer without a length ends where the connection was closed
            raise deadline.error()
        return json.loads(data.decode("utf-8"))

    def _post(self, url: str, samples: list[RemoteSample], first: int = 0) -> tuple[list[float], int]:
        """(scores, retries used) of one request for the batch's ``samples`` from index ``first``; RemoteRewardError
        after the last try."""
        body = json.dumps(request_body(samples, self.protocol)).encode("utf-8")
        retries = 0
        try:
            while True:
                wait = None
                try:
                    return scores_of(self._post_once(url, body), samples, url, first), retries
                except urllib.error.HTTPError as error:
                    if error.code not in RETRIED_STATUS:
                        detail = error.read(300).decode("utf-8", "replace").strip().splitlines()
                        raise RemoteRewardError(f"{url} answered HTTP {error.code}"
                                                f"{': ' + detail[0] if detail else ''}") from None
                    reason, wait = f"HTTP {error.code}", _retry_after(error)
                except (OSError, http.client.HTTPException) as error:  # URLError, timeouts and resets are OSErrors
                    # HTTPException: the connection closed mid-answer (IncompleteRead), a garbled status line, ...
                    reason = str(getattr(error, "reason", error)) or type(error).__name__
                except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, an integer of 4300+ digits
                    raise RemoteRewardError(f"{url} answered with something that is not JSON") from None
                if self.closed.is_set():
                    raise RemoteRewardError(f"{url}: the remote reward was closed while its request was under way")
                if retries >= self.max_retries:
                    tries = "once" if retries == 0 else f"{retries + 1} times"
                    raise RemoteRewardError(f"{url} failed {tries}, last: {reason} (timeout_s="
                                            f"{self.timeout_s:g}, max_retries={self.max_retries})")
                retries += 1
                self.closed.wait(min(wait if wait is not None else self.backoff_s * 2 ** (retries - 1), MAX_BACKOFF_S))
        except RemoteRewardError as error:
            error.retries = retries  # the retries it used, for reward/remote/retries
            raise

    def score(self, samples: list[RemoteSample]) -> RemoteScores:
        """Every sample's score, in order; fallback_score where its request failed for good."""
        chunks = [samples[start:start + self.batch_size] for start in range(0, len(samples), self.batch_size)]
        futures = [self.pool.submit(self._post, self.urls[index % len(self.urls)], chunk, index * self.batch_size)
                   for index, chunk in enumerate(chunks)]
        scores: list[float] = []
        failed = retries = 0
        last_error: RemoteRewardError | None = None
        for chunk, future in zip(chunks, futures, strict=True):
            try:
                chunk_scores, used = future.result()
            except RemoteScoreTypeError:
                raise
            except RemoteRewardError as error:
                last_error, used = error, error.retries
                chunk_scores = [self.fallback_score] * len(chunk)
                failed += len(chunk)
            scores.extend(chunk_scores)
            retries += used
        if chunks and failed == len(samples):
            raise RemoteRewardError(f"the remote reward scored none of {len(samples)} samples: {last_error}; check "
                                    f"that the endpoint is up (reward.remote.url) and answers as "
                                    f"reward.remote.protocol={self.protocol} says")
        return RemoteScores(scores, failed, retries, len(chunks))
