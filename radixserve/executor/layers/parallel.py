"""Tensor parallelism as layers: a model built with a ``TensorParallel`` holds one rank's
part (the loader's ``ShardLayout`` cut its weights) and computes the whole model's function.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from radixserve.executor.layers.linear import LinearLike


class Collectives(Protocol):
    """What the parallel layers need of the group: an in-place sum across ranks and an
    all-gather (the list holds every rank's tensor, in rank order)."""

    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> None: ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


class TensorParallel:
    """This rank's place in the group: ``group`` (None: one rank, every call a no-op),
    its vocabulary rows ``vocab_start .. vocab_start + vocab_shard`` and the real vocabulary
    size ``vocab_size`` (the last shard is zero-padded past it).

    Invariant: ``reduce`` of a row-parallel projection's partial output is the full output
    on every rank; every method is a collective when ``group`` is set (all ranks call it
    in the same order on tensors of the same shapes)."""

    def __init__(
        self,
        group: Collectives | None = None,
        vocab_start: int = 0,
        vocab_shard: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.group = group
        self.vocab_start = vocab_start
        self.vocab_shard = vocab_shard
        self.vocab_size = vocab_size

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else self.group.world_size

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Row-parallel output: the sum over ranks, in place (the tensor itself at TP=1)."""
        if self.group is not None:
            self.group.all_reduce(partial)
        return partial

    def embedding(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: each rank holds rows ``vocab_start ..`` of the table,
        fills the rows of its own ids (zeros elsewhere), and the sum across ranks is the
        full embedding. A fresh [T, hidden] tensor, equal on every rank."""
        if self.group is None:
            return F.embedding(ids, table)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= table.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), table)
        out.masked_fill_(outside.unsqueeze(1), 0.0)
        return self.reduce(out)

    def logits(self, head: LinearLike, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over this rank's vocabulary rows, every rank's slice gathered for
        the given rows and cut back to ``vocab_size``: [S, vocab_size] on every rank."""
        local = head(hidden)
        if self.group is None:
            return local
        logits = torch.cat(self.group.all_gather(local.contiguous()), dim=1)
        return logits[:, : self.vocab_size].contiguous()
