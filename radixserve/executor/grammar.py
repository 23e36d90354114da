"""Constrained decoding with xgrammar: grammar compilation (off the engine loop, cached)
and the per-step token bitmask of every constrained request, filled in one batched call."""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time
from collections import deque
from typing import Any, ClassVar

import numpy as np
import torch

from radixserve.executor.native import apply_token_bitmask, load_token_mask

_DEFAULT_COMPILE_THREADS = 2


def _xgr():
    import xgrammar  # imported on first use: free requests never pay for it

    return xgrammar


def _fill_threads() -> int:
    """Threads of the batched bitmask fill: half the cores, at most 4 (on a small CPU the
    model's own threads need the rest; measured on 2 cores: 1 thread is faster than 2)."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are
    valid EBNF string literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompileError(ValueError):
    """A structured-output spec that does not compile; the message names the field."""


def parse_grammar(key: tuple[str, str]) -> Any:
    """The grammar of ``key`` (``SamplingParams.grammar_key``) parsed, not compiled: no
    tokenizer, well under a millisecond for usual specs. Every error a spec can have shows
    here (a bad schema, regex or EBNF), as ``GrammarCompileError`` naming the field, so the
    frontend checks a request with this and only the engine compiles (the vocabulary's
    token masks, the expensive part)."""
    xgr = _xgr()
    kind, text = key
    kind, _, after = kind.partition("@")
    if after:  # the thinking first, then the answer's grammar
        return xgr.Grammar.concat(_thinking_grammar(after), parse_grammar((kind, text)))
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(text, any_whitespace=False)
        if kind == "json_object":  # OpenAI's json_object: some JSON object
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(text)))
    except Exception as exc:  # xgrammar raises RuntimeError with the parser's message
        message = str(exc).strip().splitlines()
        detail = message[-1] if message else type(exc).__name__
        raise GrammarCompileError(
            f"structured_output.{kind}: invalid {_KIND_NAMES[kind]}: {_strip_location(detail)}"
        ) from None
    raise GrammarCompileError(f"structured_output: unknown kind {kind!r}")


_THINK_END = "</think>"


def _thinking_grammar(family: str) -> Any:
    """What may come before the answer's grammar (``structured_output.reasoning``): the
    family's thinking block, any text without its end marker, then the marker and the
    whitespace after it. The text is the exact language "no ``</think>`` in it", written
    as the automaton that looks for the marker (state k: its first k characters just
    seen). qwen3: the block is optional (no thinking: the answer at once); deepseek_r1:
    the reply starts inside the thinking (a leading ``<think>`` allowed) and must close it.
    """
    xgr = _xgr()
    marker = _THINK_END
    rules = []
    for k in range(len(marker)):
        alts = ['""', f"[^<{marker[k] if k else ''}] s0", '"<" s1']
        if 0 < k < len(marker) - 1:
            alts.append(f'"{marker[k]}" s{k + 1}')
        rules.append(f"s{k} ::= " + " | ".join(alts))
    block = f'"{marker}" [ \\t\\r\\n]*'
    if family == "qwen3":
        root = f'root ::= ("<think>" s0 {block})?'
    elif family == "deepseek_r1":
        root = f'root ::= "<think>"? s0 {block}'
    else:
        raise GrammarCompileError(f"structured_output.reasoning: unknown family {family!r}")
    return xgr.Grammar.from_ebnf("\n".join([root, *rules]))


class GrammarService:
    """Compiles structured-output specs for one tokenizer in worker threads.

    Invariants: ``submit`` never blocks (it returns a future); a spec's key ``(kind, text)``
    is compiled at most once while cached (concurrent askers share one future); a failed
    compile is not cached (the same bad spec fails again the same way); the cache holds at
    most ``cache_size`` compiled grammars, least recently used dropped first.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int] | None = None,
        threads: int = _DEFAULT_COMPILE_THREADS,
        cache_size: int = 256,
    ) -> None:
        xgr = _xgr()
        if getattr(tokenizer, "backend_tokenizer", None) is None:
            raise ValueError("structured output needs the model's tokenizer")
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=threads)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "grammar-compile")
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str], concurrent.futures.Future] = {}
        self._cache_size = cache_size

    def submit(self, key: tuple[str, str]) -> concurrent.futures.Future:
        """A future of the compiled grammar of ``key`` (see ``SamplingParams.grammar_key``)."""
        with self._lock:
            fut = self._cache.pop(key, None)
            if fut is None or (fut.done() and fut.exception() is not None):
                fut = self._pool.submit(self._compile, key)
            self._cache[key] = fut  # most recently used last
            while len(self._cache) > self._cache_size:
                del self._cache[next(iter(self._cache))]
            return fut

    def _compile(self, key: tuple[str, str]) -> Any:
        grammar = parse_grammar(key)
        try:
            return self._compiler.compile_grammar(grammar)
        except Exception as exc:  # parsed, yet xgrammar refused it: still the spec's fault
            message = str(exc).strip().splitlines()
            detail = message[-1] if message else type(exc).__name__
            raise GrammarCompileError(
                f"structured_output.{key[0]}: {_strip_location(detail)}"
            ) from None

    def compile(self, key: tuple[str, str], timeout_s: float) -> Any:
        """Compile (or fetch) ``key``, waiting at most ``timeout_s``; ``GrammarCompileError``
        on a bad spec or a timeout."""
        try:
            return self.submit(key).result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise GrammarCompileError(timeout_message(key[0], timeout_s)) from None

    def matcher(self, compiled: Any) -> GrammarState:
        return GrammarState(_xgr().GrammarMatcher(compiled))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON grammar",
    "regex": "regular expression",
    "grammar": "EBNF grammar",
    "choice": "choice list",
}


def timeout_message(kind: str, timeout_s: float) -> str:
    return f"structured_output.{kind}: the grammar did not compile within {timeout_s:g} s"


def _strip_location(detail: str) -> str:
    """xgrammar prefixes messages with ``[time] /path/file.cc:line: ``; keep the rest."""
    if detail.startswith("[") and ".cc:" in detail:
        detail = detail.split(": ", 1)[-1]
    return detail


class GrammarState:
    """The grammar matcher of one constrained sample.

    Invariant: the matcher has accepted exactly the sample's first ``num_accepted`` output
    tokens: those of every step run so far (the sampler accepts each token right after
    drawing it, on the device side, in step order). ``end_at`` is the output number of the
    token that ended the grammar (a stop token accepted, or a token refused: ``failed``),
    0 while it goes on; the host, processing tokens in order, ends the sample at that token
    (with overlap the device may be a step ahead of it).
    """

    __slots__ = ("end_at", "failed", "matcher", "num_accepted")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.num_accepted = 0
        self.end_at = 0
        self.failed = False

    @property
    def done(self) -> bool:
        return self.end_at > 0

    def ends_at(self, num_output: int) -> bool:
        """Whether output token number ``num_output`` (1-based) ended the grammar."""
        return self.end_at == num_output


class GrammarBatch:
    """The constrained rows of one step's sampling batch (``rows[i]`` ↔ ``states[i]``).

    Invariant: built at prepare time from the requests' states; ``apply`` runs on the device
    side after every earlier step has accepted its tokens, so each matcher is current.
    """

    __slots__ = ("rows", "states")

    _batch_matcher: ClassVar[Any] = None
    mask_ms: ClassVar[deque[float]] = deque(maxlen=100_000)  # per step: fill + apply, milliseconds

    def __init__(self, rows: list[int], states: list[GrammarState]) -> None:
        self.rows = rows
        self.states = states

    @classmethod
    def of(cls, requests: list[Any]) -> GrammarBatch | None:
        rows, states = [], []
        for i, r in enumerate(requests):
            if r.grammar is not None:
                rows.append(i)
                states.append(r.grammar)
        return cls(rows, states) if rows else None

    def apply(self, logits: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """``logits`` with every token a constrained row's grammar forbids at -inf (one
        batched bitmask fill for all rows; rows of other requests untouched). ``inplace``:
        the caller owns ``logits`` (no copy)."""
        xgr = _xgr()
        started = time.perf_counter()
        live = [j for j, s in enumerate(self.states) if not s.done]
        if not live:
            return logits
        num_rows, vocab = logits.shape
        rows = [self.rows[j] for j in live]
        bitmask = xgr.allocate_token_bitmask(num_rows, vocab)  # row i ↔ logits row i
        if GrammarBatch._batch_matcher is None:
            GrammarBatch._batch_matcher = xgr.BatchGrammarMatcher(_fill_threads())
        GrammarBatch._batch_matcher.batch_fill_next_token_bitmask(
            [self.states[j].matcher for j in live], bitmask, rows
        )
        if not inplace:
            logits = logits.clone()
        native = load_token_mask() if logits.device.type == "cpu" else None
        if native is not None and apply_token_bitmask(
            native, logits, bitmask, torch.tensor(rows, dtype=torch.int64)
        ):
            GrammarBatch.mask_ms.append((time.perf_counter() - started) * 1e3)
            return logits
        words = bitmask if len(rows) == num_rows else bitmask[rows]
        if logits.device.type == "cpu":  # numpy unpacks bits ~10x faster than xgrammar's loop
            bits = np.unpackbits(words.numpy().view(np.uint8), axis=-1, bitorder="little")
            allowed = torch.from_numpy(bits[:, :vocab].view(np.bool_))
        else:
            allowed = unpack_bitmask(words.to(logits.device, non_blocking=True), vocab)
        if len(rows) == num_rows:
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            index = torch.tensor(rows, dtype=torch.long).to(logits.device)
            logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))
        GrammarBatch.mask_ms.append((time.perf_counter() - started) * 1e3)
        return logits

    def accept(self, tokens: np.ndarray) -> None:
        """Advance each row's matcher with the token drawn for it (host array, by row)."""
        for row, state in zip(self.rows, self.states, strict=True):
            if state.done:
                continue
            state.num_accepted += 1
            if not state.matcher.accept_token(int(tokens[row])):
                state.failed = True
                state.end_at = state.num_accepted
            elif state.matcher.is_terminated():
                state.end_at = state.num_accepted


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[k, ceil(vocab / 32)] int32 bit words → [k, vocab] bool (bit j of word w: token
    32 w + j allowed), with tensor ops on the bitmask's device."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
