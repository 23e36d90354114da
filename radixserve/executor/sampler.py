"""Batched token sampling: penalties, logit bias, temperature, top-k/p, min-p, seeds."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.core.request import Request
from radixserve.executor.grammar import GrammarBatch
from radixserve.executor.native import load_elementwise


@functools.cache
def _argmax_kernel() -> Callable[..., None] | None:
    lib = load_elementwise()  # cached: built and loaded once per process
    return None if lib is None else lib.argmax_rows_bf16


def first_max_indices(logits: torch.Tensor) -> torch.Tensor:
    """``logits.max(dim=-1).indices`` for [S, vocab] (the first maximal index; a NaN counts
    above every number): bfloat16 rows on the CPU in one native pass
    (``native/elementwise.c``: ``argmax_rows_bf16``, a row's spans on every thread), where
    PyTorch's reduction took 1.6-2.9 ms for 16 rows of Gemma 3's 262,144 logits; anything
    else through PyTorch."""
    kernel = _argmax_kernel()
    if (
        kernel is None
        or logits.dtype != torch.bfloat16
        or logits.dim() != 2
        or not logits.is_cpu
        or not logits.is_contiguous()
        or logits.shape[0] == 0
        or logits.shape[1] == 0
        or logits.shape[1] >= 2**31
    ):
        return logits.max(dim=-1).indices
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    kernel(
        logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(), torch.get_num_threads()
    )
    return out


@dataclass(frozen=True)
class TokenLogprobs:
    """log p of the chosen token and of the ``top`` most likely ones, under the model's
    distribution (raw logits, before penalties and temperature, as vLLM reports them)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class SamplingBatch:
    """Per-row sampling settings of the requests sampled this step (row i ↔ requests[i]),
    taken when the step is prepared: sampling reads nothing else of the requests, which may
    change while the step runs.

    Invariant: tensors have one row per request; ``generators[i]`` is the request's own
    generator when it has a seed (so its draws do not depend on the batch), else None;
    ``output_ids[i]`` (penalties) may end with placeholders of tokens not sampled yet.
    """

    requests: list[Request]
    temperature: torch.Tensor  # [S] float32; 0 = greedy
    top_k: torch.Tensor  # [S] int64; vocab size = off
    top_p: torch.Tensor  # [S] float32
    min_p: torch.Tensor  # [S] float32
    all_greedy: bool
    needs_filter: bool  # some row uses top-k, top-p or min-p
    needs_penalties: bool
    needs_bias: bool
    needs_min_tokens: bool
    generators: list[torch.Generator | None]
    num_logprobs: list[int | None]  # per row: None = not asked
    # penalties: per row, output token ids so far and prompt ids (None: no repetition penalty)
    output_ids: list[np.ndarray] | None = None
    prompt_ids: list[np.ndarray | None] | None = None
    blocked: list[list[int]] | None = None  # min_tokens: per row, ids that cannot be drawn
    grammar: GrammarBatch | None = None  # constrained rows (None: no row is constrained)

    @property
    def argmax_only(self) -> bool:
        """Every row is plain greedy: the token is the argmax of the raw logits (of the
        grammar-masked logits for constrained rows; masking needs no float32)."""
        return (
            self.all_greedy
            and not (self.needs_bias or self.needs_penalties or self.needs_min_tokens)
            and all(n is None for n in self.num_logprobs)
        )


class Sampler:
    """Draws one token per sampled request in a handful of batched tensor ops.

    Invariant: greedy rows take the argmax of the processed logits; a seeded request's draws
    come only from its own generator, created once from its seed, so the same seed gives the
    same tokens alone or in any batch. Sampling uses the exponential-race form of the
    categorical draw (argmax of p / E, E ~ Exp(1)), one draw per row per step.
    """

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._generators: dict[str, torch.Generator] = {}
        self.raw_logits: torch.Tensor | None = None

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def prepare(self, requests: list[Request]) -> SamplingBatch:
        params = [r.sampling_params for r in requests]
        temperature = [p.temperature for p in params]
        top_k = [p.top_k if p.top_k > 0 else self.vocab_size for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        generators: list[torch.Generator | None] = []
        for r, p in zip(requests, params, strict=True):
            if p.seed is None or p.temperature == 0:
                generators.append(None)
                continue
            g = self._generators.get(r.request_id)
            if g is None:
                g = torch.Generator().manual_seed(p.seed)
                self._generators[r.request_id] = g
            generators.append(g)
        needs_penalties = any(
            p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params
        )
        needs_min_tokens = any(
            r.num_output_tokens < p.min_tokens for r, p in zip(requests, params, strict=True)
        )
        return SamplingBatch(
            requests=requests,
            temperature=torch.tensor(temperature, dtype=torch.float32),
            top_k=torch.tensor(top_k, dtype=torch.int64),
            top_p=torch.tensor(top_p, dtype=torch.float32),
            min_p=torch.tensor(min_p, dtype=torch.float32),
            all_greedy=all(t == 0 for t in temperature),
            needs_filter=any(
                k < self.vocab_size or tp < 1 or mp > 0
                for k, tp, mp in zip(top_k, top_p, min_p, strict=True)
            ),
            needs_penalties=needs_penalties,
            needs_bias=any(p.logit_bias for p in params),
            needs_min_tokens=needs_min_tokens,
            generators=generators,
            num_logprobs=[p.logprobs for p in params],
            output_ids=[r.output_token_ids.copy() for r in requests] if needs_penalties else None,
            prompt_ids=[
                r.prompt_token_ids if p.repetition_penalty != 1 else None
                for r, p in zip(requests, params, strict=True)
            ]
            if needs_penalties
            else None,
            blocked=[self._blocked_ids(r) for r in requests] if needs_min_tokens else None,
            grammar=GrammarBatch.of(requests),
        )

    def _blocked_ids(self, r: Request) -> list[int]:
        """Before min_tokens outputs, EOS and stop_token_ids cannot be drawn (a grammar
        decides alone when a constrained output may end)."""
        return self.blocked_ids(r, r.num_output_tokens)

    def __call__(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        resolve: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> torch.Tensor:
        """Sample from float32 ``logits`` [S, vocab]; returns token ids [S] int64.
        ``resolve`` replaces placeholders in the output histories (penalties)."""
        logits = self.process(logits, batch, resolve)
        # max(...).indices: the first maximal index, like argmax, but a vectorised kernel
        # for bfloat16 too (argmax on bf16 is ~4x slower on CPU); bfloat16 natively
        greedy_tokens = first_max_indices(logits)
        if batch.all_greedy:
            return greedy_tokens
        probs = self.probs(logits, batch)
        noise = self._exponential(probs.shape, batch.generators)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(batch.temperature == 0, greedy_tokens, sampled)

    def process(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        resolve: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> torch.Tensor:
        """The logits greedy rows take the argmax of: logit bias, penalties, min_tokens
        blocking and grammar masks applied (keeps the raw logits when logprobs are asked)."""
        self.raw_logits = logits if any(n is not None for n in batch.num_logprobs) else None
        if batch.needs_bias:
            logits = self._apply_bias(logits, batch.requests)
        if batch.needs_penalties:
            logits = self._apply_penalties(logits, batch, resolve)
        if batch.needs_min_tokens:
            logits = self._block_stop_tokens(logits, batch)
        if batch.grammar is not None:
            logits = batch.grammar.apply(logits, inplace=logits is not self.raw_logits)
        return logits

    def probs(self, processed: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution sampled rows draw from: softmax at the row's temperature, then
        top-k, top-p and min-p (unnormalised after filtering)."""
        temperature = batch.temperature.clamp_min(1e-6).unsqueeze(1)
        probs = torch.softmax(processed / temperature, dim=-1)
        if batch.needs_filter:
            probs = self._filter(probs, batch)
        return probs

    def blocked_ids(self, r: Request, num_output: int) -> list[int]:
        """The ids that cannot be drawn when ``r`` has ``num_output`` outputs (min_tokens)."""
        p = r.sampling_params
        if num_output >= p.min_tokens or r.grammar is not None:
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))

    def logprobs_of(self, tokens: torch.Tensor, batch: SamplingBatch) -> list[TokenLogprobs | None]:
        """Per row, the logprobs asked for by its request (after ``__call__`` on that batch)."""
        if self.raw_logits is None:
            return [None] * len(batch.requests)
        rows = [i for i, n in enumerate(batch.num_logprobs) if n is not None]
        k = max(batch.num_logprobs[i] or 0 for i in rows)
        entries = self.logprobs_for(self.raw_logits[rows], tokens[rows], k)
        out: list[TokenLogprobs | None] = [None] * len(batch.requests)
        for i, entry in zip(rows, entries, strict=True):
            n = batch.num_logprobs[i] or 0  # rows share one top-k: keep this row's n
            out[i] = (
                entry if n == k else TokenLogprobs(entry.token_id, entry.logprob, entry.top[:n])
            )
        return out

    @staticmethod
    def logprobs_for(
        logits: torch.Tensor, tokens: torch.Tensor, num_top: int
    ) -> list[TokenLogprobs]:
        """Row i: log p(tokens[i]) and the ``num_top`` most likely tokens under ``logits[i]``."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        if num_top:
            top_vals, top_ids = logp.topk(num_top, dim=-1)
            tops = [
                list(zip(i, v, strict=True))
                for i, v in zip(top_ids.tolist(), top_vals.tolist(), strict=True)
            ]
        else:
            tops = [[] for _ in chosen]
        return [
            TokenLogprobs(t, lp, top)
            for t, lp, top in zip(tokens.tolist(), chosen, tops, strict=True)
        ]

    @staticmethod
    def _filter(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Zero out tokens outside top-k, the top-p nucleus, or below min_p × max prob."""
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1]).unsqueeze(0)
        cumulative = sorted_probs.cumsum(dim=-1)
        # keep a token if the mass strictly before it is < top_p (the top token always stays)
        keep = (ranks < batch.top_k.unsqueeze(1)) & (
            (cumulative - sorted_probs) < batch.top_p.unsqueeze(1)
        )
        keep &= sorted_probs >= batch.min_p.unsqueeze(1) * sorted_probs[:, :1]
        keep[:, 0] = True
        filtered = torch.zeros_like(probs)
        filtered.scatter_(1, order, sorted_probs * keep)
        return filtered

    @staticmethod
    def _exponential(shape: torch.Size, generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty(shape, dtype=torch.float32)
        if all(g is None for g in generators):
            return noise.exponential_()
        for row, g in enumerate(generators):
            noise[row].exponential_(generator=g)
        return noise

    @staticmethod
    def _apply_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows, cols, values = [], [], []
        for i, r in enumerate(requests):
            for token, bias in (r.sampling_params.logit_bias or {}).items():
                rows.append(i)
                cols.append(token)
                values.append(bias)
        logits = logits.clone()
        logits.index_put_(
            (torch.tensor(rows), torch.tensor(cols)),
            torch.tensor(values, dtype=logits.dtype),
            accumulate=True,
        )
        return logits

    @staticmethod
    def _apply_penalties(
        logits: torch.Tensor,
        batch: SamplingBatch,
        resolve: Callable[[np.ndarray], np.ndarray] | None,
    ) -> torch.Tensor:
        """Repetition penalty over prompt + output (as vLLM / HF); presence and frequency
        penalties over the output only (as OpenAI)."""
        num_rows, vocab = logits.shape
        output_counts = np.zeros((num_rows, vocab), dtype=np.float32)
        seen = np.zeros((num_rows, vocab), dtype=bool)
        rep = np.ones(num_rows, dtype=np.float32)
        presence = np.zeros(num_rows, dtype=np.float32)
        frequency = np.zeros(num_rows, dtype=np.float32)
        assert batch.output_ids is not None and batch.prompt_ids is not None
        for i, r in enumerate(batch.requests):
            p = r.sampling_params
            rep[i], presence[i], frequency[i] = (
                p.repetition_penalty,
                p.presence_penalty,
                p.frequency_penalty,
            )
            output_ids = batch.output_ids[i]
            if resolve is not None:
                output_ids = resolve(output_ids)
            np.add.at(output_counts[i], output_ids, 1)
            prompt_ids = batch.prompt_ids[i]
            if prompt_ids is not None:
                seen[i, prompt_ids] = True
        seen |= output_counts > 0
        counts = torch.from_numpy(output_counts)
        rep_t = torch.from_numpy(rep).unsqueeze(1)
        penalised = torch.where(logits > 0, logits / rep_t, logits * rep_t)
        logits = torch.where(torch.from_numpy(seen), penalised, logits)
        logits = logits - torch.from_numpy(frequency).unsqueeze(1) * counts
        return logits - torch.from_numpy(presence).unsqueeze(1) * (counts > 0).float()

    @staticmethod
    def _block_stop_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Before min_tokens outputs, EOS and stop_token_ids cannot be drawn."""
        assert batch.blocked is not None
        logits = logits.clone()
        for i, blocked in enumerate(batch.blocked):
            if blocked:
                logits[i, blocked] = float("-inf")
        return logits
