"""radixserve: an LLM inference and serving engine.

The public names load on first use (PEP 562), so processes that need only part of the
package (the router, the CLI's argument parsing) do not import torch."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
from radixserve.core.version import __version__

_LAZY = {
    "LLM": "radixserve.engine.llm",
    "CompletionOutput": "radixserve.engine.outputs",
    "RequestOutput": "radixserve.engine.outputs",
    "SamplingParams": "radixserve.core.sampling_params",
}

if TYPE_CHECKING:
    from radixserve.core.sampling_params import SamplingParams
    from radixserve.engine.llm import LLM
    from radixserve.engine.outputs import CompletionOutput, RequestOutput


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
