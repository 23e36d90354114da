"""Rotary embedding variants: the cos/sin tables (``executor/rotary.py``: default, linear,
llama3, longrope/su scaling) and, for models whose layers rotate with different bases
(Gemma 3's local and global layers), one table per base."""

from __future__ import annotations

from radixserve.executor.rotary import RotaryEmbedding, apply_rotary, inverse_frequencies

__all__ = ["RotaryEmbedding", "apply_rotary", "inverse_frequencies"]
