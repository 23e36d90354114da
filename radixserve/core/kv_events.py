"""The radix tree's KV-cache events, in the shape of vLLM's ``KVEventBatch`` events
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), for llm-d's precise prefix-cache
scorer and anything else that reads vLLM's KV events (``engine/kv_publisher.py`` sends
them over ZMQ).

A block is one full KV page. Its hash names the page's tokens and every token before it in
its cache namespace (``kv_tiers.page_prefix_hashes``: a blake2b chain seeded by the
namespace, so a tenant's, salt's or adapter's pages never share a hash with another's),
published as vLLM publishes its own by default: the digest's last 8 bytes, big-endian, an
unsigned 64-bit integer. A partly filled last page is never published: it is not a block
anyone can match."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# where the blocks live, in vLLM's words: "GPU" is its main KV pool (here the page pool,
# on whatever device it is), "CPU" its host offload tier
MEDIUM_POOL = "GPU"


def block_hash(digest: bytes) -> int:
    """A page hash as vLLM's events carry it (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, its
    default): the last 8 bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")


class KVEventLog:
    """The events of one radix tree since the last ``drain``, in order, each a dict with
    vLLM's field names and its ``type`` tag (what ``msgspec`` encodes for vLLM's tagged
    structs, the fields left at their defaults omitted). Invariant: replaying the drained
    events in order over an empty block set gives exactly the pool pages of the tree's
    full pages, by hash (``test_kv_events``)."""

    def __init__(self, page_size: int, medium: str = MEDIUM_POOL) -> None:
        self.page_size = page_size
        self.medium = medium
        self._events: list[dict[str, Any]] = []

    def stored(self, hashes: Sequence[bytes], parent: bytes | None, tokens: np.ndarray) -> None:
        """Pages ``hashes`` (full, of ``tokens``, in order) are now in the pool, after the
        page hashed ``parent`` (None: at the start of their namespace)."""
        if not hashes:
            return
        self._events.append(
            {
                "type": "BlockStored",
                "block_hashes": [block_hash(h) for h in hashes],
                "parent_block_hash": None if parent is None else block_hash(parent),
                "token_ids": tokens[: len(hashes) * self.page_size].tolist(),
                "block_size": self.page_size,
                "lora_id": None,
                "medium": self.medium,
                "lora_name": None,
            }
        )

    def removed(self, hashes: Sequence[bytes]) -> None:
        """Pages ``hashes`` left the pool (evicted, or moved to the host tier)."""
        if hashes:
            self._events.append(
                {
                    "type": "BlockRemoved",
                    "block_hashes": [block_hash(h) for h in hashes],
                    "medium": self.medium,
                }
            )

    def cleared(self) -> None:
        """Every page left the pool."""
        self._events.append({"type": "AllBlocksCleared"})

    def drain(self) -> list[dict[str, Any]]:
        """The events since the last drain (and forget them)."""
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._events)
