"""Gives requests KV pages: prefix reuse (radix cache or a sibling), growth, release."""

from __future__ import annotations

import numpy as np

from radixserve.core.page_pool import OutOfPages, PagePool
from radixserve.core.page_table import PageTable
from radixserve.core.radix_cache import MatchResult, RadixCache
from radixserve.core.request import Request
from radixserve.core.step import PageCopy


class KVManager:
    """Maps requests to pages of one ``PagePool`` through one ``PageTable``, with an optional
    ``RadixCache`` holding the KV of finished and preempted requests.

    Invariants:
      * a request with ``table_row >= 0`` holds one reference to each of
        ``page_table.pages(row, num_pages)`` and to nothing else; the tree holds one
        reference to each page it stores; refcount = number of holders;
      * shared KV is immutable: a request writes only to pages past its
        ``num_computed_tokens``, which are private to it; a partially filled shared page is
        copied into a private page first (``pending_copies``), never written in place;
      * a request using cached pages locks the deepest tree node they come from
        (``request.cache_node``) until it releases them.
    """

    def __init__(
        self, pool: PagePool, page_table: PageTable, cache: RadixCache | None = None
    ) -> None:
        self.pool = pool
        self.page_table = page_table
        self.cache = cache
        self.page_size = pool.page_size
        self.pending_copies: list[PageCopy] = []

    # -- capacity -------------------------------------------------------------------------
    def available_pages(self) -> int:
        """Free pages plus those the cache could give back by evicting."""
        if self.cache is None:
            return self.pool.num_free
        return self.pool.num_free + self.cache.evictable_pages + self.cache.num_pending_free

    def pages_needed(self, request: Request, num_tokens: int) -> int:
        """Extra pages ``request`` needs so that its pages cover ``num_tokens`` tokens."""
        return max(0, self.pool.pages_for(num_tokens) - request.num_pages)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens could ever fit in the pool alone."""
        return self.pool.pages_for(num_tokens) <= self.pool.num_pages

    def _alloc(self, count: int) -> np.ndarray:
        """Take ``count`` pages, evicting cached KV first if the free list is short."""
        if count > self.pool.num_free and self.cache is not None:
            self.cache.flush()
            if count > self.pool.num_free:
                self.cache.evict(count - self.pool.num_free)
                self.cache.flush()
        return self.pool.alloc(count)

    # -- attach: a row and the reusable prefix --------------------------------------------
    def match(self, request: Request) -> MatchResult | None:
        """The cached prefix of ``request``'s tokens but the last (always computed). None
        for requests that need every prompt token's hidden state: prompt logprobs, and
        mean pooling (last-token pooling reuses a prefix: its last token is computed)."""
        if (
            self.cache is None
            or request.num_tokens < 2
            or request.sampling_params.prompt_logprobs is not None
            or request.pooling == "mean"
        ):
            return None
        tokens = request.token_ids[: request.num_tokens - 1]
        if self.cache.host is not None:  # KV tiers: host/disk pages into the pool first
            self.cache.promote(tokens, request.cache_namespace, self._alloc)
        hit = self.cache.match_prefix(tokens, request.cache_namespace)
        return hit if hit.num_tokens else None

    def attach(self, request: Request, source: Request | None, hit: MatchResult | None) -> int:
        """Give ``request`` a row and reuse a prefix: the first ``num_prompt_tokens - 1``
        tokens of ``source`` (a running sibling of the same prompt), else the cache ``hit``.
        Returns the number of tokens whose KV is reused."""
        assert request.table_row < 0, f"{request.request_id} already has a row"
        request.table_row = self.page_table.acquire_row()
        request.num_pages = 0
        if source is not None and source.table_row >= 0:
            shared = min(
                source.num_computed_tokens, request.num_prompt_tokens, request.num_tokens - 1
            )
            src_pages = self.page_table.pages(source.table_row, source.num_pages)
            num_full, remainder = divmod(shared, self.page_size)
            partial = int(src_pages[num_full]) if remainder else -1
            copied = self._take_prefix(request, src_pages[:num_full].copy(), partial)
            return shared if copied else num_full * self.page_size
        if hit is None:
            return 0
        if hit.num_full_tokens:
            assert self.cache is not None
            self.cache.lock(hit.node)  # before any allocation below can evict it
            request.cache_node = hit.node
        copied = self._take_prefix(request, hit.page_ids, hit.partial_page)
        return hit.num_tokens if copied else hit.num_full_tokens

    def _take_prefix(self, request: Request, full_pages: np.ndarray, partial_page: int) -> bool:
        """Share ``full_pages``; copy ``partial_page`` into a private page if one can be had
        (returns whether it was)."""
        self.pool.incref(full_pages)
        self.page_table.set_pages(request.table_row, 0, full_pages)
        request.num_pages = full_pages.size
        if partial_page < 0:
            return False
        try:
            dst = self._alloc(1)
        except OutOfPages:
            return False  # recompute those few tokens instead
        if self.cache is not None and self.cache.transfer is not None:
            # KV tiers move pages at once (demotions and promotions copy while scheduling):
            # copy now, before a later allocation of this step can reuse partial_page
            self.cache.transfer.copy(partial_page, int(dst[0]))
        else:
            self.pending_copies.append(PageCopy(partial_page, int(dst[0])))
        self.page_table.set_pages(request.table_row, request.num_pages, dst)
        request.num_pages += 1
        return True

    # -- growth ---------------------------------------------------------------------------
    def grow(self, request: Request, num_tokens: int) -> bool:
        """Ensure pages cover ``num_tokens`` tokens; False (nothing changed) if short."""
        need = self.pages_needed(request, num_tokens)
        if need == 0:
            return True
        if need > self.available_pages():
            return False
        if self.pool.pages_for(num_tokens) > self.page_table.max_pages_per_row:
            raise ValueError(
                f"request {request.request_id} needs {num_tokens} tokens of KV, more than "
                "the model's context allows"
            )
        try:
            pages = self._alloc(need)
        except OutOfPages:  # evictable pages were locked meanwhile
            return False
        self.page_table.set_pages(request.table_row, request.num_pages, pages)
        request.num_pages += need
        return True

    def shrink(self, request: Request, num_tokens: int) -> None:
        """Give back the pages past those covering ``num_tokens`` tokens (pages grown for
        rejected speculative tokens: private to ``request``, never in the tree)."""
        keep = self.pool.pages_for(num_tokens)
        if keep >= request.num_pages:
            return
        extra = self.page_table.pages(request.table_row, request.num_pages)[keep:].copy()
        self.pool.decref(extra)
        request.num_pages = keep

    # -- caching --------------------------------------------------------------------------
    def cache_full_pages(self, request: Request, num_computed: int | None = None) -> None:
        """Insert the full pages of ``request``'s first ``num_computed`` tokens (default: its
        ``num_computed_tokens``) while it runs (chunked prefill), adopt the tree's pages where
        it already had them, and move the lock down to the new node."""
        if self.cache is None:
            return
        if num_computed is None:
            num_computed = request.num_computed_tokens
        num_tokens = num_computed // self.page_size * self.page_size
        if num_tokens == 0:
            return
        num_pages = num_tokens // self.page_size
        row = self.page_table.table[request.table_row]
        own = row[:num_pages].copy()
        _, tree_pages, node = self.cache.insert(
            request.token_ids[:num_tokens], own, request.cache_namespace
        )
        differs = own != tree_pages
        if differs.any():  # someone cached the same tokens first: share theirs, free ours
            self.pool.incref(tree_pages[differs])
            self.pool.decref(own[differs])
            row[:num_pages] = tree_pages
        self.cache.lock(node)
        if request.cache_node is not None:
            self.cache.unlock(request.cache_node)
        request.cache_node = node

    # -- release --------------------------------------------------------------------------
    def release(self, request: Request, keep_kv: bool = True) -> None:
        """Drop ``request``'s pages and row (no-op if it holds none). With ``keep_kv`` and a
        cache, its computed KV goes into the tree first, so a later request (or this one,
        resumed after preemption) reuses it."""
        if request.table_row < 0:
            return
        pages = self.page_table.pages(request.table_row, request.num_pages).copy()
        if self.cache is not None:
            computed = request.num_computed_tokens
            if keep_kv and computed:
                self.cache.insert(
                    request.token_ids[:computed],
                    pages[: self.pool.pages_for(computed)],
                    request.cache_namespace,
                )
            if request.cache_node is not None:
                self.cache.unlock(request.cache_node)
                request.cache_node = None
        if not keep_kv and self.pending_copies:
            own = set(pages.tolist())
            self.pending_copies = [c for c in self.pending_copies if c.dst not in own]
        self.pool.decref(pages)
        self.page_table.release_row(request.table_row)
        request.table_row = -1
        request.num_pages = 0

    def take_pending_copies(self) -> list[PageCopy]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def held_page_ids(self, requests: list[Request]) -> np.ndarray:
        """All page references held by ``requests`` and the tree (with repeats)."""
        parts = [
            self.page_table.pages(r.table_row, r.num_pages) for r in requests if r.table_row >= 0
        ]
        if self.cache is not None:
            parts.append(self.cache.held_page_ids())
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
