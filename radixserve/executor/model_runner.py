"""Runs one scheduled batch: inputs → model forward over the paged cache → sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from radixserve.core.page_table import PageTable
from radixserve.core.step import ScheduledBatch
from radixserve.executor.attention import TorchNativeAttention
from radixserve.executor.forward_batch import ForwardBatch
from radixserve.executor.kv_cache import KVCache
from radixserve.executor.models.llama import LlamaForCausalLM
from radixserve.executor.sampler import Sampler, TokenLogprobs

_PROMPT_LOGITS_ROWS = 256  # prompt positions turned into logits at once


@dataclass
class StepResult:
    """``tokens[i]``: the token sampled for ``batch.requests[i]`` (-1 if none this step);
    ``logprobs``: by request id, for sampled requests that asked for logprobs;
    ``prompt_logprobs``: by request id, (p, entries) where entry j is for prompt token
    p + 1 + j, for requests that asked for prompt logprobs and computed prompt tokens."""

    tokens: np.ndarray
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


class ModelRunner:
    """Executes batches; decides nothing about who runs.

    Invariant: ``execute`` returns one token per scheduled request: the sampled token id
    where ``batch.sample[i]`` is set, -1 elsewhere. Pending page copies run before the
    forward, so copied pages are complete before anything reads or extends them.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        page_table: PageTable,
        sampler: Sampler,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.page_table = page_table
        self.sampler = sampler
        c = model.config
        self.attention = TorchNativeAttention(kv_cache, c.num_attention_heads, c.head_dim)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        if batch.page_copies:
            src = torch.tensor([c.src for c in batch.page_copies])
            dst = torch.tensor([c.dst for c in batch.page_copies])
            self.kv_cache.copy_pages(src, dst)
        fb = ForwardBatch.build(batch, self.page_table, self.kv_cache.page_size)
        meta = self.attention.prepare(fb)
        hidden = self.model.forward(
            torch.from_numpy(fb.input_ids), torch.from_numpy(fb.positions), self.attention, meta
        )
        tokens = np.full(len(batch.requests), -1, dtype=np.int64)
        logprobs: dict[str, TokenLogprobs] = {}
        if fb.logits_indices.size:
            sampled_reqs = [r for r, s in zip(batch.requests, batch.sample, strict=True) if s]
            sampling = self.sampler.prepare(sampled_reqs)
            # Plain greedy needs only an argmax: skip widening the logits to float32.
            logits = self.model.compute_logits(
                hidden[torch.from_numpy(fb.logits_indices)], upcast=not sampling.argmax_only
            )
            sampled = self.sampler(logits, sampling)
            tokens[batch.sample] = sampled.numpy()
            for req, lp in zip(
                sampled_reqs, self.sampler.logprobs_of(sampled, sampling), strict=True
            ):
                if lp is not None:
                    logprobs[req.request_id] = lp
        return StepResult(tokens, logprobs, self._prompt_logprobs(batch, fb, hidden))

    def _prompt_logprobs(
        self, batch: ScheduledBatch, fb: ForwardBatch, hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """For requests asking for prompt logprobs: position p of this step's chunk predicts
        prompt token p + 1, for every p before the prompt's last token."""
        out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        for i, req in enumerate(batch.requests):
            num_top = req.sampling_params.prompt_logprobs
            if num_top is None:
                continue
            start = req.num_computed_tokens
            end = min(start + int(batch.num_new_tokens[i]), req.num_prompt_tokens - 1)
            if end <= start:
                continue
            first_row = int(fb.query_start_loc[i])
            targets = torch.from_numpy(req.token_ids[start + 1 : end + 1].astype(np.int64))
            entries: list[TokenLogprobs] = []
            for j in range(0, end - start, _PROMPT_LOGITS_ROWS):  # bounded [rows, vocab] logits
                rows = hidden[first_row + j : first_row + min(j + _PROMPT_LOGITS_ROWS, end - start)]
                logits = self.model.compute_logits(rows, upcast=True)
                chunk_targets = targets[j : j + _PROMPT_LOGITS_ROWS]
                entries.extend(self.sampler.logprobs_for(logits, chunk_targets, num_top))
            out[req.request_id] = (start, entries)
        return out
