"""A scheduled batch flattened into the arrays a forward pass consumes (numpy, no torch)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from radixserve.core.page_table import PageTable
from radixserve.core.request import Request
from radixserve.core.step import ScheduledBatch
from radixserve.executor.lora import LoRAStep
from radixserve.executor.quant import PANEL_COPY_ROWS


def long_prompt_tokens(req: Request) -> int:
    """The prompt tokens ``req`` computes (its prompt less the prefix cache's hit)."""
    return req.num_prompt_tokens - req.num_cached_tokens


@dataclass
class ForwardBatch:
    """Flat token-major inputs of one step.

    Invariants (B requests, T tokens):
      * request i owns tokens ``query_start_loc[i] : query_start_loc[i+1]`` of ``input_ids``,
        ``positions`` and ``slot_mapping``; its positions are
        ``seq_lens[i] - q_lens[i] .. seq_lens[i] - 1``;
      * ``page_tables[i, :ceil(seq_lens[i] / page_size)]`` are request i's pages, and
        ``slot_mapping[t] = page * page_size + position % page_size`` is where token t's KV goes;
      * ``logits_indices`` are the flat indices of the last token of each sampled request,
        in batch order — of its last ``num_spec[i] + 1`` tokens when it verifies proposals.
    """

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    q_lens: np.ndarray  # [B] int64
    seq_lens: np.ndarray  # [B] int64: KV length after this step
    query_start_loc: np.ndarray  # [B+1] int64
    page_tables: np.ndarray  # [B, max_pages] int64
    logits_indices: np.ndarray  # [S] int64
    page_size: int
    # the step computes prompt tokens of a prompt with at least PANEL_COPY_ROWS of them to
    # compute (quantized layers then multiply their prefill copy: quant.long_prompt_step)
    long_prompt: bool = False
    # the LoRA adapters of the step's rows (None: every request is on the base model)
    lora: LoRAStep | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.size)

    @property
    def num_requests(self) -> int:
        return int(self.q_lens.size)

    @classmethod
    def build(
        cls,
        scheduled: ScheduledBatch,
        page_table: PageTable,
        page_size: int,
        sample: np.ndarray | None = None,
    ) -> ForwardBatch:
        """``sample``: the rows that get logits (default ``scheduled.sample``; the runner
        leaves out pooling requests, which sample nothing)."""
        reqs = scheduled.requests
        sample = scheduled.sample if sample is None else sample
        q_lens = scheduled.num_new_tokens.astype(np.int64)
        starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=len(reqs))
        rows = np.fromiter((r.table_row for r in reqs), dtype=np.int64, count=len(reqs))
        seq_lens = starts + q_lens
        query_start_loc = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        if num_tokens == len(reqs):  # decode-only step: one token each
            input_ids = np.fromiter(
                (r.token_ids[c] for r, c in zip(reqs, starts.tolist(), strict=True)),
                dtype=np.int64,
                count=len(reqs),
            )
            positions = starts
            token_req = np.arange(len(reqs))
            long_prompt = False
        else:
            input_ids = np.concatenate(
                [
                    r.token_ids[c : c + n]
                    for r, c, n in zip(reqs, starts.tolist(), q_lens.tolist(), strict=True)
                ]
            ).astype(np.int64)
            token_req = np.repeat(np.arange(len(reqs)), q_lens)
            long_prompt = any(
                n > 1 and c < r.num_prompt_tokens and long_prompt_tokens(r) >= PANEL_COPY_ROWS
                for r, c, n in zip(reqs, starts.tolist(), q_lens.tolist(), strict=True)
            )
            positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(
                starts - query_start_loc[:-1], q_lens
            )

        max_pages = int(-(-seq_lens.max() // page_size)) if len(reqs) else 0
        page_tables = page_table.table[rows, :max_pages].astype(np.int64)
        slot_mapping = (
            page_tables[token_req, positions // page_size] * page_size + positions % page_size
        )
        ends = query_start_loc[1:][sample]
        if scheduled.has_spec:  # every verified position of a speculating request
            assert scheduled.num_spec is not None
            rows = scheduled.num_spec[sample].astype(np.int64) + 1
            first = np.repeat(ends - rows, rows)
            logits_indices = first + (
                np.arange(int(rows.sum())) - np.repeat(np.cumsum(rows) - rows, rows)
            )
        else:
            logits_indices = ends - 1
        return cls(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            q_lens=q_lens,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            page_tables=page_tables,
            logits_indices=logits_indices,
            page_size=page_size,
            long_prompt=long_prompt,
            lora=LoRAStep.build([r.lora for r in reqs], query_start_loc)
            if any(r.lora is not None for r in reqs)
            else None,
        )
