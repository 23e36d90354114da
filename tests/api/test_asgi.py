"""The ASGI layer on its own (no model, no server): routing, limits, errors, streaming and
client disconnects, driven through the ASGI interface as uvicorn drives it."""

from __future__ import annotations

import asyncio

import orjson

from radixserve.api.asgi import (
    APIError,
    ASGIApp,
    HTTPRequest,
    StreamResponse,
    json_response,
)


class _Client:
    """Plays uvicorn: feeds the body, records what the app sends, can disconnect."""

    def __init__(self, body: bytes = b"", chunk: int = 1 << 20) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()
        for i in range(0, max(len(body), 1), chunk):
            part = body[i : i + chunk]
            self.inbox.put_nowait(
                {"type": "http.request", "body": part, "more_body": i + chunk < len(body)}
            )
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        return await self.inbox.get()

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def disconnect(self) -> None:
        self.inbox.put_nowait({"type": "http.disconnect"})

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])


def _scope(method: str, path: str, headers: list | None = None) -> dict:
    return {"type": "http", "method": method, "path": path, "headers": headers or []}


async def _noop() -> None:
    return None


def _app(events: list) -> ASGIApp:
    def authorize(request: HTTPRequest) -> APIError | None:
        if request.path == "/secret" and request.headers.get("authorization") != "Bearer k":
            return APIError(401, "no", "authentication_error")
        return None

    app = ASGIApp(64, authorize, _noop, _noop)

    @app.route("POST", "/echo")
    async def echo(request: HTTPRequest):
        return json_response({"got": request.body.decode()})

    @app.route("GET", "/secret")
    async def secret(_: HTTPRequest):
        return json_response({"ok": True})

    @app.route("GET", "/bad")
    async def bad(_: HTTPRequest):
        raise APIError(400, "nope", param="x")

    @app.route("GET", "/bug")
    async def bug(_: HTTPRequest):
        raise RuntimeError("boom")

    @app.route("GET", "/stream", watch_disconnect=True)
    async def stream(_: HTTPRequest):
        async def frames():
            try:
                for i in range(3):
                    yield b"data: %d\n\n" % i
                    await asyncio.sleep(0.01)
                if events and events[0] == "fail":
                    raise RuntimeError("mid-stream")
                await asyncio.sleep(10)  # a long generation
            finally:
                events.append("closed")

        return StreamResponse(frames())

    return app


def test_routing_limits_and_errors():
    async def scenario():
        app = _app([])
        out = {}
        for name, scope, body in (
            ("ok", _scope("POST", "/echo"), b"hi"),
            ("chunked", _scope("POST", "/echo"), b"abcdefgh"),
            ("404", _scope("GET", "/nowhere"), b""),
            ("405", _scope("GET", "/echo"), b""),
            ("413", _scope("POST", "/echo"), b"x" * 65),
            ("401", _scope("GET", "/secret"), b""),
            ("authorized", _scope("GET", "/secret", [(b"Authorization", b"Bearer k")]), b""),
            ("400", _scope("GET", "/bad"), b""),
            ("500", _scope("GET", "/bug"), b""),
        ):
            client = _Client(body, chunk=3 if name == "chunked" else 1 << 20)
            await app(scope, client.receive, client.send)
            out[name] = client
        return out

    out = asyncio.run(scenario())
    assert out["ok"].status == 200 and orjson.loads(out["ok"].body) == {"got": "hi"}
    assert orjson.loads(out["chunked"].body) == {"got": "abcdefgh"}
    for name, status in (("404", 404), ("405", 405), ("413", 413), ("401", 401), ("400", 400)):
        client = out[name]
        assert client.status == status, name
        assert set(orjson.loads(client.body)["error"]) == {"message", "type", "param", "code"}
    assert out["405"].headers[b"allow"] == b"POST"
    assert orjson.loads(out["400"].body)["error"]["param"] == "x"
    assert out["authorized"].status == 200
    assert out["500"].status == 500 and b"boom" in out["500"].body


def test_client_disconnect_cancels_the_stream_and_closes_its_generator():
    events: list = []

    async def scenario():
        client = _Client()
        task = asyncio.create_task(
            _app(events)(_scope("GET", "/stream"), client.receive, client.send)
        )
        await asyncio.sleep(0.1)  # three frames out, then the generation waits
        client.disconnect()
        await asyncio.wait_for(task, 2)  # returns promptly, without raising
        return client

    client = asyncio.run(scenario())
    assert client.status == 200 and client.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert events == ["closed"]


def test_an_exception_mid_stream_ends_it_with_an_error_event():
    events: list = ["fail"]

    async def scenario():
        client = _Client()
        await _app(events)(_scope("GET", "/stream"), client.receive, client.send)
        return client

    client = asyncio.run(scenario())
    frames = client.body.split(b"\n\n")
    assert frames[:3] == [b"data: 0", b"data: 1", b"data: 2"]
    assert orjson.loads(frames[3][6:])["error"]["type"] == "internal_error"
    assert frames[4] == b"data: [DONE]" and client.sent[-1]["more_body"] is False
    assert events == ["fail", "closed"]


def test_lifespan_runs_startup_and_shutdown():
    calls: list[str] = []

    async def up() -> None:
        calls.append("up")

    async def down() -> None:
        calls.append("down")

    async def scenario():
        app = ASGIApp(10, lambda r: None, up, down)
        inbox: asyncio.Queue = asyncio.Queue()
        for kind in ("lifespan.startup", "lifespan.shutdown"):
            inbox.put_nowait({"type": kind})
        sent: list = []

        async def send(message):
            sent.append(message["type"])

        await app({"type": "lifespan"}, inbox.get, send)
        return sent

    sent = asyncio.run(scenario())
    assert calls == ["up", "down"]
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
