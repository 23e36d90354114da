"""Dense layers: y = x @ W^T (+ b), through oneDNN's prepacked weights for bfloat16 on CPU."""

from __future__ import annotations

import torch

from radixserve.executor import batch_invariant, gemm

_PACK_BATCH_HINT = 256  # oneDNN picks the packed layout for about this many rows


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and not gemm.float32_products()  # below AVX-512 the plain weight serves both paths
    )


class Linear:
    """A weight [out, in] (and bias) applied to [T, in] inputs.

    Invariant: ``__call__`` computes ``F.linear(x, weight, bias)``; with bfloat16 weights on
    CPU it goes through a weight reordered once for oneDNN (about 10% faster than
    ``F.linear`` here), else through ``gemm.linear`` (``F.linear``, or float32 products of
    many rows below the AVX-512 kernel tiers: ``executor/gemm.py``). A reordered layer keeps
    only the reordered copy (``weight`` rebuilds the plain one on demand), so its weights take their
    size once, not twice; unless ``shared``: a weight that lives on elsewhere anyway (a
    tied LM head's embedding table) stays referenced, and the reordered one is its copy.
    """

    __slots__ = ("_invariant", "_shared", "_weight", "bias", "packed")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, shared: bool = False
    ) -> None:
        self.bias = bias
        self._shared = shared
        self.weight = weight
        # deterministic mode's copies of the weight (batch_invariant.DensePanels), by row dtype
        self._invariant: dict[torch.dtype, batch_invariant.DensePanels] = {}

    @property
    def weight(self) -> torch.Tensor:
        """The plain [out, in] weight (a new tensor each time for a reordered layer)."""
        if self._weight is not None:
            return self._weight
        assert self.packed is not None
        return self.packed.to_dense()

    @weight.setter
    def weight(self, weight: torch.Tensor) -> None:
        self._weight, self.packed = weight, None
        if _can_pack(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
            except RuntimeError:  # an older oneDNN without this reorder: plain path
                self.packed = None
            else:
                if not self._shared:
                    self._weight = None

    @property
    def plain_weight(self) -> torch.Tensor | None:
        """The plain weight this layer holds, if it holds one (None when only reordered)."""
        return self._weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if batch_invariant.on():
            return batch_invariant.dense(self._invariant, lambda: self.weight, self.bias, x)
        if self.packed is not None and x.dtype == torch.bfloat16:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return gemm.linear(x, self.weight, self.bias)
