"""The native routes beside OpenAI's: ``/generate`` (SGLang's shape: text or token ids,
``sampling_params`` as ``SamplingParams`` fields), ``/tokenize`` and ``/detokenize``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from radixserve.api.asgi import (
    APIError,
    ASGIApp,
    HTTPRequest,
    Response,
    StreamResponse,
    json_response,
)
from radixserve.api.openai import converter as cv
from radixserve.api.openai.generation import DONE, sse
from radixserve.api.openai.protocol import (
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    body_schema,
)
from radixserve.api.openai.state import OpenAIServer
from radixserve.api.openai.tool_parser import template_message
from radixserve.core.errors import InputError
from radixserve.serving.engine_streams import EngineDead, RequestRejected
from radixserve.serving.frontend import ModelInputs


def add_routes(app: ASGIApp, server: OpenAIServer) -> None:

    @app.route("POST", "/tokenize", body_schema=body_schema(TokenizeRequest))
    async def tokenize(request: HTTPRequest) -> Response:
        body, frontend, _ = await server.parse_inputs(request, TokenizeRequest)
        if body.messages is not None:
            messages = [
                template_message(m, i, cv.message_text(m, i)) for i, m in enumerate(body.messages)
            ]
            try:
                ids = await frontend.chat_ids(messages)
            except InputError as exc:
                raise cv.input_error(exc) from None
        elif body.prompt is not None:
            ids = await frontend.encode(body.prompt, body.add_special_tokens)
        else:
            raise APIError(400, "give prompt or messages", param="prompt")
        return json_response(
            {"tokens": ids, "count": len(ids), "max_model_len": frontend.max_model_len}
        )

    @app.route("POST", "/detokenize", body_schema=body_schema(DetokenizeRequest))
    async def detokenize(request: HTTPRequest) -> Response:
        body, frontend, _ = await server.parse_inputs(request, DetokenizeRequest)
        bad = [t for t in body.tokens if not 0 <= t < frontend.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {frontend.vocab_size})", param="tokens")
        return json_response({"prompt": frontend.tokenizer.decode(body.tokens)})

    async def read(frontend: ModelInputs, body: GenerateRequest):
        if body.input_ids is not None:
            ids = body.input_ids
        elif body.text is not None:
            ids = await frontend.encode(body.text)
        else:
            raise APIError(400, "give text or input_ids", param="text")
        fields = {k: v for k, v in (body.sampling_params or {}).items() if k != "n"}
        params = cv.checked_sampling_params(frontend, prefix="sampling_params.", **fields)
        cv.check_prompt(frontend, ids, params.max_tokens)
        if params.structured_output is not None:
            try:
                await frontend.grammar.check(params.structured_output, "sampling_params")
            except InputError as exc:
                raise cv.input_error(exc) from None
        return ids, params

    @app.route("POST", "/generate", watch_disconnect=True, body_schema=body_schema(GenerateRequest))
    async def generate(request: HTTPRequest) -> Response | StreamResponse:
        body, routing = await server.parse_routed(request, GenerateRequest, read)
        frontend = server.frontend_of(routing)
        ids, params = await read(frontend, body)
        gen = frontend.run([ids], params, routing)
        if body.stream:

            async def events() -> AsyncIterator[bytes]:
                try:
                    async for _, d in gen:
                        yield sse(
                            {
                                "text": d.text,
                                "token_ids": d.token_ids,
                                "finished": d.finished,
                                "finish_reason": d.finish_reason,
                            }
                        )
                except BaseException as exc:
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    yield sse(cv.engine_error(exc).body())
                yield DONE

            return StreamResponse(events())
        try:
            items = [x async for x in gen]
        except (RequestRejected, EngineDead) as exc:
            raise cv.engine_error(exc) from None
        out_ids = [t for _, d in items for t in d.token_ids]
        last = items[-1][1]
        return json_response(
            {
                "text": "".join(d.text for _, d in items),
                "output_ids": out_ids,
                "meta_info": {
                    "finish_reason": last.finish_reason,
                    "prompt_tokens": len(ids),
                    "completion_tokens": len(out_ids),
                    "cached_tokens": last.num_cached_tokens,
                },
            }
        )
