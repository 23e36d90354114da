"""``POST /v1/chat/completions``: messages through the model's chat template, the thinking
split off as ``reasoning_content`` (``--reasoning-parser``), tool calls (parsed whole, or
held back while streamed), logprobs, streamed or whole."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

from radixserve.api.asgi import ASGIApp, HTTPRequest, Response, StreamResponse, json_response
from radixserve.api.openai import converter as cv
from radixserve.api.openai.generation import collect, sse, stream_events, usage
from radixserve.api.openai.logprobs import chat_logprobs
from radixserve.api.openai.protocol import ChatCompletionRequest, body_schema
from radixserve.api.openai.state import OpenAIServer
from radixserve.api.openai.structured import structured_spec
from radixserve.api.openai.tool_parser import (
    ToolContext,
    ToolStreamer,
    keep_markers,
    parse_tool_calls,
    tool_context,
)
from radixserve.core.sampling_params import SamplingParams
from radixserve.serving import reasoning as rp
from radixserve.serving.frontend import ModelInputs
from radixserve.serving.tenancy import Routing


def add_routes(app: ASGIApp, server: OpenAIServer) -> None:
    async def read(frontend: ModelInputs, body: ChatCompletionRequest):
        ids, params, tools = await chat_inputs(server, frontend, body)
        reasoning = server.reasoning_parser(frontend)
        return ids, params, tools, await structured_spec(frontend.grammar, body, tools, reasoning)

    @app.route(
        "POST",
        "/v1/chat/completions",
        watch_disconnect=True,
        body_schema=body_schema(ChatCompletionRequest),
    )
    async def chat_completions(request: HTTPRequest) -> Response | StreamResponse:
        body, routing = await server.parse_routed(request, ChatCompletionRequest, read)
        ids, params, tools, spec = await read(server.frontend_of(routing), body)
        if spec is not None:
            params = dataclasses.replace(params, structured_output=spec)
        params = keep_markers(params, tools)  # (a format whose markers are special)
        rid = cv.response_id("chatcmpl", body)
        if body.stream:
            return StreamResponse(_stream(server, rid, ids, params, body, routing, tools))
        return await _whole(server, rid, ids, params, body, routing, tools)


async def chat_inputs(
    server: OpenAIServer, frontend: ModelInputs, body: ChatCompletionRequest
) -> tuple[list[int], SamplingParams, ToolContext]:
    """A chat request's prompt ids (its template, tools and checks), its sampling
    parameters (before a grammar) and its tools: what ``/v1/chat/completions`` runs and
    ``/v1/chat/completions/render`` answers."""
    tools = tool_context(body, server.tool_call_parser(frontend))
    ids = await cv.chat_prompt(frontend, body, tools)
    max_tokens = cv.chat_max_tokens(frontend, body, len(ids))
    params = cv.sampling_params(frontend, body, max_tokens, server.config)
    cv.check_prompt(frontend, ids, max_tokens)
    cv.check_request_size(server.config, [ids], params)
    return ids, params, tools


async def _whole(
    server: OpenAIServer,
    rid: str,
    ids: list[int],
    params: SamplingParams,
    body: ChatCompletionRequest,
    routing: Routing,
    tools: ToolContext,
) -> Response:
    done = await collect(server, [ids], params, routing)
    parser = server.reasoning_parser(server.frontend_of(routing))
    thinking = 0
    choices = []
    for idx, o in done.outputs.items():
        message: dict[str, Any] = {"role": "assistant", "content": o.text}
        text = o.text
        if parser is not None:
            reply = rp.split(o.text, parser)
            thinking += rp.reasoning_tokens(
                server.frontend_of(routing).tokenizer, o.token_ids, reply
            )
            text = reply.content or ""
            message = {
                "role": "assistant",
                "content": reply.content,
                "reasoning_content": reply.reasoning,
            }
        reason = o.reason
        if tools.active:
            content, calls = parse_tool_calls(text, tools, truncated=reason == "length")
            if calls:
                message = {**message, "content": content, "tool_calls": calls}
                reason = "length" if reason == "length" else "tool_calls"
        logprobs = None
        if params.logprobs is not None:
            logprobs = chat_logprobs(server.frontend_of(routing).token_text, o.logprobs)
        choices.append(
            {"index": idx, "message": message, "logprobs": logprobs, "finish_reason": reason}
        )
    return json_response(
        {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": server.served_name(routing),
            "choices": choices,
            "usage": usage(
                [ids],
                done.completion_tokens,
                done.cached_tokens,
                thinking if parser is not None else None,
            ),
        }
    )


def _stream(
    server: OpenAIServer,
    rid: str,
    ids: list[int],
    params: SamplingParams,
    body: ChatCompletionRequest,
    routing: Routing,
    tools: ToolContext,
):
    token_text = server.frontend_of(routing).token_text
    base = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": server.served_name(routing),
    }

    def frame(idx: int, delta: dict, finish_reason: str | None = None) -> bytes:
        choice = {"index": idx, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return sse({**base, "choices": [choice]})

    def head() -> Iterator[bytes]:
        for j in range(params.n):
            yield frame(j, {"role": "assistant", "content": ""})

    streamers: dict[int, ToolStreamer] = {}
    parser = server.reasoning_parser(server.frontend_of(routing))
    thinkers: dict[int, rp.ReasoningStreamer] = {}
    reply_ids: dict[int, list[int]] = {}
    thinking: dict[int, int] = {}  # by choice: its reasoning tokens, once it finished

    def on_delta(idx, d) -> bytes:
        logprobs = chat_logprobs(token_text, d.logprobs) if d.logprobs else None
        text, delta = d.text, {}
        if parser is not None:  # the thinking first, as reasoning_content
            reasoning, text = thinkers.setdefault(idx, rp.ReasoningStreamer(parser)).feed(text)
            if reasoning:
                delta["reasoning_content"] = reasoning
        if tools.active and text:  # tool calls are held back until complete
            text = streamers.setdefault(idx, ToolStreamer(tools)).feed(text)
        if text or (parser is None and not tools.active):
            delta["content"] = text
        if not delta and not logprobs:
            return b""
        choice = {"index": idx, "delta": delta or {"content": ""}, "logprobs": logprobs}
        return sse({**base, "choices": [{**choice, "finish_reason": None}]})

    def on_finish(idx, reason) -> bytes:
        frames = b""
        thinker = thinkers.pop(idx, None)
        if thinker is not None:
            reasoning, text = thinker.finish()
            if reasoning:
                frames += frame(idx, {"reasoning_content": reasoning})
            if text and tools.active:
                text = streamers.setdefault(idx, ToolStreamer(tools)).feed(text)
            if text:
                frames += frame(idx, {"content": text})
            thinking[idx] = rp.reasoning_tokens(
                server.frontend_of(routing).tokenizer, reply_ids.pop(idx, []), thinker.reply()
            )
        streamer = streamers.pop(idx, None)
        if streamer is not None:
            rest, calls = streamer.finish(truncated=reason == "length")
            if rest:
                frames += frame(idx, {"content": rest})
            if calls:
                reason = "length" if reason == "length" else "tool_calls"
                frames += frame(
                    idx, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
                )
        return frames + frame(idx, {}, reason)

    return stream_events(
        server,
        [ids],
        params,
        routing,
        body,
        on_delta,
        on_finish,
        head,
        base,
        reasoning_tokens=(lambda: sum(thinking.values())) if parser is not None else None,
        on_tokens=(lambda idx, ids: reply_ids.setdefault(idx, []).extend(ids))
        if parser is not None
        else None,
    )
