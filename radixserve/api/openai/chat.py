"""``POST /v1/chat/completions``: messages through the model's chat template, tool calls
(parsed whole, or held back while streamed), logprobs, streamed or whole."""

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
    parse_tool_calls,
    tool_context,
)
from radixserve.core.sampling_params import SamplingParams
from radixserve.serving.tenancy import Routing


def add_routes(app: ASGIApp, server: OpenAIServer) -> None:
    @app.route(
        "POST",
        "/v1/chat/completions",
        watch_disconnect=True,
        body_schema=body_schema(ChatCompletionRequest),
    )
    async def chat_completions(request: HTTPRequest) -> Response | StreamResponse:
        body, routing = server.parse_routed(request, ChatCompletionRequest)
        server.check_model(body.model)
        frontend = server.frontend
        tools = tool_context(body, server.config.tool_call_parser)
        ids = await cv.chat_prompt(frontend, body, tools)
        max_tokens = cv.chat_max_tokens(frontend, body, len(ids))
        params = cv.sampling_params(frontend, body, max_tokens, server.config)
        cv.check_prompt(frontend, ids, max_tokens)
        cv.check_request_size(server.config, [ids], params)
        spec = await structured_spec(frontend.grammar, body, tools)
        if spec is not None:
            params = dataclasses.replace(params, structured_output=spec)
        rid = cv.response_id("chatcmpl", body)
        if body.stream:
            return StreamResponse(_stream(server, rid, ids, params, body, routing, tools))
        return await _whole(server, rid, ids, params, body, routing, tools)


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
    choices = []
    for idx, o in done.outputs.items():
        message: dict[str, Any] = {"role": "assistant", "content": o.text}
        reason = o.reason
        if tools.active:
            content, calls = parse_tool_calls(o.text, tools, truncated=reason == "length")
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                reason = "length" if reason == "length" else "tool_calls"
        logprobs = None
        if params.logprobs is not None:
            logprobs = chat_logprobs(server.frontend.token_text, o.logprobs)
        choices.append(
            {"index": idx, "message": message, "logprobs": logprobs, "finish_reason": reason}
        )
    return json_response(
        {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": server.frontend.model_name,
            "choices": choices,
            "usage": usage([ids], done.completion_tokens, done.cached_tokens),
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
    token_text = server.frontend.token_text
    base = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": server.frontend.model_name,
    }

    def frame(idx: int, delta: dict, finish_reason: str | None = None) -> bytes:
        choice = {"index": idx, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return sse({**base, "choices": [choice]})

    def head() -> Iterator[bytes]:
        for j in range(params.n):
            yield frame(j, {"role": "assistant", "content": ""})

    streamers: dict[int, ToolStreamer] = {}

    def on_delta(idx, d) -> bytes:
        logprobs = chat_logprobs(token_text, d.logprobs) if d.logprobs else None
        text = d.text
        if tools.active:  # tool calls are held back until complete
            text = streamers.setdefault(idx, ToolStreamer(tools)).feed(text)
            if not text and not logprobs:
                return b""
        choice = {"index": idx, "delta": {"content": text}, "logprobs": logprobs}
        return sse({**base, "choices": [{**choice, "finish_reason": None}]})

    def on_finish(idx, reason) -> bytes:
        frames = b""
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

    return stream_events(server, [ids], params, routing, body, on_delta, on_finish, head, base)
