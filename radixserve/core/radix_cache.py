"""RadixAttention's prefix cache: a compressed radix tree over token ids holding KV pages."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np

from radixserve.core.kv_events import KVEventLog
from radixserve.core.kv_tiers import (
    TIER_HOST,
    TIER_POOL,
    KVTransfer,
    TierSlots,
    namespace_seed,
    page_prefix_hashes,
)
from radixserve.core.page_pool import OutOfPages, PagePool

_EMPTY_PAGES = np.zeros(0, dtype=np.int32)


class RadixNode:
    """One edge of the tree and the KV pages of its tokens.

    Invariants: ``key`` is a view of a contiguous int32 token array; ``pages[i]`` holds the
    KV of tokens ``[i * page_size, (i + 1) * page_size)`` of ``key`` (the last page may be
    partly filled only in a leaf); a node starts at a page boundary; ``lock_count`` counts
    the running requests that use this node or a descendant; ``subtree_tokens`` is the
    number of tokens on this edge and every edge below it. ``tier`` says where ``pages``
    live: pool page ids (``TIER_POOL``) or host-tier slot ids (``TIER_HOST``); a child's
    tier is never below its parent's; ``pool_children`` counts the children in the pool.
    With KV events on (``RadixCache.events``), ``hashes[i]`` is the prefix hash of full
    page i (``kv_tiers.page_prefix_hashes`` over the namespace's tokens up to its end);
    otherwise ``hashes`` is None.
    """

    __slots__ = (
        "children",
        "first_tokens",
        "hashes",
        "key",
        "last_access",
        "lock_count",
        "pages",
        "parent",
        "pool_children",
        "subtree_tokens",
        "tier",
    )

    def __init__(self, key: np.ndarray, pages: np.ndarray, parent: RadixNode | None) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[Hashable, RadixNode] = {}
        # first token -> number of children starting with it (page_size > 1): lets a
        # partial-page lookup skip nodes where no child can share even one token
        self.first_tokens: dict[int, int] = {}
        self.lock_count = 0
        self.last_access = 0
        self.subtree_tokens = key.size
        self.tier = TIER_POOL
        self.pool_children = 0
        self.hashes: list[bytes] | None = None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (
            f"RadixNode(len={self.key.size}, pages={self.pages.size}, locks={self.lock_count}, "
            f"tier={self.tier})"
        )


@dataclass
class MatchResult:
    """The longest cached prefix of a query.

    ``page_ids`` cover the first ``num_full_tokens`` tokens in whole pages (shared, read-only);
    if ``partial_page`` >= 0, its first ``partial_tokens`` slots continue the match and must be
    copied into a private page before use. ``node`` is the deepest node the full pages
    come from (lock it while using them).
    """

    page_ids: np.ndarray
    num_full_tokens: int
    node: RadixNode
    partial_page: int = -1
    partial_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_full_tokens + self.partial_tokens


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int arrays, in one vectorised compare."""
    n = min(a.size, b.size)
    if n == 0:
        return 0
    differs = a[:n] != b[:n]
    first = int(differs.argmax())
    return first if differs[first] else n


class RadixCache:
    """Token-id radix tree with compressed edges, refcounted immutable pages and LRU eviction,
    over up to three KV tiers (pool, host, disk).

    Invariants:
      * the tree holds exactly one pool reference to each page of a pool-tier node (pages
        waiting in ``_pending_free`` are still counted as tree-held until ``flush``), and
        each host slot of a host-tier node is held (``host``) by that node alone;
      * children are keyed by their first page of tokens (their first token when page_size
        is 1), so siblings differ within their first page;
      * ``evictable_pages + protected_pages`` = pool pages in the tree; a pool-tier node's
        pages count as protected while ``lock_count > 0``;
      * every unlocked pool-tier node with no pool-tier child has an entry in ``_heap``
        stamped with its current ``last_access`` (stale entries are skipped when popped), and
        every unlocked host-tier leaf one in ``_host_heap``, so evicting k nodes costs
        O(k log n), never a rebuild over all nodes;
      * with a host tier, evicting a pool node demotes it (its KV copied into host slots, the
        node kept); a match promotes host nodes back (``promote``) before it can use them;
        a host node evicted from a full host tier is written to the disk tier (if any) and
        dropped from the tree; disk records are found again by page-prefix hash.
    """

    def __init__(
        self,
        pool: PagePool,
        free_batch_pages: int = 256,
        host: TierSlots | None = None,
        transfer: KVTransfer | None = None,
        events: KVEventLog | None = None,
    ) -> None:
        """``events``: where the pool's full pages coming and going are told (KV events:
        ``core/kv_events.py``); None: nowhere, and no page is hashed for it."""
        if (host is None) != (transfer is None):
            raise ValueError("a host tier needs a transfer and a transfer needs a host tier")
        self.pool = pool
        self.page_size = pool.page_size
        self._roots: dict[Hashable, RadixNode] = {}
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._host_heap: list[tuple[int, int, RadixNode]] = []
        self._heap_seq = itertools.count()
        self._pending_free: list[np.ndarray] = []
        self._num_pending_free = 0
        self.free_batch_pages = free_batch_pages
        self.evictable_pages = 0
        self.protected_pages = 0
        self.num_nodes = 0
        self.last_stamp = 0  # the latest ``last_access`` stamp handed out
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.host = host
        self.transfer = transfer
        self.tiers = TierCounters()
        self.events = events

    # -- helpers --------------------------------------------------------------------------
    def _root(self, namespace: Hashable) -> RadixNode:
        root = self._roots.get(namespace)
        if root is None:
            root = RadixNode(np.zeros(0, dtype=np.int32), _EMPTY_PAGES, None)
            root.lock_count = 1  # never evicted
            if self.events is not None:
                root.hashes = [namespace_seed(namespace)]  # (the chain's start, not a page)
            self._roots[namespace] = root
        return root

    def _child_key(self, tokens: np.ndarray, start: int) -> Hashable:
        if self.page_size == 1:
            return int(tokens[start])
        return tuple(tokens[start : start + self.page_size].tolist())

    def _push(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._heap_seq), node))
        if len(self._heap) > 4 * self.num_nodes + 1024:
            self._compact_heap()

    def _push_host(self, node: RadixNode) -> None:
        heapq.heappush(self._host_heap, (node.last_access, next(self._heap_seq), node))
        if len(self._host_heap) > 4 * self.num_nodes + 1024:
            self._host_heap = [e for e in self._host_heap if self._is_live_host(e)]
            heapq.heapify(self._host_heap)

    def _push_if_candidate(self, node: RadixNode) -> None:
        """Queue ``node`` for eviction from its tier if it is now a candidate there."""
        if node.parent is None or node.lock_count:
            return
        if node.tier == TIER_POOL:
            if node.pool_children == 0:
                self._push(node)
        elif not node.children:
            self._push_host(node)

    def _compact_heap(self) -> None:
        """Drop stale entries (amortised: runs when stale entries outnumber live ones 3:1)."""
        self._heap = [e for e in self._heap if self._is_live(e)]
        heapq.heapify(self._heap)

    @staticmethod
    def _is_live(entry: tuple[int, int, RadixNode]) -> bool:
        stamp, _, node = entry
        return (
            node.parent is not None
            and node.pool_children == 0
            and node.lock_count == 0
            and node.last_access == stamp
            and node.tier == TIER_POOL
        )

    @staticmethod
    def _is_live_host(entry: tuple[int, int, RadixNode]) -> bool:
        stamp, _, node = entry
        return (
            node.parent is not None
            and not node.children
            and node.lock_count == 0
            and node.last_access == stamp
            and node.tier == TIER_HOST
        )

    def _touch(self, node: RadixNode) -> None:
        """Mark ``node`` and its ancestors used now."""
        now = self.last_stamp = next(self._clock)
        leaf = node
        while node.parent is not None:
            node.last_access = now
            node = node.parent
        if leaf.parent is not None and leaf.pool_children == 0 and leaf.lock_count == 0:
            if leaf.tier == TIER_POOL:
                self._push(leaf)
            elif not leaf.children:
                self._push_host(leaf)

    # -- match ----------------------------------------------------------------------------
    def match_prefix(
        self, tokens: np.ndarray, namespace: Hashable = None, touch: bool = True
    ) -> MatchResult:
        """Longest prefix of ``tokens`` cached in the pool. Changes nothing other requests
        can see (only recency, for LRU, and not even that with ``touch=False``). Host-tier
        nodes end the match: ``promote`` brings them into the pool first."""
        tokens = np.asarray(tokens, dtype=np.int32)
        ps = self.page_size
        node = self._root(namespace)
        parts: list[np.ndarray] = []
        pos = 0
        n = tokens.size
        partial_page, partial_tokens = -1, 0
        while pos < n:
            child = node.children.get(self._child_key(tokens, pos)) if n - pos >= ps else None
            if child is None or child.tier:
                if ps > 1:
                    partial_page, partial_tokens = self._best_partial(node, tokens[pos:])
                break
            m = common_prefix_length(child.key, tokens[pos:])
            if m < child.key.size or m % ps:  # ends inside the child, or in its partial page
                full = m // ps * ps
                if full:
                    parts.append(child.pages[: full // ps])
                    pos += full
                    node = child  # its first pages are used: lock it
                if m > full:
                    partial_page, partial_tokens = int(child.pages[full // ps]), m - full
                break
            parts.append(child.pages)
            pos += m
            node = child
        if touch:
            self._touch(node)
        pages = np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else _EMPTY_PAGES)
        return MatchResult(pages, pos, node, partial_page, partial_tokens)

    def _best_partial(self, node: RadixNode, rest: np.ndarray) -> tuple[int, int]:
        """A pool child sharing the most tokens with ``rest`` within its first page
        (< page_size): (its first page, the tokens shared), or (-1, 0)."""
        child, m = self._best_partial_child(node, rest, pool_only=True)
        return (-1, 0) if child is None else (int(child.pages[0]), m)

    def _best_partial_child(
        self, node: RadixNode, rest: np.ndarray, pool_only: bool = False
    ) -> tuple[RadixNode | None, int]:
        """The child of ``node`` (any tier, or only the pool's) sharing the most tokens
        with ``rest`` within its first page (< page_size; the first such on a tie), and
        how many."""
        best_child: RadixNode | None = None
        best = 0
        if rest.size == 0 or int(rest[0]) not in node.first_tokens:
            return best_child, best
        window = rest[: self.page_size]
        for child in node.children.values():
            if pool_only and child.tier:
                continue
            m = common_prefix_length(child.key[: self.page_size], window)
            m = min(m, self.page_size - 1, rest.size)
            if m > best:
                best_child, best = child, m
        return best_child, best

    # -- insert ---------------------------------------------------------------------------
    def insert(
        self, tokens: np.ndarray, pages: np.ndarray, namespace: Hashable = None
    ) -> tuple[int, np.ndarray, RadixNode]:
        """Cache ``tokens`` whose KV is in ``pages`` (ceil(len / page_size) of them).

        The tree takes its own reference to the pages it stores; the caller keeps its own.
        Returns (tokens that were already cached, the tree's pages for ``tokens`` — use
        them instead of duplicates —, the node where ``tokens`` end). A host-tier node on
        the way takes the caller's pages back into the pool (its host slots are freed).
        """
        tokens = np.asarray(tokens, dtype=np.int32)
        pages = np.asarray(pages, dtype=np.int32)
        ps = self.page_size
        n = tokens.size
        if pages.size != -(-n // ps):
            raise ValueError(f"{n} tokens need {-(-n // ps)} pages, got {pages.size}")
        node = self._root(namespace)
        parts: list[np.ndarray] = []
        pos = 0
        already = n
        while pos < n:
            key = self._child_key(tokens, pos)
            child = node.children.get(key)
            if child is None:
                child = RadixNode(tokens[pos:], pages[pos // ps :], node)
                if self.events is not None:
                    self._hash_pages(child)
                self._add_child(node, key, child)
                self._add_subtree_tokens(node, child.key.size)
                self.pool.incref(child.pages)
                self.num_nodes += 1
                self.evictable_pages += child.pages.size  # pushed on the heap by _touch below
                parts.append(child.pages)
                already = pos
                node = child
                break
            m = common_prefix_length(child.key, tokens[pos:])
            if m == child.key.size and (m % ps == 0 or pos + m == n):
                if child.tier:
                    self._adopt(child, pages[pos // ps : pos // ps + child.pages.size])
                parts.append(child.pages)
                pos += m
                node = child
                continue
            # Diverges inside the child, or continues past its partial last page: cut the
            # child at the last page boundary before that point and go on from there.
            split = m // ps * ps
            if split == 0:  # cannot happen for well-formed keys; keep what is cached so far
                already = pos
                break
            node = self._split(child, split)
            if node.tier:
                self._adopt(node, pages[pos // ps : pos // ps + node.pages.size])
            parts.append(node.pages)
            pos += split
        self._touch(node)
        tree_pages = np.concatenate(parts) if parts else _EMPTY_PAGES
        return min(already, n), tree_pages, node

    def _hash_pages(self, node: RadixNode) -> None:
        """KV events: hash a new pool node's full pages and tell that they are stored."""
        parent = node.parent
        assert parent is not None and parent.hashes and self.events is not None
        seed = parent.hashes[-1]
        node.hashes = page_prefix_hashes(
            node.key, self.page_size, node.key.size // self.page_size, seed=seed
        )
        self.events.stored(node.hashes, self._parent_hash(node), node.key)

    @staticmethod
    def _parent_hash(node: RadixNode) -> bytes | None:
        """The hash of the page before ``node``'s first (None: it starts its namespace)."""
        parent = node.parent
        assert parent is not None and parent.hashes is not None
        return None if parent.parent is None else parent.hashes[-1]

    def _adopt(self, node: RadixNode, pages: np.ndarray) -> None:
        """A host-tier node whose tokens a caller holds in the pool: keep the caller's pages
        (one more reference) and free the host copy. Its parent is in the pool already."""
        assert node.parent is not None and node.parent.tier == TIER_POOL
        assert self.host is not None
        self.pool.incref(pages)
        self.host.free(node.pages)
        self._to_pool(node, pages.copy())

    def _to_pool(self, node: RadixNode, pages: np.ndarray) -> None:
        """Move a host-tier node to the pool tier (its new pool ``pages`` hold the KV)."""
        node.pages = pages
        node.tier = TIER_POOL
        parent = node.parent
        assert parent is not None
        parent.pool_children += 1
        if self.events is not None and node.hashes is not None:
            self.events.stored(node.hashes, self._parent_hash(node), node.key)
        if node.lock_count:
            self.protected_pages += pages.size
        else:
            self.evictable_pages += pages.size
            self._push_if_candidate(node)

    def _add_child(self, parent: RadixNode, key: Hashable, child: RadixNode) -> None:
        parent.children[key] = child
        if child.tier == TIER_POOL:
            parent.pool_children += 1
        if self.page_size > 1:
            first = int(child.key[0])
            parent.first_tokens[first] = parent.first_tokens.get(first, 0) + 1

    @staticmethod
    def _add_subtree_tokens(node: RadixNode | None, count: int) -> None:
        """Add ``count`` to the subtree totals of ``node`` and its ancestors (root included)."""
        while node is not None:
            node.subtree_tokens += count
            node = node.parent

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut ``child`` at token ``at`` (a page boundary); returns the new upper node."""
        ps = self.page_size
        parent = child.parent
        assert parent is not None and at % ps == 0 and 0 < at < child.key.size
        upper = RadixNode(child.key[:at], child.pages[: at // ps], parent)
        upper.lock_count = child.lock_count
        upper.last_access = child.last_access
        upper.subtree_tokens = child.subtree_tokens
        upper.tier = child.tier
        if child.hashes is not None:
            upper.hashes, child.hashes = child.hashes[: at // ps], child.hashes[at // ps :]
        child.subtree_tokens -= at
        parent.children[self._child_key(child.key, 0)] = upper
        child.key = child.key[at:]
        child.pages = child.pages[at // ps :]
        child.parent = upper
        self._add_child(upper, self._child_key(child.key, 0), child)
        self.num_nodes += 1
        return upper

    # -- locks ----------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        while node.parent is not None:
            if node.lock_count == 0 and node.tier == TIER_POOL:
                self.evictable_pages -= node.pages.size
                self.protected_pages += node.pages.size
            node.lock_count += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node.parent is not None:
            if node.lock_count <= 0:
                raise RuntimeError("unlock of an unlocked radix node")
            node.lock_count -= 1
            if node.lock_count == 0:
                if node.tier == TIER_POOL:
                    self.evictable_pages += node.pages.size
                    self.protected_pages -= node.pages.size
                    if node.pool_children == 0:
                        self._push(node)
                elif not node.children:
                    self._push_host(node)
            node = node.parent

    # -- eviction -------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Evict least-recently-used unlocked pool nodes with no pool child until
        ``num_pages`` pool pages are released (or nothing evictable is left); returns the
        pages released. They reach the pool's free list at the next ``flush``. With a host
        tier, a node is demoted (kept, its KV copied to host slots) where the host tier has
        room or can make it; otherwise it is dropped with what hangs below it."""
        released = 0
        while released < num_pages and self._heap:
            entry = heapq.heappop(self._heap)
            if not self._is_live(entry):
                continue
            node = entry[2]
            if self.host is not None and self._demote(node):
                released += node.pages.size
            else:
                released += self._drop_subtree(node)
        return released

    def _demote(self, node: RadixNode) -> bool:
        """Copy an evicted pool node's KV into host slots and keep it in the tree (tier 1);
        False (nothing changed) when the host tier cannot make room."""
        host, transfer = self.host, self.transfer
        assert host is not None and transfer is not None
        n = node.pages.size
        if n > host.num_slots:
            return False
        while host.num_free < n:
            if not self.evict_host(1):
                return False
        slots = host.alloc(n)
        transfer.save(node.pages, slots)
        self.tiers.demoted_pages += n
        self.evictable_pages -= n
        if self.events is not None and node.hashes is not None:
            self.events.removed(node.hashes)
        self._release_pool_pages(node.pages)
        node.pages = slots
        node.tier = TIER_HOST
        parent = node.parent
        assert parent is not None
        parent.pool_children -= 1
        self._push_if_candidate(parent)
        if not node.children:
            self._push_host(node)
        return True

    def evict_host(self, num_nodes: int) -> int:
        """Drop up to ``num_nodes`` least-recently-used unlocked host-tier leaves, writing
        their full pages to the disk tier first when there is one; returns slots freed."""
        freed = 0
        while num_nodes > 0 and self._host_heap:
            entry = heapq.heappop(self._host_heap)
            if not self._is_live_host(entry):
                continue
            node = entry[2]
            transfer = self.transfer
            if transfer is not None and transfer.has_disk:
                self._spill(node)
            freed += self._detach(node)
            num_nodes -= 1
        return freed

    def _spill(self, node: RadixNode) -> None:
        """Queue the full pages of a node leaving the tree for the disk tier (keyed by
        prefix hash)."""
        assert self.transfer is not None
        ps = self.page_size
        full = node.key.size // ps
        if full == 0:
            return
        chain: list[np.ndarray] = []
        up: RadixNode | None = node
        namespace: Hashable = None
        while up is not None and up.parent is not None:
            chain.append(up.key)
            up = up.parent
        for name, root in self._roots.items():
            if root is up:
                namespace = name
                break
        prefix = np.concatenate(chain[::-1])
        start = (prefix.size - node.key.size) // ps
        keys = page_prefix_hashes(prefix, ps, start + full, namespace)[start:]
        self.transfer.spill(node.pages[:full], keys, from_pool=node.tier == TIER_POOL)
        self.tiers.spilled_pages += full

    def _release_pool_pages(self, pages: np.ndarray) -> None:
        self._pending_free.append(pages)
        self._num_pending_free += pages.size
        if self._num_pending_free >= self.free_batch_pages:
            self.flush()

    def _detach(self, node: RadixNode) -> int:
        """Take a childless node out of the tree; its pool pages go to the pending frees,
        its host slots back to the host tier. Returns how many it had."""
        assert not node.children
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key, 0)]
        if self.page_size > 1:
            first = int(node.key[0])
            if parent.first_tokens[first] == 1:
                del parent.first_tokens[first]
            else:
                parent.first_tokens[first] -= 1
        node.parent = None
        self._add_subtree_tokens(parent, -node.key.size)
        self.num_nodes -= 1
        if node.tier == TIER_POOL:
            parent.pool_children -= 1
            self.evictable_pages -= node.pages.size
            if self.events is not None and node.hashes is not None:
                self.events.removed(node.hashes)
            self._release_pool_pages(node.pages)
        else:
            assert self.host is not None
            self.host.free(node.pages)
        self._push_if_candidate(parent)
        return node.pages.size

    def _drop_subtree(self, node: RadixNode) -> int:
        """Detach an unlocked node and every (host-tier) node below it; returns the pool
        pages released. With a disk tier (and a host tier: not while ``reset``), their full
        pages are written there first."""
        transfer = self.transfer
        spill = self.host is not None and transfer is not None and transfer.has_disk
        if not node.children and not spill:
            return self._detach(node)
        order: list[RadixNode] = []
        stack = [node]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        released = 0
        for n in reversed(order):  # children before their parent
            if spill:
                self._spill(n)
            size = self._detach(n)
            if n.tier == TIER_POOL:
                released += size
            else:
                self.tiers.dropped_host_pages += size
        return released

    def flush(self) -> None:
        """Return the pages of evicted nodes to the pool, in one batch."""
        if self._pending_free:
            self.pool.decref(np.concatenate(self._pending_free))
            self._pending_free.clear()
            self._num_pending_free = 0

    # -- promotion ------------------------------------------------------------------------
    def promote(
        self,
        tokens: np.ndarray,
        namespace: Hashable,
        alloc: Callable[[int], np.ndarray],
    ) -> int:
        """Bring the host-tier nodes a match of ``tokens`` would use back into the pool
        (pool pages from ``alloc``, which may evict other nodes), then, with a disk tier,
        the full pages past the tree's match found on disk. Returns the tokens promoted. A
        promotion that cannot get pages, or a disk record missing or corrupt, ends it
        there: what follows is a normal miss."""
        if self.host is None:
            return 0
        tokens = np.asarray(tokens, dtype=np.int32)
        promoted = self._promote_host(tokens, namespace, alloc)
        transfer = self.transfer
        if transfer is not None and transfer.has_disk:
            promoted += self._promote_disk(tokens, namespace, alloc)
        return promoted

    def _promote_host(
        self, tokens: np.ndarray, namespace: Hashable, alloc: Callable[[int], np.ndarray]
    ) -> int:
        """Promote the host-tier nodes on ``tokens``' path, cut after the last page the
        match uses — a page it uses only in part included, so the match can take those
        tokens from it (copy-on-write) instead of recomputing them, as it would from the
        pool —, with one copy for the whole path."""
        ps = self.page_size
        node = self._root(namespace)
        path: list[RadixNode] = []
        shared = 0  # tokens of the path's nodes the match shares
        pos, n = 0, tokens.size
        ended_whole = True  # the walk stopped at a node boundary
        while n - pos >= ps:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            m = common_prefix_length(child.key, tokens[pos:])  # >= ps: the key matched
            whole = m == child.key.size and m % ps == 0
            if child.tier:
                used = -(-m // ps) * ps  # the pages holding the m shared tokens
                if used < child.key.size:
                    child = self._split(child, used)
                path.append(child)
                shared += min(m, child.key.size)
            if not whole:
                ended_whole = False
                break
            pos += m
            node = child
        if ended_whole and ps > 1 and pos < n:
            # no child shares a whole page: the one sharing the most of its first page (as
            # match_prefix's _best_partial picks), if it is in the host tier
            child, m = self._best_partial_child(node, tokens[pos:])
            if child is not None and child.tier and m > self._best_partial(node, tokens[pos:])[1]:
                if child.key.size > ps:
                    child = self._split(child, ps)
                path.append(child)
                shared += m
        if not path:
            return 0
        deepest = path[-1]
        self.lock(deepest)  # neither the path nor its ancestors are evicted meanwhile
        try:
            need = sum(int(c.pages.size) for c in path)
            try:
                pages = alloc(need)
            except OutOfPages:
                self.tiers.failed_promotions += 1
                return 0
            transfer, host = self.transfer, self.host
            assert transfer is not None and host is not None
            slots = np.concatenate([c.pages for c in path]) if len(path) > 1 else path[0].pages
            transfer.load(slots, pages)
            host.free(slots)
            i = 0
            for c in path:
                k = c.pages.size
                self._to_pool(c, pages[i : i + k])
                i += k
            self._touch(deepest)  # the match about to run uses them: the last to evict
            self.tiers.promoted_pages += need
            self.tiers.host_hit_tokens += shared
            return shared
        finally:
            self.unlock(deepest)

    def _promote_disk(
        self, tokens: np.ndarray, namespace: Hashable, alloc: Callable[[int], np.ndarray]
    ) -> int:
        transfer = self.transfer
        assert transfer is not None
        ps = self.page_size
        hit = self.match_prefix(tokens, namespace, touch=False)
        first = hit.num_full_tokens // ps
        total = tokens.size // ps
        if total <= first:
            return 0
        keys = page_prefix_hashes(tokens, ps, total, namespace)[first:]
        found = transfer.disk_lookup(keys)
        if found == 0:
            return 0
        if hit.num_full_tokens:
            self.lock(hit.node)
        try:
            try:
                pages = alloc(found)
            except OutOfPages:
                self.tiers.failed_promotions += 1
                return 0
            got = transfer.disk_load(keys[:found], pages)
            self.tiers.disk_read_failures += found - got
            if got:
                end = (first + got) * ps
                self.insert(tokens[:end], np.concatenate([hit.page_ids, pages[:got]]), namespace)
                self.tiers.disk_promoted_pages += got
                self.tiers.disk_hit_tokens += got * ps
            self.pool.decref(pages)  # the tree took its own reference to those it kept
            return got * ps
        finally:
            if hit.num_full_tokens:
                self.unlock(hit.node)

    # -- introspection --------------------------------------------------------------------
    def record(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one admitted lookup in the hit-rate statistics."""
        self.queried_tokens += queried_tokens
        self.hit_tokens += hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def num_pending_free(self) -> int:
        return self._num_pending_free

    def _nodes(self) -> list[RadixNode]:
        out: list[RadixNode] = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def held_page_ids(self) -> np.ndarray:
        """Every pool page reference the tree holds (pending frees included), O(tree)."""
        parts = list(self._pending_free)
        parts.extend(n.pages for n in self._nodes() if n.tier == TIER_POOL)
        return np.concatenate(parts) if parts else _EMPTY_PAGES

    def held_host_slots(self) -> np.ndarray:
        """Every host slot the tree's host-tier nodes hold (with repeats, if any), O(tree)."""
        parts = [n.pages for n in self._nodes() if n.tier == TIER_HOST]
        return np.concatenate(parts) if parts else _EMPTY_PAGES

    def check_tiers(self) -> None:
        """Per-tier accounting (O(tree)): the tier order along every edge, each pool node's
        page count in evictable or protected, each host slot free or held by one node."""
        pool_pages = 0
        protected = 0
        for node in self._nodes():
            if node.parent is None:
                continue
            assert node.tier >= node.parent.tier, "a node's tier is above its parent's"
            in_pool = sum(c.tier == TIER_POOL for c in node.children.values())
            assert in_pool == node.pool_children, "pool_children is stale"
            if node.tier == TIER_POOL:
                pool_pages += node.pages.size
                if node.lock_count:
                    protected += node.pages.size
            else:
                assert self.host is not None, "a host-tier node without a host tier"
        assert protected == self.protected_pages, "protected pages != locked pool pages"
        assert pool_pages == self.evictable_pages + self.protected_pages, (
            "evictable + protected != pool pages in the tree"
        )
        if self.host is not None:
            self.host.check(self.held_host_slots())

    def persist(self) -> int:
        """Queue every full page of the tree (pool and host tiers) for the disk tier;
        returns how many pages were offered (records already on disk are kept). O(tree)."""
        transfer = self.transfer
        if transfer is None or not transfer.has_disk:
            return 0
        ps = self.page_size
        offered = 0
        for name, root in self._roots.items():
            stack = [(child, namespace_seed(name)) for child in root.children.values()]
            while stack:
                node, seed = stack.pop()
                full = node.key.size // ps
                if full == 0:
                    continue
                keys = page_prefix_hashes(node.key, ps, full, seed=seed)
                transfer.spill(node.pages[:full], keys, from_pool=node.tier == TIER_POOL)
                offered += full
                if full * ps == node.key.size:
                    stack.extend((child, keys[-1]) for child in node.children.values())
        return offered

    def reset(self) -> None:
        """Drop every unlocked node, in every tier, without demoting or writing anything
        (e.g. between benchmark runs); the disk tier's records stay."""
        while self._host_heap:
            entry = heapq.heappop(self._host_heap)
            if self._is_live_host(entry):
                self._detach(entry[2])
        host, self.host = self.host, None
        try:
            self.evict(self.evictable_pages + self.protected_pages + 1)
        finally:
            self.host = host
        self.flush()


@dataclass
class TierCounters:
    """What moved between tiers, in pages (tokens for hits); counters only ever increase."""

    demoted_pages: int = 0  # pool -> host
    promoted_pages: int = 0  # host -> pool
    spilled_pages: int = 0  # host (or pool, when dropped) -> disk (queued)
    disk_promoted_pages: int = 0  # disk -> pool
    dropped_host_pages: int = 0  # left the host tier with no disk tier below (or a drop)
    failed_promotions: int = 0  # no pool pages for a promotion: a normal miss
    disk_read_failures: int = 0  # records found by name but missing/corrupt when read
    host_hit_tokens: int = 0  # tokens a match got from the host tier
    disk_hit_tokens: int = 0  # tokens a match got from the disk tier
