"""Adaptive proposal length: how many tokens a request's n-gram proposer may guess next step.

A verify row costs little next to the weights a step reads at batch 1 on the CPU (measured:
about a quarter of a plain decode step per extra row), so a request whose proposals are
all kept should be allowed longer ones, and one whose proposals are rejected early should
verify fewer rows. The rule is multiplicative both ways (docs/speculative.md):

* a request starts at ``start`` (by default half the cap, one doubling below it);
* a verify that kept every proposal of a full-length proposal (as many as the limit
  allowed) doubles the request's length, up to ``max_len``;
* a verify that rejected a proposal halves it, down to ``base`` (``num_spec_tokens``);
* a verify cut short (the proposer's continuation ended, or the scheduler cut it for the
  token budget, ``max_tokens`` or pages) and fully kept leaves it: it says nothing about
  longer runs.

The length above ``base`` is an allowance shared by the batch: at a step with ``n``
decoding requests a request's limit is at most ``max(base, max_len // n)``, because a
verify row is nearly free only while the step is bound by reading the weights (at 16
requests a verify row costs more than half a plain row). So from ``max_len // base``
requests on (4 with the defaults) every limit is ``base``: the fixed length, as without
adaptation (halving down to 1 did a few percent better at batch 1 on rejection-heavy
text in a replay, worse on copied text, and changed what large batches verify).

Nothing here touches a token: the length only bounds what the proposer may guess, the
verify rule decides what is kept, so outputs never depend on it.
"""

from __future__ import annotations


class AdaptiveLength:
    """Per-request proposal lengths, adapted from each verify's outcome.

    Invariants: a request not seen yet has length ``start``; every length is in
    ``base..max_len``; ``limit(r, n)`` is ``min(length(r), max(base, max_len // n))``, so
    at least ``base`` and exactly ``base`` once ``n >= max_len // base``; only ``update``
    changes a length, only ``forget`` drops one.
    """

    def __init__(self, base: int, max_len: int, start: int | None = None) -> None:
        if start is None:
            start = max(base, max_len // 2)
        if not 1 <= base <= start <= max_len:
            raise ValueError(f"need 1 <= base <= start <= max_len, got {base}, {start}, {max_len}")
        self.base = base
        self.start = start
        self.max_len = max_len
        self._lengths: dict[str, int] = {}

    def length(self, request_id: str) -> int:
        """The request's current length (``start`` before its first verify)."""
        return self._lengths.get(request_id, self.start)

    def limit(self, request_id: str, batch: int) -> int:
        """How many proposals the request may have at a step with ``batch`` decoding
        requests."""
        share = max(self.base, self.max_len // max(1, batch))
        return min(self.length(request_id), share)

    def update(self, request_id: str, limit: int, verified: int, accepted: int) -> None:
        """A verify of ``verified`` proposals (of a ``limit`` the proposer was given) kept
        ``accepted`` of them."""
        if verified <= 0 or limit <= 0:
            return
        if not 0 <= accepted <= verified <= limit:
            raise ValueError(f"need 0 <= {accepted=} <= {verified=} <= {limit=}")
        if accepted < verified:
            self._lengths[request_id] = max(self.base, limit // 2)
        elif verified == limit:
            self._lengths[request_id] = min(self.max_len, 2 * limit)

    def forget(self, request_id: str) -> None:
        self._lengths.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._lengths)
