"""An approximate radix tree of the prompts one worker was sent (the router's guess at that
worker's prefix cache), bounded in size with least-recently-inserted eviction."""

from __future__ import annotations


class _Node:
    __slots__ = ("children", "edge", "parent", "stamp")

    def __init__(self, edge: str, parent: _Node | None, stamp: int) -> None:
        self.edge = edge  # the characters on the edge from the parent to this node
        self.parent = parent
        self.children: dict[str, _Node] = {}  # by the first character of their edge
        self.stamp = stamp  # the latest insert that passed through this node


def _common(a: str, b: str) -> int:
    """Length of the common prefix of ``a`` and ``b`` (string compares run in C: halve the
    window instead of walking characters)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixTree:
    """A radix tree over strings (prompts; token ids are mapped one character each).

    Invariants: no edge is empty and the children of a node start with distinct
    characters; ``size`` is the sum of the edge lengths (the characters stored) and is at
    most ``max_size`` after every ``insert``; ``match(s)`` is the longest prefix of ``s``
    that is a prefix of some string inserted and not yet evicted; every node's ``stamp`` is
    at least its children's, so eviction takes leaves oldest first and the string inserted
    last stays whole (up to ``max_size`` characters).
    """

    def __init__(self, max_size: int = 1 << 22) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be at least 1, got {max_size}")
        self.max_size = max_size
        self.root = _Node("", None, 0)
        self.size = 0
        self._clock = 0

    def match(self, key: str) -> int:
        """Length of the longest prefix of ``key`` stored in the tree."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                return pos
            edge = child.edge
            if key.startswith(edge, pos):
                pos += len(edge)
                node = child
                continue
            return pos + _common(edge, key[pos : pos + len(edge)])
        return pos

    def insert(self, key: str) -> None:
        """Store ``key`` (its first ``max_size`` characters), then evict down to the bound."""
        key = key[: self.max_size]
        self._clock += 1
        stamp = self._clock
        node, pos = self.root, 0
        node.stamp = stamp
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                node.children[key[pos]] = _Node(key[pos:], node, stamp)
                self.size += len(key) - pos
                break
            edge = child.edge
            k = _common(edge, key[pos : pos + len(edge)])
            if k < len(edge):  # split the edge: node -> middle (edge[:k]) -> child
                middle = _Node(edge[:k], node, child.stamp)
                node.children[key[pos]] = middle
                child.edge = edge[k:]
                child.parent = middle
                middle.children[child.edge[0]] = child
                child = middle
            child.stamp = stamp
            pos += k
            node = child
        if self.size > self.max_size:
            self._evict()

    def _evict(self) -> None:
        """Remove the oldest leaves down to 90% of ``max_size`` (a scan of the tree per
        eviction, so it is amortized over many inserts), never the newest string's."""
        import heapq

        heap: list[tuple[int, int, _Node]] = []
        order = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                heap.append((node.stamp, order, node))
                order += 1
            stack.extend(node.children.values())
        heapq.heapify(heap)
        target = self.max_size - self.max_size // 10
        while self.size > target and heap and heap[0][0] < self._clock:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.edge[0]]
            self.size -= len(leaf.edge)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.stamp, order, parent))
                order += 1

    def clear(self) -> None:
        self.root = _Node("", None, 0)
        self.size = 0
