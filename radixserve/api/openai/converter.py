"""The one request converter of the OpenAI-shaped API: a validated request body becomes
prompt token ids + ``SamplingParams`` here, for every route and for gRPC (which turns its
messages into the same bodies). The model's defaults, the chat template and the prompt
check are the engine's (``engine.inputs`` through the serving frontend); what is decided
here is only the OpenAI API's own shape: field names, limits, route defaults and errors.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from pydantic import BaseModel, ValidationError

from radixserve.api.asgi import APIError
from radixserve.api.openai.config import ServerConfig
from radixserve.api.openai.protocol import ChatCompletionRequest
from radixserve.api.openai.structured import reject_unknown_fields
from radixserve.api.openai.tool_parser import ToolContext, template_message
from radixserve.core.errors import InputError
from radixserve.core.sampling_params import SamplingParams
from radixserve.serving.engine_streams import EngineDead, RequestRejected
from radixserve.serving.frontend import ModelInputs

_FIELD_RE = re.compile(r"^([a-z_]+)")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default


# -- errors -------------------------------------------------------------------------------
def input_error(exc: InputError) -> APIError:
    """A request the engine's input checks refused: a 400 naming its field."""
    return APIError(400, str(exc), param=exc.param, code=exc.code)


def engine_error(exc: BaseException) -> APIError:
    """What the engine client raised, as the API's error."""
    if isinstance(exc, RequestRejected):
        if exc.overloaded:
            return APIError(503, str(exc), type_="overloaded_error", code="overloaded")
        m = _FIELD_RE.match(str(exc))
        return APIError(400, str(exc), param=m.group(1) if m else None)
    if isinstance(exc, EngineDead):
        return APIError(503, str(exc), type_="service_unavailable_error", code=exc.code)
    return APIError(500, f"internal error: {exc}", type_="internal_error")


def parse_body(model: type[BaseModel], data: Any) -> Any:
    """``data`` (decoded JSON) validated as ``model``; 400 naming the first bad field, or
    a field the model does not declare."""
    if not isinstance(data, dict):
        raise APIError(400, "the JSON body must be an object")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(x) for x in err.get("loc", ())) or None
        raise APIError(400, f"{param}: {err.get('msg')}", param=param) from None
    reject_unknown_fields(body)
    return body


# -- sampling -----------------------------------------------------------------------------
def num_logprobs(body: Any, limit: int) -> int | None:
    """How many top logprobs to return per token (None: no logprobs), as OpenAI's
    completions (``logprobs: int``) and chat (``logprobs: bool`` + ``top_logprobs``) ask."""
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs not in (None, False, True):
            raise APIError(400, "logprobs must be a boolean", param="logprobs")
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            if not 0 <= body.top_logprobs <= limit:
                raise APIError(400, f"top_logprobs must be in [0, {limit}]", param="top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    if body.logprobs is None:
        return None
    if isinstance(body.logprobs, bool) or not isinstance(body.logprobs, int):
        raise APIError(400, "logprobs must be an integer", param="logprobs")
    if not 0 <= body.logprobs <= limit:
        raise APIError(400, f"logprobs must be in [0, {limit}]", param="logprobs")
    return body.logprobs


def checked_sampling_params(
    frontend: ModelInputs, renames: dict[str, str] | None = None, prefix: str = "", **fields: Any
) -> SamplingParams:
    """``frontend.inputs.sampling_params(**fields)``, a bad field a 400 naming it as the
    request does (``renames``: engine field -> request field; ``prefix``: its parent)."""
    try:
        return frontend.inputs.sampling_params(**fields)
    except InputError as exc:
        name = (renames or {}).get(exc.param or "", exc.param)
        param = f"{prefix}{name}" if name else prefix.rstrip(".") or None
        raise APIError(400, str(exc), param=param, code=exc.code) from None


def sampling_params(
    frontend: ModelInputs, body: Any, max_tokens: int, config: ServerConfig
) -> SamplingParams:
    """The ``SamplingParams`` of a completions or chat body: fields it leaves unset take the
    model's defaults (``engine.inputs``); out-of-range values are a 400 naming the field."""
    if body.stream_options is not None and not body.stream:
        raise APIError(
            400, "stream_options is only allowed with stream=true", param="stream_options"
        )
    if not 1 <= body.n <= config.max_n:
        raise APIError(400, f"n must be in [1, {config.max_n}], got {body.n}", param="n")
    logprobs = num_logprobs(body, config.max_logprobs)
    if body.temperature is not None and body.temperature > 2:
        raise APIError(400, "temperature must be in [0, 2]", param="temperature")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > config.max_stop:
        raise APIError(400, f"at most {config.max_stop} stop sequences", param="stop")
    logit_bias = None
    if body.logit_bias:
        try:
            logit_bias = {int(k): v for k, v in body.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
    return checked_sampling_params(
        frontend,
        n=body.n,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=logit_bias,
        seed=body.seed,
        stop=stop,
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=logprobs,
    )


# -- per-request limits ---------------------------------------------------------------------
def check_request_size(
    config: ServerConfig,
    prompts: list[list[int]],
    params: SamplingParams,
    prompt_param: str = "prompt",
) -> None:
    """One request may not take the engine from everyone else: a 400 naming the limit
    (and its flag) when it carries too many prompts, samples or tokens (``prompt_param``:
    the request's name for its prompts)."""
    n, count = params.n, len(prompts)
    limits = [
        (count, config.max_prompts_per_request, "prompts", "--max-prompts-per-request"),
        (
            count * n,
            config.max_sequences_per_request,
            "prompts x n",
            "--max-sequences-per-request",
        ),
        (
            sum(len(p) for p in prompts),
            config.max_prompt_tokens_per_request,
            "prompt tokens",
            "--max-prompt-tokens-per-request",
        ),
        (
            count * n * params.max_tokens,
            config.max_completion_tokens_per_request,
            "completion tokens (max_tokens x n x prompts)",
            "--max-completion-tokens-per-request",
        ),
    ]
    for value, limit, what, flag in limits:
        if value > limit:
            raise APIError(
                400,
                f"this request asks for {value} {what}; this server allows at most {limit} "
                f"per request ({flag})",
                param=prompt_param if what.startswith("prompt") else "max_tokens",
                code="request_too_large",
            )


# -- prompts ------------------------------------------------------------------------------
def check_prompt(frontend: ModelInputs, ids: list[int], max_tokens: int) -> list[int]:
    try:
        return frontend.inputs.check_prompt(ids, max_tokens)
    except InputError as exc:
        raise input_error(exc) from None


async def completion_prompts(
    frontend: ModelInputs, prompt: Any, max_prompts: int, param: str = "prompt"
) -> tuple[list[str | None], list[list[int]]]:
    """(texts, token ids) of a completions ``prompt`` (or an embeddings ``input``:
    ``param`` names the field): a string, strings, token ids or lists of them (texts are
    None for token-id prompts); strings encoded in one batch. More than ``max_prompts``
    prompts is a 400 before any is tokenized."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, f"the {param} must not be empty", param=param)
    if all(isinstance(x, int) for x in prompt):
        return [None], [list(prompt)]
    if len(prompt) > max_prompts:
        raise APIError(
            400,
            f"this request has {len(prompt)} prompts; this server allows at most "
            f"{max_prompts} per request (--max-prompts-per-request)",
            param=param,
            code="request_too_large",
        )
    if all(isinstance(x, str) for x in prompt):
        if any(x == "" for x in prompt):
            raise APIError(400, f"the {param} must not be empty", param=param)
        encoded = await frontend.tokenize.encode_many(list(prompt))  # one batched call
        return list(prompt), [list(ids) for ids in encoded]
    if all(isinstance(x, list) for x in prompt):
        return [None] * len(prompt), [list(x) for x in prompt]
    raise APIError(
        400, f"{param} must be a string, strings, token ids or lists of them", param=param
    )


def message_text(m: Any, i: int) -> str:
    """A chat message's content as text (text parts joined; other parts are a 400)."""
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
    return content or ""


async def chat_prompt(
    frontend: ModelInputs, body: Any, tools: ToolContext | None = None
) -> list[int]:
    """Token ids of a chat body's messages through the model's chat template, with the
    tools it may call shown to the model (``tools`` active)."""
    messages = [template_message(m, i, message_text(m, i)) for i, m in enumerate(body.messages)]
    template_kwargs = dict(body.chat_template_kwargs or {})
    if tools is not None and tools.active:
        template_kwargs["tools"] = tools.tools
    try:
        ids = await frontend.chat_ids(
            messages,
            body.add_generation_prompt,
            body.continue_final_message,
            template_kwargs,
            body.add_special_tokens,
        )
    except InputError as exc:
        raise input_error(exc) from None
    return truncate_prompt(ids, body)


def truncate_prompt(ids: list[int], body: Any) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: only the prompt's last k tokens."""
    k = getattr(body, "truncate_prompt_tokens", None)
    return ids[-k:] if k is not None else ids


def response_id(prefix: str, body: Any) -> str:
    """The answer's id: from vLLM's ``request_id`` when the client sends one."""
    given = getattr(body, "request_id", None)
    return f"{prefix}-{given}" if given else f"{prefix}-{uuid.uuid4().hex}"


def chat_max_tokens(frontend: ModelInputs, body: Any, prompt_len: int) -> int:
    """A chat request's completion budget: as asked, else the rest of the context."""
    requested = getattr(body, "max_completion_tokens", None) or body.max_tokens
    return requested if requested is not None else max(1, frontend.max_model_len - prompt_len)
