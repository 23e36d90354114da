"""Runs one scheduled batch: inputs → model forward over the paged cache → sampled tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.core.page_table import PageTable
from radixserve.core.step import ScheduledBatch
from radixserve.executor.attention import TorchNativeAttention, TorchNativeMetadata
from radixserve.executor.batch_invariant import invariant_step
from radixserve.executor.device import PreparedStep, StepResult
from radixserve.executor.forward_batch import ForwardBatch
from radixserve.executor.future_tokens import FutureTokens
from radixserve.executor.host_memory import keep_freed_memory
from radixserve.executor.kv_cache import KVCache
from radixserve.executor.models.base import CausalLM
from radixserve.executor.quant import long_prompt_step
from radixserve.executor.sampler import Sampler, SamplingBatch, TokenLogprobs
from radixserve.executor.spec.verify import SpecPlan, verify
from radixserve.executor.spec.verify import plan as spec_plan

__all__ = ["ModelRunner", "StepResult"]

# rows per MLP block on CPU (LlamaForCausalLM._mlp); 256 ran fastest of 128-1024 at T = 2048
CPU_MLP_BLOCK_ROWS = 256

_PROMPT_LOGITS_ROWS = 256  # prompt positions turned into logits at once


@dataclass
class _PromptLogprobsPlan:
    """Prompt logprobs one request wants from this step: rows ``first_row ..`` of the
    step's hidden states predict ``targets`` (prompt tokens ``start + 1 ..``)."""

    request_id: str
    start: int
    first_row: int
    targets: torch.Tensor
    num_top: int


@dataclass
class _PoolPlan:
    """A pooling request's rows in this step: hidden rows ``first_row ..
    first_row + num_rows`` are its prompt positions ``start ..``; ``kind`` "mean" sums them
    (every chunk), "last" takes the one row of its last prompt token (final chunk only)."""

    request_id: str
    kind: str
    start: int
    first_row: int
    num_rows: int


@dataclass
class _ModelInputs:
    """Everything ``run`` reads, fixed at launch: nothing on the device side looks at the
    requests, which the host keeps changing while the step runs."""

    forward_batch: ForwardBatch
    meta: TorchNativeMetadata
    copies: tuple[torch.Tensor, torch.Tensor] | None
    sample: np.ndarray  # [B] bool
    sampled_ids: list[str]  # request ids of the sampled rows
    sampling: SamplingBatch | None
    slots: np.ndarray  # FutureTokens slots of the sampled rows
    prompt_logprobs: list[_PromptLogprobsPlan]
    spec: SpecPlan | None = None  # proposals verified this step (None: a plain step)
    pooling: list[_PoolPlan] | None = None  # pooling requests' rows (None: there are none)


class ModelRunner:
    """Executes batches; decides nothing about who runs.

    Invariant: a step's result has one token per scheduled request: the sampled token id
    where ``batch.sample[i]`` is set and the request is not a pooling request, -1
    elsewhere; a pooling request's rows give its pooled hidden state instead (no logits,
    no sampling: ``StepResult.pooled``). ``prepare`` (host) reads the requests and
    builds every input; ``run`` (device) reads only those inputs, replaces placeholders of
    earlier steps' tokens from the ``FutureTokens`` buffer and publishes its own sampled
    tokens there. Pending page copies run before the forward, so copied pages are complete
    before anything reads or extends them.

    The model work of a step is ``forward_step`` then ``prompt_logits`` per prompt-logprob
    span (``_compute`` on rank 0, ``follow_step`` on a tensor-parallel worker, so both make
    the same collectives in the same order); a subclass with other kernels (the CUDA
    runner) overrides those two and inherits the rest. A worker's runner has no page table
    or sampler (``page_table``/``sampler`` None): it only follows steps.
    """

    # speculative decoding with a draft model: told about every step's tokens (fb, input
    # ids, page copies, whether the step verifies proposals), it writes the draft's KV for
    # a verify step and marks the pages of any other step stale (a class default: the CUDA
    # runner, which does not speculate, has it too)
    shadow: (
        Callable[[ForwardBatch, np.ndarray, tuple[torch.Tensor, torch.Tensor] | None, bool], None]
        | None
    ) = None

    # every row computed as if alone (executor/batch_invariant.py; a class default: the CUDA
    # runner, which has no such mode, has it too)
    deterministic = False

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        page_table: PageTable | None,
        sampler: Sampler | None,
        max_rows: int | None = None,
        deterministic: bool = False,
    ) -> None:
        self.model = model
        self.deterministic = deterministic
        if kv_cache.k.device.type == "cpu":
            model.mlp_block_rows = CPU_MLP_BLOCK_ROWS
            keep_freed_memory()  # step buffers reused, not page-faulted in again every step
        self.kv_cache = kv_cache
        self.page_table = page_table
        self.sampler = sampler
        self.future = FutureTokens(max_rows or _rows(page_table))
        c = model.config
        self.attention = TorchNativeAttention(
            kv_cache,
            c.num_attention_heads,
            c.head_dim,
            specs=model.attention_specs(),
            deterministic=deterministic,
        )

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Prepare and run ``batch`` at once (serial use)."""
        return self.run(self.prepare(batch))

    # -- host side ------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> PreparedStep:
        copies = None
        if batch.page_copies:
            copies = (
                torch.tensor([c.src for c in batch.page_copies]),
                torch.tensor([c.dst for c in batch.page_copies]),
            )
        pooled = np.fromiter(
            (r.pooling is not None for r in batch.requests), dtype=bool, count=len(batch.requests)
        )
        sample = batch.sample & ~pooled if pooled.any() else batch.sample
        fb = ForwardBatch.build(batch, self.page_table, self.kv_cache.page_size, sample)
        sampled_reqs = [r for r, s in zip(batch.requests, sample.tolist(), strict=True) if s]
        slots = self.future.reserve(len(sampled_reqs))
        placeholders = np.full(len(batch.requests), -1, dtype=np.int64)
        placeholders[sample] = FutureTokens.placeholders(slots)
        sampling = self.sampler.prepare(sampled_reqs) if sampled_reqs else None
        spec = None
        if batch.has_spec and sampling is not None:
            assert batch.num_spec is not None
            drafts = [
                r.token_ids[t : t + k].copy()
                for r, t, k in zip(
                    sampled_reqs,
                    batch.totals[sample].tolist(),
                    batch.num_spec[sample].tolist(),
                    strict=True,
                )
            ]
            spec = spec_plan(self.sampler, sampling, drafts)
        inputs = _ModelInputs(
            forward_batch=fb,
            meta=self.attention.prepare(fb),
            copies=copies,
            sample=sample.copy(),
            sampled_ids=[r.request_id for r in sampled_reqs],
            sampling=sampling,
            slots=slots,
            prompt_logprobs=self._prompt_logprobs_plan(batch, fb),
            spec=spec,
            pooling=self._pool_plan(batch, fb, pooled) if pooled.any() else None,
        )
        return PreparedStep(placeholders, inputs=inputs)

    @staticmethod
    def _pool_plan(batch: ScheduledBatch, fb: ForwardBatch, pooled: np.ndarray) -> list[_PoolPlan]:
        """The hidden rows each pooling request of ``batch`` needs from this step."""
        plans: list[_PoolPlan] = []
        for i in np.flatnonzero(pooled).tolist():
            req = batch.requests[i]
            start, n = int(batch.starts[i]), int(batch.num_new_tokens[i])
            first = int(fb.query_start_loc[i])
            if req.pooling == "mean":
                plans.append(_PoolPlan(req.request_id, "mean", start, first, n))
            elif batch.sample[i]:  # the chunk that ends the prompt: its last row
                plans.append(_PoolPlan(req.request_id, "last", start + n - 1, first + n - 1, 1))
        return plans

    @staticmethod
    def _prompt_logprobs_plan(batch: ScheduledBatch, fb: ForwardBatch) -> list[_PromptLogprobsPlan]:
        """For requests asking for prompt logprobs: position p of this step's chunk predicts
        prompt token p + 1, for every p before the prompt's last token."""
        plans: list[_PromptLogprobsPlan] = []
        for i, req in enumerate(batch.requests):
            num_top = req.sampling_params.prompt_logprobs
            if num_top is None:
                continue
            start = int(batch.starts[i])
            end = min(start + int(batch.num_new_tokens[i]), req.num_prompt_tokens - 1)
            if end <= start:
                continue
            targets = torch.from_numpy(req.token_ids[start + 1 : end + 1].astype(np.int64))
            plans.append(
                _PromptLogprobsPlan(
                    req.request_id, start, int(fb.query_start_loc[i]), targets, num_top
                )
            )
        return plans

    # -- device side ----------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, step: PreparedStep) -> StepResult:
        inputs: _ModelInputs = step.inputs
        with invariant_step(self.deterministic):
            logits, prompt_logprobs, pooled = self._compute(inputs)
            if inputs.spec is not None:
                result = self._verify(inputs, logits, prompt_logprobs)
            else:
                tokens, logprobs = self._sample(inputs, logits)
                result = StepResult(tokens, logprobs, prompt_logprobs)
        result.pooled = pooled
        return result

    def _verify(
        self,
        inputs: _ModelInputs,
        logits: torch.Tensor | None,
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]],
    ) -> StepResult:
        """A step with proposals: the verify rule picks each sampled row's tokens."""
        assert logits is not None and self.sampler is not None and inputs.spec is not None
        emitted, lps = verify(self.sampler, logits, inputs.spec)
        rows = np.flatnonzero(inputs.sample)
        tokens = np.full(inputs.forward_batch.num_requests, -1, dtype=np.int64)
        first = np.array([t[0] for t in emitted], dtype=np.int64)
        tokens[rows] = first
        self.future.store(inputs.slots, first)
        spec_tokens = {int(r): t for r, t in zip(rows.tolist(), emitted, strict=True)}
        spec_logprobs = {
            rid: lp for rid, lp in zip(inputs.sampled_ids, lps, strict=True) if lp is not None
        }
        return StepResult(
            tokens, {}, prompt_logprobs, spec_tokens=spec_tokens, spec_logprobs=spec_logprobs
        )

    def _compute(
        self, inputs: _ModelInputs
    ) -> tuple[
        torch.Tensor | None,
        dict[str, tuple[int, list[TokenLogprobs]]],
        dict[str, tuple[int, int, np.ndarray]],
    ]:
        """Page copies, the forward, the sampled rows' logits, the prompt logprobs and the
        pooled hidden states: all the model work of a step (under tensor parallelism, every
        collective of the step happens in here, before anything that could fail on this
        rank alone; pooling reads the final hidden states, the same on every rank)."""
        fb = inputs.forward_batch
        sampling = inputs.sampling
        input_ids = self.future.resolve(fb.input_ids)
        if self.shadow is not None:
            self.shadow(fb, input_ids, inputs.copies, inputs.spec is not None)
        hidden, logits = self.forward_step(
            fb,
            input_ids,
            inputs.copies,
            inputs.meta,
            logits=sampling is not None,
            # Plain greedy needs only an argmax: skip widening the logits to float32.
            upcast=sampling is not None and not sampling.argmax_only,
            graph_ok=sampling is not None
            and inputs.spec is None
            and bool(inputs.sample.all())
            and not inputs.prompt_logprobs
            and inputs.pooling is None,
        )
        return logits, self._prompt_logprobs(inputs, hidden), self._pool(inputs, hidden)

    def _pool(
        self, inputs: _ModelInputs, hidden: torch.Tensor | None
    ) -> dict[str, tuple[int, int, np.ndarray]]:
        """Each pooling request's part of this step (``StepResult.pooled``), in float32: a
        mean-pooled chunk's sum, or in deterministic mode its rows (the engine sums them in
        order, so the sum does not depend on where the prompt's chunks end)."""
        out: dict[str, tuple[int, int, np.ndarray]] = {}
        for plan in inputs.pooling or ():
            assert hidden is not None
            rows = hidden[plan.first_row : plan.first_row + plan.num_rows].float()
            if plan.kind != "mean":
                vec = rows[-1]
            else:
                vec = rows if self.deterministic else rows.sum(dim=0)
            out[plan.request_id] = (plan.start, plan.num_rows, vec.cpu().numpy())
        return out

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
        """Page copies, the forward over ``input_ids`` (placeholders resolved) and, when
        ``logits``, the logits of rows ``fb.logits_indices``. Returns (hidden states, or
        None when a replayed graph made only logits; logits or None). ``graph_ok``: every
        row is sampled and nothing else reads the hidden states (the CUDA runner may then
        replay a graph)."""
        if copies is not None:
            self.kv_cache.copy_pages(*copies)
        self.model.lora_step = fb.lora
        try:
            with long_prompt_step(fb.long_prompt):
                hidden = self.model.forward(
                    torch.from_numpy(input_ids),
                    torch.from_numpy(fb.positions),
                    self.attention,
                    meta,
                )
        finally:
            self.model.lora_step = None
        out = None
        if logits:
            out = self.model.compute_logits(
                hidden[torch.from_numpy(fb.logits_indices)], upcast=upcast
            )
        return hidden, out

    def prompt_logits(
        self, hidden: torch.Tensor, first_row: int, num: int
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(j, float32 logits of hidden rows ``first_row + j ..``) in bounded chunks
        covering ``num`` rows (each chunk a collective under tensor parallelism)."""
        for j in range(0, num, _PROMPT_LOGITS_ROWS):
            rows = hidden[first_row + j : first_row + min(j + _PROMPT_LOGITS_ROWS, num)]
            yield j, self.model.compute_logits(rows, upcast=True)

    def follow_step(
        self,
        fb: ForwardBatch,
        copies: tuple[torch.Tensor, torch.Tensor] | None,
        plans: list[tuple[int, int]],
    ) -> None:
        """A tensor-parallel worker's part of a step rank 0 runs: the model work of
        ``_compute`` (same methods, same order, so the same collectives), its results
        dropped; ``plans``: the prompt-logprob spans (first hidden row, rows)."""
        graph_ok = fb.logits_indices.size == fb.num_requests and not plans
        hidden, _ = self.forward_step(
            fb,
            fb.input_ids,
            copies,
            self.attention.prepare(fb),
            logits=bool(fb.logits_indices.size),
            upcast=False,
            graph_ok=graph_ok,
        )
        for first, num in plans:
            assert hidden is not None
            for _ in self.prompt_logits(hidden, first, num):
                pass

    def _sample(
        self, inputs: _ModelInputs, logits: torch.Tensor | None
    ) -> tuple[np.ndarray, dict[str, TokenLogprobs]]:
        """One token per sampled row (-1 elsewhere), published to ``FutureTokens``."""
        tokens = np.full(inputs.forward_batch.num_requests, -1, dtype=np.int64)
        logprobs: dict[str, TokenLogprobs] = {}
        sampling = inputs.sampling
        if sampling is not None:
            assert logits is not None and self.sampler is not None
            sampled = self.sampler(logits, sampling, self.future.resolve)
            sampled_np = self._to_host(sampled)
            self.future.store(inputs.slots, sampled_np)
            if sampling.grammar is not None:  # before the next step fills its masks
                sampling.grammar.accept(sampled_np)
            tokens[inputs.sample] = sampled_np
            for rid, lp in zip(
                inputs.sampled_ids, self.sampler.logprobs_of(sampled, sampling), strict=True
            ):
                if lp is not None:
                    logprobs[rid] = lp
        return tokens, logprobs

    def _to_host(self, sampled: torch.Tensor) -> np.ndarray:
        """The sampled ids on the host (the CUDA runner's one synchronisation per step)."""
        return sampled.numpy()

    def _prompt_logprobs(
        self, inputs: _ModelInputs, hidden: torch.Tensor | None
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        for plan in inputs.prompt_logprobs:
            assert hidden is not None and self.sampler is not None
            entries: list[TokenLogprobs] = []
            targets = plan.targets.to(hidden.device)
            for j, logits in self.prompt_logits(hidden, plan.first_row, targets.numel()):
                chunk_targets = targets[j : j + _PROMPT_LOGITS_ROWS]
                entries.extend(self.sampler.logprobs_for(logits, chunk_targets, plan.num_top))
            out[plan.request_id] = (plan.start, entries)
        return out


def _rows(page_table: PageTable | None) -> int:
    """Rows of the future-token buffer: one per request slot (a worker samples nothing)."""
    return 1 if page_table is None else page_table.table.shape[0]
