"""The HTTP endpoint (aiohttp): OpenAI's routes, trajectory routes, a concurrency limit and one-line errors.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/completions`` (``stream:
true`` answers in server-sent events as the engine samples), and the same under ``/t/<trajectory_id>/v1`` for the trajectories the trainer opens
(``open_trajectory``): their calls are sampled as the trainer sets and recorded. At most ``max_concurrency``
generation requests run at once; one more is answered 429 with ``Retry-After``. Every error is OpenAI's error body
with a one-line message.

A streamed chat reply is OpenAI's chunks: the role, content deltas as tokens are sampled (on the native engine; the
hf backend hands a reply over whole, so it arrives as one delta), the tool calls once the reply is parsed, the
finish_reason, the usage when ``stream_options.include_usage``, then ``data: [DONE]``. An error after the stream
started arrives as one ``data: {"error": ...}`` event before ``[DONE]``.

A client that hangs up, mid-request or mid-stream, cancels its handler (aiohttp's ``handler_cancellation``), and with
it the generation it waits for: the native engine aborts the request and frees its KV blocks at once; the hf backend
drops it if its batch has not started, and stops a batch under way at its next token once none of its requests is
waited for (``agent.runner.BatchingClient``). Ctrl-C cancels every request: the server stops within a token, with no
reply, whole or cut, sent for the requests under way.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from reinforge.serve.chat import ChatSession, RequestError, error_body
from reinforge.serve.service import GenerationService, flag
from reinforge.serve.streaming import SSE_DONE, sse

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
MAX_BODY_BYTES = 64 * 1024 * 1024
ROUTES = "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health"
SHUTDOWN_GRACE_S = 5.0
"""On close (Ctrl-C), how long requests still being answered may take before they are cancelled."""


def http_errors_middleware() -> Any:
    """aiohttp's own refusals (no such route, a method the route does not take) in OpenAI's error format."""
    from aiohttp import web

    @web.middleware
    async def http_errors(request: Any, handler: Any) -> Any:
        try:
            return await handler(request)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            where = f"{request.method} {request.path}"
            if error.status == 404:
                message = f"there is no route {where}; this server answers {ROUTES}"
            elif error.status == 405:
                message = f"{where} is not answered; use {' or '.join(sorted(error.allowed_methods))} on this route"
            else:
                message = f"{error.reason} ({where})"
            headers = {"Allow": error.headers["Allow"]} if "Allow" in error.headers else None
            return web.json_response(error_body(message), status=error.status, headers=headers)
    return http_errors


class OpenAIEndpoint:
    def __init__(self, service: GenerationService, *, max_concurrency: int = 256):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency}; allow at least 1 request at a time")
        self.service = service
        self.max_concurrency = max_concurrency
        self.in_flight = 0
        self.trajectories: dict[str, ChatSession] = {}
        self._runner: Any = None
        self.base_url = ""

    def open_trajectory(self, trajectory_id: str, session: ChatSession) -> str:
        """Route ``/t/<trajectory_id>/v1`` to ``session``; returns that base URL."""
        if trajectory_id in self.trajectories:
            raise ValueError(f"trajectory {trajectory_id!r} is already open")
        self.trajectories[trajectory_id] = session
        return f"{self.base_url}/t/{trajectory_id}/v1"

    def close_trajectory(self, trajectory_id: str) -> None:
        self.trajectories.pop(trajectory_id, None)

    def application(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[http_errors_middleware()])
        app.router.add_get("/health", self._health)
        for prefix in ("", "/t/{trajectory}"):
            app.router.add_get(prefix + "/v1/models", self._models)
            app.router.add_get(prefix + "/v1/models/{model:.+}", self._model)
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completions)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen (port 0: any free port); returns the server's root URL."""
        from aiohttp import web

        # handler_cancellation: a client that hangs up cancels its handler, so its generation is aborted rather than
        # run to its max_tokens for no one (aiohttp leaves handlers running by default)
        self._runner = web.AppRunner(self.application(), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S,
                                     handler_cancellation=True)
        await self._runner.setup()
        # connections the system holds until the loop accepts them: one per request allowed (the system caps it at its
        # somaxconn); aiohttp's 128 left hundreds of agents connecting while the loop was busy refused or timed out
        site = web.TCPSite(self._runner, host, port, backlog=max(128, min(self.max_concurrency, 65535)))
        await site.start()
        bound = site._server.sockets[0].getsockname()  # the port the system chose when port is 0
        self.base_url = f"http://{host if host not in ('0.0.0.0', '::') else '127.0.0.1'}:{bound[1]}"
        return self.base_url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @staticmethod
    def _error(status: int, message: str, error_type: str = "invalid_request_error", code: str | None = None,
               headers: dict[str, str] | None = None, param: str | None = None) -> Any:
        from aiohttp import web

        return web.json_response(error_body(message, error_type, code, param), status=status, headers=headers)

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"status": "ok", "in_flight": self.in_flight})

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.service.model_name, "object": "model",
                                                              "created": 0, "owned_by": "reinforge"}]})

    async def _model(self, request: Any) -> Any:
        from aiohttp import web

        name = request.match_info["model"]
        if name != self.service.model_name:
            return self._error(404, f"model {name!r} is not served here; this server serves "
                                    f"{self.service.model_name!r}", "invalid_request_error", "model_not_found")
        return web.json_response({"id": name, "object": "model", "created": 0, "owned_by": "reinforge"})

    async def _body(self, request: Any) -> dict[str, Any]:
        from aiohttp import web

        too_large = RequestError(f"the request body is over the server's limit of {MAX_BODY_BYTES // (1024 * 1024)} "
                                 "MiB; send a shorter conversation", status=413)
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise too_large  # from its Content-Length, before any of it is read
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise RequestError(f"the request body is not JSON ({error}); send a JSON object") from None
        except RecursionError:  # [[[[... a few thousand deep: the decoder's recursion limit, not a server failure
            raise RequestError("the request body nests its JSON too deeply to read; send a JSON object of "
                               "ordinary depth") from None
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        except LookupError:  # Content-Type: application/json; charset=<no such codec>
            raise RequestError(f"the request body's charset {request.charset!r} is not one this server knows; send "
                               "the body as UTF-8") from None
        except ValueError:  # Python's int parsing refuses a literal of over 4300 digits
            raise RequestError("the request body holds a number of over 4300 digits; send numbers of ordinary "
                               "size") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        try:  # "\ud800" is valid JSON, but no character: the tokenizer would fail on it deep in the request
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError as error:
            raise RequestError(f"the request body holds {error.object[error.start:error.end]!r}, half of a UTF-16 "
                               "surrogate pair and no character; send text as valid Unicode") from None
        except RecursionError:
            raise RequestError("the request body nests its JSON too deeply to read; send a JSON object of "
                               "ordinary depth") from None
        return body

    def _session(self, request: Any) -> ChatSession | None:
        trajectory = request.match_info.get("trajectory")
        if trajectory is None:
            return None
        session = self.trajectories.get(trajectory)
        if session is None:
            raise RequestError(f"trajectory {trajectory!r} is not open (it ended or never started); use the base_url "
                               "the agent was given", status=404, code="trajectory_not_found")
        return session

    async def _guarded(self, request: Any, answer: Any) -> Any:
        if self.in_flight >= self.max_concurrency:
            return self._error(429, f"{self.in_flight} requests are in flight, the server's limit "
                                    f"(--max-concurrency {self.max_concurrency}); retry after {RETRY_AFTER_S} s",
                               "rate_limit_error", "rate_limit_exceeded", {"Retry-After": str(RETRY_AFTER_S)})
        self.in_flight += 1
        try:
            return await answer(await self._body(request))
        except RequestError as error:
            return self._error(error.status, str(error), error.error_type, error.code, param=error.param)
        except Exception as error:
            logger.exception("request failed")
            return self._error(500, f"{type(error).__name__}: {error}", "server_error")
        finally:
            self.in_flight -= 1

    async def _chat(self, request: Any) -> Any:
        async def answer(body: dict[str, Any]) -> Any:
            from aiohttp import web

            if flag(body, "stream"):
                return await self._stream(request, self.service.chat_stream(body, self._session(request)))
            return web.json_response(await self.service.chat(body, self._session(request)))
        return await self._guarded(request, answer)

    async def _completions(self, request: Any) -> Any:
        async def answer(body: dict[str, Any]) -> Any:
            from aiohttp import web

            if self._session(request) is not None:
                raise RequestError("a trajectory's calls go to /chat/completions; /completions is not recorded")
            if flag(body, "stream"):
                return await self._stream(request, self.service.complete_stream(body))
            return web.json_response(await self.service.complete(body))
        return await self._guarded(request, answer)

    async def _stream(self, request: Any, chunks: AsyncIterator[dict[str, Any]]) -> Any:
        """Send each chunk as a server-sent event as it comes, then ``[DONE]``."""
        from aiohttp import web

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            try:
                async for chunk in chunks:
                    await _send(response, sse(chunk))
            except (_HungUp, asyncio.CancelledError):
                raise
            except Exception as error:  # the generation's (an engine's ConnectionResetError too), not the client's
                logger.exception("a streamed request failed")
                await _send(response, sse(error_body(f"{type(error).__name__}: {error}", "server_error")))
            finally:
                await chunks.aclose()  # a client that hung up stops its generation here
            await _send(response, SSE_DONE)
            await response.write_eof()
        except (_HungUp, ConnectionResetError):
            # the client hung up while its reply was being written (before aiohttp saw the connection go and
            # cancelled the handler): nothing is left to send to, and nothing failed on the server's side
            logger.info("a client hung up mid-stream; its generation is stopped")
        return response


class _HungUp(Exception):
    """Writing to a client failed because it hung up."""


async def _send(response: Any, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionResetError:  # aiohttp's "Cannot write to closing transport"
        raise _HungUp from None
