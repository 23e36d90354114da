"""Each Triton kernel of the CUDA path against a torch-native reference: float32 under the
interpreter on CPU (CI), bfloat16 on a GPU (``cuda`` marker)."""

from __future__ import annotations

import pytest
import torch

from radixserve.executor.kv_cache import quantize_int8
from radixserve.executor.layer_ops import LayerOps
from radixserve.executor.rotary import RotaryEmbedding, apply_rotary

kernels = pytest.importorskip("radixserve.executor.cuda.kernels")

FLOAT32 = pytest.param(torch.float32, id="f32")
BF16 = pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.cuda)
DTYPES = [FLOAT32, BF16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _dev(dtype: torch.dtype) -> str:
    return "cuda" if dtype == torch.bfloat16 or torch.cuda.is_available() else "cpu"


def _paged(seq_lens, kv_heads, d, page_size, dtype, seed):
    """A layer's caches with random contents and shuffled page tables [B, max_pages]."""
    g = torch.Generator().manual_seed(seed)
    max_pages = -(-max(seq_lens) // page_size)
    num_pages = len(seq_lens) * max_pages + 2
    k = torch.randn(num_pages, kv_heads, page_size, d, generator=g)
    v = torch.randn(num_pages, kv_heads, page_size, d, generator=g)
    tables = torch.randperm(num_pages, generator=g)[: len(seq_lens) * max_pages]
    dev = _dev(dtype)
    return (
        k.to(dev, dtype),
        v.to(dev, dtype),
        tables.view(len(seq_lens), max_pages).to(dev),
        torch.tensor(seq_lens, device=dev),
        g,
    )


def _sequence(cache, pages, n):
    """[kv_heads, n, d] of one sequence, float64."""
    kv_heads, d = cache.shape[1], cache.shape[3]
    return cache[pages].transpose(0, 1).reshape(kv_heads, -1, d)[:, :n].double()


def _reference(q, k, v, tables, seq_lens, q_lens):
    """Dense float64 attention per request: its q_lens[i] queries are the last positions of
    seq_lens[i] and see keys up to their own position."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads, page_size = k.shape[1], k.shape[2]
    outs, start = [], 0
    for i, (n, ql) in enumerate(zip(seq_lens.tolist(), q_lens, strict=True)):
        pages = tables[i, : -(-n // page_size)]
        keys = _sequence(k, pages, n).repeat_interleave(heads // kv_heads, 0)
        values = _sequence(v, pages, n).repeat_interleave(heads // kv_heads, 0)
        queries = q[start : start + ql].double().transpose(0, 1)  # [heads, ql, d]
        scores = queries @ keys.transpose(1, 2) * d**-0.5
        pos = torch.arange(n - ql, n, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(n, device=q.device)[None, :] > pos, -torch.inf)
        outs.append((torch.softmax(scores, -1) @ values).transpose(0, 1))
        start += ql
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_decode(group, head_dim, page_size, dtype):
    kv_heads = 2
    seq_lens = [1, 17, 40, 33]  # ragged; split into 16-key tiles below
    k, v, tables, lens, g = _paged(seq_lens, kv_heads, head_dim, page_size, dtype, seed=group)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=g).to(k.device, dtype)
    ref = _reference(q, k, v, tables, lens, [1] * len(seq_lens))
    for splits in (1, 3):
        out = kernels.paged_decode(
            q, k, v, tables, lens, head_dim**-0.5, num_splits=splits, block_n=16
        )
        torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "page_size,head_dim,group", [(1, 64, 1), (16, 64, 4), (16, 128, 8), (1, 128, 4)]
)
def test_extend_attention(page_size, head_dim, group, dtype):
    """Fresh prompts, chunks after cached prefixes that end mid-page, and a decode row."""
    kv_heads = 2
    prefixes = [0, 7, 20, 33, 0]
    q_lens = [5, 9, 1, 30, 17]
    seq_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    k, v, tables, lens, g = _paged(seq_lens, kv_heads, head_dim, page_size, dtype, seed=page_size)
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=g).to(k.device, dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=k.device)
    ref = _reference(q, k, v, tables, lens, q_lens)
    out = kernels.extend_attention(
        q, k, v, tables, qsl, lens, max(q_lens), head_dim**-0.5, block_m=16, block_n=16
    )
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def _spec_reference(q, k, v, tables, seq_lens, q_lens, scale, window, softcap):
    """``_reference`` with a layer's spec: the query at p sees keys p - window + 1 .. p
    (all up to p without a window), scores ``scale * q.k`` soft-capped when asked."""
    heads = q.shape[1]
    kv_heads, page_size = k.shape[1], k.shape[2]
    outs, start = [], 0
    for i, (n, ql) in enumerate(zip(seq_lens.tolist(), q_lens, strict=True)):
        pages = tables[i, : -(-n // page_size)]
        keys = _sequence(k, pages, n).repeat_interleave(heads // kv_heads, 0)
        values = _sequence(v, pages, n).repeat_interleave(heads // kv_heads, 0)
        queries = q[start : start + ql].double().transpose(0, 1)
        scores = queries @ keys.transpose(1, 2) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(n - ql, n, device=q.device)[:, None]
        kv = torch.arange(n, device=q.device)[None, :]
        hidden = kv > pos
        if window is not None:
            hidden |= kv <= pos - window
        scores = scores.masked_fill(hidden, -torch.inf)
        outs.append((torch.softmax(scores, -1) @ values).transpose(0, 1))
        start += ql
    return torch.cat(outs)


SPECS = [
    pytest.param((7, None, 1.0), id="window7"),
    pytest.param((1, None, 1.0), id="window1"),
    pytest.param((None, 2.0, 1.5), id="softcap-scale"),
    pytest.param((19, 3.0, 0.8), id="window19-softcap-scale"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params", SPECS)
def test_paged_decode_honours_the_spec(params, dtype):
    window, softcap, factor = params
    kv_heads, group, head_dim, page_size = 2, 4, 64, 16
    seq_lens = [1, 17, 40, 90]
    k, v, tables, lens, g = _paged(seq_lens, kv_heads, head_dim, page_size, dtype, seed=5)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=g).to(k.device, dtype)
    scale = head_dim**-0.5 * factor
    ref = _spec_reference(q, k, v, tables, lens, [1] * len(seq_lens), scale, window, softcap)
    for splits in (1, 3):
        out = kernels.paged_decode(
            q,
            k,
            v,
            tables,
            lens,
            scale,
            num_splits=splits,
            block_n=16,
            window=window,
            softcap=softcap,
        )
        torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params", SPECS)
def test_extend_attention_honours_the_spec(params, dtype):
    """Prompts longer than the window (a block's later queries see none of its first key
    tile), chunks after cached prefixes, a decode row."""
    window, softcap, factor = params
    kv_heads, group, head_dim, page_size = 2, 2, 64, 4
    prefixes = [0, 7, 20, 33, 0]
    q_lens = [5, 9, 1, 30, 40]
    seq_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    k, v, tables, lens, g = _paged(seq_lens, kv_heads, head_dim, page_size, dtype, seed=9)
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=g).to(k.device, dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=k.device)
    scale = head_dim**-0.5 * factor
    ref = _spec_reference(q, k, v, tables, lens, q_lens, scale, window, softcap)
    out = kernels.extend_attention(
        q,
        k,
        v,
        tables,
        qsl,
        lens,
        max(q_lens),
        scale,
        block_m=16,
        block_n=16,
        window=window,
        softcap=softcap,
    )
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_store_kv(page_size, dtype):
    dev = _dev(dtype)
    pages, kv_heads, d, tokens = 16, 2, 64, 11
    g = torch.Generator().manual_seed(page_size)
    k_cache = torch.zeros(pages, kv_heads, page_size, d, device=dev, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    # k/v as strided views of a fused qkv row, as the model hands them over
    qkv = torch.randn(tokens, 3 * kv_heads * d, generator=g).to(dev, dtype)
    k = qkv[:, kv_heads * d : 2 * kv_heads * d].view(tokens, kv_heads, d)
    v = qkv[:, 2 * kv_heads * d :].view(tokens, kv_heads, d)
    slots = torch.randperm(pages * page_size, generator=g)[:tokens].to(dev)
    kernels.store_kv(k_cache, v_cache, k, v, slots)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    ref_k[slots // page_size, :, slots % page_size] = k
    ref_v[slots // page_size, :, slots % page_size] = v
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


# -- int8 KV cache ----------------------------------------------------------------------------
def _int8_pages(cache: torch.Tensor):
    """A cache's int8 codes and scales (``quantize_int8``, as the CPU writer) and the float64
    pages they stand for."""
    codes, scales = quantize_int8(cache)
    return codes, scales, codes.double() * scales.double()[..., None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_store_kv_int8_equals_the_cpu_quantizer(page_size, dtype):
    """Codes and scales bitwise equal to ``quantize_int8`` (ties round to even), a zero row
    included; other slots untouched."""
    dev = _dev(dtype)
    pages, kv_heads, d, tokens = 16, 2, 64, 11
    g = torch.Generator().manual_seed(page_size)
    qkv = torch.randn(tokens, 3 * kv_heads * d, generator=g)
    qkv[3] = 0.0  # an all-zero row: scale 0, codes 0
    qkv[4, kv_heads * d : kv_heads * d + 2] = torch.tensor([127.0, 0.5])  # an exact tie
    qkv = qkv.to(dev, dtype)
    k = qkv[:, kv_heads * d : 2 * kv_heads * d].view(tokens, kv_heads, d)
    v = qkv[:, 2 * kv_heads * d :].view(tokens, kv_heads, d)
    caches = [torch.full((pages, kv_heads, page_size, d), 5, dtype=torch.int8, device=dev)]
    caches.append(caches[0].clone())
    scales = [torch.full((pages, kv_heads, page_size), 7.0, device=dev) for _ in range(2)]
    slots = torch.randperm(pages * page_size, generator=g)[:tokens].to(dev)
    kernels.store_kv(*caches, k, v, slots, k_scale=scales[0], v_scale=scales[1])
    page, offset = slots // page_size, slots % page_size
    for x, cache, scale in ((k, caches[0], scales[0]), (v, caches[1], scales[1])):
        codes, expected = quantize_int8(x)
        assert torch.equal(cache[page, :, offset], codes)
        assert torch.equal(scale[page, :, offset], expected)
        untouched = torch.ones(pages * page_size, dtype=torch.bool, device=dev)
        untouched[slots] = False
        flat = cache.transpose(1, 2).reshape(pages * page_size, kv_heads, d)
        assert bool((flat[untouched] == 5).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params", [pytest.param((None, None, 1.0), id="plain"), *SPECS[::3]])
def test_paged_decode_int8(params, dtype):
    """Over int8 pages: the float64 reference over the pages the codes stand for."""
    window, softcap, factor = params
    kv_heads, group, head_dim, page_size = 2, 4, 64, 16
    seq_lens = [1, 17, 40, 90]
    k, v, tables, lens, g = _paged(seq_lens, kv_heads, head_dim, page_size, dtype, seed=11)
    (kc, ks, kd), (vc, vs, vd) = _int8_pages(k), _int8_pages(v)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=g).to(k.device, dtype)
    scale = head_dim**-0.5 * factor
    ref = _spec_reference(q, kd, vd, tables, lens, [1] * len(seq_lens), scale, window, softcap)
    for splits in (1, 3):
        out = kernels.paged_decode(
            q, kc, vc, tables, lens, scale, num_splits=splits, block_n=16,
            window=window, softcap=softcap, k_scale=ks, v_scale=vs,
        )  # fmt: skip
        torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params", [pytest.param((None, None, 1.0), id="plain"), SPECS[3]])
def test_extend_attention_int8(params, dtype):
    window, softcap, factor = params
    kv_heads, group, head_dim, page_size = 2, 2, 64, 4
    prefixes = [0, 7, 20, 33, 0]
    q_lens = [5, 9, 1, 30, 40]
    seq_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    k, v, tables, lens, g = _paged(seq_lens, kv_heads, head_dim, page_size, dtype, seed=13)
    (kc, ks, kd), (vc, vs, vd) = _int8_pages(k), _int8_pages(v)
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=g).to(k.device, dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=k.device)
    scale = head_dim**-0.5 * factor
    ref = _spec_reference(q, kd, vd, tables, lens, q_lens, scale, window, softcap)
    out = kernels.extend_attention(
        q, kc, vc, tables, qsl, lens, max(q_lens), scale, block_m=16, block_n=16,
        window=window, softcap=softcap, k_scale=ks, v_scale=vs,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_int8_cache_without_scales_is_refused():
    k = torch.zeros(2, 1, 4, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="k_scale"):
        kernels.store_kv(k, k, torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), torch.zeros(1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_add", [False, True])
def test_add_rms_norm(with_add, dtype):
    dev = _dev(dtype)
    g = torch.Generator().manual_seed(3)
    rows, width = 5, 96  # not a power of two: masked tail
    residual = torch.randn(rows, width, generator=g).to(dev, dtype)
    add = torch.randn(rows, width, generator=g).to(dev, dtype) if with_add else None
    weight = torch.randn(width, generator=g).to(dev, dtype)
    ref_residual = residual.clone()
    ref = LayerOps(use_native=False).add_rms_norm(add, ref_residual, weight, 1e-5)
    out = kernels.add_rms_norm(add, residual, weight, 1e-5)
    torch.testing.assert_close(residual, ref_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    dev = _dev(dtype)
    x = torch.randn(4, 2 * 80, generator=torch.Generator().manual_seed(4)).to(dev, dtype)
    ref = LayerOps(use_native=False).silu_and_mul(x)
    torch.testing.assert_close(
        kernels.silu_and_mul(x, block=32), ref, atol=TOL[dtype], rtol=TOL[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary(head_dim, dtype):
    """q and k rotated together as one strided view of the fused qkv rows."""
    dev = _dev(dtype)
    heads, kv_heads, tokens = 4, 2, 6
    rope = RotaryEmbedding(head_dim, 64, 10000.0, None, dtype)
    positions = torch.tensor([0, 1, 2, 17, 40, 63])
    cos, sin = (t.to(dev) for t in rope.tables(positions))
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=torch.Generator().manual_seed(5)).to(dev, dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    ref = apply_rotary(qk, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    out = kernels.rotary(qk, cos, sin)
    assert out.data_ptr() == qk.data_ptr()  # in place
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched
