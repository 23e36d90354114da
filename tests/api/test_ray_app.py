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

from radixserve.api.ray.app import Ingress, PrefixAwareRouter, build_app, coalesced  # noqa: E402
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
    from starlette.requests import Request

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
        def forward(self):
            return SimpleNamespace(remote=lambda *a, **k: Stream())

    ingress = Ingress(Handle(), retry_timeout_s=0.3)
    body = b'{"model": "m", "prompt": "hi"}'

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"content-type", b"application/json")],
        "query_string": b"",
    }
    start = time.monotonic()
    answer = asyncio.run(ingress(Request(scope, receive)))
    assert time.monotonic() - start < 5
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
    assert b'"no_replica"' in answer.body and Stream.cancelled


@pytest.fixture(scope="module")
def ray_app(tiny_llama):
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app(
        {
            "replicas": "2",
            "num_cpus": "0.5",
            "serve_args": f"--model {tiny_llama} --dtype float32",
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
        assert httpx.get(ray_app + admin, timeout=30).status_code in (403, 404), admin

    # kill one replica's actor while requests run: each is answered (retried on the
    # other replica when it had produced nothing), and Ray starts a new replica
    replicas = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "radixserve-replica" in a["name"]
    ]
    assert len(replicas) == 2
    victim = ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"])
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        running = [pool.submit(_complete, ray_app, p) for p in prompts * 2]
        time.sleep(0.3)
        ray.kill(victim, no_restart=True)
        answers = [f.result(timeout=180) for f in running]
    assert answers == expected * 2
    deadline = time.monotonic() + 180
    while True:
        status = serve.status().applications["radixserve"].deployments["radixserve-replica"]
        if status.status == "HEALTHY" and status.replica_states.get("RUNNING", 0) == 2:
            break
        assert time.monotonic() < deadline, status
        time.sleep(1)
    assert [_complete(ray_app, p) for p in prompts] == expected
