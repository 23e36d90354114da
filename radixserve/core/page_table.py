"""Per-request page tables held as rows of one numpy array."""

from __future__ import annotations

import numpy as np


class PageTable:
    """``table[row, i]`` is the page holding tokens ``[i*page_size, (i+1)*page_size)`` of the
    request that owns ``row``.

    Invariant: a row is owned by at most one request at a time; rows not owned are in the
    free-row stack. Building a batch's page tables is one fancy index: ``table[rows]``.
    """

    def __init__(self, max_rows: int, max_pages_per_row: int) -> None:
        self.table = np.zeros((max_rows, max_pages_per_row), dtype=np.int32)
        self._free_rows = list(range(max_rows - 1, -1, -1))

    @property
    def max_pages_per_row(self) -> int:
        return self.table.shape[1]

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def acquire_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free page-table row")
        return self._free_rows.pop()

    def release_row(self, row: int) -> None:
        self._free_rows.append(row)

    def set_pages(self, row: int, start: int, pages: np.ndarray) -> None:
        end = start + pages.size
        if end > self.table.shape[1]:
            raise ValueError(f"request needs {end} pages, a row holds {self.table.shape[1]}")
        self.table[row, start:end] = pages

    def pages(self, row: int, count: int) -> np.ndarray:
        return self.table[row, :count]
