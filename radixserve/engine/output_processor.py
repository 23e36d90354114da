"""A request's text: incremental detokenization and stop strings, in one place.

The engine's loop handles token ids only. Whoever wants text runs the deltas through a
``RequestOutputProcessor``: the serving frontend (the engine process sends ids only, so
its loop never spends time on text, as vLLM's output processor does), and the engine
itself when it detokenizes for an in-process caller (``LLM``, ``Engine(detokenize=True)``).
"""

from __future__ import annotations

from typing import Any, Protocol

from radixserve.core.sampling_params import SamplingParams
from radixserve.engine.detokenizer import IncrementalDetokenizer


class Delta(Protocol):
    """What the processor reads and sets of a delta: the engine's ``SequenceDelta`` and the
    wire's ``serving.protocol.Delta`` both are one."""

    index: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    error: str | None
    logprobs: Any
    stop_str: str | None


class RequestOutputProcessor:
    """Detokenizes the ``n`` samples of one request.

    Invariants: each sample yields exactly one finished delta, after which its later engine
    deltas are dropped; the texts of a sample's deltas join to its final text; when a stop
    string ends a sample here, its token ids and logprobs end at the token that completed
    the stop string and the caller is told to abort that sample in the engine. A finish
    with reason ``stop`` from the engine means a stop token: its id counts as output but
    adds no text (as in the engine's own detokenization).
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams, n: int
    ) -> None:
        self.detokenizers = [
            IncrementalDetokenizer(
                tokenizer,
                prompt_token_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            )
            for _ in range(n)
        ]
        self.done = [False] * n

    def process(self, delta: Delta) -> tuple[Delta | None, bool]:
        """(the delta with its text, or None if the sample already ended; whether a stop
        string ended the sample here while the engine is still running it)."""
        i = delta.index
        if self.done[i]:
            return None, False
        detok = self.detokenizers[i]
        ids = delta.token_ids
        stop_token = delta.finished and delta.finish_reason == "stop" and bool(ids)
        for k, token in enumerate(ids[:-1] if stop_token else ids):
            detok.add_token(token)
            if detok.stopped_by is not None:
                delta.token_ids = ids[: k + 1]
                if delta.logprobs:
                    delta.logprobs = delta.logprobs[: k + 1]
                engine_running = not delta.finished
                delta.finished, delta.finish_reason, delta.error = True, "stop", None
                delta.stop_str = detok.stopped_by
                delta.text = detok.take_delta(finished=True)
                self.done[i] = True
                return delta, engine_running
        if delta.finished:
            if delta.finish_reason != "abort":
                detok.flush()
            self.done[i] = True
        delta.text = detok.take_delta(finished=delta.finished)
        return delta, False
