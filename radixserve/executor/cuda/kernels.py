"""Triton kernels of the CUDA path, each with its Python launcher.

* ``store_kv``: a step's K/V rows into their cache slots (any page size);
* ``paged_decode``: one query token per request against its paged KV, split-K
  (flash-decoding): each program takes all query heads of one KV head over one slice of
  the sequence, a second kernel merges the slices by their log-sum-exp;
* ``extend_attention``: new tokens against the paged cached prefix plus themselves
  (causal); the step's own K/V is already in the cache, so all keys are read from pages;
* ``add_rms_norm``, ``silu_and_mul``, ``rotary``: the decoder layer's row-wise ops, fused.

The cache layout is ``KVCache``'s: a layer is [num_pages, kv_heads, page_size, head_dim]
with the last dim contiguous; every key is located by its page-table entry, so page size 1
and 16 (or any other) take the same code. Launchers accept CPU tensors too, which only
the Triton interpreter (``TRITON_INTERPRET=1``) runs: that is how CI tests these kernels.
Accumulation is float32 throughout; ``tl.dot`` on float32 inputs uses exact IEEE products
(not TF32), so float32 results match the torch reference closely.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "add_rms_norm",
    "default_num_splits",
    "extend_attention",
    "paged_decode",
    "rotary",
    "silu_and_mul",
    "store_kv",
]


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs


# -- KV store ----------------------------------------------------------------------------------
@triton.jit
def _round_half_even(x):
    """x rounded to the nearest integer, ties to even, for |x| < 2**22 (as ``torch.round``):
    adding and taking away 1.5 * 2**23 leaves float32 no bits below the units."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _quantize_rows(x, inv127):
    """Rows of x [BLOCK_H, BLOCK_D] as int8 codes and a float32 scale each, as
    ``kv_cache.quantize_int8``: scale = max|x| * (1/127), codes = round(x / scale)."""
    xf = x.to(tl.float32)
    scale = tl.max(tl.abs(xf), 1) * inv127
    safe = tl.where(scale > 0, scale, 1.0)  # an all-zero row: scale 0, codes 0
    inv = tl.where(scale > 0, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), safe), 0.0)
    codes = _round_half_even(xf * inv[:, None])
    codes = tl.minimum(tl.maximum(codes, -127.0), 127.0)
    return codes.to(tl.int8), scale


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cp,
    stride_ch,
    stride_cs,
    stride_sp,
    stride_sh,
    inv127,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    dst = page * stride_cp + offset * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    if QUANT:  # int8 codes, and each head's scale at [page, head, offset]
        k_codes, k_scale = _quantize_rows(k, inv127)
        v_codes, v_scale = _quantize_rows(v, inv127)
        tl.store(k_cache_ptr + dst, k_codes, mask=mask)
        tl.store(v_cache_ptr + dst, v_codes, mask=mask)
        at = page * stride_sp + h * stride_sh + offset
        tl.store(k_scale_ptr + at, k_scale, mask=h < NUM_KV_HEADS)
        tl.store(v_scale_ptr + at, v_scale, mask=h < NUM_KV_HEADS)
    else:
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


def _scale_args(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, int, int, bool]:
    """The kernels' scale arguments: an int8 cache's ``[pages, kv_heads, page_size]`` key
    and value scales (token stride 1) and their page and head strides, or stand-ins
    (``QUANT`` off) for a cache of the model's dtype."""
    if k_scale is None or v_scale is None:
        if k_cache.dtype == torch.int8:
            raise ValueError("an int8 KV cache needs its k_scale and v_scale")
        return k_cache, k_cache, 0, 0, False
    assert k_cache.dtype == torch.int8 and k_scale.stride() == v_scale.stride()
    assert k_scale.stride(2) == 1 and k_scale.dtype == v_scale.dtype == torch.float32
    return k_scale, v_scale, k_scale.stride(0), k_scale.stride(1), True


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """``k``/``v`` [T, kv_heads, d] (last dim contiguous) into one layer's caches
    [pages, kv_heads, page_size, d] at flat slots ``slot_mapping`` [T]. An int8 cache
    (``k_scale``/``v_scale`` [pages, kv_heads, page_size]) gets each token-head's codes and
    scale, the same numbers as ``kv_cache.quantize_int8``."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1
    ks, vs, stride_sp, stride_sh, quant = _scale_args(k_cache, k_scale, v_scale)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        ks,
        vs,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        stride_sp,
        stride_sh,
        1.0 / 127.0,
        NUM_KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=_pow2(kv_heads),
        BLOCK_D=_pow2(head_dim),
        PAGE_SIZE=k_cache.shape[2],
        QUANT=quant,
    )


# -- paged decode (split-K) --------------------------------------------------------------------
@triton.jit
def _softcap(x, cap):
    """cap * tanh(x / cap), with tanh(y) = 1 - 2 / (exp(2y) + 1) (saturates at +-1)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0))


@triton.jit
def _int8_key_scores(
    q, k_t, k_scale_ptr, v_scale_ptr, page, kv_head, n, n_mask,
    stride_sp, stride_sh, PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """q . k for a tile of keys k_t [BLOCK_D, BLOCK_N], and (int8 cache) the tile's value
    scales [BLOCK_N]: the codes are exact in q's dtype, each key's score is scaled by its
    scale after the dot, and each value's scale goes into its softmax weight
    (``_weighted_values``)."""
    if QUANT:
        at = page.to(tl.int64) * stride_sp + kv_head * stride_sh + n % PAGE_SIZE
        k_s = tl.load(k_scale_ptr + at, mask=n_mask, other=0.0)
        v_s = tl.load(v_scale_ptr + at, mask=n_mask, other=0.0)
        scores = tl.dot(q, k_t.to(q.dtype), input_precision=PRECISION) * k_s[None, :]
    else:
        v_s = tl.zeros(n.shape, dtype=tl.float32)
        scores = tl.dot(q, k_t, input_precision=PRECISION)
    return scores, v_s


@triton.jit
def _weighted_values(p, v, v_s, q, PRECISION: tl.constexpr, QUANT: tl.constexpr):
    """p [rows, BLOCK_N] times the tile's values v [BLOCK_N, BLOCK_D]; an int8 cache's
    value scales multiply the weights, and its codes go in as q's dtype."""
    if QUANT:
        return tl.dot((p * v_s[None, :]).to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return tl.dot(p.to(v.dtype), v, input_precision=PRECISION)


@triton.jit
def _decode_partial_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    page_table_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_qb,
    stride_qh,
    stride_cp,
    stride_ch,
    stride_cs,
    stride_pt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_sp,
    stride_sh,
    scale,
    num_splits,
    window,
    softcap,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    # keys lo .. seq_len - 1: a sliding window (window > 0) starts past key 0
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - lo, BLOCK_N), num_splits)
    start = lo + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + h
    h_mask = h < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        page = tl.load(page_table_ptr + b * stride_pt + n // PAGE_SIZE, mask=n_mask, other=0)
        base = page.to(tl.int64) * stride_cp + kv_head * stride_ch + (n % PAGE_SIZE) * stride_cs
        kv_mask = n_mask[None, :] & d_mask[:, None]
        k_t = tl.load(k_cache_ptr + base[None, :] + d[:, None], mask=kv_mask, other=0.0)
        scores, v_s = _int8_key_scores(
            q, k_t, k_scale_ptr, v_scale_ptr, page, kv_head, n, n_mask,
            stride_sp, stride_sh, PAGE_SIZE, PRECISION, QUANT,
        )  # fmt: skip
        scores = scores * scale  # [BLOCK_H, BLOCK_N]
        if HAS_SOFTCAP:
            scores = _softcap(scores, softcap)
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + base[:, None] + d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + _weighted_values(p, v, v_s, q, PRECISION, QUANT)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(
        part_out_ptr + b * stride_ob + head[:, None] * stride_oh + split * stride_os + d[None, :],
        out,
        mask=h_mask[:, None] & d_mask[None, :],
    )
    tl.store(part_lse_ptr + b * stride_lb + head * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_yb,
    stride_yh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    lse = tl.load(
        part_lse_ptr + b * stride_lb + head * stride_lh + s, mask=s_mask, other=float("-inf")
    )
    weights = tl.exp(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    parts = tl.load(
        part_out_ptr + b * stride_ob + head * stride_oh + s[:, None] * stride_os + d[None, :],
        mask=s_mask[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0)
    tl.store(
        out_ptr + b * stride_yb + head * stride_yh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def default_num_splits(batch_size: int, num_kv_heads: int, max_seq_len: int, block_n: int) -> int:
    """Slices per sequence: enough programs to fill ~264 (2 per multiprocessor of an H100 /
    H200), at most 32, and no more than the longest sequence has key tiles."""
    want = -(-264 // max(1, batch_size * num_kv_heads))
    tiles = max(1, -(-max_seq_len // block_n))
    return max(1, min(32, want, tiles))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per request: q [B, heads, d] (last dim contiguous) against
    request b's first ``seq_lens[b]`` cached positions (its last ``window`` of them when
    set; scores soft-capped at ``softcap`` when set), on pages ``page_tables[b]``; an int8
    cache with its ``k_scale``/``v_scale`` [pages, kv_heads, page_size].
    Returns ``out`` [B, heads, d]. The grid depends only on B, the head counts and
    ``num_splits`` (not on the lengths), so a CUDA graph can replay it."""
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if out is None:
        out = q.new_empty(batch, heads, head_dim)
    if batch == 0:
        return out
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and page_tables.stride(1) == 1
    part_out = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = _pow2(head_dim, 16)
    ks, vs, stride_sp, stride_sh, quant = _scale_args(k_cache, k_scale, v_scale)
    _decode_partial_kernel[(batch, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        page_tables,
        seq_lens,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        page_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        stride_sp,
        stride_sh,
        scale,
        num_splits,
        window or 0,
        softcap or 0.0,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=_pow2(group, 16),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        PAGE_SIZE=k_cache.shape[2],
        PRECISION=_precision(q.dtype),
        HAS_SOFTCAP=softcap is not None,
        QUANT=quant,
    )
    _decode_merge_kernel[(batch, heads)](
        part_out,
        part_lse,
        out,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=_pow2(num_splits, 2),
    )
    return out


# -- extend / prefill --------------------------------------------------------------------------
@triton.jit
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    page_table_ptr,
    query_start_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_cp,
    stride_ch,
    stride_cs,
    stride_pt,
    stride_yt,
    stride_yh,
    stride_sp,
    stride_sh,
    scale,
    window,
    softcap,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_ptr + b).to(tl.int32)
    q_len = tl.load(query_start_ptr + b + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    prefix = seq_len - q_len

    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < q_len
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + m)[:, None].to(tl.int64) * stride_qt + head * stride_qh + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    pos = prefix + m  # [BLOCK_M] absolute positions of the queries
    # keys up to the block's last valid query position; nothing for a block past q_len
    last = tl.minimum((m_block + 1) * BLOCK_M, q_len)
    end = tl.where(m_block * BLOCK_M < q_len, prefix + last, 0)
    # with a window (window > 0), from the first key the block's first query sees
    first = tl.where(window > 0, tl.maximum(prefix + m_block * BLOCK_M - window + 1, 0), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(first, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        page = tl.load(page_table_ptr + b * stride_pt + n // PAGE_SIZE, mask=n_mask, other=0)
        base = page.to(tl.int64) * stride_cp + kv_head * stride_ch + (n % PAGE_SIZE) * stride_cs
        k_t = tl.load(
            k_cache_ptr + base[None, :] + d[:, None],
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        )
        scores, v_s = _int8_key_scores(
            q, k_t, k_scale_ptr, v_scale_ptr, page, kv_head, n, n_mask,
            stride_sp, stride_sh, PAGE_SIZE, PRECISION, QUANT,
        )  # fmt: skip
        scores = scores * scale  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            scores = _softcap(scores, softcap)
        allowed = n_mask[None, :] & (n[None, :] <= pos[:, None])
        allowed = allowed & ((window <= 0) | (n[None, :] > pos[:, None] - window))
        scores = tl.where(allowed, scores, float("-inf"))
        # under a window a query may see no key of a tile (its max stays -inf): a finite
        # stand-in keeps exp() at 0 for it instead of NaN
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(scores - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + base[:, None] + d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + _weighted_values(p, v, v_s, q, PRECISION, QUANT)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + (q_start + m)[:, None].to(tl.int64) * stride_yt + head * stride_yh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a step's tokens q [T, heads, d]: request b's tokens
    ``query_start_loc[b] : query_start_loc[b+1]`` are its last positions of
    ``seq_lens[b]``, and each sees every cached position up to its own (the step's K/V must
    already be stored), only the last ``window`` of them when set; scores soft-capped at
    ``softcap`` when set. ``max_q_len``: the longest query span (sizes the grid). An int8
    cache comes with its ``k_scale``/``v_scale`` [pages, kv_heads, page_size]."""
    num_tokens, heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    kv_heads = k_cache.shape[1]
    if out is None:
        out = q.new_empty(num_tokens, heads, head_dim)
    if num_tokens == 0:
        return out
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and page_tables.stride(1) == 1
    block_m = min(block_m, _pow2(max_q_len, 16))
    ks, vs, stride_sp, stride_sh, quant = _scale_args(k_cache, k_scale, v_scale)
    _extend_kernel[(batch, heads, triton.cdiv(max_q_len, block_m))](
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        page_tables,
        query_start_loc,
        seq_lens,
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        page_tables.stride(0),
        out.stride(0),
        out.stride(1),
        stride_sp,
        stride_sh,
        scale,
        window or 0,
        softcap or 0.0,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=_pow2(head_dim, 16),
        PAGE_SIZE=k_cache.shape[2],
        PRECISION=_precision(q.dtype),
        HAS_SOFTCAP=softcap is not None,
        QUANT=quant,
    )
    return out


# -- row-wise layer ops ------------------------------------------------------------------------
@triton.jit
def _add_rms_norm_kernel(
    add_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    width,
    eps,
    HAS_ADD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(residual_ptr + row * width + cols, mask=mask, other=0.0)
    if HAS_ADD:
        x = x + tl.load(add_ptr + row * width + cols, mask=mask, other=0.0)
        tl.store(residual_ptr + row * width + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / width + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * inv_rms) * w
    tl.store(out_ptr + row * width + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    add: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += add`` in place (skipped when ``add`` is None), then RMSNorm(residual)
    times ``weight``: one pass over the row. Rows contiguous, [T, width]."""
    rows, width = residual.shape
    assert residual.is_contiguous() and (add is None or add.is_contiguous())
    out = torch.empty_like(residual)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            residual if add is None else add,
            residual,
            weight,
            out,
            width,
            eps,
            HAS_ADD=add is not None,
            BLOCK=_pow2(width),
        )
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, half, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < half
    gate = tl.load(x_ptr + row * 2 * half + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * half + half + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * half + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] for contiguous x [T, 2d]."""
    rows, width = x.shape
    assert x.is_contiguous()
    half = width // 2
    out = x.new_empty(rows, half)
    block = min(block, _pow2(half))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(half, block))](x, out, half, BLOCK=block)
    return out


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HALF)
    cos = tl.load(cos_ptr + t * stride_ct + d, mask=d < HALF, other=0.0).to(tl.float32)
    # sin_signed is [-sin, sin]: its second half is +sin
    sin = tl.load(sin_ptr + t * stride_st + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    first = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(first, y1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, y2.to(x_ptr.dtype.element_ty), mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, d] in place (rotate-half convention) by the tables of
    ``RotaryEmbedding.tables``: cos and sin_signed [T, 1, d] (or [T, d]). Returns ``x``."""
    num_tokens, heads, head_dim = x.shape
    assert x.stride(2) == 1 and cos.stride(-1) == 1 and sin_signed.stride(-1) == 1
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            x,
            cos,
            sin_signed,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            sin_signed.stride(0),
            NUM_HEADS=heads,
            HALF=half,
            BLOCK_H=_pow2(heads),
            BLOCK_D=_pow2(half),
        )
    return x
