"""The int8 KV cache (``--kv-cache-dtype int8``): codes and per-token-head scales against
float64, writes at their slots, copy-on-write with the scales, the page size it costs, and
the attention paths over it (decodes and chunks extending cached KV) against a dense
float64 reference over the same dequantized keys and values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.executor.attention import TorchNativeAttention
from radixserve.executor.forward_batch import ForwardBatch
from radixserve.executor.kv_cache import (
    KVCache,
    QuantizedPages,
    bytes_per_page,
    quantize_int8,
)
from radixserve.executor.native import cpu_tiers, load_paged_decode, paged_decode_int8
from tests.executor.test_attention import _dense_causal_reference


def test_codes_come_back_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 96, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, 96)
    x[3, 2] = 0.0  # an all-zero row: scale 0, codes 0
    codes, scale = quantize_int8(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32
    assert codes.abs().max() <= 127 and scale[3, 2] == 0 and not codes[3, 2].any()
    back = codes.double() * scale.double()[..., None]
    step = scale.double()[..., None]
    # rounding to the nearest code: at most half a step off (plus float32's scale rounding)
    assert torch.all((back - x).abs() <= 0.5 * step * (1 + 1e-6) + 1e-30)
    # each row's largest magnitude maps to +-127 exactly
    rows = x.abs().amax(-1) > 0
    assert torch.all(codes.abs().amax(-1)[rows] == 127)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("use_native", [True, False])
def test_writes_land_at_their_slots_with_their_scales_and_pages_copy_whole(use_native, dtype):
    """The C writer (``kv_write_int8_*``) and the PyTorch one give the same codes and
    scales, at the right slots, from k/v rows that are views into a fused qkv row."""
    pages, page_size, kv_heads, d = 12, 4, 2, 16
    cache = KVCache(2, pages, page_size, kv_heads, d, dtype, kv_cache_dtype="int8")
    cache.use_native = use_native
    assert cache.k.dtype == torch.int8 and cache.k_scale is not None
    if use_native and cache._kv_write_int8 is None:
        pytest.skip("native kernels unavailable")
    g = torch.Generator().manual_seed(1)
    slots = torch.randperm(pages * page_size, generator=g)[:9]
    qkv = torch.randn(9, 5 * kv_heads * d, generator=g).to(dtype) * 3
    k = qkv[:, kv_heads * d : 2 * kv_heads * d].view(9, kv_heads, d)
    v = qkv[:, 3 * kv_heads * d : 4 * kv_heads * d].view(9, kv_heads, d)
    assert not k.is_contiguous() and cache._native_int8_ok(slots, k, v) == use_native
    k_pages, v_pages = cache.write(1, slots, k, v)
    assert v_pages.codes.data_ptr() == cache.v[1].data_ptr()
    assert isinstance(k_pages, QuantizedPages) and k_pages.dtype == dtype
    assert k_pages.codes.data_ptr() == cache.k[1].data_ptr()  # views, not copies
    every = k_pages.index_select(0, torch.arange(pages))
    assert every.shape == (pages, kv_heads, page_size, d) and every.dtype == dtype
    for t, slot in enumerate(slots.tolist()):
        codes, scale = quantize_int8(k[t])
        page, offset = slot // page_size, slot % page_size
        assert torch.equal(cache.k[1, page, :, offset], codes)
        assert torch.equal(cache.k_scale[1, page, :, offset], scale)
        assert torch.equal(cache.v[1, page, :, offset], quantize_int8(v[t])[0])
        want = (codes.float() * scale[:, None]).to(dtype)
        assert torch.equal(every[page, :, offset], want)
    assert not cache.k[0].any() and not cache.k_scale[0].any()  # the other layer untouched
    first = int(slots[0]) // page_size
    src, dst = torch.tensor([first]), torch.tensor([(first + 1) % pages])
    cache.copy_pages(src, dst)
    assert torch.equal(cache.k[:, dst], cache.k[:, src])
    assert torch.equal(cache.v_scale[:, dst], cache.v_scale[:, src])
    assert cache.v_scale[1, first].any()  # (a written page: the copy moved scales)


def test_an_int8_page_costs_a_byte_a_value_and_a_scale_a_token_head():
    bf16 = bytes_per_page(30, 3, 64, 16, torch.bfloat16)
    int8 = bytes_per_page(30, 3, 64, 16, torch.bfloat16, "int8")
    assert int8 == 2 * 30 * 16 * 3 * (64 + 4)
    assert bf16 / int8 == pytest.approx(128 / 68)  # 1.88x the pages; 1.94x at head_dim 128
    cache = KVCache(30, 5, 16, 3, 64, torch.bfloat16, kv_cache_dtype="int8")
    held = sum(
        t.numel() * t.element_size() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale)
    )
    assert held == 5 * int8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVCache(1, 1, 16, 1, 8, torch.float32, kv_cache_dtype="fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_native", [False, True])
@pytest.mark.parametrize("path", ["explicit", "padded-sdpa", "decode-only"])
def test_attention_reads_the_int8_pages_it_wrote(path, use_native, dtype, monkeypatch):
    """Chunks extending cached KV and decodes over an int8 cache, through each PyTorch
    prompt path, the decodes in PyTorch or in C (``paged_decode_int8``; the C prefill
    kernel does not read int8 pages: the backend does not take it): equal to a float64
    reference over the same dequantized keys and values, and within the codes' error of
    one over the exact ones."""
    import radixserve.executor.attention as attention

    if path == "padded-sdpa":
        monkeypatch.setattr(attention, "_SMALL_CONTEXT", 0)
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, d, page_size = 6, 2, 32, 4
    if path == "decode-only":
        seq_lens, q_lens = [23, 30, 12], [1, 1, 1]
    else:
        seq_lens, q_lens = [23, 30, 12], [5, 9, 1]  # two chunks on cached KV, a decode
    b = len(seq_lens)
    max_pages = -(-max(seq_lens) // page_size)
    num_pages = b * max_pages
    cache = KVCache(1, num_pages, page_size, kv_heads, d, dtype, kv_cache_dtype="int8")
    tables = torch.randperm(num_pages, generator=g).view(b, max_pages)
    # every position's exact keys and values; the cached ones written before the step
    exact_k = torch.randn(num_pages, kv_heads, page_size, d, generator=g).to(dtype)
    exact_v = torch.randn(num_pages, kv_heads, page_size, d, generator=g).to(dtype)

    def slots_of(i: int, positions: np.ndarray) -> np.ndarray:
        return tables.numpy()[i, positions // page_size] * page_size + positions % page_size

    for i, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        cached = slots_of(i, np.arange(n - ql))
        s = torch.from_numpy(cached)
        pages, offsets = s // page_size, s % page_size
        cache.write(0, s, exact_k[pages, :, offsets], exact_v[pages, :, offsets])
    positions = np.concatenate(
        [np.arange(n - ql, n) for n, ql in zip(seq_lens, q_lens, strict=True)]
    )
    req = np.repeat(np.arange(b), q_lens)
    slots = tables.numpy()[req, positions // page_size] * page_size + positions % page_size
    s = torch.from_numpy(slots)
    new_k = exact_k[s // page_size, :, s % page_size]
    new_v = exact_v[s // page_size, :, s % page_size]
    total = sum(q_lens)
    q = torch.randn(total, heads, d, generator=g).to(dtype)
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    batch = ForwardBatch(
        input_ids=np.zeros(total, dtype=np.int64),
        positions=positions,
        q_lens=np.array(q_lens),
        seq_lens=np.array(seq_lens),
        query_start_loc=starts,
        page_tables=tables.numpy(),
        slot_mapping=slots,
        logits_indices=starts[1:] - 1,
        page_size=page_size,
    )
    backend = TorchNativeAttention(cache, heads, d, use_native=use_native)
    assert backend.native_prefill is None
    if use_native and backend.native is None:
        pytest.skip("native kernels unavailable")
    out = backend.forward(0, q, new_k, new_v, backend.prepare(batch)).view(total, heads, d)
    every = torch.arange(num_pages)
    k_deq = QuantizedPages(cache.k[0], cache.k_scale[0], torch.float64).index_select(0, every)
    v_deq = QuantizedPages(cache.v[0], cache.v_scale[0], torch.float64).index_select(0, every)
    ref = _dense_causal_reference(q, k_deq, v_deq, tables, seq_lens, q_lens)
    # float32: to float32's rounding; bfloat16: the output's own rounding (and, on the
    # PyTorch paths, the dequantized pages rounded to bfloat16)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    exact = _dense_causal_reference(q, exact_k, exact_v, tables, seq_lens, q_lens)
    # (codes of N(0, 1) values: a step of ~0.03)
    assert (out.double() - exact).abs().max() < (0.05 if dtype == torch.float32 else 0.08)


@pytest.mark.parametrize("tier", cpu_tiers())
def test_int8_decode_kernel_in_every_tier_this_cpu_runs(tier):
    """``paged_decode_int8`` built for each tier: a sliding window, a soft cap, grouped
    heads and a partly filled last page, against float64 over the dequantized pages."""
    lib = load_paged_decode(tier)
    if lib is None:
        pytest.skip("no C compiler, or native kernels turned off")
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, d, page_size, num_pages = 8, 2, 64, 16, 12
    cache = KVCache(1, num_pages, page_size, kv_heads, d, torch.float32, kv_cache_dtype="int8")
    slots = torch.arange(num_pages * page_size)
    x = torch.randn(len(slots), kv_heads, d, generator=g)
    cache.write(0, slots, x, x.flip(0))
    tables = torch.randperm(num_pages, generator=g).view(2, 6).int()
    seq_lens = torch.tensor([93, 50], dtype=torch.int32)
    q = torch.randn(2, heads, d, generator=g)
    every = torch.arange(num_pages)
    k = QuantizedPages(cache.k[0], cache.k_scale[0], torch.float64).index_select(0, every)
    v = QuantizedPages(cache.v[0], cache.v_scale[0], torch.float64).index_select(0, every)
    for window, softcap in ((None, None), (40, None), (None, 5.0)):
        out = paged_decode_int8(
            lib, q, cache.k[0], cache.v[0], cache.k_scale[0], cache.v_scale[0], tables,
            seq_lens, d**-0.5, window=window, softcap=softcap,
        )  # fmt: skip
        for b in range(2):
            n = int(seq_lens[b])
            keys = k[tables[b].long()].transpose(0, 1).reshape(kv_heads, -1, d)[:, :n]
            values = v[tables[b].long()].transpose(0, 1).reshape(kv_heads, -1, d)[:, :n]
            lo = 0 if window is None else max(0, n - window)
            keys = keys[:, lo:].repeat_interleave(heads // kv_heads, 0)
            values = values[:, lo:].repeat_interleave(heads // kv_heads, 0)
            scores = (q[b].double()[:, None] @ keys.transpose(1, 2))[:, 0] * d**-0.5
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            want = (torch.softmax(scores, -1)[:, None] @ values)[:, 0]
            torch.testing.assert_close(out[b].double(), want, atol=2e-5, rtol=2e-5)
