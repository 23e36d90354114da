"""Prometheus metrics of the frontend (request timings, token counts) and the engine (its
heartbeat stats, exported as they are reported)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.serving.protocol import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator:
        s = self._stats()
        if s is None:
            return
        yield GaugeMetricFamily("radixserve_num_requests_running", "Requests running", s.running)
        yield GaugeMetricFamily("radixserve_num_requests_waiting", "Requests waiting", s.waiting)
        used = 1 - s.kv_pages_free / s.kv_pages_total if s.kv_pages_total else 0.0
        yield GaugeMetricFamily("radixserve_kv_cache_usage_ratio", "KV pages in use", used)
        yield CounterMetricFamily(
            "radixserve_prefix_cache_queries", "Prompt tokens looked up", s.cache_queried_tokens
        )
        yield CounterMetricFamily(
            "radixserve_prefix_cache_hits", "Prompt tokens found cached", s.cache_hit_tokens
        )
        yield CounterMetricFamily("radixserve_num_preemptions", "Preemptions", s.preemptions)
        yield CounterMetricFamily("radixserve_engine_steps", "Engine steps", s.steps)
        yield CounterMetricFamily(
            "radixserve_spec_proposed_tokens",
            "Speculative proposals verified",
            s.spec_proposed_tokens,
        )
        yield CounterMetricFamily(
            "radixserve_spec_accepted_tokens",
            "Speculative proposals accepted",
            s.spec_accepted_tokens,
        )
        yield CounterMetricFamily(
            "radixserve_spec_verify_rows",
            "Requests that verified proposals in a step",
            s.spec_verify_rows,
        )
        decisions = CounterMetricFamily(
            "radixserve_spec_policy_steps",
            "Steps that could speculate, by what the policy decided (speculate: verified "
            "proposals; plain: declined at that batch size)",
            labels=["decision"],
        )
        decisions.add_metric(["speculate"], s.spec_steps)
        decisions.add_metric(["plain"], s.spec_declined_steps)
        yield decisions
        yield from _tier_metrics(s)
        mean = 1 + s.spec_accepted_tokens / s.spec_verify_rows if s.spec_verify_rows else 0.0
        yield GaugeMetricFamily(
            "radixserve_spec_mean_accepted_length",
            "Tokens emitted per verify row (1 + accepted proposals), since start",
            mean,
        )


def _tier_metrics(s: EngineStats) -> Iterator:
    """The KV tiers' counters (docs/kv-tiers.md): hits by tier, pages moved, bytes, time."""
    hits = CounterMetricFamily(
        "radixserve_prefix_cache_tier_hits",
        "Prompt tokens found cached, by the tier their KV came from",
        labels=["tier"],
    )
    host, disk = s.cache_hit_tokens_host, s.cache_hit_tokens_disk
    hits.add_metric(["pool"], s.cache_hit_tokens - host - disk)
    hits.add_metric(["host"], host)
    hits.add_metric(["disk"], disk)
    yield hits
    moved = CounterMetricFamily(
        "radixserve_kv_tier_pages", "KV pages moved between tiers", labels=["direction"]
    )
    moved.add_metric(["demote_pool_to_host"], s.kv_demoted_pages)
    moved.add_metric(["promote_host_to_pool"], s.kv_promoted_pages)
    moved.add_metric(["spill_host_to_disk"], s.kv_spilled_pages)
    moved.add_metric(["promote_disk_to_pool"], s.kv_disk_promoted_pages)
    yield moved
    yield CounterMetricFamily(
        "radixserve_kv_tier_promotions_failed",
        "Promotions that got no pool pages or read a bad record (plain misses)",
        s.kv_failed_promotions + s.kv_disk_read_failures,
    )
    yield CounterMetricFamily(
        "radixserve_kv_tier_bytes", "Bytes moved between KV tiers", s.kv_tier_bytes_moved
    )
    yield CounterMetricFamily(
        "radixserve_kv_tier_seconds",
        "Seconds spent copying between tiers and reading disk records",
        s.kv_tier_move_seconds,
    )
    yield GaugeMetricFamily(
        "radixserve_kv_host_pages_used", "Host-tier pages holding KV", s.kv_host_pages_used
    )
    yield GaugeMetricFamily(
        "radixserve_kv_disk_bytes_used", "Disk-tier bytes (records)", s.kv_disk_bytes_used
    )


@dataclass(frozen=True)
class VLLMNames:
    """What the vLLM-named series say about the server: its model's name (their
    ``model_name`` label), KV page size and most adapters in one batch (None: no LoRA
    gauge; a model that can load adapters at any time always has one)."""

    model_name: str
    page_size: int
    max_loras: int | None = None


class _VLLMCollector(Collector):
    """The engine's state under the names vLLM exports and llm-d's / the Gateway API
    Inference Extension's endpoint picker scrapes by default (its model-server protocol):
    ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
    ``vllm:kv_cache_usage_perc`` (the pages held by requests, a fraction 0 to 1: those the
    radix tree alone caches are free on demand, as vLLM counts its cached blocks; also as
    the older ``vllm:gpu_cache_usage_perc``), the prefix-cache counters,
    ``vllm:cache_config_info`` (``block_size``, ``num_gpu_blocks``) and, when adapters can
    be served, ``vllm:lora_requests_info``. Invariant: one series per family for one model
    (the picker reads the first matching one; a several-model server has one per model),
    labelled
    as vLLM labels them (``model_name``, ``engine``; the LoRA gauge with its own three
    labels only, its value the time it was read, as vLLM sets it)."""

    def __init__(self, stats: Callable[[], EngineStats | None], names: VLLMNames) -> None:
        self._stats = stats
        self.names = names

    def collect(self) -> Iterator:
        s = self._stats()
        if s is None:
            return
        labels, values = ["model_name", "engine"], [self.names.model_name, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch", s.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be admitted", s.waiting)
        # as vLLM counts it: pages cached by the radix tree alone are free (on demand)
        held = s.kv_pages_total - s.kv_pages_free - s.kv_pages_evictable
        used = held / s.kv_pages_total if s.kv_pages_total else 0.0
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100 percent)", used)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (older name)", used)
        yield counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up", s.cache_queried_tokens
        )
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found cached", s.cache_hit_tokens)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "The KV cache's configuration (labels)",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"],
        )
        info.add_metric([str(self.names.page_size), str(s.kv_pages_total), "True", "0"], 1.0)
        yield info
        if self.names.max_loras is not None:
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on LoRA requests (the value: when they were read)",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            lora.add_metric(
                [
                    str(self.names.max_loras),
                    ",".join(s.waiting_loras),
                    ",".join(s.running_loras),
                ],
                time.time(),
            )
            yield lora


class Metrics:
    """One registry per app (tests start several). ``vllm``: also the series under vLLM's
    names (``_VLLMCollector``)."""

    def __init__(
        self, engine_stats: Callable[[], EngineStats | None], vllm: VLLMNames | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine_stats))
        if vllm is not None:
            self.registry.register(_VLLMCollector(engine_stats, vllm))
        r = self.registry
        # request, token and latency series carry the tenant's label (tenancy.TenantTag:
        # "default" or a keys-file name, so bounded)
        self.prompt_tokens = Counter(
            "radixserve_prompt_tokens",
            "Prompt tokens of finished requests",
            ["tenant"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "radixserve_generation_tokens", "Generated tokens", ["tenant"], registry=r
        )
        self.request_success = Counter(
            "radixserve_request_success",
            "Finished requests by finish reason",
            ["finished_reason", "tenant"],
            registry=r,
        )
        self.ttft = Histogram(
            "radixserve_time_to_first_token_seconds",
            "TTFT",
            ["tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "radixserve_inter_token_latency_seconds",
            "Time between tokens",
            ["tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "radixserve_request_queue_time_seconds",
            "Time from arrival at the engine to first admission",
            ["tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "radixserve_e2e_request_latency_seconds",
            "End-to-end latency",
            ["tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ByModel(Collector):
    """The series of several models' registries as one family each, every sample labelled
    with its ``model`` (Prometheus wants a family's samples together, under one TYPE)."""

    def __init__(self, registries: list[tuple[str, CollectorRegistry]]) -> None:
        self._registries = registries

    def collect(self) -> Iterator:
        families: dict[str, Metric] = {}
        for model, registry in self._registries:
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                merged.samples.extend(
                    s._replace(labels={"model": model, **s.labels}) for s in family.samples
                )
        yield from families.values()


def render_by_model(metrics: list[tuple[str, Metrics]]) -> bytes:
    """Several models' metrics in one exposition, each series labelled ``model``."""
    registry = CollectorRegistry()
    registry.register(_ByModel([(name, m.registry) for name, m in metrics]))
    return generate_latest(registry)


class RequestTimer:
    """Timings and token counts of one streamed request, into ``Metrics`` (shared by the
    HTTP and gRPC frontends). Invariants: TTFT is observed once, at the first token of any
    sample; ITL between consecutive token-bearing deltas of one sample; one success count
    per finished sample; e2e and token totals once, at ``finish``; every series under the
    request's tenant ``label`` (``tenancy.TenantTag``)."""

    def __init__(self, metrics: Metrics, label: str) -> None:
        self.metrics = metrics
        self.label = label
        self.started = time.monotonic()
        self.first: float | None = None
        self.last: dict[Hashable, float] = {}
        self.tokens = 0  # generated so far, all samples

    def delta(self, sample: Hashable, d: Any) -> None:
        """Count one engine delta (``protocol.Delta``) of ``sample``."""
        if d.token_ids:
            now = time.monotonic()
            if self.first is None:
                self.first = now
                self.metrics.ttft.labels(self.label).observe(now - self.started)
            elif sample in self.last:
                self.metrics.itl.labels(self.label).observe(now - self.last[sample])
            self.last[sample] = now
        self.tokens += len(d.token_ids)
        if d.finished:
            self.metrics.request_success.labels(d.finish_reason or "unknown", self.label).inc()

    def finish(self, prompt_tokens: int) -> None:
        """The request ended normally: its latency and token counts."""
        self.metrics.e2e.labels(self.label).observe(time.monotonic() - self.started)
        self.metrics.generation_tokens.labels(self.label).inc(self.tokens)
        self.metrics.prompt_tokens.labels(self.label).inc(prompt_tokens)
