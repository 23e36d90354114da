"""The waiting queue and the policies that order it for admission."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator
from typing import Protocol

from radixserve.core.radix_cache import RadixCache, RadixNode
from radixserve.core.request import Request

POLICIES = ("fcfs", "lpm", "dfs-weight", "priority", "fair")


class WaitingQueue:
    """Waiting requests sorted by ``(priority, seq)``: lower priority values first, arrival
    order within a level; a preempted request re-enters at the front of its level.

    Invariant: ``_keys`` is sorted and ``_keys[i]`` is the key of ``_items[i]``; a request
    is in the queue at most once (``_ids``).
    """

    def __init__(self, use_priority: bool) -> None:
        self.use_priority = use_priority
        self._keys: list[tuple[int, int]] = []
        self._items: list[Request] = []
        self._ids: set[str] = set()
        self._seq = itertools.count()
        self._front_seq = itertools.count(-1, -1)

    def push(self, req: Request, front: bool = False) -> None:
        seq = next(self._front_seq) if front else next(self._seq)
        key = (req.priority if self.use_priority else 0, seq)
        req.queue_key = key
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._items.insert(i, req)
        self._ids.add(req.request_id)

    def remove(self, req: Request) -> None:
        i = bisect.bisect_left(self._keys, req.queue_key)
        assert self._items[i] is req, "waiting queue out of order"
        del self._keys[i]
        del self._items[i]
        self._ids.discard(req.request_id)

    def __contains__(self, req: Request) -> bool:
        return req.request_id in self._ids

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def first(self) -> Request:
        return self._items[0]


class SchedulePolicy(Protocol):
    """Orders waiting requests for admission (it never admits anything itself)."""

    name: str

    def order(self, waiting: WaitingQueue) -> Iterable[Request]: ...


class FCFSPolicy:
    """Arrival order (priority order for ``priority``: the queue is sorted by it)."""

    def __init__(self, name: str = "fcfs") -> None:
        self.name = name

    def order(self, waiting: WaitingQueue) -> list[Request]:
        return list(waiting)


class _PrefixProbe:
    """Keeps each waiting request's cached-prefix estimate fresh within a per-step budget:
    never-probed requests first, then the stalest, ``budget`` tree lookups per step; so the
    cost per step is bounded however long the queue is, and no request's estimate stays
    unrefreshed for more than ``len(waiting) / budget`` steps."""

    def __init__(self, cache: RadixCache, budget: int) -> None:
        self.cache = cache
        self.budget = budget
        self._clock = itertools.count(1)

    def refresh(self, waiting: list[Request]) -> None:
        stale = sorted(waiting, key=lambda r: r.probe_stamp)[: self.budget]
        now = next(self._clock)
        for req in stale:
            if req.num_tokens < 2:
                req.probe_len, req.probe_node = 0, None
            else:
                hit = self.cache.match_prefix(
                    req.token_ids[: req.num_tokens - 1], req.cache_namespace, touch=False
                )
                req.probe_len, req.probe_node = hit.num_tokens, hit.node
            req.probe_stamp = now


class _CacheAwarePolicy:
    """Base of the prefix-aware policies: refreshes estimates, then ``rank``s."""

    name = ""

    def __init__(self, cache: RadixCache, probe_budget: int = 64) -> None:
        self._probe = _PrefixProbe(cache, probe_budget)

    def order(self, waiting: WaitingQueue) -> list[Request]:
        reqs = list(waiting)
        self._probe.refresh(reqs)
        return self.rank(reqs)

    def rank(self, reqs: list[Request]) -> list[Request]:
        raise NotImplementedError


class LongestPrefixPolicy(_CacheAwarePolicy):
    """``lpm``: the request with the longest cached prefix first (ties: queue order)."""

    name = "lpm"

    def rank(self, reqs: list[Request]) -> list[Request]:
        return sorted(reqs, key=lambda r: (-r.probe_len, r.queue_key))


class DFSWeightPolicy(_CacheAwarePolicy):
    """``dfs-weight``: walk the radix tree depth first, heaviest subtree (most waiting
    requests under it) first, emitting each node's requests as it is reached; requests
    under the same prefix therefore run together."""

    name = "dfs-weight"

    def rank(self, reqs: list[Request]) -> list[Request]:
        at_node: dict[int, list[Request]] = {}
        weight: dict[int, int] = {}
        children: dict[int, list[RadixNode]] = {}
        roots: list[RadixNode] = []
        unplaced: list[Request] = []
        for req in reqs:
            node = req.probe_node
            if node is None or node.parent is None:  # no hit, or its node was evicted
                unplaced.append(req)
                continue
            at_node.setdefault(id(node), []).append(req)
            while node.parent is not None:
                key = id(node)
                if key not in weight:
                    weight[key] = 0
                    parent = node.parent
                    if parent.parent is None:
                        roots.append(node)
                    else:
                        children.setdefault(id(parent), []).append(node)
                weight[key] += 1
                node = node.parent
        ordered: list[Request] = []
        stack = sorted(roots, key=lambda n: weight[id(n)])  # heaviest popped first
        while stack:
            node = stack.pop()
            ordered.extend(at_node.get(id(node), ()))
            stack.extend(sorted(children.get(id(node), ()), key=lambda n: weight[id(n)]))
        return ordered + unplaced


def make_policy(name: str, cache: RadixCache | None) -> SchedulePolicy:
    if name not in POLICIES:
        raise ValueError(f"schedule policy must be one of {', '.join(POLICIES)}; got {name!r}")
    if name in ("lpm", "dfs-weight"):
        if cache is None:
            raise ValueError(f"schedule policy {name!r} needs the radix cache (it is disabled)")
        return LongestPrefixPolicy(cache) if name == "lpm" else DFSWeightPolicy(cache)
    if name == "fair":
        raise ValueError("schedule policy 'fair' keeps its own queue: the scheduler makes it")
    return FCFSPolicy(name)
