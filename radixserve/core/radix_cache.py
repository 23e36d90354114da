"""RadixAttention's prefix cache: a compressed radix tree over token ids holding KV pages."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from radixserve.core.page_pool import PagePool

_EMPTY_PAGES = np.zeros(0, dtype=np.int32)


class RadixNode:
    """One edge of the tree and the KV pages of its tokens.

    Invariants: ``key`` is a view of a contiguous int32 token array; ``pages[i]`` holds the
    KV of tokens ``[i * page_size, (i + 1) * page_size)`` of ``key`` (the last page may be
    partly filled only in a leaf); a node starts at a page boundary; ``lock_count`` counts
    the running requests that use this node or a descendant; ``subtree_tokens`` is the
    number of tokens on this edge and every edge below it.
    """

    __slots__ = (
        "children",
        "first_tokens",
        "key",
        "last_access",
        "lock_count",
        "pages",
        "parent",
        "subtree_tokens",
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

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"RadixNode(len={self.key.size}, pages={self.pages.size}, locks={self.lock_count})"


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
    """Token-id radix tree with compressed edges, refcounted immutable pages and LRU eviction.

    Invariants:
      * the tree holds exactly one pool reference to each page in any node (pages waiting in
        ``_pending_free`` are still counted as tree-held until ``flush``);
      * children are keyed by their first page of tokens (their first token when page_size
        is 1), so siblings differ within their first page;
      * ``evictable_pages + protected_pages`` = pages in the tree; a node's pages count as
        protected while ``lock_count > 0``;
      * every unlocked leaf has an entry in ``_heap`` stamped with its current
        ``last_access`` (stale entries are skipped when popped), so evicting k leaves costs
        O(k log n), never a rebuild over all leaves.
    """

    def __init__(self, pool: PagePool, free_batch_pages: int = 256) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self._roots: dict[Hashable, RadixNode] = {}
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, int, RadixNode]] = []
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

    # -- helpers --------------------------------------------------------------------------
    def _root(self, namespace: Hashable) -> RadixNode:
        root = self._roots.get(namespace)
        if root is None:
            root = RadixNode(np.zeros(0, dtype=np.int32), _EMPTY_PAGES, None)
            root.lock_count = 1  # never evicted
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

    def _compact_heap(self) -> None:
        """Drop stale entries (amortised: runs when stale entries outnumber live ones 3:1)."""
        self._heap = [e for e in self._heap if self._is_live(e)]
        heapq.heapify(self._heap)

    @staticmethod
    def _is_live(entry: tuple[int, int, RadixNode]) -> bool:
        stamp, _, node = entry
        return (
            node.parent is not None
            and not node.children
            and node.lock_count == 0
            and node.last_access == stamp
        )

    def _touch(self, node: RadixNode) -> None:
        """Mark ``node`` and its ancestors used now."""
        now = self.last_stamp = next(self._clock)
        leaf = node
        while node.parent is not None:
            node.last_access = now
            node = node.parent
        if leaf.parent is not None and leaf.is_leaf and leaf.lock_count == 0:
            self._push(leaf)

    # -- match ----------------------------------------------------------------------------
    def match_prefix(
        self, tokens: np.ndarray, namespace: Hashable = None, touch: bool = True
    ) -> MatchResult:
        """Longest cached prefix of ``tokens``. Changes nothing other requests can see
        (only recency, for LRU, and not even that with ``touch=False``)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        ps = self.page_size
        node = self._root(namespace)
        parts: list[np.ndarray] = []
        pos = 0
        n = tokens.size
        partial_page, partial_tokens = -1, 0
        while pos < n:
            child = node.children.get(self._child_key(tokens, pos)) if n - pos >= ps else None
            if child is None:
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
        """A child sharing the most tokens with ``rest`` within its first page (< page_size)."""
        best_page, best = -1, 0
        if int(rest[0]) not in node.first_tokens:
            return best_page, best
        window = rest[: self.page_size]
        for child in node.children.values():
            m = common_prefix_length(child.key[: self.page_size], window)
            m = min(m, self.page_size - 1, rest.size)
            if m > best:
                best_page, best = int(child.pages[0]), m
        return best_page, best

    # -- insert ---------------------------------------------------------------------------
    def insert(
        self, tokens: np.ndarray, pages: np.ndarray, namespace: Hashable = None
    ) -> tuple[int, np.ndarray, RadixNode]:
        """Cache ``tokens`` whose KV is in ``pages`` (ceil(len / page_size) of them).

        The tree takes its own reference to the pages it stores; the caller keeps its own.
        Returns (tokens that were already cached, the tree's pages for ``tokens`` — use
        them instead of duplicates —, the node where ``tokens`` end).
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
            parts.append(node.pages)
            pos += split
        self._touch(node)
        tree_pages = np.concatenate(parts) if parts else _EMPTY_PAGES
        return min(already, n), tree_pages, node

    def _add_child(self, parent: RadixNode, key: Hashable, child: RadixNode) -> None:
        parent.children[key] = child
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
            if node.lock_count == 0:
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
                self.evictable_pages += node.pages.size
                self.protected_pages -= node.pages.size
                if node.is_leaf:
                    self._push(node)
            node = node.parent

    # -- eviction -------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Evict least-recently-used unlocked leaves until ``num_pages`` pages are released
        (or nothing evictable is left); returns the pages released. They reach the pool's
        free list at the next ``flush``."""
        released = 0
        while released < num_pages and self._heap:
            entry = heapq.heappop(self._heap)
            if not self._is_live(entry):
                continue
            node = entry[2]
            released += self._remove_leaf(node)
        return released

    def _remove_leaf(self, node: RadixNode) -> int:
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
        self.evictable_pages -= node.pages.size
        self._pending_free.append(node.pages)
        self._num_pending_free += node.pages.size
        if self._num_pending_free >= self.free_batch_pages:
            self.flush()
        if parent.parent is not None and parent.is_leaf and parent.lock_count == 0:
            self._push(parent)
        return node.pages.size

    def flush(self) -> None:
        """Return the pages of evicted nodes to the pool, in one batch."""
        if self._pending_free:
            self.pool.decref(np.concatenate(self._pending_free))
            self._pending_free.clear()
            self._num_pending_free = 0

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

    def held_page_ids(self) -> np.ndarray:
        """Every page reference the tree holds (pending frees included), O(tree)."""
        parts = list(self._pending_free)
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            parts.append(node.pages)
            stack.extend(node.children.values())
        return np.concatenate(parts) if parts else _EMPTY_PAGES

    def reset(self) -> None:
        """Drop every unlocked node (e.g. between benchmark runs)."""
        self.evict(self.evictable_pages + self.protected_pages + 1)
        self.flush()
