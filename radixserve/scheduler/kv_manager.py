"""Gives requests KV pages: growth, release, and prefix sharing between requests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from radixserve.core.page_pool import PagePool
from radixserve.core.page_table import PageTable
from radixserve.core.request import Request


@dataclass(frozen=True)
class PageCopy:
    """Copy the KV of page ``src`` into page ``dst`` before the step's forward (copy-on-write)."""

    src: int
    dst: int


class KVManager:
    """Maps requests to pages of one ``PagePool`` through one ``PageTable``.

    Invariants:
      * a request with ``table_row >= 0`` holds one reference to each of
        ``page_table.pages(row, num_pages)`` and to nothing else;
      * a page written by a request is private to it (refcount 1): pages shared through
        ``share_prefix`` are only ever read, and a partially filled shared page is copied
        into a private one first (``pending_copies``).
    """

    def __init__(self, pool: PagePool, page_table: PageTable) -> None:
        self.pool = pool
        self.page_table = page_table
        self.page_size = pool.page_size
        self.pending_copies: list[PageCopy] = []

    def pages_needed(self, request: Request, num_tokens: int) -> int:
        """Extra pages ``request`` needs so that its pages cover ``num_tokens`` tokens."""
        return max(0, self.pool.pages_for(num_tokens) - request.num_pages)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens could ever fit in the pool alone."""
        return self.pool.pages_for(num_tokens) <= self.pool.num_pages

    def attach(self, request: Request) -> None:
        """Give ``request`` a page-table row (it holds no pages yet)."""
        assert request.table_row < 0, f"{request.request_id} already has a row"
        request.table_row = self.page_table.acquire_row()
        request.num_pages = 0

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Ensure pages cover ``num_tokens`` tokens; False (nothing changed) if the pool is short."""
        need = self.pages_needed(request, num_tokens)
        if need == 0:
            return True
        if need > self.pool.num_free:
            return False
        if self.pool.pages_for(num_tokens) > self.page_table.max_pages_per_row:
            raise ValueError(
                f"request {request.request_id} needs {num_tokens} tokens of KV, more than "
                f"the model's context allows"
            )
        pages = self.pool.alloc(need)
        self.page_table.set_pages(request.table_row, request.num_pages, pages)
        request.num_pages += need
        return True

    def share_prefix(self, dst: Request, src: Request, num_tokens: int) -> bool:
        """Let ``dst`` (attached, no pages) reuse the KV of ``src``'s first ``num_tokens`` tokens.

        Full pages are shared by refcount; a partially filled last page is copied into a
        fresh private page. Returns False (nothing changed) if that page cannot be had.
        """
        assert dst.num_pages == 0
        num_full, remainder = divmod(num_tokens, self.page_size)
        src_pages = self.page_table.pages(src.table_row, src.num_pages)
        copy_dst = None
        if remainder:
            if self.pool.num_free < 1:
                return False
            copy_dst = self.pool.alloc(1)
        shared = src_pages[:num_full].copy()
        self.pool.incref(shared)
        self.page_table.set_pages(dst.table_row, 0, shared)
        dst.num_pages = num_full
        if copy_dst is not None:
            self.pending_copies.append(PageCopy(int(src_pages[num_full]), int(copy_dst[0])))
            self.page_table.set_pages(dst.table_row, num_full, copy_dst)
            dst.num_pages += 1
        return True

    def release(self, request: Request) -> None:
        """Drop ``request``'s pages and row (no-op if it holds none)."""
        if request.table_row < 0:
            return
        pages = self.page_table.pages(request.table_row, request.num_pages).copy()
        self.pool.decref(pages)
        self.page_table.release_row(request.table_row)
        request.table_row = -1
        request.num_pages = 0

    def take_pending_copies(self) -> list[PageCopy]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def held_page_ids(self, requests: list[Request]) -> np.ndarray:
        """All page references held by ``requests`` (with repeats), for accounting checks."""
        parts = [
            self.page_table.pages(r.table_row, r.num_pages) for r in requests if r.table_row >= 0
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
