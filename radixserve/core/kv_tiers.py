"""Bookkeeping of the KV tiers under the radix tree: host-tier slots, the transfer protocol
and the page-prefix hash that names a disk record. No torch, no I/O."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from typing import Protocol

import numpy as np

TIER_POOL = 0  # the KV pool the model reads (a node's pages are pool page ids)
TIER_HOST = 1  # the host tier (a node's pages are host-slot ids)
TIER_DISK = 2  # records under --kv-cache-dir, found by page-prefix hash (not tree nodes)

_HASH_BYTES = 16


class OutOfSlots(RuntimeError):
    pass


class TierSlots:
    """The slot ids ``0 .. num_slots-1`` of one lower tier (the host tier).

    Invariant: a slot is free ⇔ ``held[slot]`` is False ⇔ it is exactly once in
    ``_free[:_num_free]``; a held slot belongs to exactly one radix node (the cache frees
    it when the node leaves the tier). ``alloc`` and ``free`` cost O(slots touched).
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.held = np.zeros(num_slots, dtype=bool)
        self._free = np.arange(num_slots - 1, -1, -1, dtype=np.int32)
        self._num_free = num_slots

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_slots - self._num_free

    def alloc(self, count: int) -> np.ndarray:
        if count > self._num_free:
            raise OutOfSlots(f"need {count} slots, {self._num_free} free")
        start = self._num_free - count
        slots = self._free[start : self._num_free][::-1].copy()
        self._num_free = start
        self.held[slots] = True
        return slots

    def free(self, slots: np.ndarray) -> None:
        if slots.size == 0:
            return
        if not np.all(self.held[slots]):
            raise RuntimeError("free of a free tier slot (double free)")
        self.held[slots] = False
        n = slots.size
        self._free[self._num_free : self._num_free + n] = slots
        self._num_free += n

    def check(self, held_by_nodes: np.ndarray) -> None:
        """Raise AssertionError unless the free stack, the ``held`` flags and the slots the
        nodes hold (``held_by_nodes``, with repeats) agree: each slot free or held once."""
        free = self._free[: self._num_free]
        assert np.unique(free).size == free.size, "a tier slot is twice in the free list"
        assert not np.any(self.held[free]), "a free tier slot is marked held"
        counts = np.bincount(held_by_nodes, minlength=self.num_slots)
        assert counts.max(initial=0) <= 1, "a tier slot is held by two nodes"
        assert np.array_equal(counts.astype(bool), self.held), "tier slots held != nodes' slots"
        assert free.size + int(counts.sum()) == self.num_slots, "tier slots unaccounted"


class KVTransfer(Protocol):
    """Moves KV pages between the pool and the lower tiers (implemented by the executor).

    Every call is synchronous with respect to the pool: when it returns, the copy is done
    (a disk write may still be in flight, holding its own copy of the bytes)."""

    def save(self, pool_pages: np.ndarray, slots: np.ndarray) -> None:
        """Copy pool pages into host slots (demotion)."""

    def load(self, slots: np.ndarray, pool_pages: np.ndarray) -> None:
        """Copy host slots into pool pages (promotion)."""

    def copy(self, src: int, dst: int) -> None:
        """Copy one pool page (copy-on-write of a shared partial page, done at once)."""

    def spill(self, slots: np.ndarray, keys: list[bytes], from_pool: bool = False) -> None:
        """Queue host slots (pool pages with ``from_pool``) for the disk tier under
        ``keys``, copying the bytes first; keys the disk tier holds already are skipped."""

    def disk_lookup(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, the disk tier holds."""
        return 0

    def disk_load(self, keys: list[bytes], pool_pages: np.ndarray) -> int:
        """Read, verify and copy records into pool pages, stopping at the first missing or
        corrupt one; returns how many were loaded."""
        return 0

    @property
    def has_disk(self) -> bool:
        return False


def namespace_seed(namespace: Hashable) -> bytes:
    """The start of a namespace's hash chain: records of different namespaces (tenants,
    cache salts: ``core.request.cache_namespace``) never match each other's prefixes."""
    return hashlib.blake2b(f"ns:{namespace!r}".encode(), digest_size=_HASH_BYTES).digest()


def page_prefix_hashes(
    tokens: np.ndarray,
    page_size: int,
    num_pages: int,
    namespace: Hashable = None,
    seed: bytes | None = None,
) -> list[bytes]:
    """``h[i]`` names the first ``(i + 1) * page_size`` tokens: a chain, ``h[i] =
    blake2b(h[i-1] || page i's tokens as little-endian int32)``, so one page costs one hash.
    ``seed``: the hash of the tokens before ``tokens`` (default: the namespace's start)."""
    data = np.ascontiguousarray(tokens[: num_pages * page_size], dtype="<i4").tobytes()
    step = 4 * page_size
    h = namespace_seed(namespace) if seed is None else seed
    out: list[bytes] = []
    for i in range(num_pages):
        h = hashlib.blake2b(h + data[i * step : (i + 1) * step], digest_size=_HASH_BYTES).digest()
        out.append(h)
    return out
