"""``serve --data-parallel-size N``: N engine processes behind one frontend, with the
``EngineClient`` interface of one (``client.py``), so the frontend does not know how many
there are."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from radixserve.core.request import EngineRequest, cache_namespace
from radixserve.engine.config import EngineConfig
from radixserve.engine.parallel import replica_environments
from radixserve.serving import protocol as p
from radixserve.serving.balancer import BalanceConfig, Balancer, NoWorkerAvailable, token_key
from radixserve.serving.engine_client import EngineProcessClient
from radixserve.serving.engine_streams import EngineDead
from radixserve.serving.request_tracker import RequestTracker
from radixserve.serving.supervisor import SupervisorConfig

_SUMMED = (
    "running",
    "waiting",
    "kv_pages_total",
    "kv_pages_free",
    "cache_hit_tokens",
    "cache_queried_tokens",
    "preemptions",
    "steps",
    "kv_pages_evictable",
    "kv_pages_protected",
    "radix_nodes",
    "spec_proposed_tokens",
    "spec_accepted_tokens",
    "spec_verify_rows",
    "spec_steps",
    "spec_declined_steps",
    "kv_host_pages_total",
    "kv_host_pages_used",
    "kv_disk_bytes_used",
    "kv_disk_records",
    "cache_hit_tokens_host",
    "cache_hit_tokens_disk",
    "kv_demoted_pages",
    "kv_promoted_pages",
    "kv_spilled_pages",
    "kv_disk_promoted_pages",
    "kv_failed_promotions",
    "kv_disk_read_failures",
    "kv_tier_bytes_moved",
    "kv_tier_move_seconds",
)


class DataParallelClient:
    """N ``EngineProcessClient``s, each its own engine process, cache and scheduler; a request
    goes to one of them, picked by a ``Balancer`` (cache-aware by default: prompts are
    keyed by their token ids).

    Invariants: a request runs on exactly one engine, chosen among the live ones, and is
    counted in that engine's load until its generator ends; ``abort`` reaches the engine
    that runs it; ``stats`` is the sum over engines; ``alive`` while any engine is (the
    dead ones get no new requests, their running ones fail with ``EngineDead`` as with
    one engine). On CPU each engine gets its share of the cores unless ``num_threads``
    says otherwise; on CUDA engine i (with its tensor-parallel workers) sees only GPUs
    ``[i*tp, (i+1)*tp)`` of the visible ones (``CUDA_VISIBLE_DEVICES``), and too few
    visible GPUs is a ``ValueError`` here, before any process starts.
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        size: int,
        policy: str = "cache-aware",
        balance: BalanceConfig | None = None,
        supervision: SupervisorConfig | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``env``: more environment for every engine process (None: this process's)."""
        if size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {size}")
        if size > 1 and config.nnodes > 1:
            raise ValueError("data_parallel_size > 1 runs on one node: nnodes must be 1")
        if size > 1 and config.kv_cache_dir is not None:
            raise ValueError(
                "data_parallel_size > 1 with kv_cache_dir: the engines would share one disk "
                "tier whose size limit each counts alone (not supported; host tiers are)"
            )
        if size > 1 and config.tensor_parallel_size > 1 and config.master_port is not None:
            # every replica's TP group would listen on the same rendezvous port
            raise ValueError(
                "master_port with data_parallel_size > 1: each replica's tensor-parallel group "
                "needs its own port; leave --master-port unset (a free port per replica)"
            )
        if (
            config.num_threads is None
            and config.resolved_device == "cpu"
            and not config.simulated_device
        ):  # the engines share the cores instead of each taking them all
            config = dataclasses.replace(config, num_threads=max(1, (os.cpu_count() or 1) // size))
        self.config = config
        base = {**os.environ, **env} if env else None
        envs: list[dict[str, str] | None] = [base] * size
        if config.resolved_device == "cuda" and not config.simulated_device:
            envs = list(
                replica_environments(size, config.tensor_parallel_size, base or dict(os.environ))
            )
        # each engine is supervised (watchdog, restarts) on its own
        self.clients = [
            EngineProcessClient(
                dataclasses.replace(config, data_parallel_rank=rank),
                tokenizer,
                supervision=supervision,
                env=env,
            )
            for rank, env in enumerate(envs)
        ]
        self.tracker = RequestTracker()
        for client in self.clients:
            client.tracker = self.tracker  # one dashboard over all engines
        self.balancer = Balancer(size, policy, balance)
        self.requests = [0] * size  # routed to each engine, ever
        self._owner: dict[str, int] = {}  # running request id -> engine
        self.collector = _DPCollector(self)

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        results = await asyncio.gather(*(c.start() for c in self.clients), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.shutdown()
            raise errors[0]

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        await asyncio.gather(*(c.shutdown(timeout_s) for c in self.clients))

    @property
    def alive(self) -> bool:
        return any(c.alive for c in self.clients)

    @property
    def ready(self) -> p.Ready | None:
        return self.clients[0].ready

    # -- supervision (each engine restarts on its own; these are the frontend's view) -----
    def unhealthy_reason(self) -> str | None:
        """None while any engine can take requests (the others' requests go elsewhere),
        else every engine's reason."""
        reasons = [c.unhealthy_reason() for c in self.clients]
        if any(r is None for r in reasons):
            return None
        return "; ".join(f"engine {i}: {r}" for i, r in enumerate(reasons))

    def dead_reason(self) -> str | None:
        """None while any engine runs or will again; else every engine's reason."""
        reasons = [c.dead_reason() for c in self.clients]
        if any(r is None for r in reasons):
            return None
        return "; ".join(f"engine {i}: {r}" for i, r in enumerate(reasons))

    @property
    def restarts(self) -> int:
        return sum(c.restarts for c in self.clients)

    @property
    def deaths(self) -> int:
        return sum(c.deaths for c in self.clients)

    @property
    def hangs(self) -> int:
        return sum(c.hangs for c in self.clients)

    @property
    def state(self) -> str:
        states = [c.state for c in self.clients]
        return states[0] if len(set(states)) == 1 else ", ".join(states)

    @property
    def process(self) -> Any:
        """Engine 0's process (``/debug/engine`` shows one pid)."""
        return self.clients[0].process

    async def lora_control(
        self, name: str, path: str | None, timeout_s: float = 60.0
    ) -> p.LoRAAnswer:
        """The adapter change on every engine; the first failure, if any (an engine that
        did not answer counts as one). A load that failed anywhere is undone where it was
        done, so the engines serve the same adapters."""
        answers = await asyncio.gather(
            *(c.lora_control(name, path, timeout_s) for c in self.clients),
            return_exceptions=True,
        )
        ok = [isinstance(a, p.LoRAAnswer) and a.error is None for a in answers]
        if all(ok):
            return answers[0]  # type: ignore[return-value]
        if path is not None:
            done = [c for c, good in zip(self.clients, ok, strict=True) if good]
            await asyncio.gather(
                *(c.lora_control(name, None, timeout_s) for c in done), return_exceptions=True
            )
        failed = next(a for a, good in zip(answers, ok, strict=True) if not good)
        if isinstance(failed, BaseException):
            return p.LoRAAnswer(0, f"an engine did not take the change: {failed}")
        return failed

    async def flush_cache(self, timeout_s: float = 10.0) -> p.CacheFlushed:
        """Every engine's debug flush, summed: idle only if all were."""
        answers = await asyncio.gather(*(c.flush_cache(timeout_s) for c in self.clients))
        errors = [f"engine {i}: {a.error}" for i, a in enumerate(answers) if a.error]
        return p.CacheFlushed(
            0,
            all(a.idle for a in answers),
            sum(a.kv_pages_total for a in answers),
            sum(a.kv_pages_free for a in answers),
            sum(a.radix_nodes_before for a in answers),
            "; ".join(errors) or None,
        )

    @property
    def stats(self) -> p.EngineStats | None:
        all_stats = [c.stats for c in self.clients if c.stats is not None]
        if not all_stats:
            return None
        merged = {k: sum(getattr(s, k) for s in all_stats) for k in _SUMMED}
        for k in ("running_loras", "waiting_loras"):  # the union of the engines'
            merged[k] = sorted({name for s in all_stats for name in getattr(s, k)})
        return p.EngineStats(**merged)

    # -- requests -------------------------------------------------------------------------
    def _pick(self, request: EngineRequest) -> int:
        """The engine for a request: its routing key is the prompt in the radix-cache
        namespace the engine will match it in (its tenant's, under scope ``tenant``), so
        the balancer's trees follow the engines' caches."""
        namespace = cache_namespace(
            request.cache_salt, request.tenant, self.config.prefix_cache_scope, request.lora
        )
        for i, client in enumerate(self.clients):
            alive = client.alive
            if alive != self.balancer.available[i]:  # (a silent engine keeps its tree)
                self.balancer.set_available(i, alive, forget=client.dead)
        try:
            worker = self.balancer.choose(
                token_key(request.prompt_token_ids),
                namespace="" if namespace is None else repr(namespace),
            ).worker
        except NoWorkerAvailable:
            raise EngineDead("no engine is running") from None
        self.requests[worker] += 1
        self._owner[request.request_id] = worker
        return worker

    def _done(self, request_id: str, worker: int) -> None:
        self.balancer.release(worker)
        if self._owner.get(request_id) == worker:
            del self._owner[request_id]

    def generate(self, request: EngineRequest) -> AsyncIterator[p.Delta]:
        return self._routed("generate", request)

    def generate_batches(self, request: EngineRequest) -> AsyncIterator[list[p.Delta]]:
        return self._routed("generate_batches", request)

    async def _routed(self, method: str, request: EngineRequest) -> AsyncIterator[Any]:
        """The chosen engine's ``method`` (an async generator), counted in its load until the
        caller is done with it."""
        worker = self._pick(request)
        gen = getattr(self.clients[worker], method)(request)
        try:
            async for item in gen:
                yield item
        finally:
            await gen.aclose()
            self._done(request.request_id, worker)

    def abort(self, request_id: str) -> bool:
        worker = self._owner.get(request_id)
        return worker is not None and self.clients[worker].abort(request_id)

    async def radix_summary(
        self, max_nodes: int = 256, max_depth: int = 8, timeout_s: float = 10.0
    ) -> p.RadixSummary:
        """The first live engine's radix tree (each engine has its own)."""
        for client in self.clients:
            if client.alive:
                return await client.radix_summary(max_nodes, max_depth, timeout_s)
        raise EngineDead("no engine is running")


class _DPCollector(Collector):
    """Per-engine series for /metrics: requests routed, load, liveness, prefix-cache hits."""

    def __init__(self, dp: DataParallelClient) -> None:
        self.dp = dp

    def collect(self) -> Iterator:
        dp = self.dp
        requests = CounterMetricFamily(
            "radixserve_dp_engine_requests", "Requests routed to each engine", labels=["engine"]
        )
        load = GaugeMetricFamily(
            "radixserve_dp_engine_load", "Requests running on each engine", labels=["engine"]
        )
        alive = GaugeMetricFamily(
            "radixserve_dp_engine_alive", "1 while the engine runs", labels=["engine"]
        )
        hits = CounterMetricFamily(
            "radixserve_dp_engine_prefix_cache_hits",
            "Prompt tokens found cached, per engine",
            labels=["engine"],
        )
        for i, client in enumerate(dp.clients):
            label = [str(i)]
            requests.add_metric(label, dp.requests[i])
            load.add_metric(label, dp.balancer.load[i])
            alive.add_metric(label, 1.0 if client.alive else 0.0)
            if client.stats is not None:
                hits.add_metric(label, client.stats.cache_hit_tokens)
        yield from (requests, load, alive, hits)
