"""Incremental detokenization with stop strings that never leak into the output."""

from __future__ import annotations

from tokenizers import Tokenizer

# Tokens of context decoded before the new ones, so a token's leading space or a
# multi-byte character split across tokens comes out right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one sequence's token ids into text deltas.

    Invariants:
      * ``text`` is the decoded output so far, cut before the first stop string (unless it
        is kept with ``include_stop``) once one is found;
      * the concatenation of every returned delta equals ``text`` when the sequence ends;
        until then, up to ``len(longest stop) - 1`` trailing characters are held back, as they
        could be the start of a stop string;
      * a delta never ends inside a multi-byte character (an incomplete one decodes to
        U+FFFD and waits for its next token).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop: list[str],
        include_stop: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._include_stop = include_stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._emitted = 0
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add_token(self, token_id: int) -> None:
        """Decode one more token into ``text``; sets ``stopped_by`` if a stop string appears."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return
        new_text = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if len(self._ids) > 4 * _CONTEXT_TOKENS:  # keep the window short
            drop = self._prefix_offset
            self._ids = self._ids[drop:]
            self._prefix_offset -= drop
            self._read_offset -= drop
        search_from = max(0, len(self.text) - self._holdback)
        self.text += new_text
        if self._stop:
            self._find_stop(search_from)

    def _find_stop(self, search_from: int) -> None:
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = self.text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s)] if self._include_stop else self.text[:i]
            self.stopped_by = s

    def flush(self) -> None:
        """At the end, decode tokens still held back waiting for a complete character."""
        if self.stopped_by is None and self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            self.text += full[len(prefix) :]
            self._read_offset = len(self._ids)

    def take_delta(self, finished: bool) -> str:
        """New text since the last call; all of it once the sequence is ``finished``."""
        end = len(self.text) if finished or self.stopped_by else len(self.text) - self._holdback
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
