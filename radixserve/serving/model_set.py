"""Several models behind one server, loaded on the first request that names them and
unloaded when idle or when their memory is needed (ollama's and llama.cpp's router mode).

Each model is one ``Frontend`` (its tokenizer, its engine process or data-parallel group,
its metrics) made when the model is loaded and shut down when it is unloaded. ``ModelSet``
decides which are loaded: a request takes a ``Lease`` on its model (loading it if needed,
bounded by ``max_load_wait_s``) and gives it back when its answer is sent; a model with a
lease is never unloaded. ``--memory-budget`` covers every loaded model: a load that does
not fit unloads the least recently used idle models first, and waits for leases to end
when only busy models are left. A single-model server is a set of one pinned model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.core.process_memory import rss_bytes
from radixserve.engine.config import EngineConfig
from radixserve.engine.inputs import InputProcessor
from radixserve.engine.model_profile import model_profile
from radixserve.engine.model_source import gguf_weight_bytes
from radixserve.engine.tokenizer import load_model_tokenizer
from radixserve.serving.frontend import Frontend, ModelInputs, ServingConfig

log = logging.getLogger(__name__)

# a model's KV cache when neither its --kv-cache-memory nor its --memory-budget says
# (several models share the memory; the engine's own default takes up to half of it)
DEFAULT_MODEL_KV_GB = 0.5
# what an engine process holds before any weight (Python, PyTorch, the native kernels),
# measured at about 0.3 GiB on the development machine: counted for a model not yet seen
ENGINE_OVERHEAD_BYTES = 320 * 2**20
DEFAULT_MAX_LOAD_WAIT_S = 120.0
# engines of several models share the cores: an OpenMP thread waiting for work sleeps at
# once instead of spinning on a core another model's engine is computing on (two busy
# models at 0.26-0.72 of their throughput alone, summed; 1.3 with it: docs/benchmarks.md)
SHARED_CORES_ENV = (("OMP_WAIT_POLICY", "PASSIVE"),)
UNLOADED, LOADING, LOADED, UNLOADING = "unloaded", "loading", "loaded", "unloading"
# names the admin routes take under /v1/models/
RESERVED_NAMES = frozenset({"load", "unload", "pin"})
# a model whose load failed answers that error, without trying again, for this long
FAILED_RETRY_S = 5.0


class ModelNotFound(LookupError):
    """No model of the set has this name or alias."""


class ModelUnavailable(Exception):
    """A model could not be loaded for a request: ``retry_after_s`` set when it may be later
    (the wait ran out while others held the memory), None when loading it failed."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _Abandoned(ModelUnavailable):
    """A load given up while it waited for memory: every request for it had left."""


class ModelBusy(Exception):
    """An unload asked of a model that has requests in flight."""


def parse_keep_alive(value: Any) -> float | None:
    """ollama's ``keep_alive``: seconds (a number or its text), a duration such as ``"5m"``,
    ``"1h30m"`` or ``"90s"``; negative keeps the model loaded; 0 unloads it after the
    request. None: the server's ``--idle-unload``. ``ValueError`` for anything else."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("keep_alive must be a number of seconds or a duration like '5m'")
    if isinstance(value, int | float):
        if math.isnan(value):
            raise ValueError("keep_alive must be a number of seconds or a duration like '5m'")
        return float("inf") if value < 0 else float(value)
    text = str(value).strip()
    with contextlib.suppress(ValueError):
        return parse_keep_alive(float(text))
    match = re.fullmatch(r"(-)?((?:\d+(?:\.\d+)?[hms])+)", text)
    if match is None:
        raise ValueError(f"keep_alive {value!r} is not a number of seconds or a duration like '5m'")
    seconds = sum(
        float(n) * {"h": 3600, "m": 60, "s": 1}[u]
        for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", match[2])
    )
    return float("inf") if match[1] else seconds


def estimate_bytes(config: EngineConfig) -> int:
    """What loading the model of ``config`` is expected to take before it was ever loaded:
    an engine process, its weight files (a GGUF file runs from its codes; a checkpoint is at
    most its size in memory once cast to the serving dtype), its KV cache and host KV tier,
    or its ``--memory-budget``. (Once loaded, a model counts what its processes hold.)"""
    if config.memory_budget_gb is not None:
        return ENGINE_OVERHEAD_BYTES + int(config.memory_budget_gb * 2**30)
    path = Path(config.model) if config.model else None
    weights = 0
    if path is not None and path.is_file():
        weights = gguf_weight_bytes(path) if path.suffix == ".gguf" else path.stat().st_size
    elif path is not None and path.is_dir():
        weights = sum(
            f.stat().st_size
            for f in path.iterdir()
            if f.suffix in (".safetensors", ".bin", ".gguf")
        )
    kv = config.kv_cache_memory_gb if config.kv_cache_memory_gb is not None else DEFAULT_MODEL_KV_GB
    # (and its host KV tier, pinned memory too)
    return ENGINE_OVERHEAD_BYTES + weights + int((kv + config.kv_host_gb) * 2**30)


def tokenizer_of(spec: ModelSpec) -> Any:
    """A model's tokenizer, without loading the model (``auto`` parsers read its template)."""
    return load_model_tokenizer(spec.config.model)[1]


def model_inputs(spec: ModelSpec) -> ModelInputs:
    """A model's tokenizer and request checks from its files, without its engine
    (``engine.model_profile``). ``ValueError`` (or ``OSError``) for files it cannot read."""
    tokenizer = tokenizer_of(spec)
    profile = model_profile(spec.config)
    inputs = InputProcessor(
        tokenizer, profile.vocab_size, profile.max_model_len, profile.sampling_defaults
    )
    return ModelInputs(spec.config, tokenizer, spec.name, inputs)


def engine_pids(frontend: Frontend) -> list[int]:
    """The engine processes behind a frontend (none for an engine on a thread)."""
    client = frontend.client
    clients = getattr(client, "clients", [client])
    return [
        c.process.pid for c in clients if isinstance(getattr(c, "process", None), subprocess.Popen)
    ]


@dataclass(frozen=True)
class ModelSpec:
    """One model a server may serve: its name, the other names it answers to, its engine's
    settings and whether it stays loaded (``pinned``)."""

    name: str
    config: EngineConfig
    aliases: tuple[str, ...] = ()
    pinned: bool = False


class _Entry:
    """One model's state. Invariants: ``frontend`` is set exactly when ``state`` is
    ``loaded``; ``leases`` counts requests holding (or waiting for) the model;
    ``footprint`` is what the model counts against the budget while it is loading, loaded
    or unloading (0 once unloaded)."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.state = UNLOADED
        self.frontend: Frontend | None = None
        self.leases = 0
        self.pinned = spec.pinned
        self.last_used = 0.0
        self.keep_alive_s: float | None = None  # the last finished request's (None: default)
        self.footprint = 0
        self.seen_bytes = 0  # the most its processes held when it was last loaded
        self.error: str | None = None  # why the last load failed
        self.failed_at = 0.0
        self.failures = 0  # loads that ended without the model
        self.loads = 0
        self.load_s: float | None = None
        self.changed = asyncio.Event()  # set (and replaced) at every change of state
        self.task: asyncio.Task | None = None
        # its tokenizer and request checks without its engine, made at the first request
        # that finds it not loaded (a result: ModelInputs, or None if its files say nothing)
        self.preview: asyncio.Task | None = None

    def signal(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class Lease:
    """A request's hold on a loaded model: ``frontend`` serves it until ``release`` (which
    is idempotent), and the model is not unloaded before. The request's ``keep_alive_s``
    (None: the server's default) applies from its release on."""

    def __init__(self, models: ModelSet, entry: _Entry, keep_alive_s: float | None) -> None:
        self._models = models
        self._entry = entry
        assert entry.frontend is not None
        self.frontend: Frontend = entry.frontend
        self.keep_alive_s = keep_alive_s
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._models._release(self._entry, self.keep_alive_s)


class ModelSet:
    """The models of one server. Invariants: the footprints of loading, loaded and
    unloading models sum to at most ``budget_bytes`` (when set); a model is unloaded only
    with no lease on it, never while pinned; room is made for one load at a time (other
    models serve meanwhile); a load waiting for busy models holds nobody else up."""

    def __init__(
        self,
        specs: Iterable[ModelSpec],
        serving: ServingConfig,
        budget_bytes: int | None = None,
        idle_unload_s: float | None = None,
        max_load_wait_s: float = DEFAULT_MAX_LOAD_WAIT_S,
        make_frontend: Callable[[EngineConfig, ServingConfig, Any], Frontend] = Frontend,
    ) -> None:
        self.entries: dict[str, _Entry] = {}
        self.names: dict[str, str] = {}  # every name and alias -> the model's name
        for spec in specs:
            for name in (spec.name, *spec.aliases):
                if name in self.names:
                    raise ValueError(f"two models are named {name!r}")
                self.names[name] = spec.name
            self.entries[spec.name] = _Entry(spec)
        if not self.entries:
            raise ValueError("no model to serve")
        if max_load_wait_s <= 0:
            raise ValueError(f"--max-load-wait must be > 0, got {max_load_wait_s}")
        # a request without ``model``: the one aliased "default", else the first pinned,
        # else the first
        pinned = [n for n, e in self.entries.items() if e.pinned]
        self.default = self.names.get("default") or (pinned or [*self.entries])[0]
        self.serving = serving
        self.budget_bytes = budget_bytes
        # (negative: never, as a request's keep_alive)
        never = idle_unload_s is not None and idle_unload_s < 0
        self.idle_unload_s = None if never else idle_unload_s
        self.max_load_wait_s = max_load_wait_s
        self.make_frontend = make_frontend
        # (the user's own OpenMP wait policy stands)
        shared = len(self.entries) > 1 and "OMP_WAIT_POLICY" not in os.environ
        self._env = SHARED_CORES_ENV if shared else ()
        self._room_lock: asyncio.Lock | None = None
        self._released: asyncio.Event | None = None
        self._reaper: asyncio.Task | None = None
        self._poke: asyncio.Event | None = None
        self._closing = False
        for entry in self.entries.values():
            if budget_bytes is not None:
                try:
                    need = estimate_bytes(entry.spec.config)
                except ValueError:  # (a file that cannot be read fails its own requests)
                    continue
                if need > budget_bytes:
                    raise ValueError(
                        f"model {entry.spec.name!r} needs about {need / 2**30:.2f} GiB, more "
                        f"than --memory-budget {budget_bytes / 2**30:.2f} GiB"
                    )

    @property
    def many(self) -> bool:
        return len(self.entries) > 1

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Load the pinned models (a single model is pinned), then watch for idle ones."""
        self._room_lock = asyncio.Lock()
        self._released = asyncio.Event()
        self._poke = asyncio.Event()
        for entry in self.entries.values():
            if not entry.pinned:
                continue
            entry.leases += 1  # (held while it loads: a pinned model waits for no one)
            try:
                await self._ensure(entry, deadline=None)
            except ModelUnavailable as exc:
                await self.shutdown()
                raise RuntimeError(str(exc)) from exc
            finally:
                entry.leases -= 1
        self._reaper = asyncio.create_task(self._reap())

    async def shutdown(self) -> None:
        self._closing = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for entry in self.entries.values():
            if entry.preview is not None and not entry.preview.done():
                entry.preview.cancel()
            if entry.task is not None:
                entry.task.cancel()
                with contextlib.suppress(BaseException):
                    await entry.task
            if entry.frontend is not None:
                frontend, entry.frontend = entry.frontend, None
                await frontend.shutdown()
            entry.state, entry.footprint = UNLOADED, 0

    # -- requests -----------------------------------------------------------------------
    def resolve(self, name: str | None) -> str:
        """The model ``name`` (or alias) stands for; None: the default model."""
        if name is None:
            return self.default
        found = self.names.get(name)
        if found is None:
            raise ModelNotFound(name)
        return found

    def loaded(self, name: str) -> Frontend | None:
        """A loaded model's frontend (None if it is not loaded)."""
        return self.entries[self.resolve(name)].frontend

    async def preview(self, name: str) -> ModelInputs | None:
        """What a request for model ``name`` is checked against before the model is
        loaded: its ``ModelInputs`` from its files (made once, off the event loop). None
        when they cannot be read so (loading it will say why)."""
        entry = self.entries[self.resolve(name)]
        if entry.preview is None:

            async def make() -> ModelInputs | None:
                try:
                    return await asyncio.to_thread(model_inputs, entry.spec)
                except Exception:
                    log.warning("model %s: no checks before loading it", name, exc_info=True)
                    entry.preview = None  # (the next request reads its files again)
                    return None

            entry.preview = asyncio.ensure_future(make())
        return await asyncio.shield(entry.preview)

    def frontends(self) -> list[tuple[str, Frontend]]:
        return [(n, e.frontend) for n, e in self.entries.items() if e.frontend is not None]

    async def acquire(self, name: str | None, keep_alive_s: float | None = None) -> Lease:
        """A lease on model ``name``, loading it first if needed. ``ModelNotFound``;
        ``ModelUnavailable`` when the load failed or did not end within the wait."""
        entry = self.entries[self.resolve(name)]
        entry.leases += 1
        try:
            if entry.state != LOADED:
                await self._ensure(entry, deadline=time.monotonic() + self.max_load_wait_s)
        except BaseException:
            entry.leases -= 1
            self._wake()
            raise
        entry.last_used = time.monotonic()
        return Lease(self, entry, keep_alive_s)

    def _release(self, entry: _Entry, keep_alive_s: float | None) -> None:
        entry.leases -= 1
        entry.last_used = time.monotonic()
        entry.keep_alive_s = keep_alive_s  # (the last request to finish decides)
        self._wake()

    def _wake(self) -> None:
        for event in (self._released, self._poke):
            if event is not None:
                event.set()

    async def _ensure(self, entry: _Entry, deadline: float | None) -> None:
        """Wait until ``entry`` is loaded, starting its load if none is running (and no
        unload of it is still ending; a load that failed less than ``FAILED_RETRY_S`` ago
        answers its error again)."""
        failures = entry.failures
        while entry.state != LOADED:
            if entry.failures != failures and entry.error is not None:  # (the load we waited on)
                raise ModelUnavailable(f"model {entry.spec.name!r} failed to load: {entry.error}")
            if self._closing:
                raise ModelUnavailable("the server is shutting down", retry_after_s=1.0)
            recent = entry.error is not None and time.monotonic() - entry.failed_at < FAILED_RETRY_S
            if entry.state == UNLOADED and entry.task is None:
                if recent:
                    raise ModelUnavailable(
                        f"model {entry.spec.name!r} failed to load: {entry.error}"
                    )
                entry.task = asyncio.create_task(self._load(entry))
            changed = entry.changed
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                raise ModelUnavailable(
                    f"model {entry.spec.name!r} is still loading or waiting for memory "
                    f"after {self.max_load_wait_s:g} s",
                    retry_after_s=max(1.0, self.max_load_wait_s / 4),
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await changed.wait()

    async def _load(self, entry: _Entry) -> None:
        try:
            entry.error = None
            need = max(entry.seen_bytes, estimate_bytes(entry.spec.config))
            await self._reserve(entry, need)
            started = time.monotonic()
            serving = dataclasses.replace(
                self.serving, served_model_name=entry.spec.name, engine_env=self._env
            )
            # (the tokenizer a check before the load read already: not read twice)
            preview = entry.preview
            done = preview is not None and preview.done() and not preview.cancelled()
            read = preview.result() if done else None
            tokenizer = read.tokenizer if read is not None else None
            frontend = await asyncio.to_thread(
                self.make_frontend, entry.spec.config, serving, tokenizer
            )
            try:
                await frontend.start()
            except BaseException:
                await frontend.shutdown()
                raise
            entry.frontend, entry.state = frontend, LOADED
            entry.load_s = time.monotonic() - started
            entry.last_used = time.monotonic()
            entry.loads += 1
            self._measure(entry)
            log.info(
                "model %s loaded in %.2f s (%.2f GiB counted)",
                entry.spec.name,
                entry.load_s,
                entry.footprint / 2**30,
            )
        except BaseException as exc:
            entry.state, entry.footprint, entry.frontend = UNLOADED, 0, None
            if not isinstance(exc, Exception):
                raise  # (cancelled: the server is shutting down)
            entry.error = None if isinstance(exc, _Abandoned) else str(exc) or type(exc).__name__
            entry.failures += 1
            if isinstance(exc, ModelUnavailable):  # (no room: the next request may find some)
                log.warning("model %s not loaded: %s", entry.spec.name, exc)
            else:
                log.warning("model %s failed to load", entry.spec.name, exc_info=True)
                entry.failed_at = time.monotonic()
        finally:
            entry.task = None
            entry.signal()
            self._wake()

    def _measure(self, entry: _Entry) -> None:
        """Count what a loaded model's engine processes hold now (the KV cache's pages
        become resident as they are used), never less than it was counted."""
        if entry.frontend is not None:
            held = sum(rss_bytes(pid) or 0 for pid in engine_pids(entry.frontend))
            entry.footprint = max(entry.footprint, held)
            entry.seen_bytes = max(entry.seen_bytes, held)

    def used_bytes(self, besides: _Entry | None = None) -> int:
        """The budget loading, loaded and unloading models take (``besides`` left out)."""
        for entry in self.entries.values():
            self._measure(entry)
        return sum(e.footprint for e in self.entries.values() if e is not besides)

    def _evictable(self, besides: _Entry) -> list[_Entry]:
        """Loaded models with no lease and no pin, least recently used first."""
        idle = [
            e
            for e in self.entries.values()
            if e is not besides and e.state == LOADED and e.leases == 0 and not e.pinned
        ]
        return sorted(idle, key=lambda e: e.last_used)

    async def _reserve(self, entry: _Entry, need: int) -> None:
        """Count ``need`` bytes for ``entry`` (state ``loading``), first unloading idle
        models until they fit the budget; while only busy models hold the memory, wait
        for a request to end (without holding up other loads). ``ModelUnavailable`` when
        it can never fit beside the pinned models, or when no request waits any more."""
        assert self._room_lock is not None and self._released is not None
        while True:
            async with self._room_lock:
                self._released.clear()  # (a release from here on wakes the wait below)
                if self.budget_bytes is not None:
                    pinned = sum(
                        e.footprint for e in self.entries.values() if e.pinned and e is not entry
                    )
                    if pinned + need > self.budget_bytes:
                        raise ModelUnavailable(
                            f"model {entry.spec.name!r} needs about {need / 2**30:.2f} GiB "
                            f"and pinned models hold {pinned / 2**30:.2f} GiB of the "
                            f"{self.budget_bytes / 2**30:.2f} GiB --memory-budget"
                        )
                    while self.used_bytes(besides=entry) + need > self.budget_bytes:
                        idle = self._evictable(entry)
                        if not idle:
                            break
                        await self._unload(idle[0], "to make room for " + entry.spec.name)
                if self.budget_bytes is None or self.used_bytes(entry) + need <= self.budget_bytes:
                    entry.state, entry.footprint = LOADING, need
                    entry.signal()
                    return
            if entry.leases == 0:
                raise _Abandoned("no request waits for it any more")
            await self._released.wait()

    async def _unload(self, entry: _Entry, why: str) -> None:
        """Shut a loaded model's engines down; it counts against the budget, and no new
        load of it starts, until they are gone."""
        frontend = entry.frontend
        self._measure(entry)
        entry.frontend, entry.state = None, UNLOADING
        entry.signal()
        try:
            if frontend is not None:
                await frontend.shutdown()
        finally:
            entry.state, entry.footprint = UNLOADED, 0
            entry.signal()
            self._wake()
        log.info("model %s unloaded (%s)", entry.spec.name, why)

    async def _reap(self) -> None:
        """Unload each idle model once its keep-alive (the last request's, else
        ``idle_unload_s``) has passed since it was last used."""
        assert self._poke is not None
        while True:
            self._poke.clear()
            now = time.monotonic()
            next_check = 60.0
            for entry in list(self.entries.values()):
                if entry.state != LOADED or entry.leases or entry.pinned:
                    continue
                keep = entry.keep_alive_s if entry.keep_alive_s is not None else self.idle_unload_s
                if keep is None or keep == float("inf"):
                    continue
                left = entry.last_used + keep - now
                if left > 0:
                    next_check = min(next_check, left)
                    continue
                try:
                    await self._unload(entry, "idle")
                except Exception:  # (the reaper goes on for the other models)
                    log.exception("unloading model %s failed", entry.spec.name)
            with contextlib.suppress(TimeoutError):  # (asyncio.timeout: a cancel is never lost)
                async with asyncio.timeout(next_check):
                    await self._poke.wait()

    # -- admin --------------------------------------------------------------------------
    async def unload(self, name: str) -> None:
        """Unload model ``name`` now; ``ModelBusy`` while requests hold it or it is pinned."""
        entry = self.entries[self.resolve(name)]
        if entry.pinned:
            raise ModelBusy(f"model {entry.spec.name!r} is pinned")
        if entry.leases:
            raise ModelBusy(f"model {entry.spec.name!r} has {entry.leases} requests in flight")
        if entry.state == LOADED:
            await self._unload(entry, "asked")

    def pin(self, name: str, pinned: bool) -> None:
        """Keep model ``name`` loaded once it is (or let it go again)."""
        self.entries[self.resolve(name)].pinned = pinned
        self._wake()

    def status(self, operator: bool = True) -> list[dict[str, Any]]:
        """Each model's state, for ``/v1/models``; ``operator``: with how it runs (requests
        in flight, memory, loads and their time, a failed load's reason), which only the
        server's operator sees (an admin key, or a single-user server on loopback)."""
        out = []
        for name, e in self.entries.items():
            card: dict[str, Any] = {
                "id": name,
                "status": e.state,
                "aliases": list(e.spec.aliases),
                "pinned": e.pinned,
            }
            if operator:
                card.update(in_flight=e.leases, memory_bytes=e.footprint, loads=e.loads)
                if e.error:
                    card["error"] = e.error
                if e.load_s is not None:
                    card["load_s"] = round(e.load_s, 3)
            out.append(card)
        return out


# -- which models a server has ------------------------------------------------------------
def _is_model_file(path: Path) -> bool:
    """A GGUF file that is a whole model or the first part of a split one."""
    if path.suffix != ".gguf":
        return False
    split = re.search(r"-(\d{5})-of-\d{5}$", path.stem)
    return split is None or split[1] == "00001"


def _scan(folder: Path) -> dict[str, Path]:
    """Every GGUF file and HF model folder (one with config.json) in ``folder``, by name."""
    found: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and _is_model_file(path):
            found[re.sub(r"-00001-of-\d{5}$", "", path.stem)] = path
        elif path.is_dir() and (path / "config.json").is_file():
            found[path.name] = path
    return found


def model_specs(
    base: EngineConfig, entries: Iterable[str] = (), models_dir: str | None = None
) -> list[ModelSpec]:
    """The models of a several-model server: ``NAME=PATH`` entries (``--model``), then every
    model in ``models_dir`` and what its ``models.toml`` says (``[models.NAME]`` tables:
    ``path``, ``aliases``, ``pinned`` and engine settings by flag name). Each model's engine
    takes ``base``'s settings with its own on top, and a KV cache of its own size
    (``DEFAULT_MODEL_KV_GB`` unless given): ``base.memory_budget_gb`` is the whole server's
    (``ModelSet.budget_bytes``), not a model's. ``ValueError`` naming a bad entry."""
    import tomllib

    from radixserve.core.settings import from_mapping

    paths: dict[str, Path] = {}
    tables: dict[str, dict[str, Any]] = {}
    for item in entries:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--model {item!r}: give NAME=PATH to serve several models")
        paths[name] = Path(path)
    if models_dir is not None:
        folder = Path(models_dir)
        if not folder.is_dir():
            raise ValueError(f"--models-dir {models_dir}: not a folder")
        for name, path in _scan(folder).items():
            paths.setdefault(name, path)
        toml = folder / "models.toml"
        if toml.is_file():
            try:
                doc = tomllib.loads(toml.read_text())
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"{toml}: {exc}") from None
            for name, table in (doc.get("models") or {}).items():
                if not isinstance(table, dict):
                    raise ValueError(f"{toml}: [models.{name}] must be a table")
                table = dict(table)
                if "path" in table:
                    given = Path(str(table.pop("path"))).expanduser()
                    paths[name] = given if given.is_absolute() else folder / given
                elif name not in paths:
                    raise ValueError(f"{toml}: [models.{name}] has no path and no such file")
                tables[name] = table
    specs = []
    for name, path in paths.items():
        if not path.exists():
            raise ValueError(f"model {name!r}: {path} does not exist")
        where = f"models.toml [models.{name}]"
        if name in RESERVED_NAMES or "/" in name:
            raise ValueError(f"{where}: a model cannot be named {name!r}")
        table = dict(tables.get(name, {}))
        aliases = table.pop("aliases", [])
        pinned = table.pop("pinned", False)
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise ValueError(f"{where}: aliases must be a list of names")
        if not isinstance(pinned, bool):
            raise ValueError(f"{where}: pinned must be true or false")
        if "model" in table:
            raise ValueError(f"{where}: give the file as path, not model")
        own = from_mapping(EngineConfig, table, where)
        own.setdefault("memory_budget_gb", None)
        if own.get("memory_budget_gb") is None:
            own.setdefault("kv_cache_memory_gb", base.kv_cache_memory_gb or DEFAULT_MODEL_KV_GB)
        # (an automatic prefill copy sizes itself by the machine's memory, not the budget)
        own.setdefault(
            "prefill_weight_copy",
            "off" if base.prefill_weight_copy == "auto" else base.prefill_weight_copy,
        )
        try:
            config = dataclasses.replace(base, model=str(path), **own)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        specs.append(ModelSpec(name, config, tuple(aliases), pinned))
    if not specs:
        raise ValueError("no model found: give --model NAME=PATH or --models-dir DIR")
    _check_kv_event_endpoints(specs)
    return specs


def _check_kv_event_endpoints(specs: list[ModelSpec]) -> None:
    """Each model's KV events need a socket of their own (one PUB socket, one sequence of
    numbers per engine): two models on one endpoint are refused, naming them."""
    seen: dict[str, str] = {}
    for spec in specs:
        for endpoint in (spec.config.kv_events_endpoint, spec.config.kv_events_replay_endpoint):
            if endpoint is None:
                continue
            if endpoint in seen:
                raise ValueError(
                    f"models {seen[endpoint]!r} and {spec.name!r} would publish KV events on "
                    f"one endpoint ({endpoint}): give each its own kv_events_endpoint (and "
                    "replay endpoint) in models.toml"
                )
            seen[endpoint] = spec.name
