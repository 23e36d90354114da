"""The model runner of the CUDA path: staged inputs, Triton attention, CUDA graphs, sampling
on the device, one device-to-host copy per step."""

from __future__ import annotations

import logging

import numpy as np
import torch

from radixserve.core.page_table import PageTable
from radixserve.executor.cuda.attention import (
    TritonAttention,
    TritonHostMetadata,
    TritonMetadata,
)
from radixserve.executor.cuda.graph_runner import CudaGraphRunner, StagedInputs
from radixserve.executor.cuda.lora_step import CudaLoRAStep, LoRAStacks
from radixserve.executor.cuda.sampler import DeviceSampler
from radixserve.executor.forward_batch import ForwardBatch
from radixserve.executor.future_tokens import FutureTokens
from radixserve.executor.kv_cache import KVCache
from radixserve.executor.model_runner import ModelRunner, _ModelInputs, _rows
from radixserve.executor.models.base import CausalLM

log = logging.getLogger(__name__)


class CudaModelRunner(ModelRunner):
    """``ModelRunner`` for a model, KV cache and sampler on ``device`` (a GPU; CPU tensors
    work too under the Triton interpreter, which is how CI runs it).

    Invariants (beyond ``ModelRunner``'s): the step's index arrays reach the device in one
    non-blocking copy from a pinned buffer, which is not rewritten before that copy is done;
    a step synchronises with the host once, when it copies its sampled token ids back (and
    again only for logprobs asked for); a decode-only step whose every row is sampled
    replays a CUDA graph when ``graphs`` is set and the batch fits a bucket, else runs
    eagerly with the same kernels. ``step_events`` (when a list): a (start, end) CUDA event
    pair per step, for measuring device busy time. The step's model work goes through
    ``forward_step`` / ``prompt_logits`` like ``ModelRunner``'s (so the tensor-parallel
    mixin and worker drive this runner as they drive the CPU one).
    """

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        page_table: PageTable | None,
        sampler: DeviceSampler | None,
        device: torch.device,
        scratch_page: int,
        cuda_graph_max_bs: int | None = None,
        max_rows: int | None = None,
    ) -> None:
        # not ModelRunner.__init__: that builds the CPU attention backend
        self.model = model
        self.kv_cache = kv_cache
        self.page_table = page_table
        self.sampler = sampler
        self.future = FutureTokens(max_rows or _rows(page_table))
        self.device = device
        self._lora_stacks = LoRAStacks(device)  # the LoRA adapter sets' stacked weights
        c = model.config
        self.attention = TritonAttention(
            kv_cache, c.num_attention_heads, c.head_dim, model.attention_specs()
        )
        self._pinned = device.type == "cuda"
        self._staging = torch.empty(0, dtype=torch.int64)
        self._staged_event: torch.cuda.Event | None = None
        self.step_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # this step's
        self.graphs: CudaGraphRunner | None = None
        if cuda_graph_max_bs and device.type == "cuda" and c.moe is not None:
            # the router's choices are read on the host (one GEMM pair per chosen expert): a
            # graph would freeze one step's routing, and capture forbids the read
            log.info("CUDA graphs are off for a mixture-of-experts model")
            cuda_graph_max_bs = 0
        if cuda_graph_max_bs and device.type == "cuda":
            assert page_table is not None
            self.graphs = CudaGraphRunner(
                model,
                self.attention,
                min(cuda_graph_max_bs, page_table.table.shape[0]),
                page_table.table.shape[1],
                scratch_page,
                device,
            )
            self.graphs.capture()

    # -- inputs -----------------------------------------------------------------------------
    def _stage(self, input_ids: np.ndarray, fb: ForwardBatch) -> StagedInputs:
        parts = (
            input_ids,
            fb.positions,
            fb.slot_mapping,
            fb.logits_indices,
            fb.query_start_loc,
            fb.seq_lens,
            fb.page_tables.reshape(-1),
        )
        sizes = [int(p.size) for p in parts]
        total = sum(sizes)
        if self._staged_event is not None:
            self._staged_event.synchronize()  # the last step's copy has left the buffer
        if self._staging.numel() < total:
            self._staging = torch.empty(
                max(total, 2 * self._staging.numel()), dtype=torch.int64, pin_memory=self._pinned
            )
        host = self._staging.numpy()
        offset = 0
        for part, size in zip(parts, sizes, strict=True):
            host[offset : offset + size] = part
            offset += size
        if self._pinned:
            flat = self._staging[:total].to(self.device, non_blocking=True)
            self._staged_event = torch.cuda.Event()
            self._staged_event.record()
        else:
            flat = self._staging[:total].clone()
        ids, positions, slots, logits_idx, qsl, seq_lens, tables = torch.split(flat, sizes)
        return StagedInputs(
            ids,
            positions,
            slots,
            logits_idx,
            qsl,
            seq_lens,
            tables.view(fb.page_tables.shape),
        )

    # -- device side ----------------------------------------------------------------------
    def _compute(self, inputs: _ModelInputs):  # type: ignore[override]
        if self.step_events is not None:
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self._events[0].record()
        return super()._compute(inputs)

    def forward_step(
        self,
        fb: ForwardBatch,
        input_ids: np.ndarray,
        copies: tuple[torch.Tensor, torch.Tensor] | None,
        meta: object,
        logits: bool,
        upcast: bool,
        graph_ok: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        host: TritonHostMetadata = meta  # type: ignore[assignment]
        if copies is not None:
            src, dst = copies
            self.kv_cache.copy_pages(src.to(self.device), dst.to(self.device))
        staged = self._stage(input_ids, fb)
        num = fb.num_requests
        if (
            self.graphs is not None
            and fb.lora is None  # (a graph holds no LoRA products)
            and host.is_decode
            and logits
            and graph_ok
            and self.graphs.can_run(num, fb.page_tables.shape[1])
        ):
            out = self.graphs.replay(staged)
            return None, (out.float() if upcast else out)
        triton_meta = TritonMetadata(
            is_decode=host.is_decode,
            num_tokens=host.num_tokens,
            max_q_len=host.max_q_len,
            num_splits=self.attention.num_splits(num, host.max_seq_len),
            query_start_loc=staged.query_start_loc,
            seq_lens=staged.seq_lens,
            page_tables=staged.page_tables,
            slot_mapping=staged.slot_mapping,
        )
        if fb.lora is not None:
            self.model.lora_step = CudaLoRAStep(  # type: ignore[assignment]
                fb.lora, fb.num_tokens, self.device, self._lora_stacks
            )
        try:
            hidden = self.model.forward(
                staged.input_ids, staged.positions, self.attention, triton_meta
            )
        finally:
            self.model.lora_step = None
        out = None
        if logits:
            out = self.model.compute_logits(hidden[staged.logits_indices], upcast=upcast)
        return hidden, out

    def _to_host(self, sampled: torch.Tensor) -> np.ndarray:
        self._end_events()
        return sampled.cpu().numpy()  # the step's one synchronisation

    def _sample(self, inputs: _ModelInputs, logits: torch.Tensor | None):  # type: ignore[override]
        out = super()._sample(inputs, logits)
        self._end_events()  # a step that sampled nothing
        return out

    def _end_events(self) -> None:
        if self._events is not None and self.step_events is not None:
            self._events[1].record()
            self.step_events.append(self._events)
        self._events = None
