"""The HTTP server's settings (``radixserve serve``'s transport flags), apart from the
engine's (``EngineConfig``) and the serving frontend's (``ServingConfig``, derived here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.api.openai.response_store import DEFAULT_MAX_RESPONSES
from radixserve.api.openai.tool_parser import TOOL_CALL_PARSERS
from radixserve.core.settings import setting, zero_is_none
from radixserve.serving.balancer import POLICIES as BALANCE_POLICIES
from radixserve.serving.frontend import ServingConfig
from radixserve.serving.reasoning import REASONING_PARSERS
from radixserve.serving.supervisor import SupervisorConfig


def _mib(text: str) -> int:
    return int(float(text) * 2**20)


@dataclass(frozen=True)
class ServerConfig:
    """The transport's settings: each ``setting(...)`` field is also a flag of
    ``radixserve serve`` (``core.settings``); the others are set from what the command
    line says otherwise (``loopback_only`` from ``--host``, the data-parallel fields from
    the data-parallel flags, ``supervision`` from its own flags) or keywords only."""

    served_model_name: str | None = setting(
        None, help="the model's name in /v1/models and answers (default: from its file)"
    )
    api_keys: tuple[str, ...] = setting((), name="--api-key", repeat=True, help="repeatable")
    max_body_bytes: int = setting(
        8 * 2**20, name="--max-body-mb", parse=_mib, help="request body size limit (MiB; 8)"
    )
    max_n: int = setting(16, help="most samples (n) a request may ask for")
    max_logprobs: int = setting(
        20, choices=range(21), metavar="{0..20}", help="most top logprobs a request may ask for"
    )
    max_stop: int = 16  # stop strings a request may give
    tool_call_parser: str = setting(
        "hermes",
        choices=(*TOOL_CALL_PARSERS, "auto"),
        help="how tool calls are read from chat output, in the model family's own format: "
        "hermes (<tool_call> JSON), llama3_json, mistral ([TOOL_CALLS]), qwen3_coder "
        "(<function=...> XML), pythonic ([f(a=1)]), deepseek_v3; auto: the one the chat "
        "template shows (else hermes)",
    )
    reasoning_parser: str | None = setting(
        None,
        choices=(*REASONING_PARSERS, "auto"),
        help="split the thinking (<think> ... </think>) from the answer as this model family "
        "writes it (reasoning_content, reasoning items, thinking blocks, reasoning_tokens); "
        "auto: as the chat template shows, where unambiguous (default: off, the whole text "
        "is the answer)",
    )
    data_parallel_size: int = setting(
        1,
        aliases=("-dp",),
        group="dp",
        help="engine processes (replicas, each with its own KV cache) behind this frontend",
    )
    dp_policy: str = setting(
        "cache-aware",
        choices=BALANCE_POLICIES,
        group="dp",
        help="how requests are spread over the engines",
    )
    dp_balance: Any = None  # serving.balancer.BalanceConfig (None: its defaults): its flags
    supervision: SupervisorConfig = field(default_factory=SupervisorConfig)  # watchdog, restarts
    engine_in_process: bool = False  # the engine on a thread of the server (tests)
    enable_debug_endpoints: bool = setting(
        False,
        group="reliability",
        help="serve /debug/flush_cache and /debug/engine (for soak tests; behind --api-key)",
    )
    enable_embeddings: bool = setting(
        False,
        help="serve /v1/embeddings on a generative model: its final-norm hidden states, "
        "pooled (an embedding model's are always served; otherwise it is a 400)",
    )
    embedding_pooling: str | None = setting(
        None,
        choices=("last", "mean"),
        help="how /v1/embeddings pools the prompt's hidden states (default: the model's "
        "own pooling if it is an embedding model, else the last token)",
    )
    enable_rerank: bool = setting(
        False,
        help="serve /v1/rerank, /v2/rerank and /v1/score on this generative model (a model "
        "whose name says reranker is served without it): the probability of 'yes' after "
        "--rerank-template",
    )
    rerank_template: str = setting(
        "qwen3",
        metavar="NAME|FILE",
        help="the rerank prompt: qwen3 (Qwen3-Reranker's), or a file holding {query}, "
        "{document} and optionally {instruction}",
    )
    max_stored_responses: int = DEFAULT_MAX_RESPONSES  # the Responses API's store
    max_prompts_per_request: int = setting(64, group="limits", help="prompts in one request")
    max_sequences_per_request: int = setting(256, group="limits", help="prompts x n")
    max_prompt_tokens_per_request: int = setting(
        1 << 18, group="limits", help="prompt tokens in all"
    )
    max_completion_tokens_per_request: int = setting(
        1 << 20, group="limits", help="max_tokens x n x prompts"
    )
    body_timeout_s: float | None = setting(
        30.0,
        name="--body-timeout",
        parse=zero_is_none(float),
        metavar="SECONDS",
        help="a request body must arrive this long after its headers (408 otherwise); 0: none",
    )
    # without admin keys the admin routes are served only when the server listens on
    # loopback (loopback_only, from --host)
    admin_api_keys: tuple[str, ...] = setting(
        (),
        name="--admin-api-key",
        repeat=True,
        help="guards /metrics, /v1/engine/*, /debug/* and the radix view's prompt text "
        "(repeatable; one more may come from $RADIXSERVE_ADMIN_API_KEY); without one those "
        "routes are served only on a loopback --host",
    )
    loopback_only: bool = True
    behind_proxy: bool = setting(
        False,
        help="the server is reached through a proxy that forwards other machines' requests "
        "(the Ray Serve application's replicas): a loopback --host is not trusted as one "
        "user's machine (admin routes need --admin-api-key, as on a public address)",
    )
    api_keys_file: str | None = setting(
        None,
        metavar="PATH",
        help="inference keys, one 'NAME:KEY [weight=W] [max_concurrency=N] "
        "[subtenants=true]' a line, each naming its tenant (docs/many-users.md); "
        "re-read on SIGHUP",
    )

    # several models behind one server (serving/model_set.py, docs/multi-model.md)
    models_dir: str | None = setting(
        None,
        metavar="DIR",
        group="models",
        help="serve every GGUF file and HF model folder in DIR, each named by its file or "
        "folder name (or by DIR/models.toml: aliases, pinned, engine flags per model) and "
        "loaded on the first request that names it; --memory-budget then covers them all",
    )
    model_entries: tuple[str, ...] = ()  # serve's --model NAME=PATH, repeated
    idle_unload_s: float = setting(
        300.0,
        name="--idle-unload",
        metavar="SECONDS",
        group="models",
        help="several models: unload a model this long after its last request (a "
        "request's keep_alive overrides; 0: at once; negative: never)",
    )
    max_load_wait_s: float = setting(
        120.0,
        name="--max-load-wait",
        metavar="SECONDS",
        group="models",
        help="several models: how long a request waits for its model to load (then 503 "
        "with Retry-After)",
    )

    vllm_metrics: bool = setting(
        False,
        help="/metrics also under vLLM's names (vllm:num_requests_waiting, "
        "vllm:num_requests_running, vllm:kv_cache_usage_perc, vllm:lora_requests_info, "
        "vllm:cache_config_info), the ones llm-d's and the Gateway API Inference "
        "Extension's endpoint picker scrape",
    )

    @property
    def many_models(self) -> bool:
        return bool(self.models_dir or self.model_entries)

    def __post_init__(self) -> None:
        self.serving()  # its checks (the data-parallel size) hold here too

    def serving(self) -> ServingConfig:
        """The transport-independent part, for the serving frontend."""
        return ServingConfig(
            served_model_name=self.served_model_name,
            data_parallel_size=self.data_parallel_size,
            dp_policy=self.dp_policy,
            dp_balance=self.dp_balance,
            supervision=self.supervision,
            engine_in_process=self.engine_in_process,
            vllm_metrics=self.vllm_metrics,
        )
