"""What completions and chat share: running a request to its end (``collect``) or as
server-sent events (``stream_events``), usage, and the JSON/SSE framing."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from radixserve.api.asgi import APIError
from radixserve.api.openai.converter import engine_error
from radixserve.api.openai.state import OpenAIServer
from radixserve.core.sampling_params import SamplingParams
from radixserve.serving.engine_streams import EngineDead, RequestRejected
from radixserve.serving.metrics import RequestTimer
from radixserve.serving.protocol import Delta
from radixserve.serving.tenancy import Routing

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage(
    prompts: list[list[int]],
    completion_tokens: int,
    cached: int,
    reasoning_tokens: int | None = None,
) -> dict:
    """OpenAI's usage object; ``reasoning_tokens`` (with a reasoning parser) adds
    ``completion_tokens_details``."""
    prompt_tokens = sum(len(p) for p in prompts)
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


@dataclass
class SampleOutput:
    """One finished sample: its text, token count, finish reason and logprobs."""

    text: str = ""
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    reason: str | None = None
    error: str | None = None
    logprobs: list = field(default_factory=list)
    stop_str: str | None = None  # the stop string that ended it, if one did


@dataclass
class Collected:
    """Every sample of a request, by choice index (prompt i, sample j: ``i * n + j``)."""

    outputs: dict[int, SampleOutput]
    prompt_logprobs: dict[int, list]  # by prompt: from the sample that computed the prompt
    cached_tokens: int
    completion_tokens: int


def sample_error(message: str | None) -> APIError:
    """A sample the engine ended with an error: the request's fault (400) when its grammar
    would not compile there (it parsed in the frontend, but xgrammar refused it or it took
    longer than ``--grammar-compile-timeout``), the server's (500) otherwise."""
    if message is not None and message.startswith("structured_output"):
        return APIError(400, message, param="structured_output")
    return APIError(500, message or "generation failed", type_="internal_error")


async def collect(
    server: OpenAIServer,
    prompts: list[list[int]],
    params: SamplingParams,
    routing: Routing,
    run: Any = None,
) -> Collected:
    """Run the request to its end; a sample that failed in the engine is a 500. ``run``:
    what yields the (prompt index, delta) pairs (None: ``Frontend.run``)."""
    frontend, n = server.frontend_of(routing), params.n
    started = time.monotonic()
    try:
        items = [x async for x in (run or frontend.run)(prompts, params, routing)]
    except (RequestRejected, EngineDead) as exc:
        raise engine_error(exc) from None
    outs: dict[int, SampleOutput] = {}
    cached: dict[int, int] = {}
    prompt_lps: dict[int, list] = {}
    first = None
    for i, d in items:
        if d.prompt_logprobs:
            prompt_lps[i] = d.prompt_logprobs
        o = outs.setdefault(i * n + d.index, SampleOutput())
        o.text += d.text
        o.tokens += len(d.token_ids)
        o.token_ids.extend(d.token_ids)
        o.logprobs.extend(d.logprobs or ())
        if d.token_ids and first is None:
            first = time.monotonic()
        if d.finished:
            o.reason, o.error, o.stop_str = d.finish_reason, d.error, d.stop_str
            cached[i] = max(cached.get(i, 0), d.num_cached_tokens)
    errors = [o.error for o in outs.values() if o.reason == "error"]
    if errors:
        raise sample_error(errors[0])
    total = sum(o.tokens for o in outs.values())
    metrics, label = frontend.metrics, routing.tag.label
    for o in outs.values():
        metrics.request_success.labels(o.reason or "unknown", label).inc()
    metrics.e2e.labels(label).observe(time.monotonic() - started)
    if first is not None:
        metrics.ttft.labels(label).observe(first - started)
    metrics.generation_tokens.labels(label).inc(total)
    metrics.prompt_tokens.labels(label).inc(sum(len(p) for p in prompts))
    return Collected(dict(sorted(outs.items())), prompt_lps, sum(cached.values()), total)


async def stream_events(
    server: OpenAIServer,
    prompts: list[list[int]],
    params: SamplingParams,
    routing: Routing,
    body: Any,
    on_delta: Callable[[int, Delta], bytes],
    on_finish: Callable[[int, str | None], bytes],
    head: Callable[[], Iterable[bytes]],
    usage_obj: dict,
    every_token_step: bool = False,
    reasoning_tokens: Callable[[], int] | None = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
) -> AsyncIterator[bytes]:
    """Shared SSE loop: head frames, per-delta frames, then usage and [DONE]. ``usage_obj``
    is the dict every frame is made from: with ``stream_options.continuous_usage_stats``
    (vLLM's extension) it carries the usage so far, so every chunk does.

    ``every_token_step``: a delta that brings tokens but no text yet (the detokenizer holds
    back an incomplete character or a possible stop string, or the token is a skipped
    special one) still gets a frame, with empty text (unless it is the last: its finish
    frame follows at once), as vLLM's completions stream does: the client sees its first
    token when it is made, not one engine step later. Otherwise such deltas are skipped."""
    n = params.n
    timer = RequestTimer(server.frontend_of(routing).metrics, routing.tag.label)
    cached: dict[int, int] = {}
    options = body.stream_options
    continuous = options is not None and options.continuous_usage_stats
    try:
        if continuous:
            usage_obj["usage"] = usage(prompts, 0, 0)
        for frame in head():
            yield frame
        async for i, d in server.frontend_of(routing).run(prompts, params, routing):
            idx = i * n + d.index
            timer.delta(idx, d)
            if on_tokens is not None:  # every delta's ids, text or not (reasoning tokens)
                on_tokens(idx, d.token_ids)
            if d.finished:
                cached[i] = max(cached.get(i, 0), d.num_cached_tokens)
            if continuous:
                usage_obj["usage"] = usage(
                    prompts,
                    timer.tokens,
                    sum(cached.values()),
                    reasoning_tokens() if reasoning_tokens is not None else None,
                )
            if d.text or d.logprobs or (every_token_step and d.token_ids and not d.finished):
                frame = on_delta(idx, d)
                if frame:  # empty: held back (a tool call being generated)
                    yield frame
            if d.finished:
                if d.finish_reason == "error":
                    yield sse(sample_error(d.error).body())
                yield on_finish(idx, d.finish_reason)
        timer.finish(sum(len(p) for p in prompts))
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse(
                {
                    **usage_obj,
                    "choices": [],
                    "usage": usage(
                        prompts,
                        timer.tokens,
                        sum(cached.values()),
                        reasoning_tokens() if reasoning_tokens is not None else None,
                    ),
                }
            )
    except (RequestRejected, EngineDead) as exc:
        yield sse(engine_error(exc).body())
    yield DONE
