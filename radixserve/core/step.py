"""The contract of one step between the scheduler (who decides) and the executor (who runs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from radixserve.core.request import Request


@dataclass(frozen=True)
class PageCopy:
    """Copy the KV of page ``src`` into page ``dst`` before the step's forward (copy-on-write)."""

    src: int
    dst: int


@dataclass
class ScheduledBatch:
    """One step's work: request ``requests[i]`` computes ``num_new_tokens[i]`` tokens starting
    at position ``starts[i]`` (its ``num_computed_tokens`` when scheduled); if ``sample[i]``
    the chunk reaches its last token (``starts[i] + num_new_tokens[i] == totals[i]``, the
    request's ``num_tokens`` when scheduled) and the step samples one new token for it, which
    lands at ``token_ids[totals[i]]`` — with ``num_spec[i]`` proposals verified in the same
    chunk, 1 to ``num_spec[i] + 1`` tokens land from there. (A pooling request's last chunk
    has ``sample[i]`` set too, but the runner samples nothing for it: -1 lands there and
    the engine ends it with its pooled hidden state; see ``Request.pooling``.)

    Invariant: the arrays are aligned with ``requests`` and fixed once scheduled, so the
    executor can build the step's inputs from them while the scheduler moves on.
    """

    requests: list[Request]
    num_new_tokens: np.ndarray  # [B] int32
    sample: np.ndarray  # [B] bool
    starts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [B]
    totals: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [B]
    page_copies: list[PageCopy] = field(default_factory=list)
    # Requests that ended while scheduling (cannot fit, timed out), with no forward.
    failed: list[Request] = field(default_factory=list)
    step_id: int = -1  # set when the scheduler launches the step (``begin_step``)
    # Speculative decoding: ``num_spec[i]`` proposals follow request i's last token in its
    # chunk (``num_new_tokens[i] = 1 + num_spec[i]``); they sit in its ``token_ids`` at
    # ``totals[i] ..`` (past ``num_tokens``: unverified, never counted). None: no proposals.
    num_spec: np.ndarray | None = None  # [B] int32
    # Policy fair, a step built while tenants share the engine: (the prompt-token cap it
    # was built under, the prompt tokens it computes under it); None otherwise.
    shared_step: tuple[int, int] | None = None
    _rows: dict[str, int] | None = field(default=None, repr=False)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def has_spec(self) -> bool:
        return self.num_spec is not None and bool(self.num_spec.any())

    @property
    def num_tokens(self) -> int:
        return int(self.num_new_tokens.sum())

    def row_of(self, request_id: str) -> int | None:
        """The batch row of ``request_id``, or None (an index built once, on first use)."""
        if self._rows is None:
            self._rows = {r.request_id: i for i, r in enumerate(self.requests)}
        return self._rows.get(request_id)
