"""The integer codes of a GGUF tensor's blocks, with their per-group scales and zeros.

Every type here is an affine map of small integers over groups of 16 or 32 inputs,
``W[n, k] = q[n, k] * scale[n, g] + zero[n, g]`` with ``g = k // group``; ``decode_codes``
reads those numbers straight from the file's bytes (no float32 copy of the weights), the
same arithmetic as the ``gguf`` package's dequantizers, which are the reference:

========  =====  ===========  =======================================================
type      group  q            scale, zero
========  =====  ===========  =======================================================
Q2_K      16     0..45        d, -dmin m[j]       (q = sc[j] q2: the 4-bit sub-scale folded in)
Q3_K      32     -128..124    -d, none            (q = -(sc[j] - 32) q3: the 6-bit one folded in)
Q4_0      32     -8..7        d, none
Q4_1      32     -8..7        d, m + 8 d
Q4_K      32     -8..7        d sc[j], 8 d sc[j] - dmin m[j]
Q5_0      32     -16..15      d, none
Q5_1      32     0..31        d, m
Q5_K      32     0..31        d sc[j], -dmin m[j]
Q6_K      16     -32..31      d sc[j] (sc a signed byte), none
Q8_0      32     -127..127    d, none
IQ4_NL    32     -127..113    d, none             (q = the 4-bit code's table value)
IQ4_XS    32     -127..113    d (ls[j] - 32), none (the same table; a 6-bit ls per 32)
MXFP4     32     -12..12      2^(e - 128), none   (q = 2 x the FP4 value: integers)
IQ1_S     32     -9..9        d (2 s + 1) / 8     (q = 8 (grid + delta), grid -1..1)
IQ1_M     16     -9..9        d (2 s + 1) / 8     (the same, delta per 8 inputs)
IQ2_XXS   32     -43..43      d (s + 1/2) / 4     (q = a signed grid value: 8, 25, 43)
IQ2_XS    16     -43..43      d (s + 1/2) / 4
IQ2_S     16     -43..43      d (s + 1/2) / 4     (grid values 8, 25, 43, 60... <= 43)
IQ3_XXS   32     -62..62      d (s + 1/2) / 2     (grid values 4 .. 62)
IQ3_S     32     -15..15      d (2 s + 1)         (grid values 1 .. 15)
========  =====  ===========  =======================================================

IQ4_NL and IQ4_XS are 4-bit codes into a fixed non-linear table (``IQ4_TABLE``) and MXFP4
4-bit floating-point codes (E2M1) with a power-of-two scale per 32 (E8M0): none is an
affine map of its 4-bit code, but each is one of its table's values, an integer, times
the group's scale, so as int8 codes (the table value) they run exactly, at 8 bits a weight
instead of the 16 of a bfloat16 copy (the gguf package's dequantizers are again the
reference).

The grid types (IQ1, IQ2, IQ3: "i-quants") store each 8 weights as an index into a
lattice of points with small integer coordinates, signs apart (IQ1: coordinates -1, 0, 1
and a shift of +-1/8 per group, so eight times the value is an integer). Their codes are
taken from the gguf package's dequantization divided by the group's scale read from the
bytes (the lattices are its tables), and checked to be integers in a byte: exact as int8
groups. Their scales (a float16 ``d`` times an odd factor up to 31, over 4 or 8) round
to 16 bits in the kernels, as IQ4_XS's do.

The 4-bit types (``bits == 4``) fit the int4 kernels (code ``q + 8`` in 0..15), the others
the int8 group-wise ones. Scales and zeros are float32 here, exact (a float16 times an
integer below 2**8); the kernels round them to 16 bits.

Q2_K and Q3_K (2- and 3-bit codes, a sub-block scale per 16 inputs, a float16 ``d`` per
256) fold the sub-block scale into the code, which still fits a byte, so the scale left is
the super-block's float16 ``d`` itself (Q3_K: ``-d``, which keeps ``q`` in -128..124):
no rounding of it at all in the int8 kernels' float16 scales. Q3_K then has one scale per
256 inputs (any group dividing 256 holds it; 32, as the other int8 types); Q2_K keeps
groups of 16 for its zeros ``-dmin m[j]``, which float16 rounds as Q5_K's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK_K = 256
# GGML type name -> (group, bits of the codes' range)
CODE_TYPES: dict[str, tuple[int, int]] = {
    "Q2_K": (16, 8),
    "Q3_K": (32, 8),
    "Q4_0": (32, 4),
    "Q4_1": (32, 4),
    "Q4_K": (32, 4),
    "Q5_0": (32, 8),
    "Q5_1": (32, 8),
    "Q5_K": (32, 8),
    "Q6_K": (16, 8),
    "Q8_0": (32, 8),
    "IQ4_NL": (32, 8),
    "IQ4_XS": (32, 8),
    "MXFP4": (32, 8),
    "IQ1_S": (32, 8),
    "IQ1_M": (16, 8),
    "IQ2_XXS": (32, 8),
    "IQ2_XS": (16, 8),
    "IQ2_S": (16, 8),
    "IQ3_XXS": (32, 8),
    "IQ3_S": (32, 8),
}
# the grid types: signed lattice points (IQ2/IQ3: integers; IQ1: -1, 0, 1 plus a +-1/8
# shift per group) times a scale per 16 or 32 inputs (see ``_grid_codes``)
GRID_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")
# IQ4_NL / IQ4_XS's code table (ggml's kvalues_iq4nl) and MXFP4's E2M1 values, doubled
IQ4_TABLE = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8
)
MXFP4_TABLE = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


@dataclass
class GroupCodes:
    """A weight [N, K] as ``q * scale + zero`` per group of ``group`` inputs.

    Invariant: ``q`` int8 [N, K] (in -8..7 when ``bits == 4``); ``scale`` float32
    [N, K / group]; ``zero`` the same shape or None (all zero); ``source`` the GGML type
    names it came from (several for fused projections)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group: int
    bits: int
    source: tuple[str, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        n, k = self.shape
        w = self.q.float().view(n, k // self.group, self.group) * self.scale[..., None]
        if self.zero is not None:
            w = w + self.zero[..., None]
        return w.view(n, k)

    def permute_rows(self, index: torch.Tensor) -> GroupCodes:
        """The same codes with output rows reordered (``index`` [N])."""
        i = index.numpy()

        def take(t: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(t.numpy()[i]))

        zero = None if self.zero is None else take(self.zero)
        return GroupCodes(take(self.q), take(self.scale), zero, self.group, self.bits, self.source)

    def regroup(self, group: int) -> GroupCodes:
        """The same weight with ``group`` (a divisor of this one): scales repeated."""
        if group == self.group:
            return self
        if self.group % group:
            raise ValueError(f"cannot regroup {self.group} into {group}")
        r = self.group // group

        def repeat(t: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(np.repeat(t.numpy(), r, axis=1))

        zero = None if self.zero is None else repeat(self.zero)
        return GroupCodes(self.q, repeat(self.scale), zero, group, self.bits, self.source)


def concat_codes(parts: list[GroupCodes]) -> GroupCodes:
    """Parts stacked along the outputs (fused q/k/v, gate/up), exactly: the smallest group
    of any part, zeros where any part has them, 8 bits where any part needs them."""
    if len(parts) == 1:
        return parts[0]
    group = min(p.group for p in parts)
    parts = [p.regroup(group) for p in parts]
    with_zero = any(p.zero is not None for p in parts)
    zeros = [p.zero if p.zero is not None else torch.zeros_like(p.scale) for p in parts]

    def cat(ts: list[torch.Tensor]) -> torch.Tensor:  # numpy: one thread, no pool to wake
        return torch.from_numpy(np.concatenate([t.numpy() for t in ts]))

    return GroupCodes(
        cat([p.q for p in parts]),
        cat([p.scale for p in parts]),
        cat(zeros) if with_zero else None,
        group,
        max(p.bits for p in parts),
        tuple(s for p in parts for s in p.source),
    )


def _f16(raw: np.ndarray) -> np.ndarray:
    """float16 fields (2 bytes each along the last axis) as float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """[..., half] bytes → [..., 2 * half] codes: low nibbles first, then high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 packed bytes → 8 six-bit scales and 8 six-bit mins (gguf's rule)."""
    lead = scales.shape[:-1]
    s = scales.reshape(*lead, 3, 4)
    d, m, m_d = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q2_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q2_K blocks [n, nb, 84] (scales 16, qs 64, d, dmin) → scale [n, nb, 16] (``d``),
    zero [n, nb, 16] (``-dmin m[j]``) and codes [n, nb, 16, 16] (``sc[j] q``, 0..45), element
    ``32 (4 h + s) + l`` of a block being bits ``2 s`` of byte ``32 h + l`` (gguf's rule)."""
    n, nb = blocks.shape[:2]
    scales, qs = blocks[..., 0:16], blocks[..., 16:80]
    d, dmin = _f16(blocks[..., 80:82]), _f16(blocks[..., 82:84])  # [n, nb, 1]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    q2 = (qs.reshape(n, nb, 2, 1, 32) >> shifts) & 3  # [n, nb, half, shift, 32]
    sc = (scales & 0x0F).reshape(n, nb, 16, 1)
    q = (q2.reshape(n, nb, 16, 16) * sc).astype(np.int8)  # at most 3 * 15
    scale = np.broadcast_to(d, (n, nb, 16))
    zero = -(dmin * (scales >> 4).astype(np.float32))
    return scale, zero, q


def _q3_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q3_K blocks [n, nb, 110] (hmask 32, qs 64, 12 bytes of packed 6-bit scales, d) →
    scale [n, nb, 8] (``-d`` per group of 32) and codes [n, nb, 16, 16]
    (``-(sc[j] - 32) q``, ``q`` = the 2 low bits minus 4 where the hmask bit is 0; in
    -128..124), in gguf's element order (as ``_q2_k``; hmask bit ``e // 32`` of byte
    ``e % 32``)."""
    n, nb = blocks.shape[:2]
    hmask, qs, packed = blocks[..., 0:32], blocks[..., 32:96], blocks[..., 96:108]
    d = _f16(blocks[..., 108:110])  # [n, nb, 1]
    low = packed[..., 0:8].reshape(n, nb, 1, 8) >> np.array([0, 4], dtype=np.uint8)[:, None]
    high = packed[..., 8:12].reshape(n, nb, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    sc6 = (low.reshape(n, nb, 16) & 0x0F) | ((high.reshape(n, nb, 16) & 0x03) << 4)
    sc = sc6.astype(np.int16) - 32  # -32..31
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    q2 = (qs.reshape(n, nb, 2, 1, 32) >> shifts) & 3  # [n, nb, half, shift, 32]
    hbit = (hmask.reshape(n, nb, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    q3 = q2.reshape(n, nb, 16, 16).astype(np.int16) - 4 * (1 - hbit.reshape(n, nb, 16, 16))
    q = (-(q3 * sc[..., None])).astype(np.int8)  # -(-4 * -32) = -128 fits; 128 would not
    scale = np.broadcast_to(-d, (n, nb, QK_K // 32))
    return scale, q


def _nibble_scales(raw: np.ndarray) -> np.ndarray:
    """4-bit sub-block scales, two a byte (low nibble first): [..., 2 * bytes]."""
    return np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(*raw.shape[:-1], -1)


def _grid_scale(blocks: np.ndarray, type_name: str) -> np.ndarray:
    """The scale of each group of a grid type's super-blocks [n, nb, bytes] (float32
    [n, nb, groups]), as the gguf package's dequantizers compute it (IQ1: over 8)."""
    half, quarter = np.float32(0.5), np.float32(0.25)
    if type_name == "IQ1_M":  # the float16 d in the top nibbles of the four scale words
        words = np.ascontiguousarray(blocks[..., 48:56]).view(np.uint16)  # [n, nb, 4]
        parts = (words & np.uint16(0xF000)) >> np.array([12, 8, 4, 0], dtype=np.uint16)
        d = np.bitwise_or.reduce(parts, axis=-1, keepdims=True).view(np.float16)
        s = (words[..., None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7
        return d.astype(np.float32) * (2 * s.reshape(*words.shape[:-1], 16) + 1) / 8
    d = _f16(blocks[..., 0:2])  # [n, nb, 1]
    if type_name in ("IQ2_XXS", "IQ3_XXS"):  # 4-bit scales atop 8 uint32 words
        offset = 2 if type_name == "IQ2_XXS" else 66
        words = np.ascontiguousarray(
            blocks[..., offset : offset + 64 if type_name == "IQ2_XXS" else offset + 32]
        ).view(np.uint32)
        ls = (words[..., 1::2] if type_name == "IQ2_XXS" else words) >> 28
        return d * (half + ls.astype(np.float32)) * (quarter if type_name == "IQ2_XXS" else half)
    if type_name in ("IQ2_XS", "IQ2_S"):
        offset = 66 if type_name == "IQ2_XS" else 74
        ls = _nibble_scales(blocks[..., offset : offset + 8]).astype(np.float32)
        return d * (half + ls) * quarter
    if type_name == "IQ3_S":
        ls = _nibble_scales(blocks[..., 106:110]).astype(np.float32)
        return d * (1 + 2 * ls)
    # IQ1_S: a uint16 per 32: 3-bit scale at bit 12
    qh = np.ascontiguousarray(blocks[..., 34:50]).view(np.uint16)
    return d * (2 * ((qh >> 12) & 7).astype(np.float32) + 1) / 8


def _grid_codes(b: np.ndarray, type_name: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale [n, k / group], q [n, k] int8) of a grid type: the gguf package's values
    divided by the group's scale, checked to be integers of a byte."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    group = CODE_TYPES[type_name][0]
    blocks = b.reshape(n, k // QK_K, -1)
    scale = _grid_scale(blocks, type_name).reshape(n, k // group)
    w = np.asarray(dequantize(b.reshape(n, -1), GGMLQuantizationType[type_name]), np.float32)
    w = w.reshape(n, k // group, group)
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]
    q = np.rint(w / safe)
    if np.abs(q).max(initial=0) > 127 or not np.allclose(q * safe, w, rtol=1e-5, atol=0):
        raise ValueError(f"{type_name} values are not integers of a byte times the scale")
    return scale, q.astype(np.int8).reshape(n, k)


def decode_codes(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> GroupCodes:
    """The codes of a tensor of ``shape`` [N, K] from its raw blocks (uint8, any shape
    holding them in order). ``ValueError`` for a type not in ``CODE_TYPES``."""
    if type_name not in CODE_TYPES:
        raise ValueError(f"GGML type {type_name} has no group-code form")
    n, k = shape
    group, bits = CODE_TYPES[type_name]
    b = np.asarray(raw).reshape(n, -1)
    zero: np.ndarray | None = None
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        head = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8, "Q8_0": 2}[type_name]
        blocks = b.reshape(n, k // 32, -1)
        d = _f16(blocks[..., 0:2])[..., 0]
        if type_name == "Q8_0":
            q = blocks[..., 2:].view(np.int8)
        else:
            qs = blocks[..., head:]
            codes = _nibbles(qs, 16)
            if type_name in ("Q5_0", "Q5_1"):
                qh = np.ascontiguousarray(blocks[..., head - 4 : head]).view(np.uint32)
                high = (qh >> np.arange(32, dtype=np.uint32)) & 1
                codes = codes | (high.astype(np.uint8) << 4)
            if type_name in ("Q4_0", "Q4_1"):
                q = codes.astype(np.int8) - np.int8(8)
            elif type_name == "Q5_0":
                q = codes.astype(np.int8) - np.int8(16)
            else:
                q = codes.astype(np.int8)
        scale = d
        if type_name == "Q4_1":
            zero = _f16(blocks[..., 2:4])[..., 0] + 8.0 * d
        elif type_name == "Q5_1":
            zero = _f16(blocks[..., 2:4])[..., 0]
    elif type_name in ("Q4_K", "Q5_K"):
        blocks = b.reshape(n, k // QK_K, -1)
        d = _f16(blocks[..., 0:2])  # [n, nb, 1]
        dmin = _f16(blocks[..., 2:4])
        sc, mn = _k_scale_min(blocks[..., 4:16])  # [n, nb, 8]
        scale = d * sc
        m = dmin * mn
        if type_name == "Q4_K":
            qs = blocks[..., 16:].reshape(n, k // QK_K, 4, 32)
            codes = _nibbles(qs, 32).reshape(n, k // QK_K, 4, 2, 32)  # low: sub 2i, high: 2i+1
            q = codes.astype(np.int8) - np.int8(8)
            zero = 8.0 * scale - m
        else:
            qh = blocks[..., 16:48]  # [n, nb, 32]
            qs = blocks[..., 48:].reshape(n, k // QK_K, 4, 32)
            low = _nibbles(qs, 32).reshape(n, k // QK_K, 4, 2, 32)
            high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [n,nb,8,32]
            q = (low | (high.reshape(n, k // QK_K, 4, 2, 32) << 4)).astype(np.int8)
            zero = -m
        scale, zero = scale.reshape(n, -1), zero.reshape(n, -1)
    elif type_name in ("IQ4_NL", "MXFP4"):  # 32 a block: a scale, then 16 bytes of nibbles
        head = 2 if type_name == "IQ4_NL" else 1
        blocks = b.reshape(n, k // 32, -1)
        table = IQ4_TABLE if type_name == "IQ4_NL" else MXFP4_TABLE
        q = table[_nibbles(blocks[..., head:], 16)]
        if type_name == "IQ4_NL":
            scale = _f16(blocks[..., 0:2])[..., 0]
        else:  # E8M0: 2^(e - 127), halved as the table is doubled (ggml's e8m0_to_fp32_half)
            scale = np.ldexp(np.float32(1.0), blocks[..., 0].astype(np.int32) - 128)
    elif type_name == "IQ4_XS":  # 256: d, 2 bytes of high scale bits, 4 of low, 128 nibbles
        blocks = b.reshape(n, k // QK_K, -1)
        d = _f16(blocks[..., 0:2])  # [n, nb, 1]
        high = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16)  # [n, nb, 1]
        low = blocks[..., 4:8]  # [n, nb, 4]: sub-blocks 2i (low nibble) and 2i + 1 (high)
        ls_low = np.stack([low & 0x0F, low >> 4], axis=-1).reshape(n, -1, 8)
        ls_high = (high >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [n, nb, 8]
        ls = (ls_low.astype(np.int16) | (ls_high.astype(np.int16) << 4)) - 32
        scale = (d * ls.astype(np.float32)).reshape(n, -1)
        qs = blocks[..., 8:].reshape(n, k // QK_K, 8, 16)
        q = IQ4_TABLE[_nibbles(qs, 16)]  # per sub-block of 32: low nibbles, then high
    elif type_name in GRID_TYPES:
        scale, q = _grid_codes(b, type_name, n, k)
    elif type_name == "Q2_K":
        scale, zero, q = _q2_k(b.reshape(n, k // QK_K, -1))
    elif type_name == "Q3_K":
        scale, q = _q3_k(b.reshape(n, k // QK_K, -1))
    else:  # Q6_K
        blocks = b.reshape(n, k // QK_K, -1)
        ql = blocks[..., 0:128].reshape(n, -1, 2, 64)
        qh = blocks[..., 128:192].reshape(n, -1, 2, 32)
        sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
        d = _f16(blocks[..., 208:210])
        low = _nibbles(ql, 64).reshape(n, -1, 2, 4, 32)  # (half, quarter, 32)
        high = (qh[..., None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
        q = (low | (high << 4)).astype(np.int8) - np.int8(32)
        scale = (d * sc).reshape(n, -1)
    qt = torch.from_numpy(np.ascontiguousarray(q).reshape(n, k))
    st = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(n, k // group))
    zt = None
    if zero is not None:
        zt = torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32).reshape(n, k // group))
    return GroupCodes(qt, st, zt, group, bits, (type_name,))
