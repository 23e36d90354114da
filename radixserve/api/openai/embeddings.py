"""``POST /v1/embeddings``: a string, strings, token ids or lists of them in; per input the
model's final-norm hidden state pooled by the engine (a pooling request: prefill only,
batched with generation traffic), L2-normalised, as floats or base64 float32.

Served when the model is an embedding model (its pooling from sentence-transformers'
``1_Pooling`` or GGUF ``pooling_type``) or when ``serve --enable-embeddings`` asks for
pooled hidden states of a generative model; otherwise a 400 saying so.
"""

from __future__ import annotations

import base64

import numpy as np

from radixserve.api.asgi import APIError, ASGIApp, HTTPRequest, Response, json_response
from radixserve.api.openai import converter as cv
from radixserve.api.openai.protocol import EmbeddingRequest, body_schema
from radixserve.api.openai.state import OpenAIServer
from radixserve.core.errors import InputError
from radixserve.core.request import POOLING_PARAMS
from radixserve.serving.engine_streams import EngineDead, RequestRejected
from radixserve.serving.frontend import Frontend, ModelInputs

# what the wire carries for a pooling request (the engine makes its own)
_INPUT_SHAPES = (
    "input must be a string, a list of strings, a list of token ids or a list of lists of token ids"
)


async def embedding_prompts(
    server: OpenAIServer, frontend: ModelInputs, body: EmbeddingRequest
) -> list[list[int]]:
    """An embeddings request's prompt ids, each checked against the context (nothing is
    generated: a prompt may fill it whole), and the request's size against the limits."""
    config = server.config
    _, prompts = await cv.completion_prompts(
        frontend, body.input, config.max_prompts_per_request, param="input"
    )
    if body.truncate_prompt_tokens is not None:
        prompts = [cv.truncate_prompt(ids, body) for ids in prompts]
    try:
        prompts = [frontend.inputs.check_prompt(ids, 0) for ids in prompts]
    except InputError as exc:
        raise APIError(400, str(exc), param="input", code=exc.code) from None
    cv.check_request_size(config, prompts, POOLING_PARAMS, prompt_param="input")
    return prompts


def pooling_kind(server: OpenAIServer, frontend: Frontend) -> str:
    """How this server pools: ``--embedding-pooling`` if given, else the model's own,
    else last-token (a decoder LM's natural summary, as vLLM pools causal LMs); a 400
    when embeddings are not served at all."""
    ready = frontend.client.ready
    model_pooling = ready.model_pooling if ready is not None else None
    config = server.config
    if model_pooling is None and not config.enable_embeddings:
        raise APIError(
            400,
            f"The model `{frontend.model_name}` is not an embedding model; start the "
            "server with --enable-embeddings to serve its pooled hidden states at "
            "/v1/embeddings",
            code="embeddings_not_enabled",
        )
    return config.embedding_pooling or model_pooling or "last"


def check_dimensions(frontend: Frontend, dimensions: int | None) -> int | None:
    """The size to truncate to (None: the full vector). Only a Matryoshka model may be
    truncated (to its listed sizes, if it lists them); a 400 naming ``dimensions``."""
    ready = frontend.client.ready
    hidden = ready.hidden_size if ready is not None else 0
    if dimensions is None or dimensions == hidden:
        return None
    if not 1 <= dimensions <= hidden:
        raise APIError(400, f"dimensions must be in [1, {hidden}]", param="dimensions")
    allowed = ready.matryoshka_dimensions if ready is not None else None
    if allowed is None:
        raise APIError(
            400,
            f"The model `{frontend.model_name}` does not support matryoshka "
            f"representations: dimensions must be its embedding size ({hidden}) or unset",
            param="dimensions",
        )
    if allowed and dimensions not in allowed:
        raise APIError(
            400,
            f"dimensions must be one of {allowed} (the model's matryoshka dimensions)",
            param="dimensions",
        )
    return dimensions


def finish_vector(raw: bytes, dimensions: int | None, normalize: bool) -> np.ndarray:
    """A pooled vector from the engine (float32 bytes), truncated to ``dimensions`` and
    then L2-normalised (unless ``normalize`` is off)."""
    vec = np.frombuffer(raw, dtype="<f4")
    if dimensions is not None:
        vec = vec[:dimensions]
    if normalize:
        norm = float(np.linalg.norm(vec.astype(np.float64)))
        if norm > 0:
            vec = vec / np.float32(norm)
    return vec.astype("<f4", copy=False)


def add_routes(app: ASGIApp, server: OpenAIServer) -> None:
    @app.route(
        "POST",
        "/v1/embeddings",
        watch_disconnect=True,
        body_schema=body_schema(EmbeddingRequest),
    )
    async def embeddings(request: HTTPRequest) -> Response:
        try:
            body, routing = await server.parse_routed(
                request, EmbeddingRequest, lambda f, b: embedding_prompts(server, f, b)
            )
        except APIError as exc:  # (pydantic names the union member: "input.str")
            if exc.param is None or not exc.param.startswith("input."):
                raise
            raise APIError(400, _INPUT_SHAPES, param="input") from None
        frontend = server.frontend_of(routing)
        kind = pooling_kind(server, frontend)
        dimensions = check_dimensions(frontend, body.dimensions)
        prompts = await embedding_prompts(server, frontend, body)
        vectors: dict[int, bytes] = {}
        try:
            async for i, d in frontend.run(
                prompts, POOLING_PARAMS, routing, request_id=body.request_id, pooling=kind
            ):
                if not d.finished:
                    continue
                if d.embedding is None:
                    raise APIError(
                        500, f"the engine failed: {d.error or d.finish_reason}", "internal_error"
                    )
                vectors[i] = d.embedding
        except (RequestRejected, EngineDead) as exc:
            raise cv.engine_error(exc) from None
        data = []
        for i in range(len(prompts)):
            vec = finish_vector(vectors[i], dimensions, body.normalize)
            if body.encoding_format == "base64":
                embedding: object = base64.b64encode(vec.tobytes()).decode("ascii")
            else:
                embedding = vec.tolist()
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        num_tokens = sum(len(p) for p in prompts)
        return json_response(
            {
                "object": "list",
                "data": data,
                "model": server.served_name(routing),
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
            }
        )
