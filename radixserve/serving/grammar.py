"""Structured-output grammars checked in the frontend: a request's grammar is compiled
(in a worker thread) before the request reaches the engine, and its errors name the field
of the API the spec came from (``source``: response_format, structured_outputs, tools,
sampling_params)."""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

from radixserve.core.errors import InputError
from radixserve.core.sampling_params import SamplingParams
from radixserve.engine.structured import DEFAULT_COMPILE_TIMEOUT_S


def _param_of(message: str, spec_source: str) -> str:
    """The request field a ``structured_output...`` error message is about."""
    m = re.match(r"structured_output(\.[a-z_]+)?", message)
    sub = m.group(1) if m and m.group(1) else ""
    if spec_source == "response_format":
        return "response_format.json_schema.schema" if sub == ".json" else "response_format"
    if spec_source == "tools":
        return "tools"
    if spec_source == "sampling_params":
        return "sampling_params.structured_output" + sub
    if spec_source == "structured_outputs":
        return "structured_outputs" + sub
    return spec_source  # a field that is one spec by itself (guided_json, regex, ...)


def _public_message(message: str, spec_source: str) -> str:
    return re.sub(r"^structured_output(\.[a-z_]+)?", _param_of(message, spec_source), message)


class GrammarChecker:
    """Compiles a request's grammar in a worker thread before the request goes to the
    engine, so that a bad schema, regex or grammar is an ``InputError`` naming its field (a
    400 at the API) and a grammar that compiles too slowly is one too, never a hang.
    Invariant: the event loop never waits on a compile (``asyncio.wait`` on the worker's future, bounded by the timeout);
    compiled grammars stay cached by spec text (the engine compiles its own copy)."""

    def __init__(self, tokenizer: Any, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self._service = None
        self._lock = threading.Lock()

    def _get_service(self, vocab_size: int):
        with self._lock:
            return self._make_service(vocab_size)

    def _make_service(self, vocab_size: int):
        if self._service is None:
            from radixserve.engine.structured import GrammarService

            eos = self.tokenizer.eos_token_id
            self._service = GrammarService(
                self.tokenizer, vocab_size, [eos] if eos is not None else None
            )
        return self._service

    async def check(self, spec: dict[str, Any], vocab_size: int, source: str) -> None:
        try:
            key = SamplingParams(structured_output=spec).grammar_key()
        except ValueError as exc:
            raise InputError(
                _public_message(str(exc), source), _param_of(str(exc), source)
            ) from None
        assert key is not None
        if self._service is None:  # the tokenizer's vocabulary scan (~0.1 s) off the loop
            await asyncio.to_thread(self._get_service, vocab_size)
        service = self._get_service(vocab_size)
        future = asyncio.wrap_future(service.submit(key))
        done, _ = await asyncio.wait([future], timeout=self.timeout_s)
        if not done:
            from radixserve.engine.structured import timeout_message

            message = timeout_message(key[0], self.timeout_s)
            raise InputError(_public_message(message, source), _param_of(message, source))
        exc = future.exception()
        if exc is not None:
            raise InputError(_public_message(str(exc), source), _param_of(str(exc), source))

    def close(self) -> None:
        if self._service is not None:
            self._service.close()
