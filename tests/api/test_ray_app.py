"""radixserve as a Ray Serve application (``radixserve/api/ray/app.py``) on a real local
Ray cluster: two replicas of a tiny model behind the ingress; answers equal one
``radixserve serve``'s; a replica actor killed under load is replaced by Ray with nothing
lost. And the prefix-aware request router alone, with stand-in replicas. Skipped without
``ray[serve]``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
psutil = pytest.importorskip("psutil")

from radixserve.api.ray import app as ray_app_module  # noqa: E402
from radixserve.api.ray.app import (  # noqa: E402
    Ingress,
    PrefixAwareRouter,
    build_app,
    coalesced,
    held_requests,
    queue_depth_policy,
)
from radixserve.api.router.server import routing_key, routing_namespace  # noqa: E402
from tests.api.server_helpers import ServerProcess, free_port  # noqa: E402


@dataclass
class _Replica:
    replica_id: str
    routing_stats: dict = field(default_factory=dict)


@dataclass
class _Pending:
    kwargs: dict
    args: list = field(default_factory=list)
    routing_context: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(should_backoff=False)
    )


class _Cache:
    def get(self, replica_id):
        return None


def _router() -> tuple[PrefixAwareRouter, list[_Replica]]:
    replicas = [_Replica("a"), _Replica("b")]

    class Router(PrefixAwareRouter):
        curr_replicas = property(lambda self: {r.replica_id: r for r in replicas})
        replica_queue_len_cache = property(lambda self: _Cache())

    router = Router.__new__(Router)  # (no Ray deployment around it)
    router.initialize_state(cache_threshold=0.5)
    return router, replicas


def test_the_router_sends_a_prefix_back_where_it_went() -> None:
    router, replicas = _router()

    def choose(prompt: str, key: str = "k1", avoid: tuple[str, ...] = ()) -> str:
        body = {"model": "m", "prompt": prompt}
        headers = {"authorization": key}
        routing = (routing_key("/v1/completions", body), routing_namespace("tenant", headers, body))
        pending = _Pending({"routing": routing, "avoid": avoid})
        ranks = asyncio.run(router.choose_replicas(replicas, pending))
        assert pending.routing_context.should_backoff  # (Ray waits when all are full)
        ranked = sorted(r.replica_id for rank in ranks for r in rank)
        assert ranked == sorted(r.replica_id for r in replicas)  # each once
        return ranks[0][0].replica_id

    story = "Once upon a time there was a very long shared system prompt. " * 4
    first = choose(story + "first question")
    assert choose(story + "second question") == first  # the prefix went there
    other = choose("something else entirely, unrelated to the story above")
    assert other != first  # a new prefix goes to the replica with room
    # a retry avoids the replica that failed it, even where its prefix is
    assert choose(story + "second question", avoid=(first,)) == other
    # another tenant's identical prompt does not match (the namespace leads the key)
    assert choose(story + "first question", key="k2") in ("a", "b")
    # a replica Ray no longer has is forgotten: its tree goes with it
    replicas.pop(["a", "b"].index(first))
    assert choose(story + "third question") == other
    assert first not in router.slots


def test_the_router_counts_answers_read_over_loopback_and_honours_a_pin(monkeypatch) -> None:
    router, replicas = _router()

    def ranks(kwargs: dict) -> list[list[str]]:
        chosen = asyncio.run(router.choose_replicas(replicas, _Pending(kwargs)))
        return [[r.replica_id for r in rank] for rank in chosen]

    routing = ("a new prefix nobody has sent", "")
    # Ray's queues are empty, but this process reads 9 answers from "a" over loopback
    monkeypatch.setitem(ray_app_module._LOCAL_LOADS, "a", 9)
    assert ranks({"routing": routing})[0] == ["b"]
    monkeypatch.setitem(ray_app_module._LOCAL_LOADS, "a", 0)
    monkeypatch.setitem(ray_app_module._LOCAL_LOADS, "b", 9)
    assert ranks({"routing": ("another new prefix", "")})[0] == ["a"]
    # a request already routed (its address asked) goes to the replica it names, then to
    # the others, those that failed it last
    assert ranks({"routing": routing, "pin": "a"}) == [["a"], ["b"]]
    assert ranks({"routing": routing, "pin": "b"}) == [["b"], ["a"]]
    replicas.append(_Replica("c"))
    assert ranks({"routing": routing, "pin": "a", "avoid": ("b",)}) == [["a"], ["c"], ["b"]]


def test_the_ingress_passes_on_its_routes_only() -> None:
    class Handle:
        def options(self, **_):
            return self

        @property
        def address(self):
            raise AssertionError("no replica is asked for a path the ingress refuses")

    ingress = Ingress(Handle())
    for path in (
        "/metrics",
        "/v1/models/../../metrics",
        "/v1/completions/./x",
        "/v1/models/a\nb",
        "/console",
    ):
        answer = asyncio.run(ingress(_request(b"{}", path)))
        assert answer.status_code == 404 and b'"not_found"' in answer.body, path


def test_autoscaling_reads_the_requests_the_servers_hold() -> None:
    metrics = (
        "# HELP radixserve_num_requests_running Requests running\n"
        "# TYPE radixserve_num_requests_running gauge\n"
        "radixserve_num_requests_running 5.0\n"
        "radixserve_num_requests_waiting 12.0\n"
        "radixserve_num_requests_total 99.0\n"
        "radixserve_num_requests_running_seconds_total 7.0\n"
        'vllm:num_requests_running{model_name="m"} 5.0\n'
    )
    assert held_requests(metrics) == 17.0
    config = SimpleNamespace(get_target_ongoing_requests=lambda: 8.0)
    ctx = SimpleNamespace(
        current_num_replicas=2,
        target_num_replicas=2,
        aggregated_metrics={"requests": {"r1": 17.0, "r2": 9.0}},
        total_queued_requests=6.0,
        config=config,
    )
    assert queue_depth_policy(ctx) == (4.0, {})  # (17 + 9 + 6) / 8
    ctx.aggregated_metrics = None  # no report yet: what Ray queues
    assert queue_depth_policy(ctx) == (0.75, {})
    ctx.current_num_replicas, ctx.target_num_replicas = 0, 1  # (Ray's cold start)
    assert queue_depth_policy(ctx) == (1, {})


def test_chunks_that_arrive_together_travel_as_one() -> None:
    async def source(fail: bool):
        for i in range(6):
            yield b"e%d;" % i
            if i == 2:
                await asyncio.sleep(0.05)  # a pause: what came before goes out alone
        if fail:
            raise ConnectionError("cut")

    async def read(fail: bool, slow: bool) -> list[bytes]:
        out = []
        async for batch in coalesced(source(fail)):
            out.append(batch)
            if slow:
                await asyncio.sleep(0.01)  # a busy reader: the rest piles up
        return out

    fast = asyncio.run(read(False, False))
    assert b"".join(fast) == b"e0;e1;e2;e3;e4;e5;"
    slow = asyncio.run(read(False, True))
    assert b"".join(slow) == b"e0;e1;e2;e3;e4;e5;"
    assert len(slow) < 6  # batched while the reader was busy
    with pytest.raises(ConnectionError):
        asyncio.run(read(True, True))  # everything before the failure, then the failure


def test_a_request_no_replica_takes_gets_a_503_within_the_budget() -> None:
    """While no replica is up (or all are full) Ray's handle waits to assign a request;
    the ingress bounds that wait by its retry budget and answers a 503 saying so."""

    class Stream:
        cancelled = False

        async def _fetch_future_result_async(self):
            await asyncio.sleep(3600)  # never assigned

        def cancel(self):
            Stream.cancelled = True

    class Handle:
        def options(self, **_):
            return self

        @property
        def address(self):
            return SimpleNamespace(remote=lambda *a, **k: Stream())

    ingress = Ingress(Handle(), retry_timeout_s=0.3)
    start = time.monotonic()
    answer = asyncio.run(ingress(_request(b'{"model": "m", "prompt": "hi"}')))
    assert time.monotonic() - start < 5
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
    assert b'"no_replica"' in answer.body and Stream.cancelled


def _request(body: bytes, path: str = "/v1/completions"):
    from starlette.requests import Request

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"content-type", b"application/json")],
        "query_string": b"",
    }
    return Request(scope, receive)


class _Chosen:
    """An ``address`` call's answer as Ray's handle gives it: assigned at once."""

    def __init__(self, where: dict[str, str]) -> None:
        self.where = where

    async def _fetch_future_result_async(self) -> None:
        return None

    def __await__(self):
        return asyncio.sleep(0, self.where).__await__()


_FULL = b'{"error": {"message": "full", "type": "overloaded_error", "code": "overloaded"}}'
_EVENTS = (  # (the role event as a replica writes it: held back as a preamble)
    b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\n',
    b'data: {"choices": [{"delta": {"content": " there"}}]}\n\n',
    b"data: [DONE]\n\n",
)


async def _scripted_server(name: str, script: list[str]) -> tuple[asyncio.AbstractServer, dict]:
    """A replica's server over loopback, answering each request by the next of ``script``:
    ``full`` (a 503 as a full server's), ``stream`` (a chat stream) or ``cut`` (a
    stream whose connection drops after its first token)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        what = script.pop(0)
        if what == "full":
            writer.write(
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(_FULL), _FULL)
            )
        else:
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            for event in _EVENTS[:2] if what == "cut" else _EVENTS:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
            if what == "hold":
                await asyncio.sleep(3600)  # (a long answer: the client leaves first)
            if what != "cut":
                writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    return server, {"url": url, "node": None, "replica": name}


def test_an_answer_read_over_loopback_is_retried_elsewhere_until_its_first_output() -> None:
    """On the ingress's own node an answer is read from the replica's server over
    loopback: a replica that answers full is avoided on the next try; the stream that
    produced output is passed on whole; one cut after its first output ends with an
    error event; and nothing stays counted as running on a replica."""

    async def scenario() -> None:
        script_a = ["full", "stream"]
        server_a, a = await _scripted_server("a", script_a)
        server_b, b = await _scripted_server("b", ["stream", "cut"])
        asked: list[tuple[str, ...]] = []
        picks = [a, b, a]  # each request's first choice

        def address(routing=("", ""), avoid=()):
            asked.append(tuple(avoid))
            return _Chosen(b if "a" in avoid else picks.pop(0))

        class Handle:
            def options(self, **_):
                return self

            @property
            def address(self):
                return SimpleNamespace(remote=address)

        ingress = Ingress(Handle(), retry_timeout_s=10)
        assert ingress.node_id is None  # (as the stand-in replicas' node)
        body = b'{"model": "m", "messages": [], "stream": true}'

        async def chat() -> bytes:
            answer = await ingress(_request(body, "/v1/chat/completions"))
            assert answer.status_code == 200
            return b"".join([chunk async for chunk in answer.body_iterator])

        try:
            assert await chat() == b"".join(_EVENTS)  # a was full: b answered
            assert asked == [(), ("a",)]
            cut = await chat()  # b again: its connection drops after "Hi"
            assert cut.startswith(b"".join(_EVENTS[:2])) and b'"worker_failed"' in cut
            assert cut.endswith(b"data: [DONE]\n\n")
            assert await chat() == b"".join(_EVENTS)  # a, which answers now
            assert asked == [(), ("a",), (), ()]
            # a client that leaves mid-stream: the answer is counted while it runs, and
            # its connection to the replica is let go when the client goes
            picks.append(a)
            script_a.append("hold")
            answer = await ingress(_request(body, "/v1/chat/completions"))
            assert ray_app_module._LOCAL_LOADS == {"a": 1}

            class Gone(Exception):
                pass

            sent: list[dict] = []

            async def send(message: dict) -> None:
                sent.append(message)
                if message.get("body"):
                    raise Gone

            async def receive() -> dict:
                await asyncio.sleep(3600)
                return {"type": "http.disconnect"}

            with pytest.raises(Gone):
                await answer({"type": "http"}, receive, send)
            assert sent[1]["body"].startswith(_EVENTS[0] + _EVENTS[1])  # (preamble held)
        finally:
            server_a.close()
            server_b.close()
        assert ray_app_module._LOCAL_LOADS == {}

    asyncio.run(scenario())


@pytest.fixture(scope="module", params=["loopback", "ray"])
def ray_app(tiny_llama, request):
    """The application on a local Ray cluster, its answers read over loopback (the
    default: one node) or through Ray's handle (as from another node)."""
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app(
        {
            "replicas": "2",
            "num_cpus": "0.5",
            "serve_args": f"--model {tiny_llama} --dtype float32",
            "transport": request.param,
        }
    )
    serve.run(app, name="radixserve", route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _complete(url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


@pytest.mark.slow
def test_answers_equal_one_server_and_a_killed_replica_loses_nothing(ray_app, tiny_llama):
    prompts = [f"request {i} about the weather" for i in range(6)]
    single = ServerProcess("--model", str(tiny_llama), "--dtype", "float32")
    try:
        expected = [_complete(single.url, p) for p in prompts]
    finally:
        single.stop()
    assert [_complete(ray_app, p) for p in prompts] == expected
    # a streamed chat passes through whole
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", ray_app + "/v1/chat/completions", json=body, timeout=120) as r:
        lines = [x for x in r.iter_lines() if x]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert not any('"error"' in x for x in lines)
    (card,) = httpx.get(ray_app + "/v1/models", timeout=30).json()["data"]
    # the network's clients are not the operator: no admin route, no operator's fields
    assert "memory_bytes" not in card and "in_flight" not in card
    for admin in ("/metrics", "/debug/engine", "/v1/models/load", "/console"):
        # (401: the replicas hold an admin key of their own, for the load they report)
        assert httpx.get(ray_app + admin, timeout=30).status_code in (401, 403, 404), admin

    # kill one replica's actor while requests run: each is answered (retried on the
    # other replica when it had produced nothing), and Ray starts a new replica
    replicas = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "radixserve-replica" in a["name"]
    ]
    assert len(replicas) == 2
    before = _server_pids()
    assert len(before) == 2
    victim = ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"])
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        running = [pool.submit(_complete, ray_app, p) for p in prompts * 2]
        time.sleep(0.3)
        ray.kill(victim, no_restart=True)
        answers = [f.result(timeout=180) for f in running]
    assert answers == expected * 2
    # (Serve's status says two replicas run for a while after one died: count servers)
    _wait_for_a_new_server(before)
    assert [_complete(ray_app, p) for p in prompts] == expected

    # kill a replica's server itself (its actor lives on): the answers it was giving fail
    # before any output (none is streamed) and are sent to the other replica, and Ray's
    # health check replaces the replica whose server is gone
    before = _server_pids()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        running = [pool.submit(_complete, ray_app, p) for p in prompts * 2]
        time.sleep(0.3)
        psutil.Process(min(before)).kill()
        answers = [f.result(timeout=180) for f in running]
    assert answers == expected * 2
    _wait_for_a_new_server(before)
    assert [_complete(ray_app, p) for p in prompts] == expected


def _wait_for_a_new_server(before: set[int]) -> None:
    """Until two replicas' servers run again, one of them started after ``before``."""
    deadline = time.monotonic() + 180
    while True:
        now = _server_pids()
        if len(now) == 2 and now != before:
            return
        assert time.monotonic() < deadline, f"Ray did not replace the replica: {now}"
        time.sleep(1)


def _server_pids() -> set[int]:
    return {
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if "--behind-proxy" in (p.info["cmdline"] or []) and p.is_running()
    }
