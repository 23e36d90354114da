"""The radix cache inside the engine: reuse without corruption, on or off gives the same."""

from __future__ import annotations

import random

import pytest

from radixserve import LLM, SamplingParams
from radixserve.core.request import RequestState
from tests.helpers import greedy

# The tiny llama's KV takes 512 bytes a token (2 layers x K,V x 2 heads x 16 x float32).


def _llm(path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory_gb", 0.02)
    return LLM(str(path), dtype="float32", **kw)


def _run(llm: LLM, prompts, params) -> list[list[int]]:
    """Generate; check accounting (the cache keeps its pages between calls)."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_page_accounting()
    assert not llm.engine.scheduler.has_unfinished()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(("page_size", "prefix_len"), [(1, 1000), (16, 1000), (16, 1007)])
def test_shared_prefix_never_leaks_between_requests(tiny_llama, page_size, prefix_len):
    """Two requests share a long prefix (ending mid-page for 1000 and 1007 with pages of 16)
    and sample at temperature 1 with different seeds: each gets exactly its solo output."""
    rng = random.Random(page_size + prefix_len)
    prefix = [rng.randrange(3, 512) for _ in range(prefix_len)]
    prompts = [[*prefix, 11, 12], [*prefix, 13]]
    params = [
        SamplingParams(temperature=1.0, max_tokens=24, seed=s, ignore_eos=True) for s in (1, 2)
    ]
    off = _llm(tiny_llama, page_size=page_size, disable_radix_cache=True)
    solo = [_run(off, [p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert solo[0] != solo[1]
    on = _llm(tiny_llama, page_size=page_size)
    assert [_run(on, [p], [sp])[0] for p, sp in zip(prompts, params, strict=True)] == solo
    stats = on.engine.cache_stats()
    assert stats["hit_tokens"] >= prefix_len - page_size  # the 2nd reused it
    assert 0 < stats["hit_rate"] < 1 and stats["protected_pages"] == 0
    assert _run(on, prompts, params) == solo  # together, both from the cache
    assert _run(on, prompts[::-1], params[::-1]) == solo[::-1]
    on.engine.check_idle()


def _related_prompts(page_size: int) -> list[list[int]]:
    rng = random.Random(page_size)
    base = [rng.randrange(3, 512) for _ in range(5 * page_size + 3)]
    mid_page = page_size * 2 + page_size // 2
    return [
        base,  # the original
        list(base),  # equal
        base[: 3 * page_size],  # a prefix of it, at a page boundary
        base[:mid_page],  # a prefix ending mid-page
        [*base, 7, 8, 9],  # extends it
        [*base[:mid_page], 1, 2, 3, 4, 5],  # diverges mid-page
        [*base[: 2 * page_size], 6, 5, 4, 3],  # diverges at a page boundary
        [4, *base],  # shares nothing
    ]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_same_with_cache_on_and_off(tiny_llama, page_size):
    prompts = _related_prompts(page_size)
    params = greedy(16)
    off = _llm(tiny_llama, page_size=page_size, disable_radix_cache=True)
    expected = [_run(off, [p], params)[0] for p in prompts]
    on = _llm(tiny_llama, page_size=page_size)
    assert [_run(on, [p], params)[0] for p in prompts] == expected  # one by one: hits
    assert _run(on, prompts, params) == expected  # all at once, on a warm tree
    assert on.engine.prefix_cache.hit_rate > 0.3
    # A pool of about three requests' KV: the tree evicts and requests get preempted.
    pool_tokens = 3 * (len(max(prompts, key=len)) + 16)
    tiny = _llm(
        tiny_llama,
        page_size=page_size,
        kv_cache_memory_gb=pool_tokens * 512 / 2**30,
        schedule_conservativeness=0.0,  # admit greedily: preemption must happen
    )
    assert _run(tiny, prompts + prompts, params) == expected + expected
    assert tiny.engine.scheduler.stats.num_preemptions > 0
    tiny.engine.check_idle()
    on.engine.check_idle()


def test_chunked_prefill_shares_inserted_chunks_with_a_concurrent_request(tiny_llama):
    llm = _llm(tiny_llama, page_size=4, max_num_batched_tokens=32)
    engine = llm.engine
    prompt = list(range(10, 210))
    engine.add_request("first", prompt, greedy(4))
    for _ in range(3):  # three 32-token chunks computed and inserted
        engine.step()
    engine.add_request("second", prompt, greedy(4))
    second = engine.scheduler.get("second")
    while second.state is RequestState.NEW:  # admitted once the budget has room
        engine.step()
    assert second.num_cached_tokens >= 3 * 32
    results = {}
    while engine.has_unfinished():
        for d in engine.step():
            results.setdefault(d.request_id, []).extend(d.token_ids)
    assert results["first"] == results["second"]
    engine.check_idle()


def test_preempted_request_resumes_with_a_cache_hit(tiny_llama):
    llm = _llm(tiny_llama, page_size=4)
    prompt = list(range(30, 90))
    expected = _run(_llm(tiny_llama, page_size=4, disable_radix_cache=True), [prompt], greedy(20))
    engine = llm.engine
    engine.add_request("r", prompt, greedy(20))
    tokens = []
    for _ in range(6):  # prefill + 5 decodes
        tokens += [t for d in engine.step() for t in d.token_ids]
    req = engine.scheduler.get("r")
    computed = req.num_computed_tokens
    engine.scheduler._preempt(req)  # what the scheduler does when pages run out
    engine.check_page_accounting()
    tokens += [t for d in engine.step() for t in d.token_ids]
    assert req.num_cached_tokens == computed  # all of its KV came back from the tree
    while engine.has_unfinished():
        tokens += [t for d in engine.step() for t in d.token_ids]
    assert tokens == expected[0]
    engine.check_idle()


def test_cache_salt_keeps_tenants_apart(tiny_llama):
    llm = _llm(tiny_llama, page_size=4)
    engine = llm.engine
    prompt = list(range(20, 80))
    for rid, salt in (("a", "tenant-a"), ("b", "tenant-b"), ("c", "tenant-a")):
        engine.add_request(rid, prompt, greedy(2), cache_salt=salt)
        cached = None
        while engine.has_unfinished():
            for d in engine.step():
                if d.finished:
                    cached = d.num_cached_tokens
        assert cached == (59 if rid == "c" else 0)  # all but the last prompt token
    engine.check_idle()


def _cached_tokens(engine, rid: str, prompt: list[int], **kw) -> int:
    """Run one request alone; its ``num_cached_tokens``."""
    engine.add_request(rid, prompt, greedy(2), **kw)
    cached = None
    while engine.has_unfinished():
        for d in engine.step():
            if d.finished:
                cached = d.num_cached_tokens
    return cached


@pytest.mark.parametrize("scope", ["tenant", "global"])
def test_tenants_share_no_cached_prefix_unless_the_scope_is_global(tiny_llama, scope):
    """Scope ``tenant`` (the default): a tenant's request never matches another tenant's
    pages (nor a sub-tenant's of the same key), even with the same salt; it does match its
    own. Tenant ``default`` keeps the bare salt's namespace. ``global``: all share."""
    from radixserve.core.request import Tenant

    llm = _llm(tiny_llama, page_size=4, prefix_cache_scope=scope)
    engine = llm.engine
    prompt = list(range(20, 80))
    alice, bob, bob_sub = Tenant("alice"), Tenant("bob"), Tenant("bob/team-1")
    full = 59  # all but the last prompt token
    assert _cached_tokens(engine, "a1", prompt, tenant=alice) == 0
    shared = full if scope == "global" else 0
    assert _cached_tokens(engine, "b1", prompt, tenant=bob) == shared
    assert _cached_tokens(engine, "s1", prompt, tenant=bob_sub) == shared
    assert _cached_tokens(engine, "d1", prompt) == shared  # tenant default
    assert _cached_tokens(engine, "a2", prompt, tenant=alice) == full
    assert _cached_tokens(engine, "b2", prompt, tenant=bob) == full
    # a salt partitions within a tenant; another tenant sending it gets nothing of it
    assert _cached_tokens(engine, "a3", prompt, tenant=alice, cache_salt="x") == 0
    assert _cached_tokens(engine, "a4", prompt, tenant=alice, cache_salt="x") == full
    assert _cached_tokens(engine, "b3", prompt, tenant=bob, cache_salt="x") == shared
    assert _cached_tokens(engine, "d2", prompt, cache_salt="x") == shared
    engine.check_idle()
