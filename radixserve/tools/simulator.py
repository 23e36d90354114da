"""Drive the real scheduler, radix cache and page pool with a simulated device over a trace."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from radixserve.core.page_pool import PagePool
from radixserve.core.page_table import PageTable
from radixserve.core.radix_cache import RadixCache
from radixserve.core.request import FinishReason, Request, Tenant
from radixserve.core.sampling_params import SamplingParams
from radixserve.core.step import ScheduledBatch
from radixserve.executor.simulated import CostModel, SimulatedRunner, VirtualClock
from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.scheduler import Scheduler, SchedulerConfig


@dataclass
class TraceRequest:
    arrival_s: float
    prompt: np.ndarray
    max_tokens: int
    priority: int = 0
    tenant: Tenant | None = None


def load_trace(path: Path, vocab_size: int = 32000) -> list[TraceRequest]:
    """JSONL, one request a line: ``arrival`` (s), ``output_tokens``, and either
    ``prompt_ids`` or ``prompt_tokens`` (random ids) with optional ``prefix_group`` and
    ``prefix_tokens`` (requests of a group share their first ``prefix_tokens`` ids);
    optional ``priority``, and ``tenant`` (a name) with ``weight`` and ``max_concurrency``
    (policy ``fair``)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace file {path} does not exist")
    rng = np.random.default_rng(0)
    prefixes: dict[object, np.ndarray] = {}
    trace = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if "prompt_ids" in item:
                prompt = np.asarray(item["prompt_ids"], dtype=np.int32)
            else:
                total = int(item["prompt_tokens"])
                group = item.get("prefix_group")
                shared = int(item.get("prefix_tokens", 0)) if group is not None else 0
                if group is not None and group not in prefixes:
                    prefixes[group] = rng.integers(0, vocab_size, shared, dtype=np.int32)
                head = prefixes[group][:shared] if group is not None else np.zeros(0, np.int32)
                tail = rng.integers(0, vocab_size, total - head.size, dtype=np.int32)
                prompt = np.concatenate([head, tail])
            tenant = None
            if "tenant" in item:
                cap = item.get("max_concurrency")
                tenant = Tenant(
                    str(item["tenant"]),
                    float(item.get("weight", 1.0)),
                    None if cap is None else int(cap),
                )
            trace.append(
                TraceRequest(
                    float(item.get("arrival", 0.0)),
                    prompt,
                    int(item["output_tokens"]),
                    int(item.get("priority", 0)),
                    tenant,
                )
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}:{line_no}: bad trace line ({exc})") from None
    return sorted(trace, key=lambda t: t.arrival_s)


def shared_prefix_trace(
    groups: int = 64,
    per_group: int = 16,
    prefix_tokens: int = 1024,
    question_tokens: int = 128,
    output_tokens: int = 256,
    request_rate: float = 8.0,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[TraceRequest]:
    """Groups of requests sharing a prefix, shuffled, arriving as a Poisson process."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(groups):
        prefix = rng.integers(0, vocab_size, prefix_tokens, dtype=np.int32)
        for _ in range(per_group):
            question = rng.integers(0, vocab_size, question_tokens, dtype=np.int32)
            prompts.append(np.concatenate([prefix, question]))
    order = rng.permutation(len(prompts))
    arrivals = np.cumsum(rng.exponential(1.0 / request_rate, len(prompts)))
    return [
        TraceRequest(float(arrivals[i]), prompts[j], output_tokens)
        for i, j in enumerate(order.tolist())
    ]


@dataclass
class SimulationResult:
    num_requests: int
    num_finished: int
    num_failed: int
    makespan_s: float
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    hit_rate: float = 0.0
    preemptions: int = 0
    steps: int = 0
    ttft_by_tenant: dict[str, list[float]] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s else 0.0

    def summary(self) -> dict[str, float]:
        def pct(values: list[float], q: float) -> float:
            return float(np.percentile(values, q)) if values else 0.0

        return {
            "requests": self.num_requests,
            "finished": self.num_finished,
            "failed": self.num_failed,
            "makespan_s": round(self.makespan_s, 3),
            "output_tok_s": round(self.output_tok_s, 1),
            "ttft_p50_s": round(pct(self.ttft_s, 50), 4),
            "ttft_p90_s": round(pct(self.ttft_s, 90), 4),
            "ttft_p99_s": round(pct(self.ttft_s, 99), 4),
            "itl_p50_ms": round(1e3 * pct(self.itl_s, 50), 2),
            "itl_p90_ms": round(1e3 * pct(self.itl_s, 90), 2),
            "itl_p99_ms": round(1e3 * pct(self.itl_s, 99), 2),
            "hit_rate": round(self.hit_rate, 4),
            "preemptions": self.preemptions,
            "steps": self.steps,
            **{
                f"ttft_p99_s[{name}]": round(pct(values, 99), 4)
                for name, values in sorted(self.ttft_by_tenant.items())
                if len(self.ttft_by_tenant) > 1
            },
        }


class Simulator:
    """The real ``Scheduler`` + ``KVManager`` + ``RadixCache`` + ``PagePool`` on a virtual
    clock, with a ``SimulatedRunner`` for a device.

    Invariant: after ``run``, every request of the trace has ended exactly once and every
    page is free or held by the radix tree (``check_pages``).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        num_pages: int,
        page_size: int = 16,
        max_model_len: int = 32768,
        cost: CostModel | None = None,
        enable_cache: bool = True,
    ) -> None:
        self.clock = VirtualClock()
        self.pool = PagePool(num_pages, page_size)
        self.cache = RadixCache(self.pool) if enable_cache else None
        table = PageTable(scheduler_config.max_num_seqs, self.pool.pages_for(max_model_len))
        self.kv = KVManager(self.pool, table, self.cache)
        self.scheduler = Scheduler(scheduler_config, self.kv, clock=self.clock)
        self.runner = SimulatedRunner(cost, clock=self.clock)

    def run(
        self,
        trace: list[TraceRequest],
        max_steps: int = 10_000_000,
        on_step: Callable[[ScheduledBatch, list[Request]], None] | None = None,
    ) -> SimulationResult:
        """Run ``trace`` to its end. ``on_step(batch, received)``, if given, sees every
        step after it ran: its batch and the requests that received a token."""
        pending = sorted(trace, key=lambda t: t.arrival_s)
        first_token: dict[str, float] = {}
        last_token: dict[str, float] = {}
        arrival: dict[str, float] = {}
        result = SimulationResult(len(trace), 0, 0, 0.0, 0)
        next_idx = 0
        for _ in range(max_steps):
            while next_idx < len(pending) and pending[next_idx].arrival_s <= self.clock.now:
                t = pending[next_idx]
                rid = f"sim-{next_idx}"
                params = SamplingParams(max_tokens=t.max_tokens, ignore_eos=True)
                req = Request(
                    rid,
                    t.prompt,
                    params,
                    arrival_time=t.arrival_s,
                    priority=t.priority,
                    tenant=t.tenant,
                )
                self.scheduler.add_request(req)
                arrival[rid] = t.arrival_s
                next_idx += 1
            if not self.scheduler.has_unfinished():
                if next_idx == len(pending):
                    break
                self.clock.advance_to(pending[next_idx].arrival_s)
                continue
            batch = self.scheduler.schedule()
            result.num_failed += len(batch.failed)
            if batch.is_empty:
                wake = self.scheduler.next_wakeup()
                nxt = pending[next_idx].arrival_s if next_idx < len(pending) else None
                candidates = [w for w in (wake, nxt) if w is not None and w > self.clock.now]
                if not candidates and not batch.failed:
                    raise RuntimeError("simulation stalled: requests wait but none can run")
                if candidates:
                    self.clock.advance_to(min(candidates))
                continue
            result.steps += 1
            step = self.runner.execute(batch)
            self.scheduler.observe_step(batch, step.seconds)
            tokens = step.tokens
            now = self.clock.now
            received = self.scheduler.update_after_step(batch, tokens)
            if on_step is not None:
                on_step(batch, received)
            for req in received:
                rid = req.request_id
                if rid not in first_token:
                    first_token[rid] = now
                    result.ttft_s.append(now - arrival[rid])
                    ttfts = result.ttft_by_tenant.setdefault(req.tenant.name, [])
                    ttfts.append(now - arrival[rid])
                else:
                    result.itl_s.append(now - last_token[rid])
                last_token[rid] = now
                result.output_tokens += 1
                if req.num_output_tokens >= req.sampling_params.max_tokens:
                    self.scheduler.finish(req, FinishReason.LENGTH)
                    result.num_finished += 1
        else:
            raise RuntimeError(f"simulation did not finish within {max_steps} steps")
        result.makespan_s = self.clock.now - (pending[0].arrival_s if pending else 0.0)
        result.hit_rate = self.cache.hit_rate if self.cache else 0.0
        result.preemptions = self.scheduler.stats.num_preemptions
        return result

    def check_pages(self) -> None:
        """Idle accounting: every page is free or held once by the tree."""
        self.pool.check()
        held = self.kv.held_page_ids([])
        expected = np.bincount(held, minlength=self.pool.num_pages)
        assert np.array_equal(expected, self.pool.refcount), "page refcounts != holders"
