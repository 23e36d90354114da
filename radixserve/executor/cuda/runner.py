"""The model runner of the CUDA path: staged inputs, Triton attention, CUDA graphs, sampling
on the device, one device-to-host copy per step."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from radixserve.core.page_table import PageTable
from radixserve.executor.cuda.attention import (
    TritonAttention,
    TritonHostMetadata,
    TritonMetadata,
)
from radixserve.executor.cuda.graph_runner import CudaGraphRunner, StagedInputs
from radixserve.executor.cuda.sampler import DeviceSampler
from radixserve.executor.device import PreparedStep, StepResult
from radixserve.executor.forward_batch import ForwardBatch
from radixserve.executor.future_tokens import FutureTokens
from radixserve.executor.kv_cache import KVCache
from radixserve.executor.model_runner import ModelRunner, _ModelInputs
from radixserve.executor.models.llama import LlamaForCausalLM
from radixserve.executor.sampler import TokenLogprobs


class CudaModelRunner(ModelRunner):
    """``ModelRunner`` for a model, KV cache and sampler on ``device`` (a GPU; CPU tensors
    work too under the Triton interpreter, which is how CI runs it).

    Invariants (beyond ``ModelRunner``'s): the step's index arrays reach the device in one
    non-blocking copy from a pinned buffer, which is not rewritten before that copy is done;
    a step synchronises with the host once, when it copies its sampled token ids back (and
    again only for logprobs asked for); a decode-only step whose every row is sampled
    replays a CUDA graph when ``graphs`` is set and the batch fits a bucket, else runs
    eagerly with the same kernels. ``step_events`` (when a list): a (start, end) CUDA event
    pair per step, for measuring device busy time.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        page_table: PageTable,
        sampler: DeviceSampler,
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
        self.future = FutureTokens(max_rows or page_table.table.shape[0])
        self.device = device
        c = model.config
        self.attention = TritonAttention(kv_cache, c.num_attention_heads, c.head_dim)
        self._pinned = device.type == "cuda"
        self._staging = torch.empty(0, dtype=torch.int64)
        self._staged_event: torch.cuda.Event | None = None
        self.step_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        self.graphs: CudaGraphRunner | None = None
        if cuda_graph_max_bs and device.type == "cuda":
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
    @torch.inference_mode()
    def run(self, step: PreparedStep) -> StepResult:
        inputs: _ModelInputs = step.inputs
        fb = inputs.forward_batch
        host: TritonHostMetadata = inputs.meta
        events = None
        if self.step_events is not None:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        if inputs.copies is not None:
            src, dst = inputs.copies
            self.kv_cache.copy_pages(src.to(self.device), dst.to(self.device))
        staged = self._stage(self.future.resolve(fb.input_ids), fb)
        sampling = inputs.sampling
        num = fb.num_requests
        use_graph = (
            self.graphs is not None
            and host.is_decode
            and sampling is not None
            and bool(inputs.sample.all())
            and not inputs.prompt_logprobs
            and self.graphs.can_run(num, fb.page_tables.shape[1])
        )
        hidden = None
        logits = None
        if use_graph:
            assert self.graphs is not None
            logits = self.graphs.replay(staged)
        else:
            meta = TritonMetadata(
                is_decode=host.is_decode,
                num_tokens=host.num_tokens,
                max_q_len=host.max_q_len,
                num_splits=self.attention.num_splits(num, host.max_seq_len),
                query_start_loc=staged.query_start_loc,
                seq_lens=staged.seq_lens,
                page_tables=staged.page_tables,
                slot_mapping=staged.slot_mapping,
            )
            hidden = self.model.forward(staged.input_ids, staged.positions, self.attention, meta)
        tokens = np.full(num, -1, dtype=np.int64)
        logprobs: dict[str, TokenLogprobs] = {}
        if sampling is not None:
            if logits is None:
                assert hidden is not None
                logits = self.model.compute_logits(
                    hidden[staged.logits_indices], upcast=not sampling.argmax_only
                )
            elif not sampling.argmax_only:
                logits = logits.float()
            sampled = self.sampler(logits, sampling, self.future.resolve)
            if events is not None:
                events[1].record()
            sampled_np = sampled.cpu().numpy()  # the step's one synchronisation
            self.future.store(inputs.slots, sampled_np)
            if sampling.grammar is not None:  # before the next step fills its masks
                sampling.grammar.accept(sampled_np)
            tokens[inputs.sample] = sampled_np
            for rid, lp in zip(
                inputs.sampled_ids, self.sampler.logprobs_of(sampled, sampling), strict=True
            ):
                if lp is not None:
                    logprobs[rid] = lp
        elif events is not None:
            events[1].record()
        if events is not None and self.step_events is not None:
            self.step_events.append(events)
        prompt_logprobs = {}
        if inputs.prompt_logprobs:
            assert hidden is not None
            plans = [
                dataclasses.replace(p, targets=p.targets.to(self.device))
                for p in inputs.prompt_logprobs
            ]
            prompt_logprobs = self._prompt_logprobs(
                dataclasses.replace(inputs, prompt_logprobs=plans), hidden
            )
        return StepResult(tokens, logprobs, prompt_logprobs)
