"""Tokens sampled by launched steps, addressed by placeholders until the host knows them."""

from __future__ import annotations

import numpy as np
import torch


class FutureTokens:
    """A device-side buffer of sampled tokens: placeholder ``-(s + 1)`` names slot ``s``.

    Invariants: a step's sampled rows get distinct slots, written by that step when it runs
    and read only by steps launched after it (the device runs steps in order). The two halves
    of the buffer alternate between consecutive steps, so a step's slots are not reused
    before the next step has read them; by then the host has replaced them in the requests'
    token ids, so no older placeholder is ever read.
    """

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.buffer = torch.zeros(2 * max_rows, dtype=torch.int64)
        self._host = self.buffer.numpy()  # the same memory (CPU device)
        self._half = 0

    def reserve(self, count: int) -> np.ndarray:
        """Slots for the ``count`` tokens one step samples."""
        if count > self.max_rows:
            raise ValueError(f"a step samples {count} rows, more than {self.max_rows}")
        base = self._half * self.max_rows
        self._half ^= 1
        return np.arange(base, base + count, dtype=np.int64)

    @staticmethod
    def placeholders(slots: np.ndarray) -> np.ndarray:
        return -(slots + 1)

    def store(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Device side: the step that sampled ``tokens`` publishes them."""
        self._host[slots] = tokens

    def resolve(self, ids: np.ndarray) -> np.ndarray:
        """Device side: ``ids`` with every placeholder replaced by its token."""
        if ids.size == 0 or ids.min() >= 0:
            return ids
        return np.where(ids < 0, self._host[np.maximum(-ids - 1, 0)], ids)
