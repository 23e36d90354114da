"""The scheduler on its own: no model, tokens made up by a deterministic fake device."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve import SamplingParams
from radixserve.core.page_pool import PagePool
from radixserve.core.page_table import PageTable
from radixserve.core.radix_cache import RadixCache
from radixserve.core.request import FinishReason, Request, RequestState
from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.scheduler import Scheduler, SchedulerConfig


def make(
    num_pages=64,
    page_size=4,
    budget=64,
    max_seqs=16,
    threshold=None,
    reserve=0.0,
    cache=False,
    **config,
):
    """A scheduler over a small pool; ``reserve`` 0 admits greedily (preemption-prone)."""
    pool = PagePool(num_pages, page_size)
    kv = KVManager(pool, PageTable(max_seqs, 1024), RadixCache(pool) if cache else None)
    cfg = SchedulerConfig(
        budget,
        max_seqs,
        threshold,
        reserve_ratio_init=reserve,
        reserve_ratio_min=reserve,
        **config,
    )
    return Scheduler(cfg, kv)


def fake_token(req: Request) -> int:
    """A token that depends only on the request and its position (so recompute is exact)."""
    return (hash(req.request_id) + 31 * req.num_tokens) % 1000


def check_accounting(s: Scheduler) -> None:
    pool = s.kv.pool
    pool.check()
    held = s.kv.held_page_ids(s.running)
    assert np.array_equal(np.bincount(held, minlength=pool.num_pages), pool.refcount)


def step(s: Scheduler, ended: list[Request]) -> None:
    apply(s, s.schedule(), ended)


def apply(s: Scheduler, batch, ended: list[Request]) -> None:
    """What the engine does with a scheduled batch: run it (fake tokens), finish at length."""
    ended.extend(batch.failed)
    sampled = np.array(
        [fake_token(r) if do else -1 for r, do in zip(batch.requests, batch.sample, strict=True)],
        dtype=np.int64,
    )
    for req in s.update_after_step(batch, sampled):
        req.token_ids[req.num_tokens - 1] = fake_token_at(req, req.num_tokens - 1)
        if req.num_output_tokens >= req.sampling_params.max_tokens:
            s.finish(req, FinishReason.LENGTH)
            ended.append(req)
    check_accounting(s)


def fake_token_at(req: Request, position: int) -> int:
    return (hash(req.request_id) + 31 * position) % 1000


def run(s: Scheduler, max_steps=10_000) -> list[Request]:
    ended: list[Request] = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            break
        step(s, ended)
    assert not s.has_unfinished(), "requests left after the step bound"
    return ended


def req(rid, prompt_len, max_tokens=4):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def test_token_budget_and_long_prefill_threshold():
    s = make(budget=32, threshold=10)
    s.add_request(req("a", 25))
    s.add_request(req("b", 25))
    batch = s.schedule()
    assert batch.num_new_tokens.tolist() == [10, 10]  # capped per request
    assert not batch.sample.any()
    assert batch.num_tokens <= 32


def test_decodes_first_then_prefill_chunks():
    s = make(budget=8)
    ended: list[Request] = []
    s.add_request(req("a", 4, max_tokens=10))
    step(s, ended)  # a prefills and samples
    s.add_request(req("b", 30))
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["a", "b"]
    assert batch.num_new_tokens.tolist() == [1, 7]
    assert batch.sample.tolist() == [True, False]


def test_preemption_never_loses_a_request():
    s = make(num_pages=12, page_size=4, budget=64)
    reqs = [req(f"r{i}", 6 + i, max_tokens=12) for i in range(6)]
    for r in reqs:
        s.add_request(r)
    ended = run(s)
    assert s.stats.num_preemptions > 0
    assert sorted(r.request_id for r in ended) == sorted(r.request_id for r in reqs)
    for r in reqs:
        assert r.state is RequestState.FINISHED and r.finish_reason is FinishReason.LENGTH
        expected = [fake_token_at(r, p) for p in range(r.num_prompt_tokens, r.num_tokens)]
        assert r.output_token_ids.tolist() == expected
    assert s.kv.pool.num_free == s.kv.pool.num_pages


def test_request_too_large_for_the_pool_fails_with_reason():
    s = make(num_pages=4, page_size=4)
    big = req("big", 10, max_tokens=20)
    s.add_request(big)
    ended = run(s)
    assert ended == [big]
    assert big.finish_reason is FinishReason.ERROR and "KV pages" in big.error
    assert s.kv.pool.num_free == 4


def test_a_lone_request_waits_for_pages_held_elsewhere_instead_of_failing():
    """Pages held outside the running set (a step still in flight, a tree lock) are no
    reason to fail a request that fits the pool: it is preempted and resumes later."""
    s = make(num_pages=8, page_size=4)
    held = s.kv.pool.alloc(4)  # half the pool, held by someone else for a while
    r = req("r", 8, max_tokens=12)  # 20 tokens: 5 pages, more than the 4 left
    s.add_request(r)
    ended: list[Request] = []
    for _ in range(40):
        batch = s.schedule()
        ended.extend(batch.failed)
        sampled = np.array([fake_token(q) for q in batch.requests], dtype=np.int64)
        for q in s.update_after_step(batch, sampled):
            q.token_ids[q.num_tokens - 1] = fake_token_at(q, q.num_tokens - 1)
    assert not ended and s.stats.num_preemptions > 0  # preempted, not failed
    s.kv.pool.decref(held)
    ended = run(s)
    assert ended == [r] and r.finish_reason is FinishReason.LENGTH
    assert r.output_token_ids.tolist() == [fake_token_at(r, p) for p in range(8, 20)]
    assert s.kv.pool.num_free == s.kv.pool.num_pages


def test_prompt_larger_than_pool_fails_at_admission():
    s = make(num_pages=2, page_size=4)
    r = req("r", 20)
    s.add_request(r)
    batch = s.schedule()
    assert batch.failed == [r] and r.finish_reason is FinishReason.ERROR


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "decoding", "preempted", "held"])
def test_abort_in_every_state_frees_pages(when):
    s = make(num_pages=32, page_size=4, budget=8)
    ended: list[Request] = []
    target = req("t", 20, max_tokens=8)
    if when == "held":
        group = [req(f"g{i}", 20, max_tokens=8) for i in range(3)]
        s.add_group(group)
        target = group[2]
    elif when == "preempted":
        s.add_request(target)
        step(s, ended)
        s._preempt(target)
        assert target.state is RequestState.PREEMPTED
    else:
        s.add_request(target)
        steps = {"waiting": 0, "mid_prefill": 1, "decoding": 3}[when]
        for _ in range(steps):
            step(s, ended)
        expected = {
            "waiting": RequestState.NEW,
            "mid_prefill": RequestState.PREFILL,
            "decoding": RequestState.DECODE,
        }[when]
        assert target.state is expected
    assert s.abort(target.request_id) is target
    assert target.state is RequestState.ABORTED and target.table_row == -1
    assert s.abort(target.request_id) is None  # ends once
    run(s)
    assert s.kv.pool.num_free == s.kv.pool.num_pages


def test_n_samples_share_prompt_pages():
    s = make(num_pages=64, page_size=4, budget=64)
    group = [req(f"g{i}", 10, max_tokens=3) for i in range(3)]
    s.add_group(group)
    ended: list[Request] = []
    step(s, ended)  # leader prefills 10 tokens
    assert group[0].state is RequestState.DECODE
    batch = s.schedule()
    siblings = [r for r in batch.requests if r is not group[0]]
    assert siblings == group[1:]
    # the siblings computed 9 prompt tokens for free: 2 full pages shared + 1 copied page
    assert all(r.num_cached_tokens == 9 for r in siblings)
    assert batch.num_new_tokens.tolist() == [1, 1, 1]
    assert len(batch.page_copies) == 2
    shared = s.kv.page_table.pages(group[0].table_row, 2)
    assert (s.kv.pool.refcount[shared] == 3).all()
    sampled = np.array([fake_token(r) for r in batch.requests])
    s.update_after_step(batch, sampled)
    check_accounting(s)
    run(s)
    assert s.kv.pool.num_free == s.kv.pool.num_pages
