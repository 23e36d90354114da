"""The KV cache tensors: allocated once, addressed by page id."""

from __future__ import annotations

import torch

from radixserve.executor.native import load_elementwise


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
        # the C scatter for writes when available (False: always the PyTorch path)
        self.use_native = True

    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store token t's k/v [T, kv_heads, head_dim] at slot ``slots[t]`` (int64); returns
        the layer's caches. k and v may be row-strided views (into a fused qkv row)."""
        k_layer, v_layer = self.k[layer], self.v[layer]
        native = self._native_write(slots, k, v)
        if native is not None:
            num_tokens, kv_heads, head_dim = k.shape
            native(
                k.data_ptr(),
                v.data_ptr(),
                k.stride(0) * k.element_size(),
                v.stride(0) * v.element_size(),
                k_layer.data_ptr(),
                v_layer.data_ptr(),
                slots.data_ptr(),
                num_tokens,
                kv_heads,
                self.page_size,
                head_dim * k.element_size(),
                torch.get_num_threads(),
            )
            return k_layer, v_layer
        pages, offsets = slots // self.page_size, slots % self.page_size
        k_layer[pages, :, offsets] = k
        v_layer[pages, :, offsets] = v
        return k_layer, v_layer

    def _native_write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """The C scatter (``elementwise.c``'s ``kv_write``) when it applies: CPU tensors of
        the cache's dtype whose heads are contiguous within a token row."""
        if not self.use_native or self.k.device.type != "cpu":
            return None
        lib = load_elementwise()
        if lib is None or slots.dtype != torch.int64 or not slots.is_contiguous():
            return None
        _, _, kv_heads, _, head_dim = self.k.shape
        for t in (k, v):
            if (
                t.dtype != self.k.dtype
                or t.shape[1:] != (kv_heads, head_dim)
                or t.stride(2) != 1
                or t.stride(1) != head_dim
                or t.device.type != "cpu"
            ):
                return None
        return lib.kv_write

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages ``src`` → ``dst`` in every layer (copy-on-write of shared pages)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
