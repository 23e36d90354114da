"""A bounded summary of a RadixCache for display: the biggest subtrees first, depth-limited.

The cost does not grow with the tree: at most ``max_nodes`` nodes are reported and at most
``max_scanned`` child entries are looked at in all, at most ``max_scanned_per_node`` of one
node's (a node with more children has only its first ones compared). Subtree sizes come from ``RadixNode.subtree_tokens``, kept
up to date by the cache, so nothing below the reported nodes is visited.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from radixserve.core.radix_cache import RadixCache, RadixNode

# one reported node: (id, parent id (-1 for a root), namespace index, depth, edge tokens,
# subtree tokens, pages, lock count, age (cache touches since its last use), children,
# the first edge token ids as little-endian int32 bytes (empty for salted namespaces), the
# KV tier of its pages (0 pool, 1 host): one object per row, not one per token)
NodeRow = tuple[int, int, int, int, int, int, int, int, int, int, bytes, int]


@dataclass
class RadixSummaryData:
    """What ``summarize`` saw. Invariant: ``len(nodes) <= max_nodes``; a node's parent is
    listed before it; ``truncated`` is set when some node had children not reported."""

    nodes: list[NodeRow] = field(default_factory=list)
    namespaces: int = 0  # roots (the default namespace and one per cache salt)
    total_nodes: int = 0
    total_tokens: int = 0
    evictable_pages: int = 0
    protected_pages: int = 0
    page_size: int = 1
    truncated: bool = False


def summarize(
    cache: RadixCache,
    max_nodes: int = 256,
    max_depth: int = 8,
    max_children: int = 16,
    max_scanned: int = 8192,
    max_scanned_per_node: int = 1024,
    preview_tokens: int = 24,
) -> RadixSummaryData:
    """The ``max_nodes`` most token-heavy subtrees, expanded best first (a node's biggest
    ``max_children`` children, to ``max_depth`` edges below a root). Token previews are
    given for the default namespace only: salted namespaces belong to other tenants."""
    if (
        min(max_nodes, max_children, max_scanned, max_scanned_per_node) < 1
        or min(max_depth, preview_tokens) < 0
    ):
        raise ValueError("summary bounds must be positive")
    out = RadixSummaryData(
        total_nodes=cache.num_nodes,
        evictable_pages=cache.evictable_pages,
        protected_pages=cache.protected_pages,
        page_size=cache.page_size,
    )
    now = cache.last_stamp
    nodes = out.nodes
    seq = itertools.count()
    heap: list[tuple[int, int, RadixNode, int, int, int, bool]] = []
    scanned = 0
    roots = cache._roots  # a summary reads the tree's private structure on purpose
    out.namespaces = len(roots)
    for ns, (name, root) in enumerate(roots.items()):
        out.total_tokens += root.subtree_tokens
        if scanned >= max_scanned or len(nodes) >= max_nodes:
            out.truncated = True
            continue
        scanned += 1
        node_id = len(nodes)
        nodes.append(
            (node_id, -1, ns, 0, 0, root.subtree_tokens, 0, 0, 0, len(root.children), b"", 0)
        )
        heapq.heappush(heap, (-root.subtree_tokens, next(seq), root, node_id, ns, 0, name is None))
    while heap and len(nodes) < max_nodes:
        _, _, node, node_id, ns, depth, public = heapq.heappop(heap)
        children = node.children
        if not children:
            continue
        if depth >= max_depth or scanned >= max_scanned:
            out.truncated = True
            continue
        budget = min(len(children), max_scanned - scanned, max_scanned_per_node)
        scanned += budget
        candidates = children.values()
        if budget < len(children):
            candidates = itertools.islice(candidates, budget)
        if budget > max_children:
            top = heapq.nlargest(max_children, candidates, key=_subtree_tokens)
        else:
            top = sorted(candidates, key=_subtree_tokens, reverse=True)
        if len(top) < len(children):
            out.truncated = True
        for child in top:
            if len(nodes) >= max_nodes:
                out.truncated = True
                break
            child_id = len(nodes)
            preview = (
                child.key[:preview_tokens].astype("<i4", copy=False).tobytes() if public else b""
            )
            nodes.append(
                (
                    child_id,
                    node_id,
                    ns,
                    depth + 1,
                    int(child.key.size),
                    child.subtree_tokens,
                    int(child.pages.size),
                    child.lock_count,
                    now - child.last_access,
                    len(child.children),
                    preview,
                    child.tier,
                )
            )
            heapq.heappush(
                heap, (-child.subtree_tokens, next(seq), child, child_id, ns, depth + 1, public)
            )
    if heap:
        out.truncated = out.truncated or any(entry[2].children for entry in heap)
    return out


def _subtree_tokens(node: RadixNode) -> int:
    return node.subtree_tokens
