"""A small ASGI layer for the frontend: exact-path routing (plus one trailing path parameter,
``/v1/models/{model}``), whole bodies, JSON and SSE answers.

Why not FastAPI/Starlette here: on a streamed 16-token completion their middleware stack,
anyio task groups and per-request disconnect listeners cost more CPU than the rest of the
frontend together (profiled with py-spy under ``benchmarks/serving.py --stub``). This layer
keeps one asyncio task per request plus, for engine-bound routes, one watcher that turns a
client disconnect into cancellation of the handler (which aborts the engine request).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

log = logging.getLogger(__name__)

_JSON = [(b"content-type", b"application/json")]
_SSE = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
]


class APIError(Exception):
    """An error answered with OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.retry_after_s = retry_after_s  # answered as Retry-After (whole seconds)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass
class HTTPRequest:
    """What a handler sees: method, path, lower-case headers, the whole body and the raw
    query string (without ``?``)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    query: str = ""
    path_params: dict[str, str] = field(default_factory=dict)  # ``{name}`` of the route
    # run once the answer is sent (or the client left): what the handler holds for the
    # answer's whole life, such as its model's lease, is given back here
    on_done: list[Callable[[], None]] = field(default_factory=list)

    def finish(self) -> None:
        callbacks, self.on_done = self.on_done, []
        for callback in callbacks:
            callback()


@dataclass
class Response:
    """A complete answer (``body`` already encoded)."""

    body: bytes = b""
    status: int = 200
    headers: list[tuple[bytes, bytes]] = field(default_factory=lambda: list(_JSON))


@dataclass
class StreamResponse:
    """Server-sent events: ``frames`` yields preformatted ``data: ...\\n\\n`` frames."""

    frames: AsyncIterator[bytes]


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status)


def error_response(error: APIError) -> Response:
    return json_response(error.body(), error.status)


class _ClientGone(Exception):
    pass


Handler = Callable[[HTTPRequest], Awaitable[Response | StreamResponse]]


@dataclass
class Route:
    handler: Handler
    watch_disconnect: bool = False  # cancel the handler when the client goes away
    body_schema: dict | None = None  # JSON schema of the request body, for /openapi.json
    in_schema: bool = True  # listed in /openapi.json (the console's static files are not)


class ASGIApp:
    """Routes by exact path (or a route whose last segment is a ``{name}`` parameter, when
    no exact path matches), then method. Invariants: every request is answered once — 404
    for unknown paths, 405 (with Allow) for known paths with another method, 413 for bodies
    over ``max_body_bytes``, the handler's answer, an ``APIError``'s OpenAI-shaped body, or
    500 for anything else; nothing a handler raises reaches the server loop. ``authorize``
    runs before the body is read."""

    def __init__(
        self,
        max_body_bytes: int,
        authorize: Callable[[HTTPRequest], APIError | None],
        on_startup: Callable[[], Awaitable[None]],
        on_shutdown: Callable[[], Awaitable[None]],
        body_timeout_s: float | None = None,
    ) -> None:
        """``body_timeout_s``: a request body must have arrived this long after its headers
        (None: no deadline), else the answer is a 408 and the connection closes."""
        self.body_timeout_s = body_timeout_s
        self.routes: dict[str, dict[str, Route]] = {}  # by path; templates as written
        # path prefix -> how errors under it are answered (another API's error shape);
        # elsewhere OpenAI's (``error_response``)
        self.error_shapes: dict[str, Callable[[APIError], Response]] = {}
        # "/v1/models" -> ("model", methods) for the route "/v1/models/{model}"
        self._templates: dict[str, tuple[str, dict[str, Route]]] = {}
        self.max_body_bytes = max_body_bytes
        self.authorize = authorize
        self.on_startup, self.on_shutdown = on_startup, on_shutdown

    def error(self, path: str, error: APIError) -> Response:
        """``error`` answered in the shape of the API that ``path`` belongs to."""
        answer = next(
            (
                render(error)
                for prefix, render in self.error_shapes.items()
                if path.startswith(prefix)
            ),
            None,
        ) or error_response(error)
        if error.retry_after_s is not None:
            answer.headers.append(
                (b"retry-after", str(max(1, round(error.retry_after_s))).encode())
            )
        return answer

    def route(self, method: str, path: str, **options: Any) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            methods = self.routes.setdefault(path, {})
            methods[method] = Route(handler, **options)
            prefix, _, last = path.rpartition("/")
            if last.startswith("{") and last.endswith("}"):
                self._templates[prefix] = (last[1:-1], methods)
            return handler

        return register

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Callable, send: Callable) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.on_startup()
                except Exception as exc:
                    log.exception("startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.on_shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope["path"]
        methods = self.routes.get(path)
        params: dict[str, str] = {}
        if methods is None or "{" in path:
            prefix, _, last = path.rpartition("/")
            template = self._templates.get(prefix)
            methods = None
            if template is not None and last:
                methods, params = template[1], {template[0]: last}
        method = scope["method"]
        if methods is None:
            return await _send_response(
                send, self.error(path, APIError(404, "Not Found", "NotFoundError"))
            )
        route = methods.get(method)
        if route is None:
            answer = self.error(path, APIError(405, "Method Not Allowed", "MethodNotAllowed"))
            answer.headers.append((b"allow", ", ".join(sorted(methods)).encode()))
            return await _send_response(send, answer)
        request = HTTPRequest(
            method,
            scope["path"],
            {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]},
            b"",
            scope.get("query_string", b"").decode("latin-1"),
            params,
        )
        error = self.authorize(request)
        if error is not None:
            return await _send_response(send, self.error(path, error))
        if method == "POST":
            try:
                async with asyncio.timeout(self.body_timeout_s):
                    body = await self._read_body(receive)
            except _ClientGone:
                return  # nobody to answer
            except TimeoutError:
                error = APIError(
                    408, f"the request body did not arrive within {self.body_timeout_s:g} s"
                )
                answer = self.error(path, error)
                answer.headers.append((b"connection", b"close"))
                return await _send_response(send, answer)
            if body is None:
                error = APIError(413, f"request body exceeds {self.max_body_bytes} bytes")
                return await _send_response(send, self.error(path, error))
            request.body = body
        try:
            if route.watch_disconnect:
                await self._run_watched(route, request, receive, send)
            else:
                await _send_response(send, await self._answer(route, request))
        finally:
            request.finish()

    async def _read_body(self, receive: Callable) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._discard_rest(receive, message, size)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _discard_rest(self, receive: Callable, message: dict, size: int) -> None:
        """Read and drop the rest of a body over the limit (up to 4x the limit): a client
        still sending when the connection closes gets a reset instead of the 413."""
        while message.get("more_body", False) and size <= 4 * self.max_body_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            size += len(message.get("body", b""))

    async def _answer(self, route: Route, request: HTTPRequest) -> Response | StreamResponse:
        try:
            return await route.handler(request)
        except APIError as exc:
            return self.error(request.path, exc)
        except Exception as exc:
            log.exception("handler failed")
            error = APIError(500, f"internal error: {exc}", "internal_error")
            return self.error(request.path, error)

    async def _run_watched(
        self, route: Route, request: HTTPRequest, receive: Callable, send: Callable
    ) -> None:
        """Answer, streaming if asked; a client disconnect cancels the handler (and with it
        the engine request) instead of letting it run on for nobody."""
        task = asyncio.current_task()
        assert task is not None
        gone = finished = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if not finished:  # (after the answer, uvicorn reports "disconnect" too)
                gone = True
                task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            answer = await self._answer(route, request)
            if isinstance(answer, Response):
                await _send_response(send, answer)
                finished = True
                return
            frames = answer.frames
            try:
                await send({"type": "http.response.start", "status": 200, "headers": _SSE})
                try:
                    async for frame in frames:
                        await send({"type": "http.response.body", "body": frame, "more_body": True})
                except Exception as exc:  # the status is sent: end the stream with an error
                    log.exception("stream failed")
                    error = APIError(500, f"internal error: {exc}", "internal_error")
                    tail = b"data: " + orjson.dumps(error.body()) + b"\n\ndata: [DONE]\n\n"
                    await send({"type": "http.response.body", "body": tail, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                finished = True
            finally:
                await frames.aclose()  # type: ignore[attr-defined]
        except asyncio.CancelledError:
            if not gone:
                raise
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher


async def _send_response(send: Callable, response: Response) -> None:
    headers = [*response.headers, (b"content-length", str(len(response.body)).encode())]
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})
