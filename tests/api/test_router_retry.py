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
        while head.startswith(b"GET "):  # (a kept-alive connection may come back)
            ok = head.startswith(b"GET /health")  # (it names no models)
            writer.write(
                b"HTTP/1.1 %s\r\ncontent-length: 0\r\n\r\n" % (b"200 OK" if ok else b"404 X")
            )
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


_DONE_BODY = orjson.dumps({"object": "text_completion", "choices": [{"text": "ok"}]})


def _error_body(code: str) -> bytes:
    return orjson.dumps(
        {"error": {"message": code, "type": "service_unavailable_error", "code": code}}
    )


async def _scripted_worker(
    answers: list[tuple], healthy: list[bool] | None = None
) -> tuple[asyncio.AbstractServer, str, list[int]]:
    """A worker answering completions with ``answers`` in turn (the last one from then
    on): ``(status, body)``, or ``(status, body, content_type, delay_s)``; ``/health``
    with 200 while ``healthy[0]``. ``served`` lists the statuses it answered with."""
    served: list[int] = []
    healthy = healthy if healthy is not None else [True]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET /health"):
                    status, body = (200, b"") if healthy[0] else (503, _error_body("down"))
                elif head.startswith(b"GET "):  # (it names no models: /v1/models is a 404)
                    status, body = 404, _error_body("not_found")
                else:
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    await reader.readexactly(length)
                    status, body, *rest = answers[min(len(served), len(answers) - 1)]
                    ctype, delay = rest if rest else (b"application/json", 0.0)
                    served.append(status)
                    await asyncio.sleep(delay)
                if head.startswith(b"GET "):
                    ctype = b"application/json"
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-type: %s\r\n"
                    b"content-length: %d\r\n\r\n%s" % (status, ctype, len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", served


def _completion() -> HTTPRequest:
    body = orjson.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2})
    return HTTPRequest("POST", "/v1/completions", {}, body)


def _run_with(workers: list[tuple], config: dict, scenario) -> None:
    async def main() -> None:
        started = [await _scripted_worker(*w) for w in workers]
        router = Router(RouterConfig(tuple(url for _, url, _ in started), **config))
        await router.start()
        try:
            await scenario(router, [served for _, _, served in started])
            assert router.balancer.load == [0] * len(started)
            assert all(not w.flights for w in router.workers) and router.queued == 0
        finally:
            await router.shutdown()
            for server, _, _ in started:
                server.close()

    asyncio.run(main())


def test_a_request_outlives_both_replicas_dying_under_it() -> None:
    """Each replica's engine dies under the request once (503 engine_dead): it was sent to
    one, then the other, and is sent again when the first is back (before, with both
    tried, the client got the 503)."""
    dead = (503, _error_body("engine_dead"))

    async def scenario(router: Router, served: list[list[int]]) -> None:
        response = await asyncio.wait_for(router.proxy_generation(_completion()), 10)
        assert response.status == 200 and orjson.loads(response.body) == orjson.loads(_DONE_BODY)
        assert sorted(map(len, served)) == [1, 2]
        assert sum(router.retried.labels(w.url)._value.get() for w in router.workers) == 2
        assert all(router.failed.labels(w.url)._value.get() == 0 for w in router.workers)

    _run_with([([dead, (200, _DONE_BODY)],)] * 2, {"health_check_interval_s": 3600}, scenario)


def test_a_request_every_replica_refuses_as_overloaded_waits_for_room() -> None:
    """Backpressure: a replica refusing the request as overloaded (503 overloaded) is asked
    again after a backoff, without using the failure budget (max_retries 0)."""
    busy = (503, _error_body("overloaded"))

    async def scenario(router: Router, served: list[list[int]]) -> None:
        response = await asyncio.wait_for(router.proxy_generation(_completion()), 10)
        assert response.status == 200
        assert served == [[503, 503, 503, 200]]

    config = {"health_check_interval_s": 3600, "max_retries": 0}
    _run_with([([busy, busy, busy, (200, _DONE_BODY)],)], config, scenario)


def test_a_request_waits_for_a_replica_to_come_back() -> None:
    """No healthy replica when the request comes: it waits until one passes its health
    check rather than failing at once."""
    healthy = [False]

    async def scenario(router: Router, served: list[list[int]]) -> None:
        assert not router.workers[0].healthy
        answer = asyncio.create_task(router.proxy_generation(_completion()))
        await asyncio.sleep(0.3)
        assert not answer.done() and router.queued == 1
        healthy[0] = True
        response = await asyncio.wait_for(answer, 5)
        assert response.status == 200 and served == [[200]]

    _run_with([([(200, _DONE_BODY)], healthy)], {"health_check_interval_s": 0.05}, scenario)


@pytest.mark.parametrize("budget", ["retries", "time"])
def test_the_last_failure_is_answered_when_the_budget_is_spent(budget) -> None:
    """A replica that keeps failing: after max_retries failures (or past retry_timeout_s)
    the client gets its 503 as it came."""
    dead = (503, _error_body("engine_dead"))

    async def scenario(router: Router, served: list[list[int]]) -> None:
        response = await asyncio.wait_for(router.proxy_generation(_completion()), 10)
        assert response.status == 503
        assert orjson.loads(response.body)["error"]["code"] == "engine_dead"
        assert served == [[503] * (2 if budget == "retries" else 1)]
        assert router.failed.labels(router.workers[0].url)._value.get() == 1

    config = {"health_check_interval_s": 3600}
    config |= {"max_retries": 1} if budget == "retries" else {"retry_timeout_s": 0.3}
    _run_with([([dead],)], config, scenario)


_SSE = b"text/event-stream"


def _stream_of(*events: bytes) -> bytes:
    return b"".join(b"data: " + e + b"\n\n" for e in events) + b"data: [DONE]\n\n"


_ROLE = b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}'
_TOKEN = b'{"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":null}]}'


@pytest.mark.parametrize("code", ["engine_dead", "overloaded"])
def test_a_stream_that_failed_before_any_output_goes_elsewhere(code) -> None:
    """A chat stream whose role chunk came, then its engine's failure (or its refusal as
    overloaded) before any token: nothing is passed on, the request goes to the other
    worker, and the client sees one clean stream."""
    failed = (200, _stream_of(_ROLE, _error_body(code)), _SSE, 0.0)
    good = (200, _stream_of(_ROLE, _TOKEN), _SSE, 0.0)

    async def scenario(router: Router, served: list[list[int]]) -> None:
        body = orjson.dumps({"model": "tiny", "messages": [], "stream": True})
        request = HTTPRequest("POST", "/v1/chat/completions", {}, body)
        response = await asyncio.wait_for(router.proxy_generation(request), 10)
        frames = b"".join([f async for f in response.frames])
        assert b"error" not in frames and frames.count(_ROLE) == 1 and _TOKEN in frames
        assert sorted(map(len, served)) == [1, 1]

    config = {"health_check_interval_s": 3600, "policy": "round-robin"}
    _run_with([([failed],), ([good],)], config, scenario)


def test_a_messages_529_is_waited_out() -> None:
    """Messages' overload answer is Anthropic's 529 overloaded_error: backpressure too."""
    busy = (529, b'{"type":"error","error":{"type":"overloaded_error","message":"full"}}')
    ok = (200, b'{"type":"message","content":[]}')

    async def scenario(router: Router, served: list[list[int]]) -> None:
        request = HTTPRequest("POST", "/v1/messages", {}, b'{"model":"tiny","messages":[]}')
        response = await asyncio.wait_for(router.proxy_generation(request), 10)
        assert response.status == 200 and served == [[529, 200]]

    _run_with([([busy, ok],)], {"health_check_interval_s": 3600, "max_retries": 0}, scenario)


def test_the_budget_counts_from_the_first_failure() -> None:
    """A first attempt that outlasts --retry-timeout and then fails still goes to the
    other worker (the budget is for waiting, not for the first answer)."""
    slow_dead = (503, _error_body("engine_dead"), b"application/json", 0.5)

    async def scenario(router: Router, served: list[list[int]]) -> None:
        response = await asyncio.wait_for(router.proxy_generation(_completion()), 10)
        assert response.status == 200 and served == [[503], [200]]

    config = {"health_check_interval_s": 3600, "retry_timeout_s": 0.2, "policy": "round-robin"}
    _run_with([([slow_dead],), ([(200, _DONE_BODY)],)], config, scenario)


def test_a_client_leaving_while_its_request_waits_leaves_nothing_behind() -> None:
    async def scenario(router: Router, served: list[list[int]]) -> None:
        task = asyncio.create_task(router.proxy_generation(_completion()))
        await asyncio.sleep(0.2)
        assert router.queued == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    _run_with([([(200, _DONE_BODY)], [False])], {"health_check_interval_s": 3600}, scenario)


def test_a_backoff_that_passed_is_not_waited_for() -> None:
    """Only avoided workers whose backoff is still running set the next wake-up (an
    expired entry would make a waiting request spin)."""
    from radixserve.api.router.server import Worker, _Avoid

    workers = [Worker("http://a"), Worker("http://b")]
    avoid = _Avoid()
    avoid.add(0, 0, (1.0, 8.0), now=100.0)  # until 101
    avoid.add(1, 0, (5.0, 8.0), now=100.0)  # until 105
    assert avoid.next_change(workers, 100.5) == pytest.approx(0.5)
    assert avoid.next_change(workers, 102.0) == pytest.approx(3.0)  # 0's has passed
    workers[1].epoch += 1  # 1 came back: no longer avoided
    assert avoid.next_change(workers, 102.0) is None
    assert avoid.excluded(workers, 102.0) == frozenset()
