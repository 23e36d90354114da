"""The router in front of replicas that serve different models (several-model ``serve``
instances): it learns each replica's models from its ``/v1/models``, sends a request only
to replicas serving the model it names, prefers one where the model is loaded, and lists
every replica's models as one. In process, against raw asyncio sockets as workers."""

from __future__ import annotations

import asyncio

import orjson

from radixserve.api.asgi import HTTPRequest
from radixserve.api.router.server import Router, RouterConfig, served_models


def _card(name: str, status: str | None = None, **extra) -> dict:
    card = {"id": name, "object": "model", **extra}
    if status is not None:
        card["status"] = status
    return card


async def _worker(cards: list[dict], keys: tuple[str, ...] = ()):
    """A replica listing ``cards`` at /v1/models (a 401 without one of ``keys``, when
    given) and answering every POST with its own name; ``got`` lists the models asked."""
    got: list[str | None] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                fields = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
                status, body = 200, b""
                if lines[0].startswith("POST"):
                    sent = orjson.loads(await reader.readexactly(int(fields["content-length"])))
                    got.append(sent.get("model"))
                    body = orjson.dumps({"worker": port, "model": sent.get("model")})
                elif lines[0].startswith("GET /v1/models"):
                    if keys and fields.get("authorization") not in {f"bearer {k}" for k in keys}:
                        status, body = 401, orjson.dumps({"error": {"message": "key"}})
                    else:
                        body = orjson.dumps({"object": "list", "data": cards})
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (status, len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", got


def _request(model: str | None, prompt: str = "hello there") -> HTTPRequest:
    body = {"prompt": prompt, "max_tokens": 2}
    if model is not None:
        body["model"] = model
    return HTTPRequest("POST", "/v1/completions", {}, orjson.dumps(body))


def _run(lists: list[list[dict]], scenario, **config) -> None:
    keys = config.pop("keys", ())

    async def main() -> None:
        started = [await _worker(cards, keys) for cards in lists]
        router = Router(
            RouterConfig(
                tuple(url for _, url, _ in started), health_check_interval_s=3600, **config
            )
        )
        await router.start()
        try:
            await scenario(router, [got for _, _, got in started])
            assert router.balancer.load == [0] * len(started)
        finally:
            await router.shutdown()
            for server, _, _ in started:
                server.close()

    asyncio.run(main())


def test_what_a_replica_serves_is_read_from_its_model_list() -> None:
    listing = {
        "object": "list",
        "data": [
            _card("chat", "loaded", aliases=["default"]),
            _card("coder", "unloaded"),
            _card("sql", parent="coder", root="/adapters/sql"),
        ],
    }
    assert served_models(listing) == {
        "chat": "loaded",
        "default": "loaded",
        "coder": "unloaded",
        "sql": "unloaded",  # (an adapter runs where its base model is)
    }
    # a single-model server's card has no status: it is loaded
    assert served_models({"data": [_card("tiny")]}) == {"tiny": "loaded"}
    assert served_models({"error": {}}) is None and served_models([1]) is None


def test_each_request_goes_to_a_replica_that_serves_its_model() -> None:
    async def scenario(router: Router, got: list[list]) -> None:
        assert [w.models for w in router.workers] == [{"a": "loaded"}, {"b": "loaded"}]
        for i in range(6):
            model = "ab"[i % 2]
            answer = await router.proxy_generation(_request(model, f"prompt {i}"))
            assert answer.status == 200 and orjson.loads(answer.body)["model"] == model
        assert got == [["a"] * 3, ["b"] * 3]
        # so do the routes any replica serving the model answers (tokenizing, rendering)
        for model in "abab":
            tokenize = orjson.dumps({"model": model, "prompt": "hi"})
            answer = await router.forward_any(HTTPRequest("POST", "/tokenize", {}, tokenize))
            assert orjson.loads(answer.body)["model"] == model
        assert got == [["a"] * 5, ["b"] * 5]
        # a name no replica lists (the default model, an unknown one): any replica answers
        for model in (None, "nobody"):
            assert (await router.proxy_generation(_request(model))).status == 200
        assert len(got[0]) + len(got[1]) == 12

    _run([[_card("a")], [_card("b")]], scenario)


def test_a_replica_with_the_model_loaded_is_preferred_to_one_that_must_load_it() -> None:
    async def scenario(router: Router, got: list[list]) -> None:
        for i in range(4):  # (different prompts: the cache-aware policy would spread them)
            await router.proxy_generation(_request("m", f"{i} " * (i + 1)))
        assert got == [[], ["m"] * 4]
        # the warm replica gone: the other takes the model, and counts it as loaded once
        # it answered
        router.take_out(1, "test")
        await router.proxy_generation(_request("m"))
        assert got[0] == ["m"] and router.workers[0].models["m"] == "loaded"
        # unbalanced past the policy's thresholds: the cold replica is used
        router.workers[0].models["m"] = "unloaded"
        router.workers[1].healthy = True
        router.balancer.set_available(1, True)
        router.balancer.load[1] = 100
        await router.proxy_generation(_request("m", "another"))
        assert got[0] == ["m", "m"]
        router.balancer.load[1] = 0

    _run([[_card("m", "unloaded")], [_card("m", "loaded")]], scenario)


def test_the_model_list_is_every_replicas_as_one() -> None:
    async def scenario(router: Router, got: list[list]) -> None:
        answer = await router.list_models(HTTPRequest("GET", "/v1/models", {}, b""))
        data = orjson.loads(answer.body)["data"]
        assert {c["id"]: c.get("status", "loaded") for c in data} == {
            "a": "loaded",  # (loaded on the second replica)
            "b": "unloaded",
            "c": "loaded",
            "d": "loaded",  # (a single-model replica's card says nothing: it is loaded)
        }

    _run(
        [
            [_card("a", "unloaded"), _card("b", "unloaded")],
            [_card("a", "loaded"), _card("c", "loaded")],
            [_card("d")],
            [_card("d", "unloaded")],
        ],
        scenario,
    )


def test_replicas_that_take_keys_are_asked_with_the_routers_own() -> None:
    async def scenario(router: Router, got: list[list]) -> None:
        assert router.workers[0].models == {"a": "loaded"}
        # a client's own listing is asked with its credentials: without, the replica's 401
        answer = await router.list_models(HTTPRequest("GET", "/v1/models", {}, b""))
        assert answer.status == 401

    _run([[_card("a")]], scenario, keys=("sk-router",), worker_api_key="sk-router")
