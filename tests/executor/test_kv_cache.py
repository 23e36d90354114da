"""KV writes into the paged cache: the C scatter and the PyTorch path against a plain loop
over tokens, with k/v as strided views into a fused qkv row (as the model passes them)."""

from __future__ import annotations

import pytest
import torch

from radixserve.executor.kv_cache import KVCache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_native", [True, False])
@pytest.mark.parametrize("num_tokens", [5, 300])  # 300: the multi-threaded branch
def test_write_places_every_token_at_its_slot(dtype, use_native, num_tokens):
    pages, page_size, kv_heads, heads, d = 40, 16, 3, 9, 32
    cache = KVCache(2, pages, page_size, kv_heads, d, dtype)
    cache.use_native = use_native
    if (
        use_native
        and cache._native_write(
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, kv_heads, d, dtype=dtype),
            torch.zeros(1, kv_heads, d, dtype=dtype),
        )
        is None
    ):
        pytest.skip("native kernels unavailable")
    g = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(num_tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(num_tokens, kv_heads, d)
    assert not k.is_contiguous()
    slots = torch.randperm(pages * page_size, generator=g)[:num_tokens]
    k_layer, v_layer = cache.write(1, slots, k, v)
    assert k_layer.data_ptr() == cache.k[1].data_ptr()
    assert v_layer.data_ptr() == cache.v[1].data_ptr()
    expected_k, expected_v = torch.zeros_like(cache.k[1]), torch.zeros_like(cache.v[1])
    for t, slot in enumerate(slots.tolist()):
        expected_k[slot // page_size, :, slot % page_size] = k[t]
        expected_v[slot // page_size, :, slot % page_size] = v[t]
    assert torch.equal(cache.k[1], expected_k) and torch.equal(cache.v[1], expected_v)
    assert not cache.k[0].any() and not cache.v[0].any()  # the other layer is untouched


def test_native_write_declines_what_it_cannot_address():
    cache = KVCache(1, 4, 16, 2, 8, torch.float32)
    slots = torch.arange(3)
    k = torch.randn(3, 2, 8)
    if cache._native_write(slots, k, k) is None:
        pytest.skip("native kernels unavailable")
    assert cache._native_write(slots, k.bfloat16(), k.bfloat16()) is None  # dtype differs
    assert cache._native_write(slots.int(), k, k) is None  # int32 slots
    assert cache._native_write(slots, k.transpose(1, 2).contiguous().transpose(1, 2), k) is None
