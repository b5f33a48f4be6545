"""A client for ``POST /run_code``: ours or a SandboxFusion deployment, with retries and a deadline.

``run_code`` never raises for the sandbox's sake and never waits past its deadline: a refused
connection, a reset, 429, 502, 503 and 504 are retried, after the server's Retry-After or an
exponential backoff with jitter (whichever is longer), for as long as ``retry_budget_s``
allows (seconds since the first attempt, not a count: a server under load refuses quickly and
often, and a full queue takes its time to drain; ``DEFAULT_RETRY_BUDGET_S`` outlasts one) and
the caller's ``timeout_s`` does. Anything that still fails comes back as a ``SandboxError``
response whose message says what happened, ready to show the model.

Every client of one sandbox URL in a process shares one limit on the requests in flight
(``max_in_flight``, set by the first client made for that URL): the tools of a run, each with
its threads, then queue here instead of each flooding the server's queue. The wait for a turn
counts against the call's deadline.

    client = SandboxClient("http://127.0.0.1:8080")
    response = client.run_code("print(6 * 7)")
    response.run_result.stdout   # '42\\n'
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import random
import socket
import threading
import time
import urllib.parse
import urllib.request
from typing import Any

from reinforge.sandbox.protocol import SANDBOX_ERROR, RunCodeRequest, RunCodeResponse

RETRY_STATUSES = (429, 502, 503, 504)
DEFAULT_RETRY_BUDGET_S = 300.0
"""Seconds a call keeps retrying: a full queue of our server's default size (64 requests) of programs at the
longest run timeout (60 s) drains in 64 x 60 / slots seconds, under 300 with 16 slots or more."""
DEFAULT_MAX_IN_FLIGHT = 64
"""Requests one process keeps at one sandbox URL at once: our server's default queue length."""
LONGEST_WAIT_S = 1e9
"""A call's deadline is at most this far off (about 30 years): a retry budget or timeout of 1e10 s, or infinity,
means "wait as long as it takes", and past about 9.2e9 s a lock's or a socket's timeout overflows."""

_in_flight: dict[str, threading.BoundedSemaphore] = {}
_in_flight_lock = threading.Lock()


def in_flight_limit(url: str, size: int) -> threading.BoundedSemaphore:
    """The one semaphore of ``url``'s requests in this process, made with ``size`` places on first use."""
    key = _url(url, "")
    with _in_flight_lock:
        if key not in _in_flight:
            _in_flight[key] = threading.BoundedSemaphore(size)
        return _in_flight[key]
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""An opener that ignores HTTP_PROXY and the like."""


def _seconds(retry_after: str | None) -> float:
    """Retry-After in seconds (0 for none, or for the HTTP-date form, which the backoff then covers)."""
    try:
        return max(0.0, float(retry_after or 0))
    except ValueError:
        return 0.0


def _post(url: str, payload: bytes, timeout_s: float) -> tuple[int, str | None, bytes]:
    """(status, Retry-After, body) of one POST, or TimeoutError once ``timeout_s`` is spent in all.

    A socket timeout bounds each read, not the exchange: a server (or proxy) that sends a byte
    now and then would hold the caller for ever. So the exchange runs on a thread and, at the
    deadline, its socket is shut down under it.
    """
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=timeout_s)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    outcome: dict[str, Any] = {}

    def exchange() -> None:
        try:
            connection.request("POST", path, body=payload, headers={"Content-Type": "application/json",
                                                                    "Accept": "application/json"})
            answer = connection.getresponse()
            outcome["answer"] = (answer.status, answer.getheader("Retry-After"), answer.read())
        except BaseException as error:  # handed to the caller's thread
            outcome["error"] = error

    worker = threading.Thread(target=exchange, name="sandbox-client-call", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        with contextlib.suppress(OSError, AttributeError):
            connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
        raise TimeoutError(f"no answer within {timeout_s:.1f}s")
    connection.close()
    if "error" in outcome:
        error = outcome["error"]
        raise TimeoutError(str(error)) if isinstance(error, TimeoutError) else error
    return outcome["answer"]


def _url(base_url: str, path: str) -> str:
    """SandboxFusion's tools are often given the full ``.../run_code`` URL; accept both forms."""
    base = base_url.rstrip("/")
    return base.removesuffix("/run_code") + path


class SandboxClient:
    def __init__(self, url: str, *, retry_budget_s: float = DEFAULT_RETRY_BUDGET_S, backoff_s: float = 0.5,
                 max_backoff_s: float = 8.0, timeout_slack_s: float = 30.0,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        """``retry_budget_s``: seconds after the first attempt in which a failed one is retried (0: one attempt).
        ``timeout_slack_s``: time allowed beyond the program's own timeouts, for the server's queue.
        ``max_in_flight``: requests at once to this URL from the whole process (the first client's value holds)."""
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"sandbox url {url!r} must start with http:// or https://, e.g. http://127.0.0.1:8080")
        if not retry_budget_s >= 0 or max_in_flight < 1:
            raise ValueError(f"retry_budget_s={retry_budget_s} must be >= 0 and max_in_flight={max_in_flight} >= 1")
        self.url, self.retry_budget_s = url, retry_budget_s
        self.backoff_s, self.max_backoff_s, self.timeout_slack_s = backoff_s, max_backoff_s, timeout_slack_s
        self._in_flight = in_flight_limit(url, max_in_flight)

    def run_code(self, code: str, language: str = "python", *, run_timeout: float = 10.0,
                 compile_timeout: float = 10.0, memory_limit_mb: int = -1, stdin: str | None = None,
                 files: dict[str, bytes] | None = None, timeout_s: float | None = None) -> RunCodeResponse:
        """Run ``code`` remotely; by ``timeout_s`` (default: both timeouts + slack) there is an answer."""
        request = RunCodeRequest(code=code, language=language, compile_timeout=compile_timeout,
                                 run_timeout=run_timeout, memory_limit_MB=memory_limit_mb, stdin=stdin,
                                 files={path: base64.b64encode(data).decode() for path, data in (files or {}).items()})
        return self.send(request, timeout_s)

    def send(self, request: RunCodeRequest, timeout_s: float | None = None) -> RunCodeResponse:
        """The response by ``timeout_s`` (default: the retry budget, then one run with both timeouts + slack)."""
        started = time.monotonic()
        if timeout_s is None:
            timeout_s = self.retry_budget_s + request.run_timeout + request.compile_timeout + self.timeout_slack_s
        timeout_s = min(timeout_s, LONGEST_WAIT_S)
        deadline = started + timeout_s
        retry_until = started + self.retry_budget_s
        payload = json.dumps(request.to_json()).encode()
        last_problem = "no attempt made"
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            retry_after_s = 0.0
            try:
                status, retry_after, body = self._post_in_turn(payload, remaining)
            except TimeoutError:
                last_problem = f"no answer within {timeout_s:.1f}s"
                break
            except (OSError, http.client.HTTPException) as error:  # refused, reset, closed early, no such host
                last_problem = f"{type(error).__name__}: {error}"
            else:
                if status == 200:
                    try:
                        return RunCodeResponse.from_json(json.loads(body))
                    except (ValueError, TypeError, AttributeError) as error:  # not a /run_code response
                        return self._error(f"the sandbox at {self.url} answered something unreadable: "
                                           f"{type(error).__name__}: {str(error)[:300]}")
                last_problem = f"HTTP {status} from {self.url}: {body[:300].decode(errors='replace')}"
                if status not in RETRY_STATUSES:
                    return self._error(f"the sandbox rejected the request: {last_problem}")
                retry_after_s = _seconds(retry_after)
            backoff = min(self.max_backoff_s, self.backoff_s * 2**min(attempt, 30)) * (0.5 + random.random() / 2)
            # Retry-After plus up to a quarter more: callers refused together must not all come back together
            pause = max(backoff, retry_after_s * (1.0 + random.random() / 4))
            attempt += 1
            if time.monotonic() + pause > min(retry_until, deadline):
                spent = time.monotonic() - started
                last_problem += f"; {attempt} attempts in {spent:.1f}s, retry budget {self.retry_budget_s:g}s"
                break
            time.sleep(pause)
        return self._error(f"the code sandbox at {self.url} gave no result ({last_problem})")

    def _post_in_turn(self, payload: bytes, timeout_s: float) -> tuple[int, str | None, bytes]:
        """``_post`` once this process has fewer than ``max_in_flight`` requests at the URL (the wait counts)."""
        started = time.monotonic()
        if not self._in_flight.acquire(timeout=timeout_s):
            raise TimeoutError(f"no turn among this process's requests to {self.url} within {timeout_s:.1f}s")
        try:
            remaining = timeout_s - (time.monotonic() - started)
            if remaining <= 0:
                raise TimeoutError(f"no answer within {timeout_s:.1f}s")
            return _post(_url(self.url, "/run_code"), payload, remaining)
        finally:
            self._in_flight.release()

    def _error(self, message: str) -> RunCodeResponse:
        return RunCodeResponse(status=SANDBOX_ERROR, message=message)

    def is_healthy(self, timeout_s: float = 2.0) -> bool:
        """``GET /`` answers 200; directly, as ``run_code`` connects: through an ``HTTP_PROXY`` (urllib's default)
        a live sandbox read as down, or a proxy's 200 as up."""
        try:
            with _DIRECT.open(_url(self.url, "/"), timeout=timeout_s) as answer:
                return answer.status == 200
        except (OSError, http.client.HTTPException):
            return False

    def wait_until_healthy(self, timeout_s: float = 30.0) -> None:
        """Return once ``GET /`` answers 200; TimeoutError naming the URL after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.is_healthy():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the sandbox at {self.url} did not answer GET / within {timeout_s}s; "
                                   "is `reinforge sandbox serve` running there?")
            time.sleep(0.2)
