"""The router's read-only routes in process, against raw asyncio sockets as workers: a
worker taken out while a request is on its way to it does not fail that request."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from radixserve.api.asgi import APIError, HTTPRequest
from radixserve.api.router.server import Router, RouterConfig

_MODELS = orjson.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]})


async def _answering_worker() -> tuple[asyncio.AbstractServer, str, list[bytes]]:
    """Answers every request with the same 200 JSON body; records each request line."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                seen.append(head.split(b"\r\n", 1)[0])
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(_MODELS), _MODELS)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


async def _silent_worker() -> tuple[asyncio.AbstractServer, str, asyncio.Event]:
    """Accepts connections and never answers (a hung process); ``got`` is set once a
    request other than a health check has arrived."""
    got = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"GET /health"):
            got.set()
        await asyncio.sleep(3600)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", got


def test_a_worker_taken_out_mid_request_sends_the_request_elsewhere() -> None:
    async def scenario() -> None:
        silent, silent_url, got = await _silent_worker()
        good, good_url, seen = await _answering_worker()
        router = Router(
            RouterConfig(
                (silent_url, good_url),
                health_check_interval_s=3600,
                health_check_timeout_s=0.2,
                health_failure_threshold=2,  # one missed check: still in
            )
        )
        await router.start()
        try:
            assert [w.healthy for w in router.workers] == [False, True]
            router.workers[0].healthy = True  # as if it had answered before it hung
            router.balancer.set_available(0, True)
            router._rr = -1  # the next read-only request goes to the silent worker
            request = HTTPRequest("GET", "/v1/models", {}, b"")
            answer = asyncio.create_task(router.forward_any(request))
            await asyncio.wait_for(got.wait(), 5)
            router.take_out(0, "failed its health check")
            response = await asyncio.wait_for(answer, 5)
            assert response.status == 200 and orjson.loads(response.body) == orjson.loads(_MODELS)
            assert seen[-1] == b"GET /v1/models HTTP/1.1"
            # not a failed request: a retry; nothing left in flight
            assert router.failed.labels(silent_url)._value.get() == 0
            assert router.retried.labels(silent_url)._value.get() == 1
            assert router.balancer.load == [0, 0]
            assert not router.workers[0].flights and not router.workers[1].flights
        finally:
            await router.shutdown()
            silent.close()
            good.close()

    asyncio.run(scenario())


def test_a_read_only_request_fails_only_when_no_worker_is_left() -> None:
    async def scenario() -> None:
        silent, silent_url, got = await _silent_worker()
        router = Router(
            RouterConfig((silent_url,), health_check_interval_s=3600, health_check_timeout_s=0.2)
        )
        await router.start()
        try:
            router.workers[0].healthy = True
            router.balancer.set_available(0, True)
            answer = asyncio.create_task(
                router.forward_any(HTTPRequest("GET", "/v1/models", {}, b""))
            )
            await asyncio.wait_for(got.wait(), 5)
            router.take_out(0, "failed its health check")
            with pytest.raises(APIError, match="failed its health check") as error:
                await asyncio.wait_for(answer, 5)
            assert error.value.status == 502 and error.value.code == "worker_failed"
            assert router.balancer.load == [0]
        finally:
            await router.shutdown()
            silent.close()

    asyncio.run(scenario())


async def _slow_body_worker(hang: bool) -> tuple[asyncio.AbstractServer, str, asyncio.Event]:
    """Answers a completion with the head of a 200 JSON answer, then (after ``sent`` is set
    and 0.3 s) its body, or never (``hang``): a non-streamed answer whose body is still on
    its way when the worker is taken out."""
    sent = asyncio.Event()
    body = orjson.dumps({"object": "text_completion", "choices": [{"text": "ok"}]})

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        while head.startswith(b"GET /health"):  # (a kept-alive connection may come back)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body)
        )
        await writer.drain()
        sent.set()
        await asyncio.sleep(3600 if hang else 0.3)
        writer.write(body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", sent


@pytest.mark.parametrize("hang", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_whole_answer_on_its_way_survives_its_worker_being_taken_out(hang) -> None:
    """A non-streamed answer whose head has come when the health check takes its worker
    out was complete at the worker: its body is let through (the soak saw such a request
    fail with worker_failed); a worker that hangs mid-body still fails it, after the
    grace."""

    async def scenario() -> None:
        worker, url, sent = await _slow_body_worker(hang)
        router = Router(RouterConfig((url,), health_check_interval_s=3600))
        await router.start()
        try:
            assert router.workers[0].healthy
            body = orjson.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2})
            request = HTTPRequest("POST", "/v1/completions", {}, body)
            answer = asyncio.create_task(router.proxy_generation(request))
            await asyncio.wait_for(sent.wait(), 5)
            await asyncio.sleep(0.05)  # the head is through to the router
            router.take_out(0, "failed its health check")
            if hang:
                with pytest.raises(APIError, match="failed its health check") as error:
                    await asyncio.wait_for(answer, 10)
                assert error.value.status == 502
            else:
                response = await asyncio.wait_for(answer, 5)
                assert response.status == 200
                assert orjson.loads(response.body)["choices"][0]["text"] == "ok"
                assert router.failed.labels(url)._value.get() == 0
            assert router.balancer.load == [0]
            assert not router.workers[0].flights
        finally:
            await router.shutdown()
            worker.close()

    asyncio.run(scenario())
