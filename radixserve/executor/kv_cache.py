"""The KV cache tensors: allocated once, addressed by page id."""

from __future__ import annotations

import torch


def bytes_per_page(
    num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


class KVCache:
    """Keys and values of every layer: ``k[layer]`` is [kv_heads, num_pages, page_size, head_dim].

    Head-major, so gathering a batch's pages (``index_select`` on dim 1) gives each head's
    keys as one contiguous [batch, kv_len, head_dim] block, ready for batched matmuls.
    Invariant: the tensors are allocated once and never reallocated; slot ``s`` is token
    ``s % page_size`` of page ``s // page_size``.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.num_pages = num_pages

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [T, kv_heads, head_dim] at ``slot_mapping``; returns the layer's caches."""
        k_layer, v_layer = self.k[layer], self.v[layer]
        heads, _, _, head_dim = k_layer.shape
        k_layer.view(heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
        v_layer.view(heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))
        return k_layer, v_layer

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages ``src`` → ``dst`` in every layer (copy-on-write of shared pages)."""
        self.k[:, :, dst] = self.k[:, :, src]
        self.v[:, :, dst] = self.v[:, :, src]
