"""A randomised stress of the scheduler on the simulated device: nothing lost, nothing leaked,
in the serial loop and in the overlapped one (step N+1 launched before step N is processed)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from radixserve import SamplingParams
from radixserve.core.page_pool import PagePool
from radixserve.core.page_table import PageTable
from radixserve.core.radix_cache import RadixCache
from radixserve.core.request import FinishReason, Request, Tenant
from radixserve.core.step import ScheduledBatch
from radixserve.executor.simulated import CostModel, SimulatedRunner, VirtualClock
from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.scheduler import Scheduler, SchedulerConfig

NUM_REQUESTS = 5000


# the fast loop runs one (priority, overlapped: the most moving parts); the full run, CI's,
# each policy once and each loop both ways (all six cost 9 s each for little more)
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "policy, overlap",
    [
        ("priority", True),
        pytest.param("fcfs", False, marks=_SLOW),
        pytest.param("lpm", True, marks=_SLOW),
    ],
    ids=lambda v: {True: "overlap", False: "serial"}.get(v, v) if isinstance(v, bool) else v,
)
def test_five_thousand_requests_end_exactly_once(policy, overlap):
    run_stress(policy, overlap)


def run_stress(
    policy: str,
    overlap: bool,
    num_requests: int = NUM_REQUESTS,
    tenants: int = 0,
    num_pages: int = 600,
):
    """The stress itself; ``tenants`` > 0: requests come from that many tenants, of
    random weights, some capped in running requests."""
    rng = random.Random(policy)
    tenant_list = [
        Tenant(f"t{i}", rng.choice([0.5, 1.0, 3.0]), rng.choice([None, None, 6]))
        for i in range(tenants)
    ]
    clock = VirtualClock()
    pool = PagePool(num_pages, 8)  # 600: 4,800 tokens of KV, preemption and eviction constant
    table = PageTable(64, 128)
    kv = KVManager(pool, table, RadixCache(pool))
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=512,
            max_num_seqs=64,
            long_prefill_threshold=256,
            policy=policy,
            max_queue_time_s=40.0,
            reserve_ratio_init=0.2,
            reserve_ratio_min=0.0,
        ),
        kv,
        clock=clock,
    )
    # with the page table, each step's input arrays are built and their placeholders resolved
    runner = SimulatedRunner(
        CostModel(0.01, 1e-4, 1e-7), vocab_size=1000, clock=clock, page_table=table, page_size=8
    )
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(8, 300))] for _ in range(20)]
    ends: Counter[str] = Counter()
    received: Counter[str] = Counter()
    live: dict[str, Request] = {}
    in_flight: tuple[ScheduledBatch, np.ndarray] | None = None
    next_id = 0
    steps = 0
    while next_id < num_requests or sched.has_unfinished() or in_flight is not None:
        steps += 1
        assert steps < 200_000, "no progress: a deadlock"
        for _ in range(rng.randrange(0, 4)):  # arrivals
            if next_id == num_requests:
                break
            prompt = rng.choice(prefixes)[: rng.randrange(1, 300)] + [
                rng.randrange(1000) for _ in range(rng.randrange(1, 40))
            ]
            req = Request(
                f"q{next_id}",
                prompt,
                SamplingParams(max_tokens=rng.randrange(1, 60)),
                arrival_time=clock.now,
                priority=rng.randrange(3),
                deadline=clock.now + rng.uniform(5, 400) if rng.random() < 0.05 else None,
                tenant=rng.choice(tenant_list) if tenant_list else None,
            )
            sched.add_request(req)
            live[req.request_id] = req
            next_id += 1
        if live and rng.random() < 0.05:  # an abort at a random moment, in any state
            victim = sched.abort(rng.choice(list(live)))
            if victim is not None:
                ends[victim.request_id] += 1
                del live[victim.request_id]
        batch = sched.schedule()
        if tenant_list:  # each tenant's running requests within its cap
            running = Counter(r.tenant for r in sched.running)
            assert all(t.max_running is None or n <= t.max_running for t, n in running.items())
        for req in batch.failed:
            ends[req.request_id] += 1
            live.pop(req.request_id, None)
        launched = None
        if not batch.is_empty:  # launch: the device runs steps in order
            step = runner.prepare(batch)
            clock.advance(step.seconds)
            launched = (batch, runner.run(step).tokens)
            sched.begin_step(batch, step.placeholders)
        kv.cache.flush()
        pool.flush()
        previous, in_flight = (in_flight, launched) if overlap else (launched, None)
        if previous is None:
            if batch.is_empty:
                clock.advance(0.01)
            continue
        for req, index in sched.end_step(*previous):
            assert req.request_id in live, "a token for a request that ended"
            expected = runner.tokens_at([req], np.array([index]))[0]
            assert req.token_ids[index] == expected  # unchanged by preemption
            received[req.request_id] += 1
            num_output = index + 1 - req.num_prompt_tokens
            assert num_output == received[req.request_id]
            if num_output >= req.sampling_params.max_tokens or rng.random() < 0.004:
                sched.finish(req, FinishReason.LENGTH)  # at length, or a stop condition
                assert req.num_output_tokens == num_output  # a step in flight is discarded
                ends[req.request_id] += 1
                del live[req.request_id]
        if steps % 500 == 0:
            held = kv.held_page_ids(sched.running)
            assert np.array_equal(np.bincount(held, minlength=pool.num_pages), pool.refcount)
    assert len(ends) == num_requests and set(ends.values()) == {1}
    assert not live and not sched.running and not sched.waiting
    assert sched.stats.num_preemptions > 0 and sched.stats.num_aborted > 0
    assert (sched.stats.num_discarded_tokens > 0) == overlap
    kv.cache.reset()
    pool.check()
    assert pool.num_free == pool.num_pages
