"""The HTTP server's settings (``radixserve serve``'s transport flags), apart from the
engine's (``EngineConfig``) and the serving frontend's (``ServingConfig``, derived here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.api.openai.response_store import DEFAULT_MAX_RESPONSES
from radixserve.serving.frontend import ServingConfig
from radixserve.serving.supervisor import SupervisorConfig


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str | None = None
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 2**20
    max_n: int = 16
    max_logprobs: int = 20
    max_stop: int = 16
    tool_call_parser: str = "hermes"  # hermes | llama3_json
    data_parallel_size: int = 1  # engine processes behind this frontend (serving/dp_client)
    dp_policy: str = "cache-aware"
    dp_balance: Any = None  # serving.balancer.BalanceConfig (None: its defaults)
    supervision: SupervisorConfig = field(default_factory=SupervisorConfig)  # watchdog, restarts
    enable_debug_endpoints: bool = False  # /debug/* (see console/debug.py)
    # /v1/embeddings on a generative model (an embedding model is always served); pooling:
    # "last" | "mean" (None: the model's own, else last-token)
    enable_embeddings: bool = False
    embedding_pooling: str | None = None
    max_stored_responses: int = DEFAULT_MAX_RESPONSES  # the Responses API's store
    # per-request limits (a 400 naming the limit): prompts, prompts x n, prompt tokens in
    # all, completion tokens asked for in all (max_tokens x n x prompts)
    max_prompts_per_request: int = 64
    max_sequences_per_request: int = 256
    max_prompt_tokens_per_request: int = 1 << 18
    max_completion_tokens_per_request: int = 1 << 20
    body_timeout_s: float | None = 30.0  # a body must arrive this long after its headers
    # admin routes (console data, /v1/engine/*, /debug/*, /metrics): their own keys; without
    # any they are served only when the server listens on loopback
    admin_api_keys: tuple[str, ...] = ()
    loopback_only: bool = True
    # inference keys naming their tenants (api/tenants.py), re-read on SIGHUP
    api_keys_file: str | None = None

    def serving(self) -> ServingConfig:
        """The transport-independent part, for the serving frontend."""
        return ServingConfig(
            served_model_name=self.served_model_name,
            data_parallel_size=self.data_parallel_size,
            dp_policy=self.dp_policy,
            dp_balance=self.dp_balance,
            supervision=self.supervision,
        )
