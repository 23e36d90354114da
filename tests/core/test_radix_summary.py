"""The bounded radix-tree summary behind /v1/engine/radix."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.core.page_pool import PagePool
from radixserve.core.radix_cache import RadixCache
from radixserve.core.radix_summary import summarize


def _cache(page_size: int = 1, num_pages: int = 20_000) -> RadixCache:
    return RadixCache(PagePool(num_pages, page_size))


def _insert(cache: RadixCache, tokens: list[int], namespace=None) -> None:
    ps = cache.page_size
    pages = cache.pool.alloc(-(-len(tokens) // ps))
    cache.insert(np.array(tokens, dtype=np.int32), pages, namespace)
    cache.pool.decref(pages)


def _rows(summary):
    keys = ("id", "parent", "ns", "depth", "tokens", "subtree", "pages", "locks", "age", "kids")
    rows = [dict(zip((*keys, "preview", "tier"), row, strict=True)) for row in summary.nodes]
    for r in rows:
        r["preview"] = np.frombuffer(r["preview"], dtype="<i4").tolist()
    return rows


def test_shared_prefix_node_with_exact_counts():
    cache = _cache()
    _insert(cache, [1, 2, 3, 4, 5, 6])
    _insert(cache, [1, 2, 3, 7, 8])
    _insert(cache, [9])
    rows = _rows(summarize(cache))
    root, shared, nine = rows[0], rows[1], rows[2]  # best first: the root's children
    assert root["parent"] == -1 and root["subtree"] == 3 + 3 + 2 + 1 and root["kids"] == 2
    assert shared["preview"] == [1, 2, 3] and shared["subtree"] == 8 and shared["kids"] == 2
    kids = [r for r in rows if r["parent"] == shared["id"]]
    # the biggest subtree comes first
    assert [k["preview"] for k in kids] == [[4, 5, 6], [7, 8]]
    assert nine["preview"] == [9] and nine["depth"] == 1
    assert len(rows) == 5
    s = summarize(cache)
    assert s.total_tokens == 9 and s.total_nodes == 4 and not s.truncated


def test_locks_and_age_are_reported():
    cache = _cache()
    _insert(cache, [1, 2, 3])
    _insert(cache, [5, 6])
    node = cache.match_prefix(np.array([1, 2, 3], dtype=np.int32)).node
    cache.lock(node)
    rows = {tuple(r["preview"]): r for r in _rows(summarize(cache))}
    assert rows[(1, 2, 3)]["locks"] == 1 and rows[(5, 6)]["locks"] == 0
    assert rows[(1, 2, 3)]["age"] == 0 and rows[(5, 6)]["age"] > 0
    cache.unlock(node)


def test_bounds_on_nodes_depth_and_previews():
    cache = _cache()
    rng = np.random.default_rng(0)
    for _ in range(300):
        _insert(cache, rng.integers(0, 6, 12).tolist())
    full = summarize(cache, max_nodes=10_000, max_depth=100, max_children=100)
    assert not full.truncated and len(full.nodes) == cache.num_nodes + 1
    s = summarize(cache, max_nodes=40, max_depth=3, max_children=3, preview_tokens=2)
    rows = _rows(s)
    assert len(rows) == 40 and s.truncated
    seen = set()
    for r in rows:
        assert r["parent"] == -1 or r["parent"] in seen  # parents first
        seen.add(r["id"])
        assert r["depth"] <= 3 and len(r["preview"]) <= 2
        assert sum(1 for c in rows if c["parent"] == r["id"]) <= 3


def test_children_scan_is_capped_on_a_flat_tree():
    cache = _cache(num_pages=50_000)
    for t in range(10_000):
        _insert(cache, [t] * (1 + t % 7))
    s = summarize(cache, max_nodes=50, max_scanned=101)
    rows = _rows(s)
    # only the first 100 children were compared: the biggest among them, not the tree's
    assert all(r["preview"][0] < 100 for r in rows[1:]) and s.truncated
    assert rows[1]["subtree"] == 7
    rows = _rows(summarize(cache, max_nodes=50, max_scanned_per_node=30))
    assert all(r["preview"][0] < 30 for r in rows[1:])


def test_salted_namespaces_show_no_tokens():
    cache = _cache()
    _insert(cache, [1, 2, 3])
    _insert(cache, [1, 2, 3], namespace="tenant-salt")
    s = summarize(cache)
    rows = _rows(s)
    assert s.namespaces == 2 and s.total_tokens == 6
    assert sorted(r["preview"] for r in rows if r["parent"] != -1) == [[], [1, 2, 3]]


def test_bad_bounds_are_value_errors():
    with pytest.raises(ValueError):
        summarize(_cache(), max_nodes=0)


def test_rows_show_the_kv_tier():
    """A node demoted to the host tier is reported with tier 1, its parent with tier 0."""
    from radixserve.core.kv_tiers import TierSlots
    from tests.core.test_kv_tiers import FakeTransfer

    pool = PagePool(16, 2)
    cache = RadixCache(pool, host=TierSlots(8), transfer=FakeTransfer(16, 8, disk=False))
    _insert(cache, [1, 2, 3, 4, 5, 6])
    _insert(cache, [1, 2, 3, 4, 7, 8])
    cache.evict(1)  # the least recently used leaf: [5, 6]
    cache.flush()
    rows = {tuple(r["preview"]): r for r in _rows(summarize(cache))}
    assert rows[(1, 2, 3, 4)]["tier"] == 0 and rows[(7, 8)]["tier"] == 0
    assert rows[(5, 6)]["tier"] == 1 and rows[(5, 6)]["pages"] == 1
