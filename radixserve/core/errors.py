"""Errors every floor may raise and every transport knows how to answer."""

from __future__ import annotations


class InputError(ValueError):
    """A request's prompt or parameters are invalid. ``param`` names the request field
    (OpenAI's error ``param``), ``code`` an OpenAI error code where one applies: a
    transport answers it as bad input (HTTP 400, gRPC INVALID_ARGUMENT)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class LoRAError(ValueError):
    """An adapter that cannot be served here (a bad file, a module or option not
    supported, a shape the base model does not have); the message names what."""


class LoRANotFound(ValueError):
    """A request named an adapter that is not loaded (404 ``model_not_found`` at the API)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"the model {name!r} does not exist (no base model or LoRA adapter)")
        self.name = name
