"""Scheduling policies, limits and timeouts, on the scheduler alone (no model)."""

from __future__ import annotations

import pytest

from radixserve import SamplingParams
from radixserve.core.request import FinishReason, Request, RequestState
from radixserve.executor.simulated import VirtualClock
from radixserve.scheduler.scheduler import EngineOverloaded
from tests.scheduler.test_scheduler import apply, check_accounting, make, run, step


def _req(rid, tokens, max_tokens=4, **kw):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), **kw)


def _warm(s, tokens, rid="warm"):
    """Run one request to the end so its KV sits in the radix tree."""
    s.add_request(_req(rid, tokens, max_tokens=1))
    run(s)


def test_lpm_orders_by_cached_prefix_length():
    s = make(num_pages=256, page_size=4, budget=512, cache=True, policy="lpm")
    base = list(range(100, 164))
    _warm(s, base)
    s.add_request(_req("none", list(range(500, 560))))
    s.add_request(_req("short", base[:16] + list(range(600, 640))))
    s.add_request(_req("long", [*base[:60], 7, 8]))
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["long", "short", "none"]
    assert [r.num_cached_tokens for r in batch.requests] == [60, 16, 0]


def test_dfs_weight_groups_requests_by_subtree():
    s = make(num_pages=512, page_size=4, budget=64, cache=True, policy="dfs-weight")
    a, b = list(range(100, 140)), list(range(200, 240))
    _warm(s, a, "wa")
    _warm(s, b, "wb")
    # arrivals interleave the two prefix groups; b's group is heavier
    order = ["a1", "b1", "a2", "b2", "b3"]
    for rid in order:
        prefix = a if rid[0] == "a" else b
        s.add_request(_req(rid, [*prefix, int(rid[1]), 999]))
    ranked = [r.request_id for r in s.policy.order(s.waiting)]
    assert ranked[:3] == ["b1", "b2", "b3"] and ranked[3:] == ["a1", "a2"]


def test_priority_runs_lower_values_first_and_preempts_only_lower_priority():
    s = make(num_pages=12, page_size=4, budget=64, max_seqs=4, policy="priority", reserve=1.0)
    low = _req("low", list(range(10, 30)), max_tokens=20, priority=5)
    s.add_request(low)
    ended = []
    step(s, ended)
    assert low.state is RequestState.DECODE
    same = _req("same", list(range(40, 60)), max_tokens=4, priority=5)
    s.add_request(same)
    step(s, ended)
    assert low.state is RequestState.DECODE and same.state is RequestState.NEW  # no room
    high = _req("high", list(range(70, 90)), max_tokens=4, priority=0)
    s.add_request(high)
    batch = s.schedule()
    assert high in batch.requests and low.state is RequestState.PREEMPTED
    assert same.state is RequestState.NEW  # equal priority never preempts
    apply(s, batch, ended)
    run(s)
    assert all(r.finish_reason is FinishReason.LENGTH for r in (low, same, high))


def test_in_batch_prefix_sharing_computes_a_shared_prefix_once():
    s = make(num_pages=512, page_size=4, budget=256, cache=True)
    prefix = list(range(1000, 1200))
    reqs = [_req(f"r{i}", [*prefix, i, i + 1], max_tokens=2) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    first = s.schedule()
    assert [r.request_id for r in first.requests] == ["r0"]  # the others wait for its KV
    apply(s, first, [])
    second = s.schedule()
    assert {r.request_id for r in second.requests} >= {"r1", "r2", "r3"}
    assert all(r.num_cached_tokens >= 200 for r in reqs[1:])
    assert s.stats.num_deferred_for_sharing >= 3
    apply(s, second, [])
    run(s)


def test_in_batch_prefix_sharing_stays_within_a_namespace():
    """A request never waits for KV another tenant's (or salt's) request is computing: it
    could not reuse it, and the wait would tell it what the other is prefilling."""
    s = make(num_pages=512, page_size=4, budget=512, cache=True)
    prefix = list(range(1000, 1200))
    namespaces = [("tenant", "a", None), ("tenant", "b", None), "salt"]
    reqs = [
        _req(f"r{i}", [*prefix, i, i + 1], max_tokens=2, cache_namespace=ns)
        for i, ns in enumerate(namespaces)
    ]
    for r in reqs:
        s.add_request(r)
    first = s.schedule()
    assert [r.request_id for r in first.requests] == ["r0", "r1", "r2"]  # none deferred
    assert s.stats.num_deferred_for_sharing == 0
    apply(s, first, [])
    run(s)
    assert all(r.num_cached_tokens == 0 for r in reqs)


def test_long_prompt_delays_decodes_by_at_most_one_chunk_per_step():
    s = make(num_pages=4096, page_size=16, budget=512, threshold=256, max_seqs=8)
    decoders = [_req(f"d{i}", list(range(5 + i, 25 + i)), max_tokens=200) for i in range(4)]
    for d in decoders:
        s.add_request(d)
    ended: list[Request] = []
    step(s, ended)
    assert all(d.state is RequestState.DECODE for d in decoders)
    long = _req("long", [1 + (i % 500) for i in range(10_000)], max_tokens=2)
    s.add_request(long)
    while long.state is not RequestState.DECODE:
        before = {d.request_id: d.num_output_tokens for d in decoders}
        batch = s.schedule()
        counts = dict(
            zip((r.request_id for r in batch.requests), batch.num_new_tokens.tolist(), strict=True)
        )
        assert all(counts[d.request_id] == 1 for d in decoders)  # every decode, every step
        assert counts.get("long", 0) <= 256
        apply(s, batch, ended)
        assert all(d.num_output_tokens == before[d.request_id] + 1 for d in decoders)
    run(s)


def test_backpressure_rejects_when_the_queue_is_full():
    s = make(max_waiting_requests=2)
    s.add_request(_req("a", [1, 2]))
    s.add_request(_req("b", [1, 2]))
    with pytest.raises(EngineOverloaded, match="overloaded"):
        s.add_request(_req("c", [1, 2]))
    assert s.stats.num_rejected == 1
    run(s)


def test_queue_timeout_and_deadline():
    clock = VirtualClock()
    s = make(num_pages=8, page_size=4, budget=64, max_queue_time_s=5.0)
    s.clock = clock
    hog = _req("hog", list(range(1, 20)), max_tokens=10, arrival_time=0.0)
    s.add_request(hog)
    ended: list[Request] = []
    step(s, ended)
    starved = _req("starved", list(range(1, 20)), max_tokens=4, arrival_time=0.0)
    s.add_request(starved)
    doomed = _req("doomed", [5, 6], max_tokens=4, arrival_time=0.0, deadline=2.0)
    s.add_request(doomed)
    clock.advance(3.0)
    batch = s.schedule()
    assert doomed in batch.failed and "deadline" in doomed.error
    clock.advance(3.0)
    apply(s, batch, ended)
    batch = s.schedule()
    assert starved in batch.failed and "max_queue_time" in starved.error
    assert s.stats.num_timed_out == 2
    apply(s, batch, ended)
    run(s)
    assert hog.finish_reason is FinishReason.LENGTH
    check_accounting(s)


def test_batch_wait_holds_admission_until_due():
    clock = VirtualClock()
    s = make(batch_wait_s=0.05)
    s.clock = clock
    s.add_request(_req("a", [1, 2, 3], arrival_time=0.0))
    assert s.schedule().is_empty and s.next_wakeup() == pytest.approx(0.05)
    s.add_request(_req("b", [4, 5, 6], arrival_time=0.02))
    clock.advance(0.05)
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["a", "b"]  # batched together


def test_reserve_ratio_adapts_to_preemptions():
    s = make(num_pages=40, page_size=4, budget=256)
    s.config = s.config.__class__(
        256, 16, None, reserve_ratio_init=0.5, reserve_ratio_min=0.1, reserve_ratio_decay_steps=10
    )
    s.reserve_ratio = 0.5
    s.add_request(_req("a", list(range(1, 9)), max_tokens=100))
    ended: list[Request] = []
    for _ in range(10):
        step(s, ended)
    assert s.reserve_ratio == pytest.approx(0.1)  # decayed while memory sufficed
    for i in range(6):
        s.add_request(_req(f"b{i}", list(range(1, 9)), max_tokens=100))
    while s.stats.num_preemptions == 0 and s.has_unfinished():
        step(s, ended)
    assert s.stats.num_preemptions > 0 and s.reserve_ratio == pytest.approx(0.5)
    run(s)
