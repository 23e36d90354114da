"""What one layer's attention computes, beyond q, k and v: the per-layer spec every
attention backend honours."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """Causal attention of one layer.

    Invariant: the query at position i attends keys at positions j with
    ``i - sliding_window < j <= i`` (all ``j <= i`` when ``sliding_window`` is None), with
    scores ``scale * q.k``, then ``softcap * tanh(score / softcap)`` when ``softcap`` is
    set, then a softmax. ``sliding_window`` counts the query's own position (Hugging
    Face's convention: ``kv_idx > q_idx - sliding_window``). ``sinks`` (float32, one per
    query head; gpt-oss): the softmax's denominator also holds ``exp(sinks[h])``, a
    learned logit with no value (attention may go "nowhere")."""

    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"softcap must be > 0, got {self.softcap}")

    def lowest_key(self, position: int) -> int:
        """The first key position the query at ``position`` attends."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1)
