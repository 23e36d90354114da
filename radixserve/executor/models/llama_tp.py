"""The Llama-family decoder split across a tensor-parallel group (one rank's part)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from radixserve.executor.layer_ops import LayerOps
from radixserve.executor.loader.sharded import ShardLayout
from radixserve.executor.models.llama import LlamaForCausalLM


class Collectives(Protocol):
    """What the parallel layers need of the group: an in-place sum across ranks and an
    all-gather (the list holds every rank's tensor, in rank order)."""

    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> None: ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


class AllReduceLayerOps(LayerOps):
    """``LayerOps`` whose residual add first sums the sublayer output across the group; the
    ops themselves are ``inner``'s (the C kernels on CPU, Triton on the CUDA path).

    Invariant: every ``add`` reaching ``add_rms_norm`` in ``LlamaForCausalLM.forward`` is the
    output of a row-parallel projection (o or down), a partial sum on each rank; the
    all-reduce makes it the full output, so the residual stream is the same on every rank
    and equal to the single-rank model's."""

    def __init__(self, group: Collectives, inner: LayerOps | None = None) -> None:
        # not LayerOps.__init__: every op is inner's
        self.group = group
        self.inner = inner or LayerOps()

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.silu_and_mul(x)

    def add_rms_norm(
        self, add: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if add is not None:
            self.group.all_reduce(add)
        return self.inner.add_rms_norm(add, residual, weight, eps)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        return self.inner.rotary(x, cos, sin_signed)


class TensorParallelLlama(LlamaForCausalLM):
    """One rank's part of the model: its heads, kv heads, MLP rows and vocabulary rows (see
    ``ShardLayout``); ``config`` is the local config, ``full_config`` the model's.

    Invariant: ``forward`` returns, on every rank, the hidden states of the whole model
    (the same function as ``LlamaForCausalLM`` of ``full_config``); ``compute_logits``
    returns the full-vocabulary logits on every rank. Every call is a collective: all ranks
    make the same calls, in the same order, on rows of the same shapes.
    """

    def __init__(
        self,
        layout: ShardLayout,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        group: Collectives,
    ) -> None:
        super().__init__(layout.local_config(), weights, dtype, ops=AllReduceLayerOps(group))
        self.layout = layout
        self.full_config = layout.config
        self.group = group

    def use_layer_ops(self, ops: LayerOps) -> None:
        """``ops`` with the row-parallel all-reduce still folded into the residual add."""
        self.ops = AllReduceLayerOps(self.group, ops)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: each rank fills the rows of its own ids, zeros
        elsewhere, and the sum across ranks is the full embedding."""
        local = input_ids - self.layout.vocab_start
        outside = (local < 0) | (local >= self.layout.vocab_shard)
        out = F.embedding(local.masked_fill(outside, 0), self.embed)
        out.masked_fill_(outside.unsqueeze(1), 0.0)
        self.group.all_reduce(out)
        return out

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Each rank's vocabulary slice, gathered for the given rows only, cut to the real
        vocabulary (the padding of the last shard dropped)."""
        local = self.lm_head(hidden).contiguous()
        logits = torch.cat(self.group.all_gather(local), dim=1)
        logits = logits[:, : self.full_config.vocab_size].contiguous()
        return logits.float() if upcast else logits
