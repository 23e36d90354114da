"""RadixCache against a reference model, driven by hypothesis, plus targeted cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.core.page_pool import PagePool
from radixserve.core.radix_cache import RadixCache, common_prefix_length
from tests.helpers import examples

NUM_PAGES = 400
# Small alphabet and short sequences: many shared prefixes, splits and divergences mid-page.
token_lists = st.lists(st.integers(0, 3), min_size=1, max_size=24)


class RadixMachine(RuleBasedStateMachine):
    """The reference: for every cached page-aligned prefix (as a tuple), the page holding its
    last page of tokens. The tree is prefix-closed, so a query's expected number of full
    pages is the count of consecutive page prefixes present in the reference."""

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size):
        self.ps = page_size
        self.pool = PagePool(NUM_PAGES, page_size)
        self.cache = RadixCache(self.pool, free_batch_pages=8)
        self.ref: dict[tuple[int, ...], int] = {}
        self.locks: list = []  # (node, pages held by the "request")

    def _expected_full_pages(self, tokens: list[int]) -> int:
        k = 0
        while (k + 1) * self.ps <= len(tokens) and tuple(tokens[: (k + 1) * self.ps]) in self.ref:
            k += 1
        return k

    @rule(tokens=token_lists)
    def insert(self, tokens):
        n = len(tokens)
        need = -(-n // self.ps)
        if need > self.pool.num_free:
            self.cache.evict(need)
            self.cache.flush()
            if need > self.pool.num_free:
                return
        pages = self.pool.alloc(need)
        already, tree_pages, _ = self.cache.insert(np.array(tokens, dtype=np.int32), pages)
        assert tree_pages.size == need
        for k in range(n // self.ps):
            key = tuple(tokens[: (k + 1) * self.ps])
            if key in self.ref:
                assert tree_pages[k] == self.ref[key]
            else:
                self.ref[key] = int(tree_pages[k])
        assert already <= n
        self.pool.decref(pages)  # the "request" lets go; the tree keeps what it stored

    @rule(tokens=token_lists, lock=st.booleans())
    def match(self, tokens, lock):
        result = self.cache.match_prefix(np.array(tokens, dtype=np.int32))
        full = self._expected_full_pages(tokens)
        assert result.num_full_tokens == full * self.ps
        for k in range(full):
            assert result.page_ids[k] == self.ref[tuple(tokens[: (k + 1) * self.ps])]
        if self.ps == 1:
            assert result.partial_page == -1
        if lock and full:
            self.cache.lock(result.node)
            self.pool.incref(result.page_ids)
            self.locks.append((result.node, result.page_ids.copy(), tokens[: full * self.ps]))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, pages, _ = self.locks.pop(i)
        self.cache.unlock(node)
        self.pool.decref(pages)

    @rule(num_pages=st.integers(1, 30))
    def evict(self, num_pages):
        before = self.cache.evictable_pages
        released = self.cache.evict(num_pages)
        assert released >= min(num_pages, before) or self.cache.evictable_pages == 0
        self.cache.flush()
        held = set(self.cache.held_page_ids().tolist())
        self.ref = {k: p for k, p in self.ref.items() if p in held}

    @invariant()
    def locked_prefixes_survive(self):
        for _, pages, tokens in self.locks:
            for k in range(len(tokens) // self.ps):
                assert self.ref.get(tuple(tokens[: (k + 1) * self.ps])) == pages[k]

    @invariant()
    def page_accounting(self):
        self.pool.check()
        held = [self.cache.held_page_ids()] + [p for _, p, _ in self.locks]
        expected = np.bincount(np.concatenate(held), minlength=NUM_PAGES)
        assert np.array_equal(expected, self.pool.refcount)
        in_tree = self.cache.held_page_ids().size - self.cache.num_pending_free
        assert self.cache.evictable_pages + self.cache.protected_pages == in_tree

    @invariant()
    def subtree_token_counts(self):
        def total(node) -> int:
            count = node.key.size + sum(total(c) for c in node.children.values())
            assert node.subtree_tokens == count
            return count

        for root in self.cache._roots.values():
            total(root)


TestRadixCache = RadixMachine.TestCase
TestRadixCache.settings = settings(
    max_examples=examples(150), stateful_step_count=50, deadline=None
)


def test_common_prefix_length():
    a = np.array([1, 2, 3, 4], dtype=np.int32)
    assert common_prefix_length(a, a) == 4
    assert common_prefix_length(a, a[:2]) == 2
    assert common_prefix_length(a, np.array([1, 9], dtype=np.int32)) == 1
    assert common_prefix_length(a, np.array([], dtype=np.int32)) == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_partial_page_match_and_namespaces(page_size):
    pool = PagePool(64, page_size)
    cache = RadixCache(pool)
    seq = np.arange(10, dtype=np.int32)
    pages = pool.alloc(-(-10 // page_size))
    cache.insert(seq, pages)
    query = np.concatenate([seq[:6], np.array([99], dtype=np.int32)])
    r = cache.match_prefix(query)
    assert r.num_tokens == 6
    assert r.num_full_tokens == 6 // page_size * page_size
    if page_size == 4:
        assert r.partial_page == pages[1] and r.partial_tokens == 2
    assert cache.match_prefix(query, namespace="tenant-b").num_tokens == 0
    pool.decref(pages)


def test_lru_evicts_oldest_leaf_first_and_never_locked():
    pool = PagePool(64, 1)
    cache = RadixCache(pool, free_batch_pages=1)
    seqs = [np.array([i, i + 10, i + 20], dtype=np.int32) for i in range(3)]
    for s in seqs:
        p = pool.alloc(3)
        cache.insert(s, p)
        pool.decref(p)
    locked = cache.match_prefix(seqs[0])
    cache.lock(locked.node)
    cache.match_prefix(seqs[1])  # touch: seqs[2] is now the oldest unlocked leaf
    assert cache.evict(1) == 3
    assert cache.match_prefix(seqs[2]).num_tokens == 0
    assert cache.match_prefix(seqs[1]).num_tokens == 3
    cache.evict(100)
    assert cache.match_prefix(seqs[0]).num_tokens == 3  # locked survives
    assert cache.protected_pages == 3 and cache.evictable_pages == 0
