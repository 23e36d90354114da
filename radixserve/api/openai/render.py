"""vLLM's render routes, ``/v1/completions/render`` and ``/v1/chat/completions/render``:
the token ids (and sampling parameters) a request would run with, without running it.
llm-d's router reads a prompt's tokens from them to score replicas by the KV blocks they
hold (``docs/scaling.md``, under llm-d). The same parsing, templates and checks as the
generating routes, so a render is exactly what the engine would be given; a request the
generating route refuses is refused here the same way."""

from __future__ import annotations

from typing import Any

from radixserve.api.asgi import ASGIApp, HTTPRequest, Response, json_response
from radixserve.api.openai import converter as cv
from radixserve.api.openai.chat import chat_inputs
from radixserve.api.openai.completions import completion_inputs
from radixserve.api.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    body_schema,
)
from radixserve.api.openai.state import OpenAIServer
from radixserve.core.sampling_params import SamplingParams

# the sampling fields a render returns, under vLLM's SamplingParams names (radixserve's
# are the same); the rest (a grammar, logit bias) stays with the request
_RENDERED = (
    "n",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "logprobs",
    "prompt_logprobs",
)


def rendered(rid: str, ids: list[int], params: SamplingParams, model: str, body: Any) -> dict:
    """One of vLLM's ``GenerateRequest`` (the fields a router reads)."""
    return {
        "request_id": rid,
        "token_ids": ids,
        "sampling_params": {name: getattr(params, name) for name in _RENDERED},
        "model": model,
        "stream": bool(getattr(body, "stream", False)),
        "cache_salt": getattr(body, "cache_salt", None),
        "priority": getattr(body, "priority", None) or 0,
    }


def add_routes(app: ASGIApp, server: OpenAIServer) -> None:
    @app.route("POST", "/v1/completions/render", body_schema=body_schema(CompletionRequest))
    async def render_completions(request: HTTPRequest) -> Response:
        body, frontend, name = await server.parse_inputs(request, CompletionRequest)
        _, prompts, params, _ = await completion_inputs(server, frontend, body)
        rid = cv.response_id("cmpl", body)
        return json_response(
            [
                rendered(
                    rid if len(prompts) == 1 else f"{rid}-{i}",
                    ids,
                    params,
                    name,
                    body,
                )
                for i, ids in enumerate(prompts)
            ]
        )

    @app.route(
        "POST", "/v1/chat/completions/render", body_schema=body_schema(ChatCompletionRequest)
    )
    async def render_chat(request: HTTPRequest) -> Response:
        body, frontend, name = await server.parse_inputs(request, ChatCompletionRequest)
        ids, params, _ = await chat_inputs(server, frontend, body)
        rid = cv.response_id("chatcmpl", body)
        return json_response(rendered(rid, ids, params, name, body))
