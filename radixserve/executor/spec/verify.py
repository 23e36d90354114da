"""The verify rule: which proposed tokens the target model keeps, exact in distribution.

Each speculating request ran its last token plus ``k`` proposals ``d_1..d_k`` as one extend
chunk, so the step has ``k + 1`` logit rows for it: row ``j`` is the target's distribution
``p_j`` of the token after ``d_1..d_j``. Proposals are point masses (``q(d_j) = 1``), so the
standard rejection rule (accept with ``min(1, p/q)``, else draw from the normalised residual
``max(0, p - q)``) becomes: accept ``d_j`` with probability ``p_j(d_j)``; at the first
rejection draw from ``p_j`` with ``d_j`` removed; if all are accepted draw a bonus token from
``p_k``. Each emitted token is then distributed exactly as the target's next token given
the tokens before it. Greedy rows accept while ``d_j`` is the argmax and emit the argmax
at the first mismatch (or as the bonus): the non-speculative tokens, exactly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.executor.sampler import Sampler, SamplingBatch, TokenLogprobs


@dataclass
class SpecPlan:
    """The verify plan of one step, built on the host at prepare time.

    Invariant: ``drafts[i]`` are the proposals of sampled row ``i`` (empty: a plain row);
    the step's logits hold ``len(drafts[i]) + 1`` consecutive rows per sampled row, in batch
    order; ``expanded`` is the step's ``SamplingBatch`` with one row per logit row (row
    ``j`` of request ``i`` sees the output so far plus ``drafts[i][:j]``, so penalties and
    ``min_tokens`` apply at each position as they would have without speculation).
    """

    drafts: list[np.ndarray]
    expanded: SamplingBatch
    base: SamplingBatch

    @property
    def num_rows(self) -> int:
        return sum(d.size + 1 for d in self.drafts)


def plan(sampler: Sampler, batch: SamplingBatch, drafts: list[np.ndarray]) -> SpecPlan:
    """Expand ``batch`` (one row per sampled request) to one row per verified position."""
    reps = np.array([d.size + 1 for d in drafts], dtype=np.int64)
    idx = np.repeat(np.arange(len(drafts)), reps)
    offsets = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
    idx_t = torch.from_numpy(idx)
    requests = [batch.requests[i] for i in idx.tolist()]
    output_ids = prompt_ids = None
    if batch.needs_penalties:
        assert batch.output_ids is not None and batch.prompt_ids is not None
        output_ids = [
            np.concatenate([batch.output_ids[i], drafts[i][:j]]).astype(np.int64)
            for i, j in zip(idx.tolist(), offsets.tolist(), strict=True)
        ]
        prompt_ids = [batch.prompt_ids[i] for i in idx.tolist()]
    blocked = [
        sampler.blocked_ids(r, r.num_output_tokens + j)
        for r, j in zip(requests, offsets.tolist(), strict=True)
    ]
    needs_min_tokens = any(blocked)
    expanded = dataclasses.replace(
        batch,
        requests=requests,
        temperature=batch.temperature[idx_t],
        top_k=batch.top_k[idx_t],
        top_p=batch.top_p[idx_t],
        min_p=batch.min_p[idx_t],
        generators=[batch.generators[i] for i in idx.tolist()],
        num_logprobs=[batch.num_logprobs[i] for i in idx.tolist()],
        output_ids=output_ids,
        prompt_ids=prompt_ids,
        blocked=blocked if needs_min_tokens else None,
        needs_min_tokens=needs_min_tokens,
        grammar=None,
    )
    assert batch.grammar is None, "constrained requests do not speculate"
    return SpecPlan(drafts=drafts, expanded=expanded, base=batch)


def verify(
    sampler: Sampler, logits: torch.Tensor, spec: SpecPlan
) -> tuple[list[np.ndarray], list[list[TokenLogprobs] | None]]:
    """Per sampled request, the tokens it emits this step (accepted proposals, then one
    token of the target's own: 1..k+1 tokens) and, if it asked for them, their logprobs
    (raw logits, as the sampler reports them)."""
    x = spec.expanded
    drafts = spec.drafts
    processed = sampler.process(logits, x)
    raw = sampler.raw_logits
    num = len(drafts)
    counts = np.array([d.size for d in drafts], dtype=np.int64)
    first_row = np.concatenate([[0], np.cumsum(counts + 1)[:-1]]).astype(np.int64)
    greedy_rows = (spec.base.temperature == 0).numpy()
    argmax = processed.max(dim=-1).indices.numpy()
    probs = None if spec.base.all_greedy else sampler.probs(processed, x)

    accepted = np.zeros(num, dtype=np.int64)  # proposals kept per request
    final = np.zeros(num, dtype=np.int64)  # the target's own token per request
    draft_rows = np.concatenate([first_row[i] + np.arange(counts[i]) for i in range(num)])
    draft_tokens = (
        np.concatenate(drafts).astype(np.int64) if draft_rows.size else np.zeros(0, np.int64)
    )
    # greedy: keep proposals while they are the argmax
    match = argmax[draft_rows] == draft_tokens if draft_rows.size else np.zeros(0, bool)
    if probs is not None:
        # sampled: keep d_j with probability p_j(d_j)
        p_draft = (
            (
                probs[torch.from_numpy(draft_rows), torch.from_numpy(draft_tokens)]
                / probs[torch.from_numpy(draft_rows)].sum(dim=-1)
            ).numpy()
            if draft_rows.size
            else np.zeros(0, np.float32)
        )
        uniforms = _uniforms(counts, spec.base.generators, greedy_rows)
        keep_sampled = uniforms < p_draft
    else:
        keep_sampled = match
    seg_start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    resample_rows: list[int] = []
    resample_of: list[int] = []
    banned: list[int] = []
    for i in range(num):
        k = int(counts[i])
        keep = (match if greedy_rows[i] else keep_sampled)[seg_start[i] : seg_start[i] + k]
        miss = np.flatnonzero(~keep)
        a = int(miss[0]) if miss.size else k
        accepted[i] = a
        row = int(first_row[i]) + a
        if greedy_rows[i]:
            final[i] = argmax[row]
        else:
            resample_rows.append(row)
            resample_of.append(i)
            banned.append(int(drafts[i][a]) if a < k else -1)
    if resample_rows:
        assert probs is not None
        dist = probs[torch.tensor(resample_rows)].clone()
        ban = torch.tensor(banned)
        has_ban = ban >= 0
        if bool(has_ban.any()):
            # the residual max(0, p - q) with q a point mass on the rejected proposal
            dist[has_ban.nonzero().squeeze(1), ban[has_ban]] = 0.0
        gens = [spec.base.generators[i] for i in resample_of]
        noise = Sampler._exponential(dist.shape, gens)
        final[np.array(resample_of)] = (dist / noise).argmax(dim=-1).numpy()

    tokens: list[np.ndarray] = []
    logprobs: list[list[TokenLogprobs] | None] = []
    for i in range(num):
        a = int(accepted[i])
        out = np.empty(a + 1, dtype=np.int64)
        out[:a] = drafts[i][:a]
        out[a] = final[i]
        tokens.append(out)
        n_lp = spec.base.num_logprobs[i]
        if n_lp is None or raw is None:
            logprobs.append(None)
            continue
        rows = torch.arange(int(first_row[i]), int(first_row[i]) + a + 1)
        logprobs.append(Sampler.logprobs_for(raw[rows], torch.from_numpy(out), n_lp))
    return tokens, logprobs


def _uniforms(
    counts: np.ndarray, generators: list[torch.Generator | None], greedy: np.ndarray
) -> np.ndarray:
    """One U[0, 1) per proposal; a seeded request's come from its own generator."""
    total = int(counts.sum())
    if all(g is None for g in generators):
        return torch.rand(total).numpy()
    parts = []
    for k, g, is_greedy in zip(counts.tolist(), generators, greedy.tolist(), strict=True):
        if is_greedy or g is None:
            parts.append(torch.rand(k))
        else:
            parts.append(torch.rand(k, generator=g))
    return torch.cat(parts).numpy() if parts else np.zeros(0, np.float32)
