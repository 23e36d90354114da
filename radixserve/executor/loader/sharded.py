"""Tensor-parallel shards of a Llama-family checkpoint: which rows and columns rank r keeps,
read without loading the whole model (safetensors slices; GGUF one tensor at a time)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixserve.executor.layers.parallel import Collectives, TensorParallel
from radixserve.executor.loader import Checkpoint
from radixserve.executor.loader.gguf_loader import load_gguf
from radixserve.executor.loader.safetensors_loader import read_hf_config, safetensors_files
from radixserve.executor.model_config import ModelConfig

# read(rows, cols) -> that part of one tensor (None: all of that dim); 1-D tensors: cols None
Reader = Callable[[slice | None, slice | None], torch.Tensor]


@dataclass(frozen=True)
class ShardLayout:
    """How rank ``rank`` of ``world_size`` splits a model of ``config``.

    Invariants (H heads, K kv heads, N ranks; N divides H, else ``ValueError``):
      * rank r owns query heads ``r * H/N ..`` (column-parallel q, row-parallel o);
      * its KV heads are ``kv_head_ids``: every block of ``kv_group`` consecutive local query
        heads reads one local kv head, which is the global kv head those query heads read
        (kv heads are split when N divides K, replicated when K < N; in general
        ``kv_group = gcd(H/N, H/K)``);
      * it owns intermediate rows ``inter_start .. inter_end`` (gate/up column-parallel,
        down row-parallel; the split may be uneven);
      * it owns vocabulary rows ``vocab_start .. vocab_start + vocab_shard`` of the embedding
        and LM head, zero-padded past ``vocab_size`` so every rank's shard has the same
        size (the gathered logits are cut back to ``vocab_size``).
    """

    config: ModelConfig
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        c, n = self.config, self.world_size
        if n < 1 or not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} is not in a group of {n}")
        if c.moe is not None and n > 1:
            raise ValueError(
                f"{c.architecture} is a mixture of experts: tensor parallelism does not "
                "split experts yet; run it with tensor_parallel_size 1 (data parallelism "
                "replicates it whole)"
            )
        if c.num_attention_heads % n:
            raise ValueError(
                f"tensor_parallel_size {n} does not divide the model's "
                f"{c.num_attention_heads} attention heads; use a divisor of it"
            )
        if c.intermediate_size < n or c.vocab_size < n:
            raise ValueError(f"tensor_parallel_size {n} is larger than the model's layers allow")

    @property
    def heads(self) -> int:
        return self.config.num_attention_heads // self.world_size

    @property
    def head_start(self) -> int:
        return self.rank * self.heads

    @property
    def kv_group(self) -> int:
        c = self.config
        return math.gcd(self.heads, c.num_attention_heads // c.num_key_value_heads)

    @property
    def kv_heads(self) -> int:
        return self.heads // self.kv_group

    @property
    def kv_head_ids(self) -> list[int]:
        group = self.config.num_attention_heads // self.config.num_key_value_heads
        return [(self.head_start + j * self.kv_group) // group for j in range(self.kv_heads)]

    @property
    def inter_start(self) -> int:
        return self.rank * self.config.intermediate_size // self.world_size

    @property
    def inter_end(self) -> int:
        return (self.rank + 1) * self.config.intermediate_size // self.world_size

    @property
    def vocab_shard(self) -> int:
        return -(-self.config.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    def local_config(self) -> ModelConfig:
        """The config of this rank's part of the model (what its layers' shapes say)."""
        return dataclasses.replace(
            self.config,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.inter_end - self.inter_start,
            vocab_size=self.vocab_shard,
        )

    def tensor_parallel(self, group: Collectives) -> TensorParallel:
        """The parallel layers' view of this rank in ``group``."""
        return TensorParallel(group, self.vocab_start, self.vocab_shard, self.config.vocab_size)

    def shard(self, name: str, read: Reader) -> torch.Tensor:
        """This rank's part of tensor ``name`` (Hugging Face name), a fresh tensor."""
        d = self.config.head_dim
        leaf = name.rsplit(".", 2)
        kind = ".".join(leaf[-2:])  # e.g. "q_proj.weight"
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            end = min(self.vocab_start + self.vocab_shard, self.config.vocab_size)
            part = read(slice(self.vocab_start, end), None)
            if part.shape[0] < self.vocab_shard:
                pad = part.new_zeros(self.vocab_shard - part.shape[0], *part.shape[1:])
                part = torch.cat([part, pad])
        elif kind == "qkv_proj.weight":  # fused q, k, v rows (Phi-3): each cut as its own
            c = self.config
            q_size, kv_size = c.num_attention_heads * d, c.num_key_value_heads * d
            part = torch.cat(
                [
                    self.shard("q_proj.weight", _offset_rows(read, 0)),
                    self.shard("k_proj.weight", _offset_rows(read, q_size)),
                    self.shard("v_proj.weight", _offset_rows(read, q_size + kv_size)),
                ]
            )
        elif kind == "gate_up_proj.weight":  # fused gate, up rows (Phi-3)
            inter = self.config.intermediate_size
            part = torch.cat(
                [
                    self.shard("gate_proj.weight", _offset_rows(read, 0)),
                    self.shard("up_proj.weight", _offset_rows(read, inter)),
                ]
            )
        elif kind in ("q_proj.weight", "q_proj.bias"):
            part = read(slice(self.head_start * d, (self.head_start + self.heads) * d), None)
        elif kind in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
            ids = self.kv_head_ids
            first, last = ids[0], ids[-1] + 1
            part = read(slice(first * d, last * d), None)
            if ids != list(range(first, last)):  # replicated within this rank
                rows = part.view(last - first, d, *part.shape[1:])
                part = rows[torch.tensor(ids) - first].reshape(-1, *part.shape[1:])
        elif kind == "o_proj.weight":
            part = read(None, slice(self.head_start * d, (self.head_start + self.heads) * d))
        elif kind in ("gate_proj.weight", "up_proj.weight"):
            part = read(slice(self.inter_start, self.inter_end), None)
        elif kind == "down_proj.weight":
            part = read(None, slice(self.inter_start, self.inter_end))
        else:  # norms (and q/k norms, per head_dim): every rank holds them whole
            part = read(None, None)
        return part.clone(memory_format=torch.contiguous_format)  # never a view of the whole

    def shard_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``shard`` of a tensor already in memory."""
        return self.shard(name, _tensor_reader(tensor))


def _offset_rows(read: Reader, offset: int) -> Reader:
    """``read`` of the rows starting at ``offset`` (one part of a fused tensor)."""

    def part(rows: slice | None, cols: slice | None) -> torch.Tensor:
        assert rows is not None, "a fused tensor's part is read by row ranges"
        return read(slice(offset + rows.start, offset + rows.stop), cols)

    return part


def _tensor_reader(tensor: torch.Tensor) -> Reader:
    def read(rows: slice | None, cols: slice | None) -> torch.Tensor:
        out = tensor if rows is None else tensor[rows]
        return out if cols is None else out[:, cols]

    return read


def load_sharded_checkpoint(
    kind: str, path: Path, rank: int, world_size: int
) -> tuple[Checkpoint, ShardLayout]:
    """Rank ``rank``'s shard of the checkpoint at ``path`` (``kind``: hf or gguf) and the
    layout it follows. Safetensors: only this rank's slices are read from the files. GGUF:
    each tensor is decoded whole (GGUF blocks are not sliceable in general), cut, and
    dropped before the next, so memory peaks at the shard plus one tensor."""
    if kind == "gguf":
        layouts: list[ShardLayout] = []

        def select(hf_config: dict[str, Any]) -> Callable[[str, torch.Tensor], torch.Tensor]:
            layouts.append(ShardLayout(ModelConfig.from_hf_dict(hf_config), rank, world_size))
            return layouts[0].shard_tensor

        contents = load_gguf(path, select)
        checkpoint = Checkpoint(
            contents.hf_config, contents.weights, contents.metadata, contents.tensor_types
        )
        return checkpoint, layouts[0]
    hf_config = read_hf_config(path)
    layout = ShardLayout(ModelConfig.from_hf_dict(hf_config), rank, world_size)
    return Checkpoint(hf_config, load_safetensors_shard(path, layout)), layout


def load_safetensors_shard(folder: Path, layout: ShardLayout) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    weights: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)

                    def read(rows: slice | None, cols: slice | None, name: str = name):
                        if rows is None and cols is None:
                            return f.get_tensor(name)
                        part = f.get_slice(name)
                        return part[rows] if cols is None else part[:, cols]

                    weights[name] = layout.shard(name, read)
        except (SafetensorError, OSError) as exc:
            raise ValueError(
                f"cannot read {path}: corrupt or not a safetensors file ({exc})"
            ) from None
    return weights
