"""The pool of KV-cache page ids: a free stack plus a refcount per page, all in numpy."""

from __future__ import annotations

import numpy as np


class OutOfPages(RuntimeError):
    pass


class PagePool:
    """Owns the ids ``0 .. num_pages-1``.

    Invariants:
      * a page is free  ⇔  its refcount is 0  ⇔  it appears exactly once in
        ``_free[:_num_stacked]`` or in ``_released`` (freed, not yet pushed back: ``flush``
        returns them in one batch; ``alloc`` flushes when the stack is short);
      * every operation costs O(pages touched), never O(num_pages).
    A page with refcount 1 is private to its one holder (writable); refcount > 1 means
    shared (read-only).
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = np.zeros(num_pages, dtype=np.int32)
        # Pop from the end; reversed so that the first allocations get low ids.
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._num_stacked = num_pages
        self._released: list[np.ndarray] = []
        self._num_released = 0

    @property
    def num_free(self) -> int:
        """Pages with no holder (on the stack or released, not yet flushed)."""
        return self._num_stacked + self._num_released

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_released(self) -> int:
        """Freed pages not yet pushed back on the free stack."""
        return self._num_released

    def flush(self) -> None:
        """Push released pages back on the free stack, in one batch."""
        if not self._released:
            return
        released = np.concatenate(self._released)
        n = released.size
        self._free[self._num_stacked : self._num_stacked + n] = released
        self._num_stacked += n
        self._released.clear()
        self._num_released = 0

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def alloc(self, count: int) -> np.ndarray:
        """Take ``count`` free pages (refcount becomes 1). Raises OutOfPages if short."""
        if count > self._num_stacked:
            self.flush()
            if count > self._num_stacked:
                raise OutOfPages(f"need {count} pages, {self._num_stacked} free")
        start = self._num_stacked - count
        # The stack top holds the lowest ids of a fresh pool: reversed, an allocation is an
        # ascending run where the pool allows it.
        pages = self._free[start : self._num_stacked][::-1].copy()
        self._num_stacked = start
        self.refcount[pages] = 1
        return pages

    def incref(self, pages: np.ndarray) -> None:
        """Add one holder to each page. ``pages`` must be distinct and in use."""
        if pages.size == 0:
            return
        # Pages taken in one allocation are usually one run of ids: a slice is much cheaper
        # than fancy indexing into a large array.
        index = _as_slice(pages)
        if np.any(self.refcount[index] <= 0):
            raise RuntimeError("incref of a free page")
        self.refcount[index] += 1

    def decref(self, pages: np.ndarray) -> None:
        """Drop one holder from each page (``pages`` distinct); pages that reach 0 are free
        at once and reach the free stack at the next ``flush``."""
        if pages.size == 0:
            return
        index = _as_slice(pages)
        self.refcount[index] -= 1
        counts = self.refcount[index]
        if np.any(counts < 0):
            self.refcount[index] += 1
            raise RuntimeError("decref of a free page (double free)")
        released = pages[counts == 0]
        if released.size:
            self._released.append(released)
            self._num_released += released.size

    def free_page_ids(self) -> np.ndarray:
        return np.concatenate([self._free[: self._num_stacked], *self._released])

    def check(self) -> None:
        """Raise AssertionError if the free stack and refcounts disagree (O(num_pages))."""
        free = self.free_page_ids()
        assert np.unique(free).size == free.size, "a page is twice in the free list"
        assert np.all(self.refcount[free] == 0), "a free page has holders"
        assert int(np.count_nonzero(self.refcount == 0)) == free.size, (
            "a page with no holder leaked"
        )
        assert np.all(self.refcount >= 0), "negative refcount"


def _as_slice(pages: np.ndarray) -> slice | np.ndarray:
    """``pages`` (distinct ids) as a slice when they are one ascending run, else as is."""
    first, last = int(pages[0]), int(pages[-1])
    if last - first == pages.size - 1 and pages.min() == first and pages.max() == last:
        return slice(first, last + 1)
    return pages
