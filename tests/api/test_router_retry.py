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
