"""``POST /v1/completions``: text or token-id prompts (one or several), echo, logprobs
(of the prompt too with echo), streamed or whole."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

from radixserve.api.asgi import ASGIApp, HTTPRequest, Response, StreamResponse, json_response
from radixserve.api.openai import converter as cv
from radixserve.api.openai.generation import collect, sse, stream_events, usage
from radixserve.api.openai.logprobs import completion_logprobs, join_logprobs, prompt_logprobs
from radixserve.api.openai.protocol import CompletionRequest, body_schema
from radixserve.api.openai.state import OpenAIServer
from radixserve.api.openai.structured import structured_spec
from radixserve.core.sampling_params import SamplingParams
from radixserve.serving.frontend import ModelInputs
from radixserve.serving.tenancy import Routing


def add_routes(app: ASGIApp, server: OpenAIServer) -> None:
    async def read(frontend: ModelInputs, body: CompletionRequest):
        inputs = await completion_inputs(server, frontend, body)
        return inputs, await structured_spec(frontend.grammar, body)

    @app.route(
        "POST",
        "/v1/completions",
        watch_disconnect=True,
        body_schema=body_schema(CompletionRequest),
    )
    async def completions(request: HTTPRequest) -> Response | StreamResponse:
        body, routing = await server.parse_routed(request, CompletionRequest, read)
        frontend = server.frontend_of(routing)
        (texts, prompts, params, prompt_only), spec = await read(frontend, body)
        if spec is not None:
            params = dataclasses.replace(params, structured_output=spec)
        if body.echo:  # echo token-id prompts as their text; logprobs cover the prompt too
            texts = [
                t if t is not None else frontend.tokenizer.decode(ids)
                for t, ids in zip(texts, prompts, strict=True)
            ]
            if params.logprobs is not None:
                params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
        rid = cv.response_id("cmpl", body)
        if body.stream:
            return StreamResponse(
                _stream(server, rid, texts, prompts, params, body, routing, prompt_only)
            )
        return await _whole(server, rid, texts, prompts, params, body, routing, prompt_only)


async def completion_inputs(
    server: OpenAIServer, frontend: ModelInputs, body: CompletionRequest
) -> tuple[list[str | None], list[list[int]], SamplingParams, bool]:
    """A completion request's prompt texts (None where given as ids, or truncated), prompt
    ids (checked), sampling parameters (before a grammar) and whether it asks for the
    prompt only (``max_tokens`` 0 with ``echo``, as OpenAI and vLLM allow: the engine
    computes one token, which is not returned): what ``/v1/completions`` runs and
    ``/v1/completions/render`` answers."""
    texts, prompts = await cv.completion_prompts(
        frontend, body.prompt, server.config.max_prompts_per_request
    )
    max_tokens = cv.COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    prompt_only = max_tokens == 0 and bool(body.echo)
    if prompt_only:
        max_tokens = 1
    params = cv.sampling_params(frontend, body, max_tokens, server.config)
    if body.truncate_prompt_tokens is not None:  # an echo shows what the model saw
        prompts = [cv.truncate_prompt(ids, body) for ids in prompts]
        texts = [None] * len(prompts)
    prompts = [cv.check_prompt(frontend, ids, max_tokens) for ids in prompts]
    cv.check_request_size(server.config, prompts, params)
    return texts, prompts, params, prompt_only


async def _whole(
    server: OpenAIServer,
    rid: str,
    texts: list[str | None],
    prompts: list[list[int]],
    params: SamplingParams,
    body: CompletionRequest,
    routing: Routing,
    prompt_only: bool = False,
) -> Response:
    done = await collect(server, prompts, params, routing)
    token_text, n = server.frontend_of(routing).token_text, params.n
    choices = []
    for idx, o in done.outputs.items():
        prefix = (texts[idx // n] or "") if body.echo else ""
        if prompt_only:  # the token computed to get there is not part of the answer
            o.text, o.logprobs, o.reason = "", [], "length"
        logprobs = None
        if params.logprobs is not None:
            logprobs = completion_logprobs(token_text, o.logprobs, len(prefix))
            if prefix:
                prompt = prompt_logprobs(
                    token_text, prompts[idx // n], done.prompt_logprobs.get(idx // n)
                )
                logprobs = join_logprobs(prompt, logprobs)
        choices.append(
            {"index": idx, "text": prefix + o.text, "logprobs": logprobs, "finish_reason": o.reason}
        )
    return json_response(
        {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": server.served_name(routing),
            "choices": choices,
            "usage": usage(
                prompts, 0 if prompt_only else done.completion_tokens, done.cached_tokens
            ),
        }
    )


def _stream(
    server: OpenAIServer,
    rid: str,
    texts: list[str | None],
    prompts: list[list[int]],
    params: SamplingParams,
    body: CompletionRequest,
    routing: Routing,
    prompt_only: bool = False,
):
    n, token_text = params.n, server.frontend_of(routing).token_text
    base = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": server.served_name(routing),
    }
    # with logprobs, a prompt's echo waits for its first delta (which brings the prompt's
    # logprobs); without, it goes out at once
    echo_with_logprobs = body.echo and params.prompt_logprobs is not None
    echoed: set[int] = set()

    def echo_frames(i: int, logprobs: dict | None) -> Iterator[bytes]:
        for j in range(n):
            choice = {"index": i * n + j, "text": texts[i], "logprobs": logprobs}
            yield sse({**base, "choices": [{**choice, "finish_reason": None}]})

    def head() -> Iterator[bytes]:
        if body.echo and not echo_with_logprobs:
            for i in range(len(texts)):
                yield from echo_frames(i, None)

    # generated tokens' text offsets continue after the echoed prompt
    offsets: dict[int, int] = {}

    def on_delta(idx, d) -> bytes:
        i = idx // n
        frames = b""
        if echo_with_logprobs and i not in echoed:
            echoed.add(i)
            lps = prompt_logprobs(token_text, prompts[i], d.prompt_logprobs)
            frames = b"".join(echo_frames(i, lps))
        if prompt_only:  # the echo is the whole answer
            return frames
        logprobs = None
        if d.logprobs:
            start = offsets.get(idx, len(texts[i] or "") if body.echo else 0)
            logprobs = completion_logprobs(token_text, d.logprobs, start)
            offsets[idx] = start + sum(len(t) for t in logprobs["tokens"])
        choice = {"index": idx, "text": d.text, "logprobs": logprobs, "finish_reason": None}
        return frames + sse({**base, "choices": [choice]})

    def on_finish(idx, reason) -> bytes:
        reason = "length" if prompt_only else reason
        choice = {"index": idx, "text": "", "logprobs": None, "finish_reason": reason}
        return sse({**base, "choices": [choice]})

    return stream_events(
        server,
        prompts,
        params,
        routing,
        body,
        on_delta,
        on_finish,
        head,
        base,
        every_token_step=True,
    )
