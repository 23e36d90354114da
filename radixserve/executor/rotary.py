"""Rotary position embeddings (Hugging Face's rotate-half layout), with llama3 / linear / YaRN
scaling and LongRoPE."""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":  # a GGUF file's rope_freqs.weight: divisors per frequency
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors for {inv_freq.numel()}")
        return inv_freq / factors
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return yarn_parameters(head_dim, theta, scaling)[0]
    if kind in ("longrope", "su"):
        raise ValueError("longrope frequencies depend on the position: use longrope_tables")
    raise ValueError(
        f"rope scaling type {kind!r} is not supported (default, linear, llama3, yarn, longrope)"
    )


def yarn_parameters(
    head_dim: int, theta: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss, DeepSeek, Qwen's long-context configs): (inverse frequencies, the
    cos/sin scale), as transformers computes them: frequencies below the correction range
    interpolated by ``factor``, above it kept, a linear ramp between (its ends rounded
    outward unless ``truncate`` is false); the scale ``0.1 ln(factor) + 1`` unless given."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp(
        (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def is_longrope(scaling: dict[str, Any] | None) -> bool:
    return bool(scaling) and (scaling.get("rope_type") or scaling.get("type")) in ("longrope", "su")


def longrope_parameters(
    head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """LongRoPE (Phi-3's ``longrope``, formerly ``su``): (short inverse frequencies, long
    ones, the original context length, the cos/sin scale), as transformers computes them."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_positions / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta**shape)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * theta**shape)
    return short, long, original, float(attention_factor)


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions ``0 .. max_positions-1``.

    Invariant: row p of ``cos`` / ``sin_signed`` rotates position p, in the model's dtype.
    Under LongRoPE, position p rotates with the short factors while p is below the original
    context length and with the long factors from there on (each position's rotation is
    fixed, so cached keys stay valid); cos and sin carry the attention factor (LongRoPE's,
    YaRN's).
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
    ) -> None:
        positions = torch.arange(max_positions, dtype=torch.float32)
        if is_longrope(scaling):
            assert scaling is not None
            short, long, original, mscale = longrope_parameters(
                head_dim, theta, scaling, max_positions
            )
            angles = torch.where(
                positions[:, None] < original,
                torch.outer(positions, short),
                torch.outer(positions, long),
            )
            cos, sin = angles.cos() * mscale, angles.sin() * mscale
        else:
            inv_freq = inverse_frequencies(head_dim, theta, scaling).to(torch.float32)
            angles = torch.outer(positions, inv_freq)
            cos, sin = angles.cos(), angles.sin()
            if scaling and (scaling.get("rope_type") or scaling.get("type")) == "yarn":
                mscale = yarn_parameters(head_dim, theta, scaling)[1]
                cos, sin = cos * mscale, sin * mscale
        # Full-width tables so rotation is x * cos + roll(x, d/2) * sin_signed, where
        # sin_signed = [-sin, sin] reproduces rotate_half(x) * sin exactly.
        self.cos = torch.cat((cos, cos), dim=-1).to(dtype)
        self.sin_signed = torch.cat((-sin, sin), dim=-1).to(dtype)

    def to(self, device: torch.device) -> None:
        """Move the tables to ``device``."""
        self.cos = self.cos.to(device)
        self.sin_signed = self.sin_signed.to(device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for ``positions``, [T, 1, head_dim], to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] (Hugging Face's rotate-half convention)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)
