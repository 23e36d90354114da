"""Which worker gets a request: cache-aware (longest matched prefix unless load is
unbalanced), round-robin or least-load. Shared by the HTTP router and the in-process
data-parallel client; it knows workers by index only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from radixserve.core.settings import setting
from radixserve.serving.prefix_tree import PrefixTree

POLICIES = ("cache-aware", "round-robin", "least-load")


class NoWorkerAvailable(RuntimeError):
    pass


@dataclass(frozen=True)
class BalanceConfig:
    """Cache-aware knobs (SGLang's router names and defaults): route to the worker with the
    longest match when the matched fraction of the prompt exceeds ``cache_threshold``, else
    to the worker with the smallest tree (the most room); but when the busiest and the
    idlest worker differ by more than ``balance_abs_threshold`` requests *and* by a factor
    over ``balance_rel_threshold``, to the least loaded. ``max_tree_size``: characters kept
    per worker's tree."""

    cache_threshold: float = setting(
        0.3, help="cache-aware: route by prefix when more than this fraction of the prompt matches"
    )
    balance_abs_threshold: int = setting(
        64, help="cache-aware: load is unbalanced when busiest - idlest exceeds this (requests)"
    )
    balance_rel_threshold: float = setting(
        1.5, help="cache-aware: ... and busiest exceeds idlest times this"
    )
    max_tree_size: int = setting(
        1 << 22, help="cache-aware: characters (or tokens) remembered per worker"
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold must be >= 0")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("balance_rel_threshold must be >= 1")
        if self.max_tree_size < 1:
            raise ValueError("max_tree_size must be >= 1")


class Decision(NamedTuple):
    worker: int
    outcome: str  # cache_hit | cache_miss | load_balance | round_robin | least_load
    matched: int  # characters of the key matched in the chosen worker's tree


class Balancer:
    """Routing state over ``n`` workers.

    Invariants: ``choose`` returns only an available worker (or raises
    ``NoWorkerAvailable``) and counts the request in its ``load`` until ``release``;
    ``load`` never goes below 0; a worker taken out with ``forget`` has an empty tree (its
    cache is presumed lost); round-robin visits the available workers in turn.
    """

    def __init__(self, n: int, policy: str = "cache-aware", config: BalanceConfig | None = None):
        if n < 1:
            raise ValueError(f"need at least one worker, got {n}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        self.policy = policy
        self.config = config or BalanceConfig()
        self.load = [0] * n
        self.available = [True] * n
        self.trees = [PrefixTree(self.config.max_tree_size) for _ in range(n)]
        self._next = 0

    def set_available(self, worker: int, available: bool, forget: bool = True) -> None:
        """Mark ``worker`` in or out; out with ``forget`` (its cache is presumed lost, e.g.
        the process died) also empties its tree."""
        if not available and forget:
            self.trees[worker].clear()
        self.available[worker] = available

    def choose(
        self, key: str, exclude: frozenset[int] = frozenset(), namespace: str = ""
    ) -> Decision:
        """Pick a worker for a prompt whose routing key is ``key`` and count it as loaded.
        ``namespace``: the prompt's cache namespace on the workers (its tenant, its cache
        salt); prompts in different namespaces never match each other's, and the matched
        fraction is that of ``key`` alone."""
        candidates = [i for i, ok in enumerate(self.available) if ok and i not in exclude]
        if not candidates:
            raise NoWorkerAvailable("no healthy worker")
        if self.policy == "round-robin":
            n = len(self.available)
            worker = next(
                (self._next + k) % n for k in range(n) if (self._next + k) % n in candidates
            )
            self._next = (worker + 1) % n
            decision = Decision(worker, "round_robin", 0)
        elif self.policy == "least-load":
            worker = min(candidates, key=lambda i: (self.load[i], i))
            decision = Decision(worker, "least_load", 0)
        else:
            # the namespace leads, with a separator no namespace holds, so a tree matches
            # across namespaces at most up to it: ``skip`` characters are not the prompt's
            full, skip = (f"{namespace}\x00{key}", len(namespace) + 1) if namespace else (key, 0)
            decision = self._cache_aware(full, skip, candidates)
            self.trees[decision.worker].insert(full)
        self.load[decision.worker] += 1
        return decision

    def _cache_aware(self, key: str, skip: int, candidates: list[int]) -> Decision:
        c = self.config
        loads = [self.load[i] for i in candidates]
        busiest, idlest = max(loads), min(loads)

        def matched(i: int) -> int:  # characters of the prompt (after the namespace)
            return max(0, self.trees[i].match(key) - skip)

        if (
            busiest - idlest > c.balance_abs_threshold
            and busiest > idlest * c.balance_rel_threshold
        ):
            worker = min(candidates, key=lambda i: (self.load[i], self.trees[i].size, i))
            return Decision(worker, "load_balance", matched(worker))
        matches = {i: matched(i) for i in candidates}
        best = max(candidates, key=lambda i: (matches[i], -self.load[i], -i))
        prompt_len = len(key) - skip
        if prompt_len and matches[best] > 0 and matches[best] / prompt_len > c.cache_threshold:
            return Decision(best, "cache_hit", matches[best])
        worker = min(candidates, key=lambda i: (self.trees[i].size, self.load[i], i))
        return Decision(worker, "cache_miss", matches[worker])

    def release(self, worker: int) -> None:
        if self.load[worker] > 0:
            self.load[worker] -= 1


def token_key(token_ids: list[int]) -> str:
    """A routing key for a token-id prompt: one character per token (ids are below
    0x110000)."""
    return "".join(map(chr, token_ids))
