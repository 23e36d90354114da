"""``POST /v1/rerank`` (and ``/v2/rerank``, ``/rerank``: Jina's and Cohere's shape) and
``POST /v1/score`` (vLLM's): how relevant each document is to a query, from a causal
language model asked "yes or no?".

The recipe is Qwen3-Reranker's: the query and a document go into a fixed template that
ends where the model answers, and the score is the model's probability of "yes" against
"no" there, ``p(yes) / (p(yes) + p(no))``. Each (query, document) pair is two one-token
generation requests, one forced to answer "yes" and one "no" (a logit bias), each
returning its chosen token's raw log-probability (taken before any bias): so the score is
exact whatever else the model would rank higher, the second request finds the first's
prompt in the radix cache, and the pairs are batched with the server's other traffic
like any request. Served on a model whose name says it is a reranker, or on any
generative model with ``serve --enable-rerank``; ``--rerank-template`` picks the template.
"""

from __future__ import annotations

import functools
import math
import time
import uuid
from pathlib import Path
from typing import Any

from radixserve.api.asgi import APIError, ASGIApp, HTTPRequest, Response, json_response
from radixserve.api.openai import converter as cv
from radixserve.api.openai.protocol import RerankRequest, ScoreRequest, body_schema
from radixserve.api.openai.state import OpenAIServer
from radixserve.core.errors import InputError
from radixserve.core.sampling_params import SamplingParams
from radixserve.serving.engine_streams import EngineDead, RequestRejected
from radixserve.serving.frontend import Frontend, ModelInputs
from radixserve.serving.tenancy import Routing

RERANK_TEMPLATES = {
    # Qwen3-Reranker's own prompt (its model card), the thinking left empty
    "qwen3": (
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
        'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
        "<|im_end|>\n<|im_start|>user\n<Instruct>: {instruction}\n<Query>: {query}\n"
        "<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ),
}
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_FORCE = 100.0  # the logit bias that makes the answer token the chosen one


@functools.cache
def rerank_template(name: str) -> str:
    """A named template, or the text of a file holding ``{query}``, ``{document}`` and
    (optionally) ``{instruction}`` (read once); ``ValueError`` naming what is wrong. Other
    braces in a file are its own text: only those three names are filled in."""
    if name in RERANK_TEMPLATES:
        return RERANK_TEMPLATES[name]
    path = Path(name)
    if not path.is_file():
        raise ValueError(
            f"--rerank-template {name!r} is neither a template name "
            f"({', '.join(RERANK_TEMPLATES)}) nor a file"
        )
    text = path.read_text()
    if "{query}" not in text or "{document}" not in text:
        raise ValueError(f"the rerank template {name} must hold {{query}} and {{document}}")
    return text


def fill_template(template: str, query: str, document: str, instruction: str) -> str:
    """The template with its three names filled in (``str.format`` would read any other
    brace, a JSON example's say, as a field)."""
    return (
        template.replace("{instruction}", instruction)
        .replace("{query}", query)
        .replace("{document}", document)
    )


def _serves_rerank(server: OpenAIServer, frontend: ModelInputs) -> None:
    name = frontend.model_name
    if server.config.enable_rerank or "rerank" in name.lower():
        return
    raise APIError(
        400,
        f"The model `{name}` is not a reranker; start the server with "
        "--enable-rerank to score documents with it",
        code="rerank_not_enabled",
    )


def _answer_ids(frontend: Frontend) -> tuple[int, int]:
    """The one-token ids of "yes" and "no" (a 400 if the vocabulary splits either)."""
    tokenizer = frontend.tokenizer
    ids = []
    for word in ("yes", "no"):
        encoded = tokenizer.encode(word, add_special_tokens=False)
        if len(encoded) != 1:
            raise APIError(
                400,
                f"The model's vocabulary has no single token for {word!r}: it cannot rerank",
                code="rerank_not_supported",
            )
        ids.append(encoded[0])
    return ids[0], ids[1]


async def score_pairs(
    server: OpenAIServer,
    pairs: list[tuple[str, str]],
    instruction: str | None,
    routing: Routing,
    param: str,
) -> tuple[list[float], int]:
    """The relevance of each (query, document) pair, and the prompt tokens read."""
    frontend, config = server.frontend_of(routing), server.config
    if not pairs:
        raise APIError(400, "give at least one document", param=param)
    if len(pairs) > config.max_prompts_per_request:
        raise APIError(
            400,
            f"{len(pairs)} documents; at most {config.max_prompts_per_request} a request "
            "(--max-prompts-per-request)",
            param=param,
        )
    template = rerank_template(config.rerank_template)
    yes, no = _answer_ids(frontend)
    prompts = []
    for query, document in pairs:
        text = fill_template(template, query, document, instruction or DEFAULT_INSTRUCTION)
        ids = await frontend.encode(text, add_special_tokens=False)
        try:
            prompts.append(frontend.inputs.check_prompt(ids, 1))
        except InputError as exc:
            raise APIError(400, str(exc), param=param, code=exc.code) from None
    cv.check_request_size(
        config, prompts, SamplingParams(max_tokens=1), prompt_param=param
    )  # the per-request limits, as every route's
    answers = {"yes": yes, "no": no}
    logprobs: dict[str, dict[int, float]] = {}
    try:
        for word, token in answers.items():  # the "no" prompts then hit the "yes" ones' cache
            params = SamplingParams(
                temperature=0.0, max_tokens=1, logprobs=0, logit_bias={token: _FORCE}
            )
            got = logprobs.setdefault(word, {})
            async for i, d in frontend.run(prompts, params, routing):
                if d.finished and d.finish_reason == "error":
                    raise APIError(500, d.error or "scoring failed", type_="internal_error")
                for entry in d.logprobs or ():
                    token_id, logprob = entry[0], entry[1]
                    if token_id != token:
                        raise APIError(500, "the forced answer was not chosen", "internal_error")
                    got[i] = logprob
    except (RequestRejected, EngineDead) as exc:
        raise cv.engine_error(exc) from None
    scores = [
        1.0 / (1.0 + math.exp(logprobs["no"][i] - logprobs["yes"][i])) for i in range(len(pairs))
    ]
    return scores, sum(len(p) for p in prompts)


def _document_text(doc: str | dict[str, Any], i: int) -> str:
    if isinstance(doc, str):
        return doc
    text = doc.get("text")
    if not isinstance(text, str):
        raise APIError(400, 'a document is a string or {"text": "..."}', param=f"documents.{i}")
    return text


def add_routes(app: ASGIApp, server: OpenAIServer) -> None:
    async def read_rerank(frontend: ModelInputs, body: RerankRequest) -> list[str]:
        _serves_rerank(server, frontend)
        if not body.query.strip():
            raise APIError(400, "query is empty", param="query")
        if body.top_n is not None and body.top_n < 1:
            raise APIError(400, "top_n must be at least 1", param="top_n")
        return [_document_text(d, i) for i, d in enumerate(body.documents)]

    async def rerank(request: HTTPRequest) -> Response:
        body, routing = await server.parse_routed(request, RerankRequest, read_rerank)
        docs = await read_rerank(server.frontend_of(routing), body)
        scores, tokens = await score_pairs(
            server, [(body.query, d) for d in docs], body.instruction, routing, "documents"
        )
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[: body.top_n]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                result["document"] = {"text": docs[i]}
            results.append(result)
        return json_response(
            {
                "id": f"rerank-{uuid.uuid4().hex}",
                "model": server.served_name(routing),
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": results,
            }
        )

    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        app.route("POST", path, watch_disconnect=True, body_schema=body_schema(RerankRequest))(
            rerank
        )

    async def read_score(frontend: ModelInputs, body: ScoreRequest) -> list[tuple[str, str]]:
        _serves_rerank(server, frontend)
        firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise APIError(400, "text_1 must be one text or as many as text_2", param="text_1")
        if any(not t.strip() for t in firsts):
            raise APIError(400, "text_1 is empty", param="text_1")
        return list(zip(firsts, seconds, strict=True))

    async def score(request: HTTPRequest) -> Response:
        body, routing = await server.parse_routed(request, ScoreRequest, read_score)
        pairs = await read_score(server.frontend_of(routing), body)
        scores, tokens = await score_pairs(server, pairs, body.instruction, routing, "text_2")
        return json_response(
            {
                "id": f"score-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": server.served_name(routing),
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    for path in ("/v1/score", "/score"):
        app.route("POST", path, watch_disconnect=True, body_schema=body_schema(ScoreRequest))(score)
