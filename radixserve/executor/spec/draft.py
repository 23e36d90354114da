"""The draft-model proposer: a smaller model with the same vocabulary guesses greedily."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from radixserve.core.page_table import PageTable
from radixserve.core.request import Request
from radixserve.executor.attention import TorchNativeAttention
from radixserve.executor.forward_batch import ForwardBatch
from radixserve.executor.kv_cache import KVCache, bytes_per_page


class DraftProposer:
    """Proposes by running a draft model greedily for ``k`` steps, batched over requests.

    Invariants:
      * the draft has its own KV cache addressed by the target's page ids (same page table,
        same page size, as many pages): every page accounting of the target (free,
        private, tree-held, copy-on-write) covers the draft's KV of that page too;
      * ``shadow`` runs the draft over exactly the tokens and slots a verify step writes
        (page copies first), so a page's draft KV belongs to the same tokens as its target
        KV, also when it comes back from the radix tree; any other step (prompt chunks,
        plain decodes: nothing to draft for yet, maybe never) runs no draft and marks the
        pages it wrote ``stale``; ``fill`` first recomputes a request's draft KV from its
        first stale page on (one extend, ``catch_up``), so a request drafts from correct
        KV whatever ran before (a copied page takes its source's mark; a shadowed step
        that writes a page's first slot clears the page's mark). A draft that never
        proposes costs nothing but its memory;
      * proposals are the draft's argmax, a deterministic function of the tokens so far:
        the verify rule treats them as point masses, so the output stays exact;
      * ``fill`` writes draft KV only at positions ``num_tokens - 1 ..`` of the rows the
        scheduler grew for the proposals (pages private to that request).
    """

    def __init__(
        self,
        kind: str,
        path: Path,
        num_pages: int,
        page_size: int,
        page_table: PageTable,
        dtype: torch.dtype,
        vocab_size: int,
        quantization: str = "auto",
    ) -> None:
        from radixserve.executor.weights import load_model

        if quantization in ("int8", "int4"):
            dtype = torch.bfloat16  # the quantized kernels' activations, whatever the target's
        loaded = load_model(
            kind,
            path,
            device=torch.device("cpu"),
            dtype=str(dtype).removeprefix("torch."),
            quantization=quantization,
        )
        self.config = mc = loaded.config
        if mc.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({mc.vocab_size}) is not the target's "
                f"({vocab_size}): a draft must share the tokenizer"
            )
        self.model = loaded.model
        self.scheme = loaded.scheme  # None: the draft runs in ``dtype`` unquantized
        self.dtype = dtype
        self.kv_cache = KVCache(
            mc.num_hidden_layers,
            num_pages,
            page_size,
            self.model.config.num_key_value_heads,
            mc.head_dim,
            dtype,
        )
        self.kv_bytes = num_pages * bytes_per_page(
            mc.num_hidden_layers,
            self.model.config.num_key_value_heads,
            mc.head_dim,
            page_size,
            dtype,
        )
        self.attention = TorchNativeAttention(
            self.kv_cache, mc.num_attention_heads, mc.head_dim, specs=self.model.attention_specs()
        )
        self.page_table = page_table
        self.page_size = page_size
        self.stale = np.zeros(num_pages, dtype=bool)  # a slot's draft KV may be missing
        self.skipped_steps = 0  # steps not shadowed (no verify: prompts, plain decodes)
        self.caught_up_tokens = 0  # tokens recomputed by catch_up

    # -- lockstep with the target -----------------------------------------------------------
    @torch.inference_mode()
    def shadow(
        self,
        fb: ForwardBatch,
        input_ids: np.ndarray,
        copies: tuple[torch.Tensor, torch.Tensor] | None,
        verify: bool = True,
    ) -> None:
        """Write the draft's KV for the tokens of a verify step (no logits); any other step
        only marks its pages stale."""
        if copies is not None:
            self.kv_cache.copy_pages(*copies)
            src, dst = (c.numpy() for c in copies)
            self.stale[dst] = self.stale[src]
        pages = fb.slot_mapping // self.page_size
        if not verify:
            self.stale[pages] = True
            self.skipped_steps += 1
            return
        self.stale[pages[fb.slot_mapping % self.page_size == 0]] = False
        self.model.forward(
            torch.from_numpy(input_ids),
            torch.from_numpy(fb.positions),
            self.attention,
            self.attention.prepare(fb),
        )

    # -- proposing --------------------------------------------------------------------------
    @torch.inference_mode()
    def fill(self, requests: list[Request], counts: list[int]) -> None:
        """Write ``counts[i]`` greedy draft tokens after ``requests[i]``'s last token (in its
        ``token_ids`` past ``num_tokens``), running the draft ``max(counts)`` decode steps
        over the requests still drafting."""
        if not requests:
            return
        self.catch_up(requests)
        lengths = np.array([r.num_tokens for r in requests], dtype=np.int64)
        rows = np.array([r.table_row for r in requests], dtype=np.int64)
        want = np.array(counts, dtype=np.int64)
        tokens = np.array([r.token_ids[r.num_tokens - 1] for r in requests], dtype=np.int64)
        for j in range(int(want.max())):
            live = np.flatnonzero(want > j)
            positions = lengths[live] - 1 + j
            fb = self._decode_batch(rows[live], positions)
            hidden = self.model.forward(
                torch.from_numpy(tokens[live].copy()),
                torch.from_numpy(positions),
                self.attention,
                self.attention.prepare(fb),
            )
            logits = self.model.compute_logits(hidden, upcast=False)
            nxt = logits.max(dim=-1).indices.numpy()
            for i, tok in zip(live.tolist(), nxt.tolist(), strict=True):
                r = requests[i]
                r.token_ids[r.num_tokens + j] = tok
            tokens[live] = nxt

    @torch.inference_mode()
    def catch_up(self, requests: list[Request]) -> None:
        """Recompute the draft KV of positions ``..num_tokens - 2`` of each request from its
        first stale page on (pages its plain decode steps, or an earlier owner's, wrote
        without the draft), all requests in one extend; their pages are then clean."""
        ps = self.page_size
        table = self.page_table.table
        ids, positions, slots, q_lens, seq_lens, rows = [], [], [], [], [], []
        for r in requests:
            n = r.num_tokens
            if n < 2:
                continue
            pages = table[r.table_row, : (n - 2) // ps + 1].astype(np.int64)
            stale = np.flatnonzero(self.stale[pages])
            if stale.size == 0:
                continue
            first = int(stale[0])
            pos = np.arange(first * ps, n - 1, dtype=np.int64)
            ids.append(np.asarray(r.token_ids[first * ps : n - 1], dtype=np.int64))
            positions.append(pos)
            slots.append(pages[pos // ps] * ps + pos % ps)
            q_lens.append(pos.size)
            seq_lens.append(n - 1)
            rows.append(r.table_row)
            self.stale[pages[first:]] = False
        if not rows:
            return
        q = np.array(q_lens, dtype=np.int64)
        lens = np.array(seq_lens, dtype=np.int64)
        max_pages = int(-(-lens.max() // ps))
        fb = ForwardBatch(
            input_ids=np.concatenate(ids),
            positions=np.concatenate(positions),
            slot_mapping=np.concatenate(slots),
            q_lens=q,
            seq_lens=lens,
            query_start_loc=np.concatenate([[0], np.cumsum(q)]).astype(np.int64),
            page_tables=table[np.array(rows), :max_pages].astype(np.int64),
            logits_indices=np.zeros(0, dtype=np.int64),
            page_size=ps,
        )
        self.caught_up_tokens += int(q.sum())
        self.model.forward(
            torch.from_numpy(fb.input_ids),
            torch.from_numpy(fb.positions),
            self.attention,
            self.attention.prepare(fb),
        )

    def _decode_batch(self, rows: np.ndarray, positions: np.ndarray) -> ForwardBatch:
        """One token per request at ``positions`` (KV before them is the draft's)."""
        b = rows.size
        seq_lens = positions + 1
        max_pages = int(-(-seq_lens.max() // self.page_size))
        page_tables = self.page_table.table[rows, :max_pages].astype(np.int64)
        slot_mapping = (
            page_tables[np.arange(b), positions // self.page_size] * self.page_size
            + positions % self.page_size
        )
        return ForwardBatch(
            input_ids=np.zeros(b, dtype=np.int64),
            positions=positions,
            slot_mapping=slot_mapping,
            q_lens=np.ones(b, dtype=np.int64),
            seq_lens=seq_lens,
            query_start_loc=np.arange(b + 1, dtype=np.int64),
            page_tables=page_tables,
            logits_indices=np.arange(b, dtype=np.int64),
            page_size=self.page_size,
        )
