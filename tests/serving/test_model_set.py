"""The model set of a several-model server, with stand-in frontends (no model, no engine):
which models are loaded, when they are unloaded, what the memory budget allows, what a
request waiting for a load is told, and how models are found in a folder."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import types
from pathlib import Path
from typing import ClassVar

import pytest

from radixserve.engine.config import EngineConfig
from radixserve.serving import model_set as ms
from radixserve.serving.frontend import ServingConfig
from radixserve.serving.model_set import (
    ModelBusy,
    ModelNotFound,
    ModelSet,
    ModelSpec,
    ModelUnavailable,
    model_specs,
    parse_keep_alive,
)

GIB = 2**30


class FakeFrontend:
    """What ``ModelSet`` uses of a ``Frontend``: start, shutdown, a client without process."""

    log: ClassVar[list[str]] = []

    def __init__(self, config: EngineConfig, serving: ServingConfig, fail: bool = False) -> None:
        self.name = serving.served_model_name
        self.fail = fail
        self.client = object()
        self.loras: dict[str, str] = {}
        self.running = False

    async def start(self) -> None:
        await asyncio.sleep(0.01)
        if self.fail:
            raise RuntimeError("bad file")
        self.running = True
        FakeFrontend.log.append(f"load {self.name}")

    async def shutdown(self) -> None:
        self.running = False
        FakeFrontend.log.append(f"unload {self.name}")


def _specs(tmp_path: Path, names: str = "abc", **kw) -> list[ModelSpec]:
    """Models of one GiB each as counted (a stand-in file, the engine and a KV cache)."""
    specs = []
    for name in names:
        f = tmp_path / f"{name}.weights"
        f.write_bytes(b"\0" * 1024)
        kv = (GIB - ms.ENGINE_OVERHEAD_BYTES - 1024) / GIB
        config = EngineConfig(model=str(f), kv_cache_memory_gb=kv)
        specs.append(ModelSpec(name, config, **kw))
    return specs


def _set(tmp_path: Path, budget_gib: float | None = 2, fail: set[str] = frozenset(), **kw):
    FakeFrontend.log = []

    def make(config: EngineConfig, serving: ServingConfig, tokenizer=None) -> FakeFrontend:
        frontend = FakeFrontend(config, serving, serving.served_model_name in fail)
        frontend.tokenizer = tokenizer
        return frontend

    budget = None if budget_gib is None else int(budget_gib * GIB)
    return ModelSet(_specs(tmp_path), ServingConfig(), budget, make_frontend=make, **kw)


def run(coro):
    return asyncio.run(coro)


def state(models: ModelSet, name: str) -> str:
    return next(s["status"] for s in models.status() if s["id"] == name)


async def until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_load_takes_the_tokenizer_its_check_read(tmp_path, monkeypatch):
    """A request checked against the model's files before the load leaves the model's
    tokenizer read: the load takes it rather than reading it again."""
    tokenizer = object()

    def model_inputs(spec):
        return types.SimpleNamespace(tokenizer=tokenizer, name=spec.name)

    monkeypatch.setattr(ms, "model_inputs", model_inputs)

    async def scenario() -> None:
        models = _set(tmp_path)
        await models.start()
        try:
            assert (await models.preview("a")).tokenizer is tokenizer
            lease = await models.acquire("a")
            assert lease.frontend.tokenizer is tokenizer
            lease.release()
            lease = await models.acquire("b")  # (never checked: it reads its own)
            assert lease.frontend.tokenizer is None
            lease.release()
        finally:
            await models.shutdown()

    run(scenario())


def test_keep_alive_forms():
    assert parse_keep_alive(None) is None
    assert parse_keep_alive(0) == 0 and parse_keep_alive("0") == 0
    assert parse_keep_alive(90) == 90 and parse_keep_alive("2.5") == 2.5
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400
    assert parse_keep_alive("90s") == 90
    assert parse_keep_alive(-1) == float("inf") and parse_keep_alive("-1m") == float("inf")
    for bad in ("soon", "5x", True, "m"):
        with pytest.raises(ValueError, match="keep_alive"):
            parse_keep_alive(bad)


def test_lru_idle_model_makes_room_and_answers_come_from_the_right_model(tmp_path):
    async def go():
        models = _set(tmp_path)
        await models.start()
        for name in "abab":
            lease = await models.acquire(name)
            assert lease.frontend.name == name and lease.frontend.running
            lease.release()
        assert FakeFrontend.log == ["load a", "load b"]
        (await models.acquire("c")).release()  # a is the least recently used
        assert FakeFrontend.log[-2:] == ["unload a", "load c"]
        assert models.used_bytes() <= models.budget_bytes
        states = {s["id"]: s["status"] for s in models.status()}
        assert states == {"a": "unloaded", "b": "loaded", "c": "loaded"}
        await models.shutdown()

    run(go())


def test_a_model_with_requests_in_flight_is_never_unloaded(tmp_path):
    async def go():
        models = _set(tmp_path, max_load_wait_s=0.3)
        await models.start()
        a, b = await models.acquire("a"), await models.acquire("b")
        # c waits for memory that only busy models hold, then is told to retry
        with pytest.raises(ModelUnavailable) as info:
            await models.acquire("c")
        assert info.value.retry_after_s is not None
        assert {s["id"]: s["status"] for s in models.status()}["c"] == "unloaded"
        assert a.frontend.running and b.frontend.running
        with pytest.raises(ModelBusy):
            await models.unload("a")
        # a request ends meanwhile: the waiting load takes its model's place
        waiter = asyncio.create_task(models.acquire("c"))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        b.release()
        c = await asyncio.wait_for(waiter, 5)
        assert (
            c.frontend.running
            and a.frontend.running
            and FakeFrontend.log[-2:]
            == [
                "unload b",
                "load c",
            ]
        )
        a.release()
        c.release()
        await models.shutdown()

    run(go())


def test_a_failed_load_fails_that_models_requests_only(tmp_path):
    async def go():
        models = _set(tmp_path, fail={"b"})
        await models.start()
        a = await models.acquire("a")
        with pytest.raises(ModelUnavailable, match="bad file") as info:
            await models.acquire("b")
        assert info.value.retry_after_s is None  # (not a matter of waiting)
        assert a.frontend.running
        status = {s["id"]: s for s in models.status()}
        assert status["b"]["status"] == "unloaded" and "bad file" in status["b"]["error"]
        assert status["b"]["memory_bytes"] == 0 and status["b"]["in_flight"] == 0
        # anyone else (a tenant's key) sees which models there are and their state only
        public = {s["id"]: s for s in models.status(operator=False)}
        assert public["b"] == {"id": "b", "status": "unloaded", "aliases": [], "pinned": False}
        a.release()
        await models.shutdown()

    run(go())


def test_keep_alive_idle_unload_and_pin(tmp_path):
    async def go():
        models = _set(tmp_path, budget_gib=None, idle_unload_s=0.2)
        await models.start()
        (await models.acquire("a", keep_alive_s=0)).release()  # ollama's 0: unload after
        (await models.acquire("b", keep_alive_s=float("inf"))).release()
        (await models.acquire("c")).release()  # the server's --idle-unload
        models.pin("c", True)
        await until(lambda: state(models, "a") == "unloaded")
        await asyncio.sleep(0.4)  # (twice --idle-unload)
        states = {s["id"]: s["status"] for s in models.status()}
        assert states == {"a": "unloaded", "b": "loaded", "c": "loaded"}  # (c pinned)
        with pytest.raises(ModelBusy, match="pinned"):
            await models.unload("c")
        models.pin("c", False)
        await until(lambda: state(models, "c") == "unloaded")
        # the next request without keep_alive: the default again (a request's is its own)
        (await models.acquire("b")).release()
        await until(lambda: state(models, "b") == "unloaded")
        await models.shutdown()

    run(go())


def test_names_and_what_the_budget_refuses(tmp_path):
    specs = _specs(tmp_path)
    specs[1] = dataclasses.replace(specs[1], aliases=("bee", "B"))
    models = ModelSet(specs, ServingConfig(), None)
    assert models.resolve(None) == "a" and models.resolve("bee") == "b"
    with pytest.raises(ModelNotFound):
        models.resolve("nope")
    with pytest.raises(ValueError, match="two models are named 'a'"):
        ModelSet([*specs, dataclasses.replace(specs[2], name="d", aliases=("a",))], ServingConfig())
    with pytest.raises(ValueError, match="more than --memory-budget"):
        ModelSet(specs, ServingConfig(), int(0.5 * GIB))


def test_models_found_in_a_folder_with_models_toml(tmp_path):
    (tmp_path / "one.gguf").write_bytes(b"x")
    (tmp_path / "big-00001-of-00002.gguf").write_bytes(b"x")
    (tmp_path / "big-00002-of-00002.gguf").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "elsewhere.gguf").write_bytes(b"x")
    (tmp_path / "models.toml").write_text(
        '[models.one]\naliases = ["uno"]\npinned = true\nmax-model-len = 512\n'
        '[models.other]\npath = "elsewhere.gguf"\nkv_cache_memory_gb = 0.125\n'
    )
    base = EngineConfig(memory_budget_gb=4.0, max_num_seqs=8)
    specs = {
        s.name: s for s in model_specs(base, ["extra=" + str(tmp_path / "one.gguf")], str(tmp_path))
    }
    assert set(specs) == {"extra", "one", "big", "hf", "elsewhere", "other"}
    one = specs["one"]
    assert one.aliases == ("uno",) and one.pinned and one.config.max_model_len == 512
    assert one.config.max_num_seqs == 8  # the command line's settings, the file's on top
    assert one.config.memory_budget_gb is None  # (the budget is the whole server's)
    assert one.config.kv_cache_memory_gb == ms.DEFAULT_MODEL_KV_GB
    assert specs["other"].config.kv_cache_memory_gb == 0.125
    assert specs["big"].config.model.endswith("big-00001-of-00002.gguf")
    (tmp_path / "models.toml").write_text("[models.one]\nwarp-speed = 9\n")
    with pytest.raises(ValueError, match="'warp-speed' is not a setting"):
        model_specs(base, (), str(tmp_path))
    with pytest.raises(ValueError, match="NAME=PATH"):
        model_specs(base, ["no-name"])
    with pytest.raises(ValueError, match="does not exist"):
        model_specs(base, ["x=/no/such/file.gguf"])
    # KV events: one endpoint per model (a command-line endpoint would be every model's)
    one = tmp_path / "one.gguf"
    shared = dataclasses.replace(base, kv_events_endpoint="tcp://*:5557")
    with pytest.raises(ValueError, match="'a' and 'b' would publish KV events on one"):
        model_specs(shared, [f"a={one}", f"b={one}"])
    (tmp_path / "models.toml").write_text(
        '[models.a]\npath = "one.gguf"\nkv-events-endpoint = "tcp://*:5557"\n'
        '[models.b]\npath = "one.gguf"\nkv-events-endpoint = "tcp://*:5567"\n'
    )
    (tmp_path / "hf" / "config.json").unlink()
    own = {s.name: s.config.kv_events_endpoint for s in model_specs(base, (), str(tmp_path))}
    assert own["a"] == "tcp://*:5557" and own["b"] == "tcp://*:5567"


def test_a_load_waits_for_its_own_unload_to_end(tmp_path):
    async def go():
        models = _set(tmp_path, budget_gib=None)
        await models.start()
        (await models.acquire("a")).release()
        real_shutdown = FakeFrontend.shutdown

        async def slow_shutdown(self):
            await asyncio.sleep(0.2)
            await real_shutdown(self)

        FakeFrontend.shutdown = slow_shutdown  # type: ignore[method-assign]
        try:
            unloading = asyncio.create_task(models.unload("a"))
            await asyncio.sleep(0.05)
            assert state(models, "a") == "unloading" and models.used_bytes() == GIB
            again = await models.acquire("a")  # (not a second engine beside the first)
            await unloading
        finally:
            FakeFrontend.shutdown = real_shutdown  # type: ignore[method-assign]
        assert FakeFrontend.log == ["load a", "unload a", "load a"]
        assert again.frontend.running and models.used_bytes() == GIB
        again.release()
        await models.shutdown()

    run(go())
