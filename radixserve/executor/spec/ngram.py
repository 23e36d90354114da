"""Prompt lookup: propose what followed the last occurrence of the request's own suffix."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from radixserve.core.request import Request

_EMPTY = np.zeros(0, dtype=np.int32)


def ngram_propose(tokens: np.ndarray, max_n: int, min_n: int, limit: int) -> np.ndarray:
    """The tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` of length ``max_n`` down to ``min_n`` (at most ``limit`` of them).

    Vectorised: one compare over the history finds the candidates (earlier positions
    holding the last token), then at most ``max_n - 1`` compares over those candidates
    extend their match backwards; no loop over tokens."""
    n = int(tokens.size)
    if limit <= 0 or n < min_n + 1:
        return _EMPTY
    last = tokens[n - 1]
    cand = np.flatnonzero(tokens[: n - 1] == last)  # j: tokens[j] == last, j <= n - 2
    if cand.size == 0:
        return _EMPTY
    length = np.ones(cand.size, dtype=np.int64)  # matched suffix length ending at each j
    alive = np.ones(cand.size, dtype=bool)
    for t in range(1, max_n):
        if n - 1 - t < 0:
            break
        pos = cand - t
        ok = alive & (pos >= 0)
        ok[ok] = tokens[pos[ok]] == tokens[n - 1 - t]
        length += ok
        alive = ok
        if not alive.any():
            break
    best = int(length.max())
    if best < min_n:
        return _EMPTY
    j = int(cand[np.flatnonzero(length == best)[-1]])  # the latest of the longest matches
    return tokens[j + 1 : min(j + 1 + limit, n)].astype(np.int32, copy=True)


class NgramProposer:
    """Prompt lookup decoding (n-gram proposer) over each request's prompt and output.

    Invariant: a proposal is a copy of tokens that followed an earlier occurrence of the
    request's last ``k`` tokens, ``spec_ngram_max >= k >= spec_ngram_min``, preferring the
    longest ``k`` and then the latest occurrence; deterministic in the tokens so far.
    """

    def __init__(self, max_n: int, min_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[np.ndarray]:
        return [
            ngram_propose(r.all_token_ids, self.max_n, self.min_n, int(k))
            for r, k in zip(requests, limits, strict=True)
        ]
