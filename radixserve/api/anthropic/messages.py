"""Anthropic's Messages API: ``POST /v1/messages`` (whole or streamed with Anthropic's event
sequence) and ``POST /v1/messages/count_tokens``.

A request is converted into the chat messages and ``SamplingParams`` every other route
makes (the model's chat template and sampling defaults, the same prompt check, tools
through the same tool context and grammar path as Chat Completions), run on the serving
frontend, and answered in Anthropic's shapes: content blocks (``text``, ``tool_use``),
``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``), usage, and
errors as ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import dataclasses
import json
import types
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

from radixserve.api.anthropic.errors import PREFIX, anthropic_error
from radixserve.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from radixserve.api.asgi import (
    APIError,
    ASGIApp,
    HTTPRequest,
    Response,
    StreamResponse,
    json_response,
)
from radixserve.api.openai import converter as cv
from radixserve.api.openai.generation import collect
from radixserve.api.openai.protocol import body_schema
from radixserve.api.openai.state import OpenAIServer
from radixserve.api.openai.structured import structured_spec
from radixserve.api.openai.tool_parser import (
    ToolContext,
    ToolStreamer,
    keep_markers,
    parse_tool_calls,
    tool_context,
)
from radixserve.core.errors import InputError
from radixserve.core.sampling_params import SamplingParams
from radixserve.serving import reasoning as rp
from radixserve.serving.engine_streams import EngineDead, RequestRejected
from radixserve.serving.frontend import ModelInputs
from radixserve.serving.metrics import RequestTimer
from radixserve.serving.tenancy import Routing

# fields Anthropic's API has that this server does not implement: a 400 naming them
_REFUSED = ("container", "mcp_servers", "context_management")


# -- request conversion -------------------------------------------------------------------
def _block_text(content: Any, where: str) -> str:
    """Text of a ``content`` that is a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "must be a string or a list of text blocks", param=where)
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise APIError(400, "only text blocks are supported here", param=f"{where}.{j}")
        text = block.get("text")
        if not isinstance(text, str):
            raise APIError(400, "text must be a string", param=f"{where}.{j}.text")
        parts.append(text)
    return "".join(parts)


def chat_messages(body: Any) -> list[dict[str, Any]]:
    """The conversation as chat-template messages: ``system`` first, ``tool_use`` blocks as
    assistant tool calls, ``tool_result`` blocks as ``tool`` messages."""
    out: list[dict[str, Any]] = []
    if body.system is not None:
        out.append({"role": "system", "content": _block_text(body.system, "system")})
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and m.role == "assistant":
                name, args = block.get("name"), block.get("input", {})
                if not isinstance(name, str) or not isinstance(args, dict):
                    raise APIError(400, "tool_use needs a name and an input object", param=where)
                call = {"name": name, "arguments": args}
                calls.append({"id": block.get("id"), "type": "function", "function": call})
            elif kind == "tool_result" and m.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise APIError(400, "tool_result needs tool_use_id", param=where)
                content = _block_text(block.get("content", ""), f"{where}.content")
                results.append(
                    {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}
                )
            else:
                raise APIError(
                    400, f"{kind!r} blocks are not supported in {m.role} messages", param=where
                )
        out.extend(results)  # a user turn answers the calls before it says anything else
        if texts or calls or not results:
            message: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def tools_of(body: Any, parser: str) -> ToolContext:
    """Anthropic's tools and tool_choice as the chat routes' tool context (``any`` is
    OpenAI's ``required``, ``tool`` a named function)."""
    for i, tool in enumerate(body.tools or ()):
        if tool.type not in (None, "custom"):
            raise APIError(400, f"server tools ({tool.type}) are not supported", f"tools.{i}")
    functions = [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description or "",
                "parameters": t.input_schema,
            },
        }
        for t in body.tools or ()
    ]
    choice = body.tool_choice
    mapped: Any = None
    parallel = None
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, "tool_choice of type tool needs a name", "tool_choice.name")
            mapped = {"type": "function", "function": {"name": choice.name}}
        else:
            mapped = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use and functions:
            parallel = False
    request = types.SimpleNamespace(
        tools=functions or None, tool_choice=mapped, parallel_tool_calls=parallel
    )
    return tool_context(request, parser)


def _thinking(
    server: OpenAIServer, frontend: ModelInputs, body: Any
) -> tuple[bool | None, int | None]:
    """(whether to think: None = as the model does; the thinking budget in tokens) from the
    request's ``thinking``; a 400 naming the field when it cannot be honoured."""
    spec = getattr(body, "thinking", None)
    if spec is None:
        return None, None
    if server.reasoning_parser(frontend) is None:
        raise APIError(
            400,
            "thinking needs a reasoning model: start the server with --reasoning-parser",
            param="thinking",
        )
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "disabled" and set(spec) == {"type"}:
        return False, None
    if kind != "enabled" or set(spec) - {"type", "budget_tokens"}:
        raise APIError(
            400,
            'thinking must be {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}',
            param="thinking",
        )
    budget = spec.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget < body.max_tokens:
        raise APIError(
            400,
            "thinking.budget_tokens must be an integer from 1 to below max_tokens",
            param="thinking.budget_tokens",
        )
    return True, budget


async def _prompt(
    frontend: ModelInputs, body: Any, tools: ToolContext, think: bool | None = None
) -> list[int]:
    template: dict[str, Any] = {"tools": tools.tools} if tools.active else {}
    if think is not None:  # Qwen3's hybrid templates read it; others ignore it
        template["enable_thinking"] = think
    try:
        return await frontend.chat_ids(chat_messages(body), True, False, template)
    except InputError as exc:
        raise cv.input_error(exc) from None


def _reject_refused(body: Any) -> None:
    for name in _REFUSED:
        if name in (body.model_extra or {}):
            raise APIError(400, "this field is not supported by this server", param=name)


# -- answers ------------------------------------------------------------------------------
def _stop_reason(reason: str | None, stop_str: str | None, calls: bool) -> str:
    if calls:
        return "tool_use"
    if reason == "length":
        return "max_tokens"
    if reason == "stop" and stop_str is not None:
        return "stop_sequence"
    return "end_turn"


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": fn["name"],
        "input": json.loads(fn["arguments"]),
    }


def _usage(prompt_len: int, cached: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": prompt_len - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": output_tokens,
    }


def _budgeted(server: OpenAIServer, routing: Routing, budget: int | None) -> Any:
    """A ``Frontend.run`` whose thinking stops at ``budget`` tokens (None: no budget)."""
    parser = server.reasoning_parser(server.frontend_of(routing))
    if budget is None or parser is None:
        return None

    def run(prompts: list[list[int]], params: SamplingParams, routing: Routing) -> Any:
        return rp.run_with_thinking_budget(
            server.frontend_of(routing), prompts[0], params, routing, parser, budget
        )

    return run


def _block_delta(index: int, delta: dict[str, Any]) -> bytes:
    return _event(
        "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    )


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def add_routes(app: ASGIApp, server: OpenAIServer) -> None:
    app.error_shapes[PREFIX] = anthropic_error

    async def read(frontend: ModelInputs, body: MessagesRequest):
        _reject_refused(body)
        tools = tools_of(body, server.tool_call_parser(frontend))
        think, budget = _thinking(server, frontend, body)
        ids = await _prompt(frontend, body, tools, think)
        params = cv.checked_sampling_params(
            frontend,
            {"stop": "stop_sequences"},
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=body.stop_sequences or [],
        )
        cv.check_prompt(frontend, ids, body.max_tokens)
        free_text = types.SimpleNamespace(response_format=None, structured_outputs=None)
        spec = await structured_spec(
            frontend.grammar, free_text, tools, server.reasoning_parser(frontend)
        )
        if spec is not None:
            params = dataclasses.replace(params, structured_output=spec)
        return ids, keep_markers(params, tools), tools, budget  # (markers that are special)

    @app.route("POST", PREFIX, watch_disconnect=True, body_schema=body_schema(MessagesRequest))
    async def messages(request: HTTPRequest) -> Response | StreamResponse:
        body, routing = await server.parse_routed(request, MessagesRequest, read)
        ids, params, tools, budget = await read(server.frontend_of(routing), body)
        message_id = f"msg_{uuid.uuid4().hex}"
        if body.stream:
            return StreamResponse(_stream(server, message_id, ids, params, routing, tools, budget))
        return await _whole(server, message_id, ids, params, routing, tools, budget)

    @app.route("POST", PREFIX + "/count_tokens", body_schema=body_schema(CountTokensRequest))
    async def count_tokens(request: HTTPRequest) -> Response:
        body, frontend, _ = await server.parse_inputs(request, CountTokensRequest)
        _reject_refused(body)
        tools = tools_of(body, server.tool_call_parser(frontend))
        return json_response({"input_tokens": len(await _prompt(frontend, body, tools))})


async def _whole(
    server: OpenAIServer,
    message_id: str,
    ids: list[int],
    params: SamplingParams,
    routing: Routing,
    tools: Any,
    budget: int | None = None,
) -> Response:
    done = await collect(server, [ids], params, routing, _budgeted(server, routing, budget))
    out = done.outputs[0]
    calls: list[dict[str, Any]] = []
    content: list[dict[str, Any]] = []
    text: str | None = out.text
    parser = server.reasoning_parser(server.frontend_of(routing))
    if parser is not None:  # the thinking first, as a thinking block
        reply = rp.split(out.text, parser)
        if reply.reasoning is not None:
            content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
        text = reply.content or ""
    if tools.active:
        text, calls = parse_tool_calls(text or "", tools, truncated=out.reason == "length")
    if text or not calls:
        content.append({"type": "text", "text": text or ""})
    content.extend(_tool_use(c) for c in calls)
    stop_reason = _stop_reason(out.reason, out.stop_str, bool(calls))
    return json_response(
        {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": server.served_name(routing),
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": out.stop_str if stop_reason == "stop_sequence" else None,
            "usage": _usage(len(ids), done.cached_tokens, done.completion_tokens),
        }
    )


async def _stream(
    server: OpenAIServer,
    message_id: str,
    ids: list[int],
    params: SamplingParams,
    routing: Routing,
    tools: Any,
    budget: int | None = None,
) -> AsyncIterator[bytes]:
    """Anthropic's event sequence: message_start, ping, then per content block
    content_block_start / deltas / content_block_stop (the thinking first, with
    ``--reasoning-parser``, as thinking_delta and an empty signature_delta; text next, then each tool_use
    with its input as one input_json_delta), message_delta (stop_reason, usage),
    message_stop. A failure after the start is an ``error`` event."""
    frontend = server.frontend_of(routing)
    timer = RequestTimer(frontend.metrics, routing.tag.label)
    start = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": server.served_name(routing),
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(len(ids), 0, 0),
    }
    yield _event("message_start", {"type": "message_start", "message": start})
    yield _event("ping", {"type": "ping"})
    streamer = ToolStreamer(tools) if tools.active else None
    parser = server.reasoning_parser(frontend)
    thinker = rp.ReasoningStreamer(parser) if parser is not None else None
    thinking_open = False
    thought_shown = False  # a thinking block was opened
    index = 0  # of the content block being written
    text_open = False
    reason: str | None = None
    stop_str: str | None = None
    cached = 0

    def think(piece: str) -> bytes:
        nonlocal thinking_open, thought_shown
        thought_shown = True
        frames = b""
        if not thinking_open:
            thinking_open = True
            block = {"type": "thinking", "thinking": "", "signature": ""}
            frames += _event(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
        return frames + _block_delta(index, {"type": "thinking_delta", "thinking": piece})

    def thinking_done() -> bytes:
        """Close the thinking block (an empty signature: nothing is signed here)."""
        nonlocal thinking_open, index
        if not thinking_open:
            return b""
        thinking_open = False
        signed = {"type": "signature_delta", "signature": ""}
        frames = _block_delta(index, signed) + _event(
            "content_block_stop", {"type": "content_block_stop", "index": index}
        )
        index += 1
        return frames

    def answer(piece: str) -> bytes:
        if streamer is not None:
            piece = streamer.feed(piece)
        return text_delta(piece) if piece else b""

    def text_delta(text: str) -> bytes:
        nonlocal text_open
        frames = b""
        if thinker is not None and thinker.thought and not thought_shown:
            frames += think("")  # an empty thought still has its block (as whole)
        frames += thinking_done()
        if not text_open:
            text_open = True
            block = {"type": "text", "text": ""}
            frames += _event(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
        return frames + _block_delta(index, {"type": "text_delta", "text": text})

    try:
        run = _budgeted(server, routing, budget) or frontend.run
        async for _, d in run([ids], params, routing):
            timer.delta(0, d)
            text = d.text
            if thinker is not None:
                reasoning, text = thinker.feed(text)
                if reasoning:
                    yield think(reasoning)
            if text and (frames := answer(text)):
                yield frames
            if d.finished:
                reason, stop_str, cached = d.finish_reason, d.stop_str, d.num_cached_tokens
                if reason == "error":
                    raise RuntimeError(d.error or "generation failed")
        timer.finish(len(ids))
    except (RequestRejected, EngineDead, RuntimeError) as exc:
        yield _event("error", orjson.loads(anthropic_error(cv.engine_error(exc)).body))
        return
    if thinker is not None:
        reasoning, text = thinker.finish()
        if reasoning:
            yield think(reasoning)
        if text and (frames := answer(text)):
            yield frames
        if thinker.thought and not thought_shown:
            yield think("")
        yield thinking_done()
    calls: list[dict[str, Any]] = []
    if streamer is not None:
        rest, calls = streamer.finish(truncated=reason == "length")
        if rest:
            yield text_delta(rest)
    if text_open or not calls:
        if not text_open:  # an empty answer still has its (empty) text block
            yield text_delta("")
        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
        index += 1
    for call in calls:
        block = {**_tool_use(call), "input": {}}
        yield _event(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": block},
        )
        delta = {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}
        yield _block_delta(index, delta)
        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
        index += 1
    stop_reason = _stop_reason(reason, stop_str, bool(calls))
    final = {
        "stop_reason": stop_reason,
        "stop_sequence": stop_str if stop_reason == "stop_sequence" else None,
    }
    usage = _usage(len(ids), cached, timer.tokens)
    yield _event("message_delta", {"type": "message_delta", "delta": final, "usage": usage})
    yield _event("message_stop", {"type": "message_stop"})
