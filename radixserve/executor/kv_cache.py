"""The KV cache tensors: allocated once, addressed by page id."""

from __future__ import annotations

import torch


def bytes_per_page(
    num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


class KVCache:
    """Keys and values of every layer: ``k[layer]`` is [num_pages, kv_heads, page_size, head_dim].

    Page-major, so gathering a batch's pages is one ``index_select`` on dim 0 copying whole
    contiguous pages, and each (page, head) block is a [page_size, head_dim] matrix ready
    for batched matmuls. Invariant: the tensors are allocated once and never reallocated; slot ``s`` is token
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
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.num_pages = num_pages

    def write(
        self,
        layer: int,
        pages: torch.Tensor,
        offsets: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store token t's k/v [T, kv_heads, head_dim] at slot ``offsets[t]`` of page
        ``pages[t]``; returns the layer's caches."""
        k_layer, v_layer = self.k[layer], self.v[layer]
        k_layer[pages, :, offsets] = k
        v_layer[pages, :, offsets] = v
        return k_layer, v_layer

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages ``src`` → ``dst`` in every layer (copy-on-write of shared pages)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
