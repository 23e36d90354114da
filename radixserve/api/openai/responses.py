"""OpenAI's Responses API: ``POST /v1/responses`` (whole or streamed as semantic events),
``GET`` and ``DELETE /v1/responses/{response_id}``.

A request becomes chat messages (``instructions``, then the stored conversation of
``previous_response_id``, then ``input``: messages, ``function_call`` and
``function_call_output`` items) and ``SamplingParams`` through the same converter,
template, sampling defaults, tool context and grammar path as Chat Completions; the answer
is a response object with ``message`` and ``function_call`` output items. Responses with
``store`` (the default) are kept in a bounded in-memory store (``response_store``), each
for the tenant that created it: another tenant's ``GET``, ``DELETE`` and
``previous_response_id`` find nothing (a 404 like an id never stored); an admin key reads
and deletes any.
"""

from __future__ import annotations

import dataclasses
import json
import time
import types
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

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
from radixserve.api.openai.protocol import ResponsesRequest, body_schema
from radixserve.api.openai.response_store import ResponseStore, StoredResponse
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

_TEXT_PARTS = ("input_text", "output_text", "text")


# -- request conversion -------------------------------------------------------------------
def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of text parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"{kind!r} content parts are not supported", param=f"{where}.{j}")
        parts.append(part["text"])
    return "".join(parts)


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as chat-template messages: consecutive ``function_call`` items become one
    assistant message with tool calls, ``function_call_output`` items ``tool`` messages."""
    if isinstance(body.input, str):
        if not body.input:
            raise APIError(400, "input must not be empty", param="input")
        return [{"role": "user", "content": body.input}]
    if not body.input:
        raise APIError(400, "input must not be empty", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(body.input):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"role {role!r} is not supported", param=f"{where}.role")
            content = _content_text(item.get("content"), f"{where}.content")
            out.append({"role": role, "content": content})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(args, str):
                raise APIError(400, "function_call needs name and arguments", param=where)
            try:
                parsed = json.loads(args)
            except ValueError:
                raise APIError(400, "arguments must be JSON", param=f"{where}.arguments") from None
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": name, "arguments": parsed},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not last["content"]:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise APIError(400, "function_call_output needs call_id and output", param=where)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            raise APIError(400, f"input items of type {kind!r} are not supported", param=where)
    return out


def _tools(body: ResponsesRequest, parser: str) -> ToolContext:
    functions = []
    for i, tool in enumerate(body.tools or ()):
        if tool.get("type") != "function":
            raise APIError(
                400,
                f"tools of type {tool.get('type')!r} are not supported (function tools only)",
                param=f"tools.{i}.type",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        functions.append({"type": "function", "function": fn})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise APIError(400, "tool_choice must name a function tool", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    request = types.SimpleNamespace(
        tools=functions or None, tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls
    )
    return tool_context(request, parser)


def _format_spec(body: ResponsesRequest) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "json_schema needs a schema object", param="text.format.schema")
        return {"type": "json_schema", "json_schema": {"schema": schema}}
    raise APIError(
        400,
        f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}",
        param="text.format.type",
    )


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.background:
        raise APIError(400, "background mode is not supported", param="background")
    if body.reasoning is not None:
        raise APIError(400, "reasoning is not supported by this model", param="reasoning")
    if body.include:
        if "reasoning.encrypted_content" in body.include:
            raise APIError(
                400,
                "include 'reasoning.encrypted_content' is not supported: reasoning is "
                "returned as text in reasoning items (--reasoning-parser), never encrypted",
                param="include",
            )
        raise APIError(400, "include is not supported", param="include")
    if body.top_logprobs:
        raise APIError(400, "top_logprobs is not supported here", param="top_logprobs")
    if body.truncation == "auto":
        raise APIError(400, "truncation 'auto' is not supported", param="truncation")


# -- answers ------------------------------------------------------------------------------
def _usage(prompt_len: int, cached: int, output: int, reasoning: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": prompt_len,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt_len + output,
    }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """The thinking (``--reasoning-parser``) as an open model's reasoning item: its text in
    ``content``, no summary, nothing encrypted."""
    return {
        "type": "reasoning",
        "id": item_id,
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": "fc_" + call["id"].removeprefix("call_"),
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"],
        "status": status,
    }


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}


class _Responder:
    """One request's response object, its output items and its store entry."""

    def __init__(
        self,
        server: OpenAIServer,
        body: ResponsesRequest,
        conversation: list[dict[str, Any]],
        ids: list[int],
        routing: Routing,
    ) -> None:
        self.server, self.body, self.conversation, self.ids = server, body, conversation, ids
        self.routing = routing  # (its tenant owns the stored response)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        incomplete: str | None = None,
    ) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "error": None,
            "model": self.server.served_name(self.routing),
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": (body.text.format if body.text else None) or {"type": "text"}},
            "previous_response_id": body.previous_response_id,
            "store": body.store,
            "metadata": body.metadata or {},
            "output": output,
            "usage": usage,
        }

    def finish(
        self,
        text: str,
        calls: list[dict[str, Any]],
        reason: str | None,
        cached: int,
        tokens: int,
        message_id: str | None = None,
        thinking: tuple[str, str, int] | None = None,
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The final response object (and its output items: the reasoning item first when
        ``thinking`` (item id, text, tokens) is given); stored if asked."""
        output = []
        if thinking is not None:
            output.append(_reasoning_item(thinking[0], thinking[1]))
        if text or not calls:
            output.append(_message_item(message_id or f"msg_{uuid.uuid4().hex}", text))
        output.extend(_call_item(c) for c in calls)
        incomplete = "max_output_tokens" if reason == "length" else None
        response = self.response(
            "incomplete" if incomplete else "completed",
            output,
            _usage(len(self.ids), cached, tokens, thinking[2] if thinking is not None else 0),
            incomplete,
        )
        if self.body.store:
            said: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:  # as the template takes them: arguments as objects
                said["tool_calls"] = [_template_call(c) for c in calls]
            self.server.responses.put(
                self.id,
                StoredResponse(response, [*self.conversation, said], self.routing.tag.tenant.name),
            )
        return response, output


def add_routes(app: ASGIApp, server: OpenAIServer) -> None:
    store: ResponseStore = server.responses

    async def read(frontend: ModelInputs, body: ResponsesRequest, tenant: str):
        """The request's conversation, prompt ids, sampling parameters and tools (its
        400s, and a 404 for a previous response ``tenant`` cannot see)."""
        _refuse_unsupported(body)
        conversation: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            # another tenant's response is not found, exactly like one never stored
            previous = store.get(body.previous_response_id, tenant)
            if previous is None:
                raise APIError(
                    404,
                    f"Previous response with id '{body.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            conversation = [m for m in previous.conversation if m["role"] != "system"]
        if body.instructions:  # instructions are not carried over from a previous response
            conversation.insert(0, {"role": "system", "content": body.instructions})
        conversation += input_messages(body)
        tools = _tools(body, server.tool_call_parser(frontend))
        template = {"tools": tools.tools} if tools.active else {}
        try:
            ids = await frontend.chat_ids(conversation, True, False, template)
        except InputError as exc:
            raise cv.input_error(exc) from None
        max_tokens = body.max_output_tokens
        if max_tokens is None:  # the rest of the context, as chat does
            max_tokens = max(1, frontend.max_model_len - len(ids))
        params = cv.checked_sampling_params(
            frontend,
            {"max_tokens": "max_output_tokens"},
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            seed=body.seed,
        )
        cv.check_prompt(frontend, ids, max_tokens)
        fmt = types.SimpleNamespace(response_format=_format_spec(body), structured_outputs=None)
        spec = await structured_spec(
            frontend.grammar, fmt, tools, server.reasoning_parser(frontend)
        )
        if spec is not None:
            params = dataclasses.replace(params, structured_output=spec)
        return conversation, ids, keep_markers(params, tools), tools  # (special markers)

    @app.route(
        "POST", "/v1/responses", watch_disconnect=True, body_schema=body_schema(ResponsesRequest)
    )
    async def create(request: HTTPRequest) -> Response | StreamResponse:
        def check(frontend: ModelInputs, body: ResponsesRequest):
            return read(
                frontend,
                body,
                server.tenant_tag(request.headers, getattr(body, "user", None)).tenant.name,
            )

        body, routing = await server.parse_routed(request, ResponsesRequest, check)
        frontend = server.frontend_of(routing)
        conversation, ids, params, tools = await read(frontend, body, routing.tag.tenant.name)
        responder = _Responder(server, body, conversation, ids, routing)
        if body.stream:
            return StreamResponse(_stream(responder, params, tools))
        done = await collect(server, [ids], params, routing)
        out = done.outputs[0]
        text, calls, thinking = out.text, [], None
        parser = server.reasoning_parser(frontend)
        if parser is not None:
            reply = rp.split(out.text, parser)
            text = reply.content or ""
            if reply.reasoning is not None:
                count = rp.reasoning_tokens(frontend.tokenizer, out.token_ids, reply)
                thinking = (f"rs_{uuid.uuid4().hex}", reply.reasoning, count)
        if tools.active:
            parsed, calls = parse_tool_calls(text, tools, truncated=out.reason == "length")
            text = parsed or ""
        response, _ = responder.finish(
            text,
            calls,
            out.reason,
            done.cached_tokens,
            done.completion_tokens,
            thinking=thinking,
        )
        return json_response(response)

    @app.route("GET", "/v1/responses/{response_id}")
    async def retrieve(request: HTTPRequest) -> Response:
        stored = store.get(_response_id(request), server.reader(request.headers))
        if stored is None:
            raise _not_found(_response_id(request))
        return json_response(stored.response)

    @app.route("DELETE", "/v1/responses/{response_id}")
    async def delete(request: HTTPRequest) -> Response:
        response_id = _response_id(request)
        if not store.delete(response_id, server.reader(request.headers)):
            raise _not_found(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})


def _response_id(request: HTTPRequest) -> str:
    return request.path_params["response_id"]


def _not_found(response_id: str) -> APIError:
    return APIError(
        404,
        f"No response with id '{response_id}' found (never stored, deleted or evicted).",
        type_="invalid_request_error",
        param="response_id",
        code="response_not_found",
    )


async def _stream(
    responder: _Responder, params: SamplingParams, tools: ToolContext
) -> AsyncIterator[bytes]:
    """The documented event sequence, each with its ``sequence_number``:
    response.created, response.in_progress, then (with ``--reasoning-parser``, when the
    model thinks) the reasoning item: output_item.added, reasoning_text.delta...,
    reasoning_text.done, output_item.done; for the text an output_item.added,
    content_part.added, output_text.delta..., output_text.done, content_part.done,
    output_item.done; for each function call output_item.added,
    function_call_arguments.delta, .done, output_item.done; then response.completed (or
    response.incomplete). A failure ends the stream with response.failed."""
    server = responder.server
    frontend = server.frontend_of(responder.routing)
    seq = 0

    def event(kind: str, **data: Any) -> bytes:
        nonlocal seq
        frame = {"type": kind, "sequence_number": seq, **data}
        seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(frame) + b"\n\n"

    start = responder.response("in_progress", [], None)
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    timer = RequestTimer(frontend.metrics, responder.routing.tag.label)
    streamer = ToolStreamer(tools) if tools.active else None
    parser = server.reasoning_parser(frontend)
    thinker = rp.ReasoningStreamer(parser) if parser is not None else None
    reasoning_id = f"rs_{uuid.uuid4().hex}"
    thinking_state = "none"  # none | open | done: the reasoning item's events
    reply_ids: list[int] = []
    message_id = f"msg_{uuid.uuid4().hex}"
    text = ""
    opened = False
    reason: str | None = None
    cached = 0

    def message_index() -> int:  # the reasoning item, if any, comes first
        return 0 if thinking_state == "none" else 1

    def think(piece: str) -> bytes:
        nonlocal thinking_state
        frames = b""
        if thinking_state == "none":
            thinking_state = "open"
            item = {**_reasoning_item(reasoning_id, "", "in_progress"), "content": []}
            frames += event("response.output_item.added", output_index=0, item=item)
        return frames + event(
            "response.reasoning_text.delta",
            item_id=reasoning_id,
            output_index=0,
            content_index=0,
            delta=piece,
        )

    def thinking_done() -> bytes:
        nonlocal thinking_state
        if thinking_state != "open":
            return b""
        thinking_state = "done"
        assert thinker is not None
        thought = thinker.reasoning  # (all of it: the streamer keeps it)
        return event(
            "response.reasoning_text.done",
            item_id=reasoning_id,
            output_index=0,
            content_index=0,
            text=thought,
        ) + event(
            "response.output_item.done",
            output_index=0,
            item=_reasoning_item(reasoning_id, thought),
        )

    def open_message() -> bytes:
        nonlocal opened
        opened = True
        item = {**_message_item(message_id, "", "in_progress"), "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        at = message_index()
        return event("response.output_item.added", output_index=at, item=item) + event(
            "response.content_part.added",
            item_id=message_id,
            output_index=at,
            content_index=0,
            part=part,
        )

    def delta(piece: str) -> bytes:
        nonlocal text
        text += piece
        frames = b""
        if thinker is not None and thinker.thought and thinking_state == "none":
            frames += think("")  # an empty thought still has its item (as whole)
        frames += thinking_done() + (b"" if opened else open_message())
        return frames + event(
            "response.output_text.delta",
            item_id=message_id,
            output_index=message_index(),
            content_index=0,
            delta=piece,
            logprobs=[],
        )

    def answer(piece: str) -> bytes:
        if streamer is not None:
            piece = streamer.feed(piece)
        return delta(piece) if piece else b""

    try:
        async for _, d in frontend.run([responder.ids], params, responder.routing):
            timer.delta(0, d)
            if thinker is not None:
                reply_ids.extend(d.token_ids)
                reasoning, piece = thinker.feed(d.text)
                if reasoning:
                    yield think(reasoning)
            else:
                piece = d.text
            if piece and (frames := answer(piece)):
                yield frames
            if d.finished:
                reason, cached = d.finish_reason, d.num_cached_tokens
                if reason == "error":
                    raise RuntimeError(d.error or "generation failed")
        timer.finish(len(responder.ids))
    except (RequestRejected, EngineDead, RuntimeError) as exc:
        failed = responder.response("failed", [], None)
        failed["error"] = {"code": "server_error", "message": cv.engine_error(exc).message}
        yield event("response.failed", response=failed)
        return
    thinking = None
    if thinker is not None:
        reasoning, piece = thinker.finish()
        if reasoning:
            yield think(reasoning)
        if piece and (frames := answer(piece)):
            yield frames
        if thinker.thought and thinking_state == "none":
            yield think("")
        yield thinking_done()
        if thinker.thought:
            count = rp.reasoning_tokens(frontend.tokenizer, reply_ids, thinker.reply())
            thinking = (reasoning_id, thinker.reasoning, count)
    calls: list[dict[str, Any]] = []
    if streamer is not None:
        rest, calls = streamer.finish(truncated=reason == "length")
        if rest:
            yield delta(rest)
    final, output = responder.finish(
        text, calls, reason, cached, timer.tokens, message_id, thinking=thinking
    )
    index = 0 if thinking is None else 1
    if text or not calls:
        if not opened:
            yield open_message()
        part = output[index]["content"][0]
        yield event(
            "response.output_text.done",
            item_id=message_id,
            output_index=index,
            content_index=0,
            text=text,
            logprobs=[],
        )
        yield event(
            "response.content_part.done",
            item_id=message_id,
            output_index=index,
            content_index=0,
            part=part,
        )
        yield event("response.output_item.done", output_index=index, item=output[index])
        index += 1
    for k, call in enumerate(output[index:]):
        at = index + k
        yield event(
            "response.output_item.added",
            output_index=at,
            item={**call, "arguments": "", "status": "in_progress"},
        )
        yield event(
            "response.function_call_arguments.delta",
            item_id=call["id"],
            output_index=at,
            delta=call["arguments"],
        )
        yield event(
            "response.function_call_arguments.done",
            item_id=call["id"],
            output_index=at,
            arguments=call["arguments"],
        )
        yield event("response.output_item.done", output_index=at, item=call)
    # response.completed also when the response is incomplete (its status says so): the
    # official SDK's stream helper waits for this event, as vLLM's server sends it
    yield event("response.completed", response=final)
