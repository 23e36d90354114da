"""Structured-output grammars checked in the frontend: a request's grammar is parsed (in a
worker thread) before the request reaches the engine, which compiles it; errors name the
field of the API the spec came from (``source``: response_format, structured_outputs,
tools, sampling_params)."""

from __future__ import annotations

import asyncio
import re
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
    """Checks a request's grammar in the frontend, so that a bad schema, regex or grammar
    is an ``InputError`` naming its field (a 400 at the API) before anything is sent.

    It parses the spec (``executor.grammar.parse_grammar``: no tokenizer, no token masks)
    and compiles nothing: the engine compiles each grammar once, for its vocabulary (a
    request is checked once and compiled once). Invariant: the event loop never waits on a
    parse (a worker thread, bounded by ``timeout_s``: a spec that takes longer is refused).
    """

    def __init__(self, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s

    async def check(self, spec: dict[str, Any], source: str) -> None:
        from radixserve.engine.structured import parse_grammar, timeout_message

        try:
            key = SamplingParams(structured_output=spec).grammar_key()
        except ValueError as exc:
            raise InputError(
                _public_message(str(exc), source), _param_of(str(exc), source)
            ) from None
        assert key is not None
        future = asyncio.ensure_future(asyncio.to_thread(parse_grammar, key))
        done, _ = await asyncio.wait([future], timeout=self.timeout_s)
        if not done:
            future.cancel()
            message = timeout_message(key[0], self.timeout_s)
            raise InputError(_public_message(message, source), _param_of(message, source))
        exc = future.exception()
        if exc is not None:
            raise InputError(_public_message(str(exc), source), _param_of(str(exc), source))
