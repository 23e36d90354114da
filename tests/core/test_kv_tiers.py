"""KV tiers in the radix cache, with no model: a fake transfer moves a content tag per page
(the prefix the page's KV belongs to), so every promoted page can be checked for the KV it
must hold. Hypothesis drives random insert / match / lock / evict sequences."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.core.kv_events import KVEventLog, block_hash
from radixserve.core.kv_tiers import TIER_HOST, TIER_POOL, TierSlots, page_prefix_hashes
from radixserve.core.page_pool import OutOfPages, PagePool
from radixserve.core.radix_cache import RadixCache
from tests.helpers import examples

token_lists = st.lists(st.integers(0, 3), min_size=1, max_size=24)


def tag(tokens) -> int:
    """What a page's KV 'is': the tokens up to its end (a stand-in for real keys/values)."""
    return hash(tuple(int(t) for t in tokens))


class FakeTransfer:
    """Moves tags between a pool array, a host array and a dict 'disk' keyed like the real
    one; ``corrupt`` keys read as failures (a bad checksum)."""

    def __init__(self, num_pages: int, num_slots: int, disk: bool) -> None:
        self.pool = np.zeros(num_pages, dtype=np.int64)
        self.hostdata = np.zeros(num_slots, dtype=np.int64)
        self.disk: dict[bytes, int] | None = {} if disk else None
        self.corrupt: set[bytes] = set()
        self.disk_limit = 10**9

    @property
    def has_disk(self) -> bool:
        return self.disk is not None

    def save(self, pool_pages, slots) -> None:
        self.hostdata[slots] = self.pool[pool_pages]

    def load(self, slots, pool_pages) -> None:
        self.pool[pool_pages] = self.hostdata[slots]

    def copy(self, src: int, dst: int) -> None:
        self.pool[dst] = self.pool[src]

    def spill(self, slots, keys, from_pool: bool = False) -> None:
        assert self.disk is not None
        data = self.pool if from_pool else self.hostdata
        for slot, key in zip(slots.tolist(), keys, strict=True):
            if len(self.disk) < self.disk_limit or key in self.disk:
                self.disk[key] = int(data[slot])

    def disk_lookup(self, keys) -> int:
        n = 0
        while self.disk is not None and n < len(keys) and keys[n] in self.disk:
            n += 1
        return n

    def disk_load(self, keys, pool_pages) -> int:
        assert self.disk is not None
        n = 0
        for key, page in zip(keys, pool_pages.tolist(), strict=False):
            if key in self.corrupt or key not in self.disk:
                self.disk.pop(key, None)
                break
            self.pool[page] = self.disk[key]
            n += 1
        return n


def make_cache(num_pages: int, page_size: int, num_slots: int, disk: bool, events=None):
    pool = PagePool(num_pages, page_size)
    transfer = FakeTransfer(num_pages, num_slots, disk)
    cache = RadixCache(
        pool, free_batch_pages=4, host=TierSlots(num_slots), transfer=transfer, events=events
    )
    return pool, cache, transfer


def alloc_for(pool: PagePool, cache: RadixCache):
    """KVManager._alloc's policy: evict what the free list lacks."""

    def alloc(count: int) -> np.ndarray:
        if count > pool.num_free:
            cache.flush()
            if count > pool.num_free:
                cache.evict(count - pool.num_free)
                cache.flush()
        return pool.alloc(count)

    return alloc


def insert(pool, cache, transfer, tokens, namespace=None) -> bool:
    """A 'request' computed ``tokens`` into fresh pages and hands them to the tree."""
    ps = pool.page_size
    need = -(-len(tokens) // ps)
    try:
        pages = alloc_for(pool, cache)(need)
    except OutOfPages:  # the pool is full of locked pages (any other error is a failure)
        return False
    for k in range(need):
        transfer.pool[pages[k]] = tag(tokens[: (k + 1) * ps])
    cache.insert(np.array(tokens, dtype=np.int32), pages, namespace)
    pool.decref(pages)
    return True


def check_match(pool, cache, transfer, tokens, namespace=None):
    """Promote, match, and check every full page holds its prefix's KV."""
    arr = np.array(tokens, dtype=np.int32)
    cache.promote(arr, namespace, alloc_for(pool, cache))
    result = cache.match_prefix(arr, namespace)
    ps = pool.page_size
    for k in range(result.num_full_tokens // ps):
        assert transfer.pool[result.page_ids[k]] == tag(tokens[: (k + 1) * ps]), k
    if result.partial_page >= 0:  # its first partial_tokens slots continue the match
        assert pool.refcount[result.partial_page] > 0
        owner = page_prefix(cache, result.partial_page)
        full, end = result.num_full_tokens, result.num_tokens
        assert transfer.pool[result.partial_page] == tag(owner), "partial page's KV"
        assert owner.size > full and owner[:end].tolist() == list(tokens[:end])
    return result


def page_prefix(cache: RadixCache, page: int) -> np.ndarray:
    """The tokens up to the end of pool page ``page`` of the tree (whose KV it holds)."""
    ps = cache.page_size
    for node in cache._nodes():
        if node.parent is None or node.tier != TIER_POOL or page not in node.pages:
            continue
        k = int(np.flatnonzero(node.pages == page)[0])
        chain, up = [], node
        while up.parent is not None:
            chain.append(up.key)
            up = up.parent
        prefix = np.concatenate(chain[::-1])
        return prefix[: prefix.size - node.key.size + (k + 1) * ps]
    raise AssertionError(f"page {page} is in no pool node of the tree")


def check_accounting(pool, cache, locked_pages=()):
    pool.check()
    cache.check_tiers()
    held = [cache.held_page_ids(), *locked_pages]
    expected = np.bincount(np.concatenate(held), minlength=pool.num_pages)
    assert np.array_equal(expected, pool.refcount), "page refcounts != holders"


class TierMachine(RuleBasedStateMachine):
    """Random workloads over a small pool, a smaller host tier and (sometimes) a disk."""

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        num_pages=st.integers(6, 24),
        num_slots=st.integers(1, 16),
        disk=st.booleans(),
        events=st.booleans(),
    )
    def setup(self, page_size, num_pages, num_slots, disk, events):
        log = KVEventLog(page_size) if events else None
        self.pool, self.cache, self.transfer = make_cache(
            num_pages, page_size, num_slots, disk, log
        )
        self.locks: list = []
        self.blocks: set[int] = set()  # what a KV-event subscriber has rebuilt

    @rule(tokens=token_lists, salt=st.sampled_from([None, "t"]))
    def insert(self, tokens, salt):
        insert(self.pool, self.cache, self.transfer, tokens, salt)

    @rule(tokens=token_lists, salt=st.sampled_from([None, "t"]), lock=st.booleans())
    def match(self, tokens, salt, lock):
        result = check_match(self.pool, self.cache, self.transfer, tokens, salt)
        if lock and result.num_full_tokens:
            self.cache.lock(result.node)
            self.pool.incref(result.page_ids)
            self.locks.append((result.node, result.page_ids.copy(), tokens, salt))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        node, pages, _, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.unlock(node)
        self.pool.decref(pages)

    @rule(num_pages=st.integers(1, 30))
    def evict(self, num_pages):
        self.cache.evict(num_pages)
        self.cache.flush()

    @rule(num_nodes=st.integers(1, 5))
    def evict_host(self, num_nodes):
        self.cache.evict_host(num_nodes)

    @precondition(lambda self: self.transfer.disk)
    @rule(data=st.data())
    def corrupt_a_record(self, data):
        keys = sorted(self.transfer.disk)
        self.transfer.corrupt.add(keys[data.draw(st.integers(0, len(keys) - 1))])

    @invariant()
    def accounting(self):
        check_accounting(self.pool, self.cache, [p for _, p, _, _ in self.locks])

    @invariant()
    def kv_events_rebuild_the_pool_s_full_pages(self):
        """A subscriber replaying the events holds exactly the pool's full pages, by the
        hash of their namespace's tokens up to their end; each stored run follows a page
        it already holds (or starts its namespace), each removed page was held."""
        if self.cache.events is None:
            return
        apply_kv_events(self.blocks, self.cache.events.drain())
        assert self.blocks == pool_block_hashes(self.cache)

    @invariant()
    def locked_pages_hold_their_kv(self):
        ps = self.pool.page_size
        for _, pages, tokens, _ in self.locks:
            for k, page in enumerate(pages.tolist()):
                assert self.transfer.pool[page] == tag(tokens[: (k + 1) * ps])


def apply_kv_events(blocks: set[int], events: list[dict]) -> None:
    """What llm-d's indexer does with the events, checked as it goes."""
    for event in events:
        if event["type"] == "BlockStored":
            parent = event["parent_block_hash"]
            assert parent is None or parent in blocks, "stored after an unknown page"
            n = len(event["block_hashes"])
            assert len(event["token_ids"]) == n * event["block_size"]
            assert not blocks & set(event["block_hashes"]), "stored twice"
            blocks.update(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            assert set(event["block_hashes"]) <= blocks, "removed an unknown page"
            blocks.difference_update(event["block_hashes"])
        else:
            assert event == {"type": "AllBlocksCleared"}
            blocks.clear()


def pool_block_hashes(cache: RadixCache) -> set[int]:
    """The tree's full pool pages, each hashed from its namespace's tokens (checked)."""
    ps = cache.page_size
    out: set[int] = set()
    for namespace, root in cache._roots.items():
        stack = [(child, child.key) for child in root.children.values()]
        while stack:
            node, prefix = stack.pop()
            full = node.key.size // ps
            assert len(node.hashes) == full
            if node.tier == TIER_POOL and full:
                chain = page_prefix_hashes(prefix, ps, prefix.size // ps, namespace)
                assert node.hashes == chain[-full:]
                out.update(block_hash(h) for h in node.hashes)
            stack.extend((c, np.concatenate([prefix, c.key])) for c in node.children.values())
    return out


TestTiers = TierMachine.TestCase
TestTiers.settings = settings(max_examples=examples(150), stateful_step_count=50, deadline=None)


@pytest.mark.parametrize("page_size", [1, 4])
def test_demote_promote_cycles_keep_everything(page_size):
    """A pool of 6 pages, a host tier holding all 8 prompts: every prompt comes back from
    the host tier whole, however often the others pushed it out of the pool."""
    rng = np.random.default_rng(page_size)
    prompts = [rng.integers(0, 50, 3 * page_size).tolist() for _ in range(8)]
    pool, cache, transfer = make_cache(6, page_size, 64, disk=False)
    for _ in range(3):
        for p in prompts:
            result = check_match(pool, cache, transfer, p)
            assert result.num_full_tokens in (0, len(p))
            insert(pool, cache, transfer, p)
            check_accounting(pool, cache)
    assert cache.tiers.demoted_pages > 0 and cache.tiers.promoted_pages > 0
    for p in prompts:  # each is a full hit, from the pool or promoted
        assert check_match(pool, cache, transfer, p).num_full_tokens == len(p)
    check_accounting(pool, cache)
    cache.reset()
    assert pool.num_free == pool.num_pages and cache.host is not None
    assert cache.host.num_free == cache.host.num_slots and cache.num_nodes == 0


def test_mid_page_prefix_promotes_the_page_it_ends_in():
    """A host-tier node matched to the middle of a page: its pages up to and including that
    page come back (the match continues into it: copy-on-write, not recomputed), the rest
    of the node stays in the host tier."""
    pool, cache, transfer = make_cache(8, 4, 16, disk=False)
    base = list(range(10, 22))  # 3 pages
    insert(pool, cache, transfer, base)
    cache.evict(8)
    cache.flush()
    node = next(iter(cache._roots[None].children.values()))
    assert node.tier == TIER_HOST and pool.num_free == pool.num_pages
    query = [*base[:6], 99, 98]  # the 2nd page diverges mid-way
    result = check_match(pool, cache, transfer, query)
    assert result.num_full_tokens == 4 and result.partial_tokens == 2
    assert transfer.pool[result.partial_page] == tag(base[:8])
    assert cache.tiers.promoted_pages == 2 and cache.tiers.host_hit_tokens == 6
    upper = next(iter(cache._roots[None].children.values()))
    assert upper.tier == TIER_POOL and upper.pages.size == 2
    assert next(iter(upper.children.values())).tier == TIER_HOST  # the rest stays below
    check_accounting(pool, cache)


@pytest.mark.parametrize("own_node", [False, True])
def test_a_partial_last_page_comes_back_with_its_prefix(own_node):
    """A conversation's cached turn ends mid-page and the next turn continues it: the
    partial last page comes back too, and the match covers every cached token. Either the
    partial page ends the node, or (``own_node``: the full pages were cached during the
    prefill, the rest when the request finished) it is a child of its own, keyed by fewer
    than a page of tokens, which only a partial-page lookup finds."""
    pool, cache, transfer = make_cache(8, 4, 16, disk=False)
    turn = list(range(30, 40))  # 2 full pages and 2 tokens
    if own_node:
        insert(pool, cache, transfer, turn[:8])
    insert(pool, cache, transfer, turn)
    assert cache.num_nodes == 1 + own_node
    cache.evict(8)
    cache.flush()
    result = check_match(pool, cache, transfer, [*turn, 7, 8, 9])
    assert result.num_full_tokens == 8 and result.partial_tokens == 2
    assert cache.tiers.promoted_pages == 3 and cache.tiers.host_hit_tokens == 10
    check_accounting(pool, cache)


def test_promotion_without_pool_pages_is_a_miss():
    """Every pool page locked by a running request: the host-tier prefix cannot come back,
    the match is a plain miss and nothing leaks."""
    pool, cache, transfer = make_cache(4, 2, 8, disk=False)
    insert(pool, cache, transfer, [1, 2, 3, 4])
    cache.evict(4)
    cache.flush()
    pinned = [5, 6, 7, 8, 9, 10, 11, 12]
    insert(pool, cache, transfer, pinned)
    locked = check_match(pool, cache, transfer, pinned)
    cache.lock(locked.node)
    result = check_match(pool, cache, transfer, [1, 2, 3, 4, 0])
    assert result.num_full_tokens == 0 and cache.tiers.failed_promotions == 1
    check_accounting(pool, cache)
    cache.unlock(locked.node)
    assert check_match(pool, cache, transfer, [1, 2, 3, 4, 0]).num_full_tokens == 4
    check_accounting(pool, cache)


def test_disk_tier_found_by_prefix_hash_and_corrupt_records_are_misses():
    """Host tier of one page: evicted nodes go to 'disk'; a new tree (a restart) finds them
    by hash; a corrupt record ends the hit there and is forgotten."""
    pool, cache, transfer = make_cache(8, 2, 1, disk=True)
    prompt = list(range(20, 30))  # 5 pages
    insert(pool, cache, transfer, prompt)
    cache.evict(8)  # -> host (1 slot: cannot hold 5) -> dropped, written to disk first
    cache.flush()
    keys = page_prefix_hashes(np.array(prompt), 2, 5)
    assert sorted(transfer.disk) == sorted(keys) and cache.tiers.spilled_pages == 5
    transfer.disk.clear()
    insert(pool, cache, transfer, prompt)
    assert cache.persist() == 5  # what the tree holds, written as is (a clean shutdown)
    assert sorted(transfer.disk) == sorted(keys)
    pool2 = PagePool(8, 2)
    cache2 = RadixCache(pool2, host=TierSlots(1), transfer=transfer)
    transfer.pool[:] = 0  # a new process: the pool's old contents are gone
    assert check_match(pool2, cache2, transfer, prompt).num_full_tokens == 10
    assert cache2.tiers.disk_hit_tokens == 10
    check_accounting(pool2, cache2)
    # a different namespace (cache salt) never reads them
    assert check_match(pool2, cache2, transfer, prompt, "salt").num_full_tokens == 0
    transfer.corrupt.add(keys[2])
    pool3 = PagePool(8, 2)
    cache3 = RadixCache(pool3, host=TierSlots(1), transfer=transfer)
    assert check_match(pool3, cache3, transfer, prompt).num_full_tokens == 4
    assert cache3.tiers.disk_read_failures == 3  # found by name: 5; read: 2
    check_accounting(pool3, cache3)


def test_tier_slots_accounting_catches_a_leak():
    slots = TierSlots(4)
    held = slots.alloc(3)
    slots.check(held)
    with pytest.raises(AssertionError):
        slots.check(held[:2])  # a slot held by no node
    with pytest.raises(AssertionError):
        slots.check(np.concatenate([held, held[:1]]))  # a slot held twice
    slots.free(held)
    with pytest.raises(RuntimeError):
        slots.free(held[:1])


def test_page_prefix_hashes_chain():
    tokens = np.arange(12)
    full = page_prefix_hashes(tokens, 4, 3)
    assert page_prefix_hashes(tokens[4:], 4, 2, seed=full[0]) == full[1:]
    assert page_prefix_hashes(tokens, 4, 3, namespace="x") != full
    other = tokens.copy()
    other[5] = 99
    changed = page_prefix_hashes(other, 4, 3)
    assert changed[0] == full[0] and changed[1] != full[1] and changed[2] != full[2]


def test_a_prefix_two_requests_share_is_promoted_once():
    """Promotion is synchronous: the second request matching the same host-tier prefix
    finds it in the pool already (no second copy, no second set of pages)."""
    pool, cache, transfer = make_cache(12, 2, 12, disk=False)
    insert(pool, cache, transfer, [1, 2, 3, 4, 5, 6])
    cache.evict(12)
    cache.flush()
    first = check_match(pool, cache, transfer, [1, 2, 3, 4, 5, 6, 7])
    promoted = cache.tiers.promoted_pages
    second = check_match(pool, cache, transfer, [1, 2, 3, 4, 5, 6, 9])
    assert promoted == 3 and cache.tiers.promoted_pages == promoted
    assert np.array_equal(first.page_ids, second.page_ids)
    check_accounting(pool, cache)
