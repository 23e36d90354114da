"""The OpenAI-compatible HTTP frontend (FastAPI): routes, validation, tokenization, SSE."""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.api.engine_client import EngineClient, EngineDead, RequestRejected
from radixserve.api.metrics import Metrics
from radixserve.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from radixserve.api.protocol import Delta
from radixserve.core.sampling_params import SamplingParams
from radixserve.engine.config import EngineConfig
from radixserve.engine.model_source import resolve_model
from radixserve.engine.tokenizer import load_hf_tokenizer, tokenizer_from_gguf
from radixserve.executor.loader.gguf_loader import read_metadata

_FIELD_RE = re.compile(r"^([a-z_]+)")
_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str | None = None
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 2**20
    max_n: int = 16
    max_logprobs: int = 20
    max_stop: int = 16


class APIError(Exception):
    """An error answered with OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def _error_body(e: APIError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def load_frontend_tokenizer(config: EngineConfig):
    source = resolve_model(config.model)
    if source.kind == "gguf":
        return source.name, tokenizer_from_gguf(read_metadata(source.path))
    return source.name, load_hf_tokenizer(source.path)


class OpenAIServer:
    """Routes of one server. Invariants: bad input is answered 400 before anything reaches
    the engine; every request sent to the engine is either answered or aborted (client
    gone); output JSON is written with orjson, SSE frames preformatted."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig) -> None:
        self.engine_config = engine_config
        self.config = config
        self.client = EngineClient(engine_config)
        source_name, self.tokenizer = load_frontend_tokenizer(engine_config)
        self.model_name = config.served_model_name or source_name
        self.metrics = Metrics(lambda: self.client.stats)
        self._token_texts: dict[int, str] = {}
        self.created = int(time.time())

    # -- request parsing ------------------------------------------------------------------
    async def parse(self, request: Request, model: type[BaseModel]) -> Any:
        content_type = request.headers.get("content-type", "")
        if "application/json" not in content_type:
            raise APIError(400, "Content-Type must be application/json")
        body = await request.body()
        if len(body) > self.config.max_body_bytes:
            raise APIError(413, f"request body exceeds {self.config.max_body_bytes} bytes")
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise APIError(400, f"could not parse the JSON body: {exc}") from None
        if not isinstance(data, dict):
            raise APIError(400, "the JSON body must be an object")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(x) for x in err.get("loc", ())) or None
            raise APIError(400, f"{param}: {err.get('msg')}", param=param) from None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"The model `{name}` does not exist.",
                type_="NotFoundError",
                param="model",
                code="model_not_found",
            )

    def sampling(self, body: Any, max_tokens: int | None) -> tuple[dict, int]:
        """Validated SamplingParams fields (as a dict for the engine) and n."""
        if body.stream_options is not None and not body.stream:
            raise APIError(
                400, "stream_options is only allowed with stream=true", param="stream_options"
            )
        if not 1 <= body.n <= self.config.max_n:
            raise APIError(400, f"n must be in [1, {self.config.max_n}], got {body.n}", param="n")
        num_logprobs = self.num_logprobs(body)
        if body.temperature is not None and body.temperature > 2:
            raise APIError(400, "temperature must be in [0, 2]", param="temperature")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > self.config.max_stop:
            raise APIError(400, f"at most {self.config.max_stop} stop sequences", param="stop")
        fields = {
            "n": body.n,
            "max_tokens": max_tokens,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
            "repetition_penalty": body.repetition_penalty,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "seed": body.seed,
            "stop": stop,
            "stop_token_ids": body.stop_token_ids or [],
            "ignore_eos": body.ignore_eos,
            "min_tokens": body.min_tokens,
            "skip_special_tokens": body.skip_special_tokens,
            "include_stop_str_in_output": body.include_stop_str_in_output,
            "logprobs": num_logprobs,
        }
        if body.logit_bias:
            try:
                fields["logit_bias"] = {int(k): v for k, v in body.logit_bias.items()}
            except ValueError:
                raise APIError(
                    400, "logit_bias keys must be token ids", param="logit_bias"
                ) from None
        try:
            params = SamplingParams(**fields)
            params.check_vocab(self.vocab_size)
        except ValueError as exc:
            m = _FIELD_RE.match(str(exc))
            raise APIError(400, str(exc), param=m.group(1) if m else None) from None
        return fields, body.n

    def num_logprobs(self, body: Any) -> int | None:
        """How many top logprobs to return per token (None: no logprobs), as OpenAI's
        completions (``logprobs: int``) and chat (``logprobs: bool`` + ``top_logprobs``)
        ask for them."""
        limit = self.config.max_logprobs
        if isinstance(body, ChatCompletionRequest):
            if body.logprobs not in (None, False, True):
                raise APIError(400, "logprobs must be a boolean", param="logprobs")
            if body.top_logprobs is not None:
                if not body.logprobs:
                    raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
                if not 0 <= body.top_logprobs <= limit:
                    raise APIError(
                        400, f"top_logprobs must be in [0, {limit}]", param="top_logprobs"
                    )
            return (body.top_logprobs or 0) if body.logprobs else None
        if body.logprobs is None:
            return None
        if isinstance(body.logprobs, bool) or not isinstance(body.logprobs, int):
            raise APIError(400, "logprobs must be an integer", param="logprobs")
        if not 0 <= body.logprobs <= limit:
            raise APIError(400, f"logprobs must be in [0, {limit}]", param="logprobs")
        return body.logprobs

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def completion_logprobs(self, lps: list, offset: int) -> dict:
        """OpenAI's completions shape; ``text_offset`` counts from ``offset``."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, logprob, top_pairs in lps:
            text = self.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(logprob)
            top.append({self.token_text(t): lp for t, lp in top_pairs})
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def chat_logprobs(self, lps: list) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**entry(t, lp), "top_logprobs": [entry(tt, tlp) for tt, tlp in top]}
                for t, lp, top in lps
            ]
        }

    @property
    def vocab_size(self) -> int:
        assert self.client.ready is not None
        return self.client.ready.vocab_size

    @property
    def max_model_len(self) -> int:
        assert self.client.ready is not None
        return self.client.ready.max_model_len

    def check_prompt(self, ids: list[int], max_tokens: int) -> None:
        if not ids:
            raise APIError(400, "the prompt must not be empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(
                400, f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}", param="prompt"
            )
        if len(ids) + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or "
                "completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )

    # -- running requests -----------------------------------------------------------------
    async def run(
        self,
        prompts: list[list[int]],
        fields: dict,
        n: int,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[tuple[int, Delta]]:
        """Yield (prompt index, delta) for all prompts' samples, as they come."""
        base = uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, ids: list[int]) -> None:
            try:
                async for delta in self.client.generate(
                    f"{base}-{i}", ids, fields, n, cache_salt, priority
                ):
                    await queue.put((i, delta))
            except BaseException as exc:
                await queue.put((i, exc))
                if isinstance(exc, asyncio.CancelledError):
                    raise

        tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(prompts)]
        remaining = len(prompts) * n
        try:
            while remaining:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def collect(self, http: Request, gen: AsyncIterator[tuple[int, Delta]]) -> list:
        """Gather a non-streamed request, aborting it if the client goes away."""

        async def drain() -> list:
            return [x async for x in gen]

        task = asyncio.create_task(drain())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if not done and await http.is_disconnected():
                task.cancel()
                await gen.aclose()
                raise APIError(499, "client disconnected")
        return task.result()


def _engine_error(exc: BaseException) -> APIError:
    if isinstance(exc, RequestRejected):
        if exc.overloaded:
            return APIError(503, str(exc), type_="overloaded_error", code="overloaded")
        m = _FIELD_RE.match(str(exc))
        return APIError(400, str(exc), param=m.group(1) if m else None)
    if isinstance(exc, EngineDead):
        return APIError(503, str(exc), type_="service_unavailable_error", code="engine_dead")
    return APIError(500, f"internal error: {exc}", type_="internal_error")


def create_app(engine_config: EngineConfig, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    server = OpenAIServer(engine_config, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.client.start()
        yield
        await server.client.shutdown()

    app = FastAPI(title="radixserve", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return _json(_error_body(exc), exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        kind = {404: "NotFoundError", 405: "MethodNotAllowed"}.get(exc.status_code, "error")
        return _json(_error_body(APIError(exc.status_code, str(exc.detail), kind)), exc.status_code)

    @app.middleware("http")
    async def auth(request: Request, call_next: Callable):
        path = request.url.path
        if config.api_keys and (
            path.startswith("/v1") or path in ("/generate", "/tokenize", "/detokenize")
        ):
            header = request.headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            ok = False
            for key in config.api_keys:  # constant time per key, every key checked
                ok |= hmac.compare_digest(token.encode(), key.encode())
            if not ok:
                return _json(
                    _error_body(
                        APIError(401, "invalid or missing API key", "authentication_error")
                    ),
                    401,
                )
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        if server.client.alive:
            return Response(status_code=200)
        return _json(
            _error_body(APIError(503, "the engine is not running", "service_unavailable_error")),
            503,
        )

    @app.get("/version")
    async def version() -> Response:
        from radixserve import __version__

        return _json({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": server.model_name,
                        "object": "model",
                        "created": server.created,
                        "owned_by": "radixserve",
                        "max_model_len": server.max_model_len,
                    }
                ],
            }
        )

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await server.parse(request, TokenizeRequest)
        if body.messages is not None:
            ids = _render_chat(server, [m.model_dump() for m in body.messages], True, False, {})
        elif body.prompt is not None:
            ids = server.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)[
                "input_ids"
            ]
        else:
            raise APIError(400, "give prompt or messages", param="prompt")
        return _json({"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await server.parse(request, DetokenizeRequest)
        bad = [t for t in body.tokens if not 0 <= t < server.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {server.vocab_size})", param="tokens")
        return _json({"prompt": server.tokenizer.decode(body.tokens)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await server.parse(request, CompletionRequest)
        server.check_model(body.model)
        texts, prompts = _completion_prompts(server, body.prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        fields, n = server.sampling(body, max_tokens)
        for ids in prompts:
            server.check_prompt(ids, max_tokens)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(
                _stream_completion(server, request, rid, texts, prompts, fields, n, body),
                media_type="text/event-stream",
            )
        return await _complete(server, request, rid, texts, prompts, fields, n, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest = await server.parse(request, ChatCompletionRequest)
        server.check_model(body.model)
        messages = [_message(m, i) for i, m in enumerate(body.messages)]
        ids = _render_chat(
            server,
            messages,
            body.add_generation_prompt and not body.continue_final_message,
            body.continue_final_message,
            body.chat_template_kwargs or {},
        )
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = requested if requested is not None else max(1, server.max_model_len - len(ids))
        fields, n = server.sampling(body, max_tokens)
        server.check_prompt(ids, max_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(
                _stream_chat(server, request, rid, ids, fields, n, body),
                media_type="text/event-stream",
            )
        return await _complete(server, request, rid, [None], [ids], fields, n, body, chat=True)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        data = await request.body()
        try:
            obj = orjson.loads(data)
            assert isinstance(obj, dict)
        except (orjson.JSONDecodeError, AssertionError):
            raise APIError(400, "could not parse the JSON body") from None
        if "input_ids" in obj:
            ids = obj["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise APIError(400, "input_ids must be a list of token ids", param="input_ids")
        elif isinstance(obj.get("text"), str):
            ids = server.tokenizer(obj["text"])["input_ids"]
        else:
            raise APIError(400, "give text or input_ids", param="text")
        sp = obj.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise APIError(400, "sampling_params must be an object", param="sampling_params")
        try:
            params = SamplingParams(**{k: v for k, v in sp.items() if k != "n"})
        except (TypeError, ValueError) as exc:
            raise APIError(400, str(exc), param="sampling_params") from None
        server.check_prompt(ids, params.max_tokens)
        fields = {**sp, "n": 1}

        priority = obj.get("priority", 0)
        if not isinstance(priority, int):
            raise APIError(400, "priority must be an integer", param="priority")
        gen = server.run([ids], fields, 1, obj.get("cache_salt"), priority)
        if obj.get("stream"):

            async def events() -> AsyncIterator[bytes]:
                try:
                    async for _, d in gen:
                        yield _sse(
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
                    yield _sse(_error_body(_engine_error(exc)))
                yield _DONE

            return StreamingResponse(events(), media_type="text/event-stream")
        try:
            items = await server.collect(request, gen)
        except (RequestRejected, EngineDead) as exc:
            raise _engine_error(exc) from None
        text = "".join(d.text for _, d in items)
        out_ids = [t for _, d in items for t in d.token_ids]
        last = items[-1][1]
        return _json(
            {
                "text": text,
                "output_ids": out_ids,
                "meta_info": {
                    "finish_reason": last.finish_reason,
                    "prompt_tokens": len(ids),
                    "completion_tokens": len(out_ids),
                    "cached_tokens": last.num_cached_tokens,
                },
            }
        )

    return app


# -- helpers ----------------------------------------------------------------------------
def _completion_prompts(
    server: OpenAIServer, prompt: Any
) -> tuple[list[str | None], list[list[int]]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "the prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        return [None], [list(prompt)]
    if all(isinstance(x, str) for x in prompt):
        if any(x == "" for x in prompt):
            raise APIError(400, "the prompt must not be empty", param="prompt")
        encoded = server.tokenizer(list(prompt))["input_ids"]  # one batched call
        return list(prompt), [list(ids) for ids in encoded]
    if all(isinstance(x, list) for x in prompt):
        return [None] * len(prompt), [list(x) for x in prompt]
    raise APIError(
        400, "prompt must be a string, strings, token ids or lists of them", param="prompt"
    )


def _message(m: Any, i: int) -> dict:
    content = m.content
    if isinstance(content, list):
        parts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    400, "only text content parts are supported", param=f"messages.{i}.content"
                )
            parts.append(part["text"])
        content = "".join(parts)
    return {"role": m.role, "content": content or ""}


def _render_chat(
    server: OpenAIServer,
    messages: list[dict],
    add_generation_prompt: bool,
    continue_final: bool,
    kwargs: dict,
) -> list[int]:
    tok = server.tokenizer
    if not tok.chat_template:
        raise APIError(400, "this model has no chat template; use /v1/completions")
    try:
        text = tok.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            **kwargs,
        )
    except Exception as exc:  # template errors are the caller's input
        raise APIError(400, f"could not apply the chat template: {exc}", param="messages") from None
    return tok(text, add_special_tokens=False)["input_ids"]


def _usage(prompts: list[list[int]], completion_tokens: int, cached: int) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def _complete(server, request, rid, texts, prompts, fields, n, body, chat: bool) -> Response:
    started = time.monotonic()
    try:
        items = await server.collect(
            request, server.run(prompts, fields, n, body.cache_salt, body.priority)
        )
    except (RequestRejected, EngineDead) as exc:
        raise _engine_error(exc) from None
    outs: dict[int, dict] = {}
    cached: dict[int, int] = {}
    first = None
    for i, d in items:
        idx = i * n + d.index
        o = outs.setdefault(
            idx, {"text": "", "tokens": 0, "reason": None, "error": None, "logprobs": []}
        )
        o["text"] += d.text
        o["tokens"] += len(d.token_ids)
        o["logprobs"].extend(d.logprobs or ())
        if d.token_ids and first is None:
            first = time.monotonic()
        if d.finished:
            o["reason"], o["error"] = d.finish_reason, d.error
            cached[i] = max(cached.get(i, 0), d.num_cached_tokens)
    errors = [o["error"] for o in outs.values() if o["reason"] == "error"]
    if errors:
        raise APIError(500, errors[0] or "generation failed", type_="internal_error")
    total = sum(o["tokens"] for o in outs.values())
    for o in outs.values():
        server.metrics.request_success.labels(o["reason"] or "unknown").inc()
    server.metrics.e2e.observe(time.monotonic() - started)
    if first is not None:
        server.metrics.ttft.observe(first - started)
    server.metrics.generation_tokens.inc(total)
    server.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
    choices = []
    for idx in sorted(outs):
        o = outs[idx]
        wants = fields.get("logprobs") is not None
        if chat:
            choices.append(
                {
                    "index": idx,
                    "message": {"role": "assistant", "content": o["text"]},
                    "logprobs": server.chat_logprobs(o["logprobs"]) if wants else None,
                    "finish_reason": o["reason"],
                }
            )
        else:
            prefix = (texts[idx // n] or "") if getattr(body, "echo", False) else ""
            choices.append(
                {
                    "index": idx,
                    "text": prefix + o["text"],
                    "logprobs": server.completion_logprobs(o["logprobs"], len(prefix))
                    if wants
                    else None,
                    "finish_reason": o["reason"],
                }
            )
    return _json(
        {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": server.model_name,
            "choices": choices,
            "usage": _usage(prompts, total, sum(cached.values())),
        }
    )


async def _stream_events(
    server, request, prompts, fields, n, body, on_delta, on_finish, head, usage_obj
):
    """Shared SSE loop: head frames, per-delta frames, then usage and [DONE]."""
    started = time.monotonic()
    first = None
    last_time: dict[int, float] = {}
    total = 0
    cached: dict[int, int] = {}
    try:
        for frame in head():
            yield frame
        async for i, d in server.run(prompts, fields, n, body.cache_salt, body.priority):
            idx = i * n + d.index
            now = time.monotonic()
            if d.token_ids:
                if first is None:
                    first = now
                    server.metrics.ttft.observe(now - started)
                elif idx in last_time:
                    server.metrics.itl.observe(now - last_time[idx])
                last_time[idx] = now
            total += len(d.token_ids)
            if d.text or d.logprobs:
                yield on_delta(idx, d)
            if d.finished:
                cached[i] = max(cached.get(i, 0), d.num_cached_tokens)
                server.metrics.request_success.labels(d.finish_reason or "unknown").inc()
                if d.finish_reason == "error":
                    yield _sse(
                        _error_body(APIError(500, d.error or "generation failed", "internal_error"))
                    )
                yield on_finish(idx, d.finish_reason)
        server.metrics.e2e.observe(time.monotonic() - started)
        server.metrics.generation_tokens.inc(total)
        server.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse(
                {**usage_obj, "choices": [], "usage": _usage(prompts, total, sum(cached.values()))}
            )
    except (RequestRejected, EngineDead) as exc:
        yield _sse(_error_body(_engine_error(exc)))
    yield _DONE


def _stream_completion(server, request, rid, texts, prompts, fields, n, body):
    created = int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": server.model_name}

    def head():
        if body.echo:
            for i, text in enumerate(texts):
                for j in range(n):
                    yield _sse(
                        {
                            **base,
                            "choices": [
                                {
                                    "index": i * n + j,
                                    "text": text or "",
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                        }
                    )

    offsets: dict[int, int] = {}

    def on_delta(idx, d):
        logprobs = None
        if d.logprobs:
            logprobs = server.completion_logprobs(d.logprobs, offsets.get(idx, 0))
            offsets[idx] = offsets.get(idx, 0) + sum(len(t) for t in logprobs["tokens"])
        choice = {"index": idx, "text": d.text, "logprobs": logprobs, "finish_reason": None}
        return _sse({**base, "choices": [choice]})

    def on_finish(idx, reason):
        return _sse(
            {
                **base,
                "choices": [{"index": idx, "text": "", "logprobs": None, "finish_reason": reason}],
            }
        )

    return _stream_events(
        server, request, prompts, fields, n, body, on_delta, on_finish, head, base
    )


def _stream_chat(server, request, rid, ids, fields, n, body):
    created = int(time.time())
    base = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": server.model_name,
    }

    def head():
        for j in range(n):
            yield _sse(
                {
                    **base,
                    "choices": [
                        {
                            "index": j,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )

    def on_delta(idx, d):
        logprobs = server.chat_logprobs(d.logprobs) if d.logprobs else None
        choice = {
            "index": idx,
            "delta": {"content": d.text},
            "logprobs": logprobs,
            "finish_reason": None,
        }
        return _sse({**base, "choices": [choice]})

    def on_finish(idx, reason):
        return _sse(
            {
                **base,
                "choices": [{"index": idx, "delta": {}, "logprobs": None, "finish_reason": reason}],
            }
        )

    return _stream_events(server, request, [ids], fields, n, body, on_delta, on_finish, head, base)
