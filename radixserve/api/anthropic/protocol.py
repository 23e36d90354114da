"""Anthropic Messages API request bodies (pydantic; validated before anything runs)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt


class _Body(BaseModel):
    # undeclared fields are kept so that the route answers 400 naming them
    model_config = ConfigDict(extra="allow")


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control etc.: checked by the route

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" or absent; server tools are refused


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None


class MessagesRequest(_Body):
    model: str | None = None
    # ollama's: how long the model stays loaded after this request (seconds, '5m'; 0: unload
    # at once; negative: keep), where the server serves several models
    keep_alive: StrictInt | StrictFloat | str | None = None
    max_tokens: StrictInt = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = None
    top_k: StrictInt | None = None
    stream: StrictBool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None  # user_id: accepted, changes nothing
    # {"type": "enabled", "budget_tokens": N} | {"type": "disabled"}: needs a reasoning
    # parser (the thinking comes back as thinking blocks); the budget caps its tokens
    thinking: dict[str, Any] | None = None


class CountTokensRequest(_Body):
    model: str | None = None
    # ollama's: how long the model stays loaded after this request (seconds, '5m'; 0: unload
    # at once; negative: keep), where the server serves several models
    keep_alive: StrictInt | StrictFloat | str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
