"""CUDA graphs of decode steps: one per padded batch-size bucket, replayed with static inputs."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from radixserve.executor.cuda.attention import TritonAttention, TritonMetadata
from radixserve.executor.models.base import CausalLM


def graph_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_bs`` (and ``max_bs`` itself)."""
    sizes = [b for b in (1, 2, 4) if b <= max_bs] + list(range(8, max_bs + 1, 8))
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


@dataclass
class StagedInputs:
    """One step's index arrays on the device (views of one copied buffer)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    page_tables: torch.Tensor  # [B, max_pages of this step]


class CudaGraphRunner:
    """Decode steps (one token per request, every row sampled) of up to ``max_bs``
    requests, captured once per bucket and replayed.

    Invariants: every graph reads only the static buffers, whose first ``B`` rows a replay
    fills from the step and whose padding rows attend one position of the scratch page
    (a page the page pool never hands out) and write their K/V there; the graphs share one
    memory pool and were captured largest first. ``replay`` returns the logits rows of the
    ``B`` real requests, in the model's dtype, valid until the next replay.
    """

    def __init__(
        self,
        model: CausalLM,
        attention: TritonAttention,
        max_bs: int,
        max_pages: int,
        scratch_page: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attention = attention
        self.buckets = graph_buckets(max_bs)
        self.max_bs = max_bs
        self.page_size = attention.kv_cache.page_size
        self.scratch_slot = scratch_page * self.page_size
        self.scratch_page = scratch_page
        self.max_kv = max_pages * self.page_size
        i64 = {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros(max_bs, **i64)
        self.positions = torch.zeros(max_bs, **i64)
        self.slot_mapping = torch.full((max_bs,), self.scratch_slot, **i64)
        self.seq_lens = torch.ones(max_bs, **i64)
        self.query_start_loc = torch.arange(max_bs + 1, **i64)
        self.page_tables = torch.full((max_bs, max_pages), scratch_page, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    def _meta(self, bs: int) -> TritonMetadata:
        return TritonMetadata(
            is_decode=True,
            num_tokens=bs,
            max_q_len=1,
            num_splits=self.attention.num_splits(bs, self.max_kv),
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            page_tables=self.page_tables[:bs],
            slot_mapping=self.slot_mapping[:bs],
        )

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model.forward(
            self.input_ids[:bs], self.positions[:bs], self.attention, self._meta(bs)
        )
        return self.model.compute_logits(hidden, upcast=False)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.buckets):  # largest first: the rest reuse its memory
                for _ in range(2):  # compile the kernels, settle the allocator
                    self._forward(bs)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[bs] = self._forward(bs)
                self.graphs[bs] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        print(
            f"radixserve: captured CUDA graphs for {len(self.buckets)} decode batch sizes "
            f"(1..{self.max_bs}) in {self.capture_seconds:.1f} s",
            file=sys.stderr,
        )

    def can_run(self, num_requests: int, max_pages: int) -> bool:
        return 0 < num_requests <= self.max_bs and max_pages <= self.page_tables.shape[1]

    def replay(self, staged: StagedInputs) -> torch.Tensor:
        num = staged.input_ids.shape[0]
        bs = next(b for b in self.buckets if b >= num)
        self.input_ids[:num].copy_(staged.input_ids)
        self.positions[:num].copy_(staged.positions)
        self.slot_mapping[:num].copy_(staged.slot_mapping)
        self.seq_lens[:num].copy_(staged.seq_lens)
        self.page_tables[:num, : staged.page_tables.shape[1]].copy_(staged.page_tables)
        if bs > num:  # padding rows: one position on the scratch page
            self.input_ids[num:bs].zero_()
            self.positions[num:bs].zero_()
            self.slot_mapping[num:bs].fill_(self.scratch_slot)
            self.seq_lens[num:bs].fill_(1)
            self.page_tables[num:bs, 0].fill_(self.scratch_page)
        self.graphs[bs].replay()
        return self.logits[bs][:num]
