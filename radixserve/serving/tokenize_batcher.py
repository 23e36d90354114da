"""Batched tokenization for the frontend: texts submitted in one event-loop turn are
encoded together in one call of the fast (Rust) tokenizer."""

from __future__ import annotations

import asyncio
from typing import Any


class TokenizeBatcher:
    """Coalesces ``encode`` calls. Invariant: every submitted text gets exactly the ids
    that ``tokenizer(text, add_special_tokens=...)["input_ids"]`` gives; texts queued in
    one loop turn are encoded by one ``encode_batch`` per ``add_special_tokens`` value.

    Uses the tokenizer's Rust backend (``backend_tokenizer``) when it has one; otherwise
    it calls the tokenizer itself, once per batch.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self._pending: list[tuple[str, bool, asyncio.Future]] = []
        self.num_batches = 0  # encode calls made, for tests and metrics

    def encode(self, text: str, add_special_tokens: bool = True) -> asyncio.Future:
        """A future of ``text``'s token ids."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((text, add_special_tokens, future))
        return future

    async def encode_many(self, texts: list[str], add_special_tokens: bool = True):
        return list(await asyncio.gather(*(self.encode(t, add_special_tokens) for t in texts)))

    def encode_now(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Encode in one call, synchronously."""
        if not texts:
            return []
        self.num_batches += 1
        if self.backend is not None:
            encodings = self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)
            return [e.ids for e in encodings]
        return list(self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"])

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for flag in (True, False):
            group = [(text, fut) for text, special, fut in pending if special is flag]
            if not group:
                continue
            try:
                ids = self.encode_now([text for text, _ in group], flag)
            except Exception as exc:  # a tokenizer failure fails the batch's callers
                for _, fut in group:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), token_ids in zip(group, ids, strict=True):
                if not fut.done():  # (its caller may have been cancelled)
                    fut.set_result(token_ids)
