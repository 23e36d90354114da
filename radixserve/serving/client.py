"""What a transport may ask of the engine(s) behind it: one protocol for one engine process
(``engine_client.EngineProcessClient``) and for N of them (``dp_client.DataParallelClient``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from radixserve.core.request import EngineRequest
from radixserve.serving import protocol as p


@runtime_checkable
class EngineClient(Protocol):
    """The engine as a service. Invariants (both implementations): every request given to
    ``generate``/``generate_batches`` ends exactly once, with its samples' finished deltas
    or an exception (``RequestRejected``, ``EngineDead``) raised in the caller; a caller
    that stops iterating early aborts its request in the engine; ``alive`` exactly when
    ``unhealthy_reason()`` is None."""

    ready: p.Ready | None  # set once an engine has loaded its model

    async def start(self) -> None: ...

    async def shutdown(self, timeout_s: float = 10.0) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[p.Delta]:
        """The deltas of the request's ``params.n`` samples, with their text, until all
        have finished; a pooling request's one finished delta (with ``embedding``)."""
        ...

    def generate_batches(self, request: EngineRequest) -> AsyncIterator[list[p.Delta]]:
        """As ``generate``, every delta that has arrived at once (a slow reader's batch)."""
        ...

    def abort(self, request_id: str) -> bool: ...

    @property
    def stats(self) -> p.EngineStats | None: ...

    @property
    def alive(self) -> bool: ...

    def unhealthy_reason(self) -> str | None: ...

    def dead_reason(self) -> str | None: ...

    async def radix_summary(
        self, max_nodes: int = 256, max_depth: int = 8, timeout_s: float = 10.0
    ) -> p.RadixSummary: ...

    async def flush_cache(self, timeout_s: float = 10.0) -> p.CacheFlushed: ...

    async def lora_control(
        self, name: str, path: str | None, timeout_s: float = 60.0
    ) -> p.LoRAAnswer:
        """Load LoRA adapter ``name`` from ``path`` on every engine, or unload it (None)."""
        ...

    # supervision counters and state, for /metrics and /debug/engine
    restarts: Any
    deaths: Any
    hangs: Any
    state: Any
