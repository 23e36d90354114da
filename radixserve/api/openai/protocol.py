"""OpenAI-compatible request bodies, validated with pydantic (never on the output hot path)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown option: a 400 naming it

    include_usage: StrictBool = False
    # vLLM's extension (guidellm always sends it): usage so far in every chunk
    continuous_usage_stats: StrictBool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras).
    Undeclared fields are kept (``model_extra``) so that the server answers 400 naming
    them instead of ignoring them (``api.structured.reject_unknown_fields``)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    # ollama's: how long the model stays loaded after this request (seconds, '5m'; 0: unload
    # at once; negative: keep), where the server serves several models
    keep_alive: StrictInt | StrictFloat | str | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    user: str | None = None
    # extras (vLLM's); None: the model's default (engine.inputs), as for temperature, top_p
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    priority: StrictInt = 0
    cache_salt: str | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs extra
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # ... and the older fields clients still send (api/openai/structured.py LEGACY_SPEC_FIELDS)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    json_schema: dict[str, Any] | str | None = None  # SGLang
    regex: str | None = None  # SGLang
    ebnf: str | None = None  # SGLang
    # vLLM: keep only the prompt's last k tokens
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=1)
    request_id: str | None = None  # vLLM: the answer's id is made from it


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: calls it made
    tool_call_id: str | None = None  # tool: the call this answers


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    add_special_tokens: StrictBool = False  # vLLM: special tokens (BOS) on the templated text


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # undeclared fields: a 400 (see _Sampling)

    model: str | None = None
    keep_alive: StrictInt | StrictFloat | str | None = None

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # undeclared fields: a 400 (see _Sampling)

    model: str | None = None
    keep_alive: StrictInt | StrictFloat | str | None = None

    tokens: list[StrictInt]


class GenerateRequest(BaseModel):
    """The native ``/generate`` body (SGLang's shape): text or token ids, sampling params."""

    model_config = ConfigDict(extra="allow")  # undeclared fields: a 400 (see _Sampling)

    model: str | None = None
    keep_alive: StrictInt | StrictFloat | str | None = None
    text: str | None = None
    input_ids: list[StrictInt] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: StrictBool = False
    priority: StrictInt = 0
    cache_salt: str | None = None


_REF = "#/components/schemas/{model}"


def body_schema(model: type[BaseModel]) -> dict:
    """The model's JSON schema with references into OpenAPI's ``components/schemas``
    (nested definitions stay under ``$defs``; ``openapi_document`` moves them there)."""
    return model.model_json_schema(ref_template=_REF)


class ResponseTextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: dict[str, Any] | None = None  # {type: text | json_object | json_schema, ...}
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(BaseModel):
    """OpenAI's Responses API body. Undeclared fields are a 400 naming them (see
    ``_Sampling``); declared ones this server cannot honour are refused by the route."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    # ollama's: how long the model stays loaded after this request (seconds, '5m'; 0: unload
    # at once; negative: keep), where the server serves several models
    keep_alive: StrictInt | StrictFloat | str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: ResponseTextConfig | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: StrictBool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: StrictInt | None = None
    # extras (vLLM's)
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: StrictInt | None = None
    priority: StrictInt = 0
    cache_salt: str | None = None


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings body (``POST /v1/embeddings``), with vLLM's extras that change
    the result (``normalize``, ``truncate_prompt_tokens``, ``priority``) and the cache salt;
    undeclared fields are a 400 naming them (see ``_Sampling``)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    # ollama's: how long the model stays loaded after this request (seconds, '5m'; 0: unload
    # at once; negative: keep), where the server serves several models
    keep_alive: StrictInt | StrictFloat | str | None = None
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None
    # extras (vLLM's)
    normalize: StrictBool = True
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=1)
    priority: StrictInt = 0
    cache_salt: str | None = None
    request_id: str | None = None


class RerankRequest(BaseModel):
    """Jina's and Cohere's rerank body (``/v1/rerank``, ``/v2/rerank``, ``/rerank``):
    documents as strings or ``{"text": ...}`` objects; undeclared fields are a 400."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    # ollama's: how long the model stays loaded after this request (seconds, '5m'; 0: unload
    # at once; negative: keep), where the server serves several models
    keep_alive: StrictInt | StrictFloat | str | None = None
    query: str
    documents: list[str | dict[str, Any]]
    top_n: StrictInt | None = None
    return_documents: StrictBool = True
    instruction: str | None = None  # the Qwen3-Reranker template's task line
    user: str | None = None
    priority: StrictInt = 0
    cache_salt: str | None = None


class ScoreRequest(BaseModel):
    """vLLM's ``/v1/score``: ``text_1`` (one query, or one per pair) against ``text_2``."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    # ollama's: how long the model stays loaded after this request (seconds, '5m'; 0: unload
    # at once; negative: keep), where the server serves several models
    keep_alive: StrictInt | StrictFloat | str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = None
    user: str | None = None
    priority: StrictInt = 0
    cache_salt: str | None = None


class LoadLoRARequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body): serve the PEFT folder ``lora_path``
    as model ``lora_name``."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    model: str | None = None  # the base model (several models; None: the default one)


class UnloadLoRARequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # (vLLM's; ignored: adapters are named)
    model: str | None = None  # the base model holding it (None: the one that does)
