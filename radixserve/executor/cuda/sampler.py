"""The batched sampler with every operation on the logits' device (no per-row loop there)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.core.request import Request
from radixserve.executor.sampler import Sampler, SamplingBatch

_MASK32 = 0xFFFFFFFF


@dataclass
class DeviceSamplingBatch(SamplingBatch):
    """``SamplingBatch`` plus what seeded draws need, taken at prepare time: ``seeds[i]``
    (-1: unseeded) and ``draw_index[i]`` (the request's output tokens so far)."""

    seeds: torch.Tensor | None = None  # [S] int64
    draw_index: torch.Tensor | None = None  # [S] int64


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (PCG's output permutation) of int64 values in [0, 2^32), with
    products that stay inside int64."""
    state = (x * 747796405 + 2891336453) & _MASK32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _MASK32
    return (word >> 22) ^ word


def seeded_exponential(seeds: torch.Tensor, draw_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, vocab] Exp(1) noise that depends only on (seed, draw index, token id): counter
    based, so a seeded request draws the same noise alone or in any batch, on any device."""
    row = _hash32((seeds & _MASK32) ^ _hash32((draw_index + 0x9E3779B9) & _MASK32))
    row = _hash32(row ^ ((seeds >> 32) & _MASK32))
    cols = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _hash32((row[:, None] + cols[None, :] * 0x9E3779B1) & _MASK32)
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1)
    return -torch.log(uniform)


class DeviceSampler(Sampler):
    """``Sampler`` whose processing runs as tensor ops on the logits' device: logit bias,
    penalties and blocked tokens as scatters built from flat index arrays, top-k/top-p/min-p
    on a sorted copy, and seeded draws from counter-based noise instead of per-request CPU
    generators.

    Invariant: greedy rows give exactly the base sampler's tokens (the argmax of the same
    processed logits); a seeded row's draw depends only on its seed, its output position
    and the logits, so it is the same alone or in any batch (it differs from the CPU
    sampler's seeded draws, which come from torch's CPU generator).
    """

    def prepare(self, requests: list[Request]) -> DeviceSamplingBatch:
        base = super().prepare(requests)
        seeds = [-1 if r.sampling_params.seed is None else r.sampling_params.seed for r in requests]
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        fields["generators"] = [None] * len(requests)  # seeded draws use the noise below
        return DeviceSamplingBatch(
            **fields,
            seeds=torch.tensor(seeds, dtype=torch.int64),
            draw_index=torch.tensor([r.num_output_tokens for r in requests], dtype=torch.int64),
        )

    def __call__(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        resolve: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> torch.Tensor:
        assert isinstance(batch, DeviceSamplingBatch)
        dev = logits.device
        self.raw_logits = logits if any(n is not None for n in batch.num_logprobs) else None
        if batch.needs_bias:
            logits = self._device_bias(logits, batch.requests)
        if batch.needs_penalties:
            logits = self._device_penalties(logits, batch, resolve)
        if batch.needs_min_tokens:
            logits = self._device_block(logits, batch)
        if batch.grammar is not None:
            logits = batch.grammar.apply(logits, inplace=logits is not self.raw_logits)
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_tokens
        temperature = batch.temperature.to(dev, non_blocking=True)
        probs = torch.softmax(logits / temperature.clamp_min(1e-6).unsqueeze(1), dim=-1)
        if batch.needs_filter:
            probs = self._device_filter(probs, batch)
        noise = torch.empty_like(probs).exponential_()
        assert batch.seeds is not None and batch.draw_index is not None
        seeds = batch.seeds.to(dev, non_blocking=True)
        if bool((batch.seeds >= 0).any()):  # host tensor: no device sync
            seeded = seeded_exponential(seeds, batch.draw_index.to(dev), probs.shape[-1])
            noise = torch.where((seeds >= 0).unsqueeze(1), seeded, noise)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temperature == 0, greedy_tokens, sampled)

    @staticmethod
    def _device_filter(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        dev = probs.device
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=dev).unsqueeze(0)
        cumulative = sorted_probs.cumsum(dim=-1)
        keep = (ranks < batch.top_k.to(dev).unsqueeze(1)) & (
            (cumulative - sorted_probs) < batch.top_p.to(dev).unsqueeze(1)
        )
        keep &= sorted_probs >= batch.min_p.to(dev).unsqueeze(1) * sorted_probs[:, :1]
        keep[:, 0] = True
        filtered = torch.zeros_like(probs)
        filtered.scatter_(1, order, sorted_probs * keep)
        return filtered

    @staticmethod
    def _device_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows, cols, values = [], [], []
        for i, r in enumerate(requests):
            bias = r.sampling_params.logit_bias or {}
            rows.extend([i] * len(bias))
            cols.extend(bias.keys())
            values.extend(bias.values())
        dev = logits.device
        logits = logits.clone()
        logits.index_put_(
            (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
            torch.tensor(values, dtype=logits.dtype, device=dev),
            accumulate=True,
        )
        return logits

    @staticmethod
    def _device_penalties(
        logits: torch.Tensor,
        batch: SamplingBatch,
        resolve: Callable[[np.ndarray], np.ndarray] | None,
    ) -> torch.Tensor:
        """As ``Sampler._apply_penalties``, with counts scattered on the device from flat
        (row, token) arrays."""
        assert batch.output_ids is not None and batch.prompt_ids is not None
        dev = logits.device
        num_rows, vocab = logits.shape
        outputs = [resolve(o) if resolve is not None else o for o in batch.output_ids]
        out_rows = np.repeat(np.arange(num_rows), [o.size for o in outputs])
        out_ids = np.concatenate(outputs) if outputs else np.zeros(0, dtype=np.int64)
        prompts = [p if p is not None else np.zeros(0, dtype=np.int64) for p in batch.prompt_ids]
        pr_rows = np.repeat(np.arange(num_rows), [p.size for p in prompts])
        pr_ids = np.concatenate(prompts)
        counts = torch.zeros(num_rows, vocab, dtype=torch.float32, device=dev)
        counts.index_put_(
            (
                torch.from_numpy(out_rows).to(dev),
                torch.from_numpy(out_ids.astype(np.int64)).to(dev),
            ),
            torch.ones(out_ids.size, device=dev),
            accumulate=True,
        )
        seen = counts > 0
        seen[
            torch.from_numpy(pr_rows).to(dev), torch.from_numpy(pr_ids.astype(np.int64)).to(dev)
        ] = True
        params = [r.sampling_params for r in batch.requests]
        rep, presence, frequency = (
            torch.tensor(
                [getattr(p, name) for p in params], dtype=torch.float32, device=dev
            ).unsqueeze(1)
            for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")
        )
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        logits = logits - frequency * counts
        return logits - presence * (counts > 0).float()

    @staticmethod
    def _device_block(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        assert batch.blocked is not None
        rows = [i for i, ids in enumerate(batch.blocked) for _ in ids]
        cols = [t for ids in batch.blocked for t in ids]
        logits = logits.clone()
        if rows:
            dev = logits.device
            logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")
        return logits
