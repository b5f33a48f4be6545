"""``reinforge sandbox serve``: SandboxFusion's HTTP contract on a thread-per-request server.

    GET  /           health: 200 and a JSON summary (scripts wait for it)
    GET  /v1/ping    "pong", as SandboxFusion answers
    POST /run_code   run a program; 400 bad request, 413 too large, 429 rate limited,
                     503 queue full or queue wait over (429 and 503 carry Retry-After)

The server refuses to start when bubblewrap cannot isolate a test program, unless it is
started with ``--unsafe-no-isolation``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from reinforge.sandbox.admission import QueueFull, QueueTimeout, SlotPool, TokenBucket
from reinforge.sandbox.cgroups import SlotCgroups
from reinforge.sandbox.isolation import IsolationError, UidRange, find_bwrap
from reinforge.sandbox.protocol import SANDBOX_ERROR, RequestError, RunCodeRequest, RunCodeResponse
from reinforge.sandbox.runner import check_isolation, run_request
from reinforge.sandbox.settings import SandboxSettings

logger = logging.getLogger(__name__)
CLIENT_IDLE_S = 60.0
"""A connection that sends nothing for this long (a half-sent body, an idle keep-alive) is closed."""
BODY_DEADLINE_S = 60.0
"""A request body must arrive whole within this long (16 MiB needs 280 kB/s): one trickled a byte at a time, each
within ``CLIENT_IDLE_S``, held a thread for ever; past it the connection is closed."""
REFUSED_BODY_LINGER_S = 2.0
"""How long a body refused unread (413, 429, 503) is still read and dropped after the answer, the answer's side of
the connection closed: a client that sends its body before reading then reads the answer, where closing at once
would reset the connection under it; bounded, so a flood of large bodies still costs little."""


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"
    timeout = CLIENT_IDLE_S

    _expects_continue = False

    def parse_request(self) -> bool:
        self._expects_continue = False
        return super().parse_request()

    def handle_expect_100(self) -> bool:
        """``Expect: 100-continue`` is answered once the request is admitted (``do_POST``): a refusal is the final
        answer instead, and the client never sends the body."""
        self._expects_continue = True
        return True

    def _read_body(self, length: int) -> bytes:
        """The body's ``length`` bytes (fewer if the client closed early); TimeoutError when the client goes quiet
        for ``timeout`` seconds, or the whole body takes over ``BODY_DEADLINE_S``."""
        if self._expects_continue:
            self._expects_continue = False
            self.send_response_only(100)
            self.end_headers()
        deadline = time.monotonic() + BODY_DEADLINE_S
        body = bytearray()
        try:
            while len(body) < length:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the body did not arrive within {BODY_DEADLINE_S} s")
                self.connection.settimeout(min(remaining, self.timeout))
                chunk = self.rfile.read1(min(length - len(body), 1 << 20))
                if not chunk:
                    break
                body += chunk
        finally:
            self.connection.settimeout(self.timeout)
        return bytes(body)

    def _drop_unread_body(self, length: int) -> None:
        """After a refusal answered before the body was read: close the answer's side of the connection, then read
        and drop up to ``length`` bytes for at most ``REFUSED_BODY_LINGER_S`` (a client that waits for "100
        Continue" sends none and closes)."""
        if self._expects_continue:
            return  # the client waits for "100 Continue" before its body, and the refusal told it not to send it
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + REFUSED_BODY_LINGER_S
            while length > 0 and (remaining := deadline - time.monotonic()) > 0:
                self.connection.settimeout(remaining)
                chunk = self.rfile.read1(min(length, 1 << 20))
                if not chunk:
                    break
                length -= len(chunk)
        except OSError:  # the client has gone, or went quiet: nothing more to wait for
            pass
        finally:
            self.connection.settimeout(self.timeout)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def _answer(self, code: int, body: Any, retry_after_s: float | None = None) -> None:
        payload = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        if retry_after_s is not None:
            self.send_header("Retry-After", str(max(1, math.ceil(retry_after_s))))
        try:
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting (its timeout): nobody to tell
            self.close_connection = True
            logger.debug("%s left before the answer", self.address_string())

    def _content_length(self) -> int | None:
        """The body's length from Content-Length; None once a 400/411 has been answered (connection closed)."""
        header = self.headers.get("Content-Length")
        if header is None and self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            self._answer(411, {"detail": "send the body with a Content-Length header (chunked bodies are not read)"})
            return None
        try:
            length = int(header or 0)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            self._answer(400, {"detail": f"Content-Length {header!r} is not a byte count"})
            return None
        return length

    def do_GET(self) -> None:
        sandbox = self.server.sandbox
        if self.path == "/":
            self._answer(200, {"status": "ok", "isolation": sandbox.settings.isolation,
                               "memory_limit_per": sandbox.memory_scope,
                               "slots": sandbox.settings.num_slots, **sandbox.slots.stats()})
        elif self.path == "/v1/ping":
            self._answer(200, "pong")
        else:
            self._answer(404, {"detail": f"no such path {self.path}; use GET / or POST /run_code"})

    def do_POST(self) -> None:
        sandbox = self.server.sandbox
        if self.path != "/run_code":
            self._answer(404, {"detail": f"no such path {self.path}; use POST /run_code"})
            return
        length = self._content_length()
        if length is None:
            return
        if length > sandbox.settings.max_request_bytes:
            self.close_connection = True
            self._answer(413, {"detail": f"request of {length} bytes is over the limit of "
                                         f"{sandbox.settings.max_request_bytes}"})
            self._drop_unread_body(length)
            return
        refusal = sandbox.admit()
        if refusal is not None:  # before the body is read: a flood of large bodies is refused unread
            self.close_connection = True  # the unread body must not be taken for the next request
            self._answer(*refusal)
            self._drop_unread_body(length)
            return
        try:
            request = RunCodeRequest.from_json(json.loads(self._read_body(length) or b"null"))
            request.decoded_files()
        except TimeoutError:  # the client stopped sending mid-body
            self.close_connection = True
            return
        except RequestError as error:
            self._answer(400, {"detail": str(error)})
            return
        except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
            self._answer(400, {"detail": "the body is not JSON (or is nested too deeply, or holds a number of over "
                                         "4300 digits)"})
            return
        code, body, retry_after_s = sandbox.run(request)
        self._answer(code, body, retry_after_s)


class _HTTPServer(ThreadingHTTPServer):
    """One thread a connection, up to ``connection_limit(settings)`` at once: past it a connection is answered 503
    and closed at once, where each (an idle one, or one sending its headers a byte at a time) held a thread, without
    bound."""

    daemon_threads = True
    request_queue_size = 1024
    sandbox: SandboxServer
    connections: threading.BoundedSemaphore

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.connections.acquire(blocking=False):
            _refuse_connection(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: none will let the connection's place go
            self.connections.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.release()


def connection_limit(settings: SandboxSettings) -> int:
    """Connections served at once: room for every slot's request and every queued one, twice over (clients
    waiting for an answer, health checks), and some."""
    return 2 * (settings.num_slots + settings.max_queued) + 16


def _refuse_connection(connection: socket.socket) -> None:
    """A 503 with Retry-After on a connection past the limit, sent without waiting on a client that reads nothing."""
    body = json.dumps({"detail": "too many open connections to the sandbox; retry later"}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 1\r\nConnection: close\r\n\r\n").encode()
    try:
        connection.settimeout(0.1)
        connection.sendall(head + body)
    except OSError:
        pass


class SandboxServer:
    """The HTTP server with its rate limit and slots; ``start()`` serves from a thread (tests), ``serve_forever()``."""

    def __init__(self, settings: SandboxSettings) -> None:
        if settings.isolation == "bubblewrap":
            find_bwrap()  # before anything is created: IsolationError saying how to install it
        self.uids = UidRange(settings.uid_base, settings.num_slots) if os.geteuid() == 0 else None
        if self.uids is not None and self.uids.base != settings.uid_base:
            logger.warning("user ids from %d are held by another sandbox server or used on this host; this one's "
                           "slots run as %d..%d",
                           settings.uid_base, self.uids.base, self.uids.base + settings.num_slots - 1)
            settings = dataclasses.replace(settings, uid_base=self.uids.base)
        self.settings = settings
        self.cgroups, why_not = SlotCgroups.create(settings.num_slots)
        self.memory_scope = "sandbox (cgroup)" if self.cgroups is not None else "process (rlimit)"
        if self.cgroups is None:
            logger.warning("memory_limit_MB and the process limit apply to each process only (%s): a program's "
                           "forked children and in-memory files are not counted together; run the server as root "
                           "on a machine with cgroups for a limit on the whole sandbox", why_not)
        self.bucket = TokenBucket(settings.rate_per_s, settings.burst) if settings.rate_per_s > 0 else None
        self.slots = SlotPool(settings.num_slots, settings.max_queued)
        try:
            self._check_isolation()
            self._http = _HTTPServer((settings.host, settings.port), _Handler)
        except BaseException:  # refused, or the port is taken: leave no groups or held ids behind
            self._release()
            raise
        self._http.sandbox = self
        self._http.connections = threading.BoundedSemaphore(connection_limit(settings))
        self._thread: threading.Thread | None = None

    def _check_isolation(self) -> None:
        """Run the probe program; where it fails in the cgroups but runs without them, go on without (warning)."""
        try:
            check_isolation(self.settings, self.cgroups)
        except IsolationError as error:
            if self.cgroups is None:
                raise
            self.cgroups.remove()
            self.cgroups, self.memory_scope = None, "process (rlimit)"
            check_isolation(self.settings)  # fails on its own when the trouble is not the cgroups
            logger.warning("programs cannot run in cgroups here (%s); memory_limit_MB applies to each process only",
                           error)

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def admit(self) -> tuple[int, dict[str, Any], float] | None:
        """The refusal (HTTP code, body, Retry-After seconds) of a request the server cannot take now, judged from its
        headers alone: no token left in the rate limit (429), or every slot busy and the queue full (503); None to
        read its body and run it."""
        if self.bucket is not None:
            wait_s = self.bucket.take()
            if wait_s > 0:
                return 429, {"detail": f"rate limit of {self.settings.rate_per_s}/s reached; retry later"}, wait_s
        if self.slots.full():
            return self._queue_full()
        return None

    def _queue_full(self) -> tuple[int, dict[str, Any], float]:
        return 503, {"detail": f"all {self.settings.num_slots} slots busy and {self.settings.max_queued} requests "
                               "queued; retry later"}, 1.0

    def run(self, request: RunCodeRequest) -> tuple[int, dict[str, Any], float | None]:
        """(HTTP code, body, Retry-After seconds) for a valid request ``admit`` let in: a slot, then the program."""
        try:
            slot = self.slots.acquire(self.settings.queue_timeout_s)
        except QueueFull:
            return self._queue_full()
        except QueueTimeout:
            return 503, {"detail": f"no slot free within {self.settings.queue_timeout_s}s; retry later"}, 1.0
        try:
            return 200, run_request(request, self.settings, slot, self.cgroups).to_json(), None
        except Exception as error:  # a bug of ours: the caller gets SandboxFusion's SandboxError, the log the trace
            logger.exception("running a request failed")
            return 200, RunCodeResponse(SANDBOX_ERROR, f"the sandbox failed: {type(error).__name__}: {error}"
                                        ).to_json(), None
        finally:
            self.slots.release(slot)

    def serve_forever(self) -> None:
        self._http.serve_forever()

    def start(self) -> SandboxServer:
        self._thread = threading.Thread(target=self._http.serve_forever, args=(0.05,), name="sandbox-server",
                                        daemon=True)
        self._thread.start()
        return self

    def _release(self) -> None:
        """Give back what the server holds on the host: its cgroups and its user ids."""
        if self.cgroups is not None:
            self.cgroups.remove()
        if self.uids is not None:
            self.uids.release()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        if self._thread is not None:
            self._thread.join()
        self._release()


def sandbox_main(argv: list[str]) -> int:
    """``reinforge sandbox serve [--host H] [--port P] ...``."""
    defaults = SandboxSettings()
    parser = argparse.ArgumentParser(prog="reinforge sandbox", description="a local code sandbox (SandboxFusion API)")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve POST /run_code; programs run under bubblewrap")
    serve.add_argument("--host", default=defaults.host)
    serve.add_argument("--port", type=int, default=defaults.port)
    serve.add_argument("--max-concurrent", type=int, default=defaults.max_concurrent,
                       help="programs running at once (default 0: one per CPU)")
    serve.add_argument("--max-queued", type=int, default=defaults.max_queued)
    serve.add_argument("--rate", type=float, default=defaults.rate_per_s, help="requests per second (0: no limit)")
    serve.add_argument("--burst", type=int, default=defaults.burst)
    serve.add_argument("--python", default=defaults.python, help="interpreter inside the sandbox")
    serve.add_argument("--read-only-path", action="append", default=[], dest="read_only_paths",
                       help="a host folder to show read-only inside the sandbox (repeatable)")
    serve.add_argument("--uid-base", type=int, default=defaults.uid_base,
                       help="as root, slot i runs as user uid_base + i (ids held by another server on this host: "
                            "the next free range)")
    serve.add_argument("--unsafe-no-isolation", action="store_true",
                       help="run without bubblewrap: programs see this machine's files and network and can "
                            "signal processes of their user (this server's, or a per-slot id when run as root); "
                            "only rlimits and timeouts apply")
    args = parser.parse_args(argv)
    settings = SandboxSettings(host=args.host, port=args.port, max_concurrent=args.max_concurrent,
                               max_queued=args.max_queued, rate_per_s=args.rate, burst=args.burst, python=args.python,
                               read_only_paths=args.read_only_paths, uid_base=args.uid_base,
                               isolation="none" if args.unsafe_no_isolation else "bubblewrap")
    try:
        server = SandboxServer(settings)
    except IsolationError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"error: cannot listen on {settings.host}:{settings.port} ({error.strerror or error}); "
              "pass another --port or --host", file=sys.stderr)
        return 2
    if settings.isolation == "none":
        logger.warning("UNSAFE: programs run without isolation, with this machine's files and network")
    logger.info("sandbox serving on %s (%s, %d slots)", server.url, settings.isolation, settings.num_slots)
    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # so that a terminated server still removes its cgroups
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server._release()
    return 0
