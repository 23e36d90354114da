"""The KV tiers' page copies (executor/kv_tiers.copy_pages) against indexing: runs of
consecutive pages as slice copies, scattered pages by index, and both through
TierTransfer's demotion and promotion."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.executor import kv_tiers
from radixserve.executor.kv_cache import KVCache
from radixserve.executor.kv_tiers import HostKVStore, TierTransfer, copy_pages, page_runs


def test_page_runs_split_where_either_side_jumps():
    dst = np.array([3, 4, 5, 9, 10, 2])
    src = np.array([7, 8, 0, 1, 2, 3])
    assert page_runs(dst, src) == [(3, 7, 2), (5, 0, 1), (9, 1, 2), (2, 3, 1)]
    assert page_runs(np.zeros(0, np.int32), np.zeros(0, np.int32)) == []
    with pytest.raises(ValueError):
        page_runs(np.arange(3), np.arange(2))


@pytest.mark.parametrize("layout", ["runs", "scattered", "many runs"])
def test_copy_pages_equals_indexing(layout, monkeypatch):
    rng = np.random.default_rng(0)
    src_t = torch.randn(3, 40, 2, 4, 8).to(torch.bfloat16)
    dst_t = torch.randn(3, 30, 2, 4, 8).to(torch.bfloat16)
    n = 12
    if layout == "runs":
        src = np.concatenate([np.arange(5, 10), np.arange(20, 27)])
        dst = np.concatenate([np.arange(0, 8), np.arange(17, 21)])
    else:
        src = rng.permutation(40)[:n]
        dst = rng.permutation(30)[:n]
    if layout == "many runs":  # past the limit: one gather and one scatter
        monkeypatch.setattr(kv_tiers, "_MAX_RUNS", 2)
    expected = dst_t.clone()
    expected[:, torch.from_numpy(dst)] = src_t[:, torch.from_numpy(src)]
    copy_pages(dst_t, dst, src_t, src)
    assert torch.equal(dst_t, expected)


def test_transfer_round_trip_through_host_slots():
    kv = KVCache(
        num_layers=2, num_pages=10, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16
    )
    kv.k.copy_(torch.randn_like(kv.k, dtype=torch.float32).to(kv.k.dtype))
    kv.v.copy_(torch.randn_like(kv.v, dtype=torch.float32).to(kv.v.dtype))
    before_k, before_v = kv.k.clone(), kv.v.clone()
    transfer = TierTransfer(kv, HostKVStore(kv, 16))
    pool_pages = np.array([1, 2, 3, 7, 0], dtype=np.int32)
    slots = np.array([9, 10, 4, 5, 15], dtype=np.int32)
    transfer.save(pool_pages, slots)
    kv.k.zero_()
    kv.v.zero_()
    back = np.array([6, 7, 8, 2, 3], dtype=np.int32)
    transfer.load(slots, back)
    for p, b in zip(pool_pages.tolist(), back.tolist(), strict=True):
        assert torch.equal(kv.k[:, b], before_k[:, p]) and torch.equal(kv.v[:, b], before_v[:, p])
    assert transfer.stats.host_bytes_in == transfer.stats.host_bytes_out == 5 * transfer.page_bytes
