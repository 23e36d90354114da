"""LoRA adapters from their files, and the adapters a server knows by name: PEFT folders
and llama.cpp GGUF LoRA files read into ``lora.LoRAAdapter``s (``read_adapter``), checked
against the base model's shapes; ``LoRARegistry`` loads, unloads and keeps them."""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from radixserve.core.errors import LoRAError, LoRANotFound
from radixserve.executor.lora import (
    _MODULE_GROUP,
    LoRAAdapter,
    LoRAModule,
    LoRAShapes,
    _blocked,
    module_path,
)
from radixserve.executor.native import load_lora

_TENSOR = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|qkv_proj|gate_proj|up_proj|down_proj|gate_up_proj)"
    r"\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$"
)


def _scale(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling of ``module`` (its full name, ``module_path``): lora_alpha, or the
    first ``alpha_pattern`` key that is the name or matches its end as PEFT matches it,
    over the rank (its square root under rsLoRA)."""
    alpha = config.get("lora_alpha", 8)
    patterns = config.get("alpha_pattern") or {}
    if not isinstance(patterns, dict):
        raise LoRAError(f"alpha_pattern must be an object, got {patterns!r}")
    for key, value in patterns.items():
        if key == module or re.match(rf"(.*\.)?({key})$", module):
            alpha = value
            break
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise LoRAError(f"lora_alpha of {module} must be a number > 0, got {alpha!r}")
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def read_adapter(
    name: str, path: str | Path, shapes: LoRAShapes, dtype: torch.dtype, max_rank: int
) -> LoRAAdapter:
    """The adapter at ``path``: a PEFT folder (``read_peft``) or a llama.cpp GGUF LoRA
    file (``read_gguf_lora``). Whatever is wrong with it is a ``LoRAError`` naming the
    adapter (never another exception: a bad file must not take the engine down)."""
    try:
        if Path(path).suffix == ".gguf" and Path(path).is_file():
            return read_gguf_lora(name, path, shapes, dtype, max_rank)
        return read_peft(name, path, shapes, dtype, max_rank)
    except LoRAError:
        raise
    except Exception as exc:  # (a malformed config or tensor of any kind)
        raise LoRAError(f"LoRA adapter {name!r}: {type(exc).__name__}: {exc}") from None


# llama.cpp's names of the projections an adapter may touch (``convert_lora_to_gguf.py``:
# ``blk.N.<name>.weight.lora_a`` / ``.lora_b``)
_GGUF_LORA = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight\.lora_([ab])")


def read_gguf_lora(
    name: str, path: str | Path, shapes: LoRAShapes, dtype: torch.dtype, max_rank: int
) -> LoRAAdapter:
    """A llama.cpp LoRA file (``convert_lora_to_gguf.py``: ``general.type`` adapter,
    ``adapter.type`` lora, ``adapter.lora.alpha``) as served weights, scaled as llama.cpp
    scales it (alpha / rank; 1 without an alpha): its tensors renamed to PEFT's, a
    llama-arch file's q and k B rows put back in Hugging Face order."""
    from radixserve.executor.loader.gguf_file import GGUFFile
    from radixserve.executor.loader.gguf_loader import hf_name, reverse_rope_permute

    try:
        gguf = GGUFFile(Path(path))
    except ValueError as exc:
        raise LoRAError(f"LoRA adapter {name!r}: {exc}") from None
    meta = gguf.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise LoRAError(
            f"LoRA adapter {name!r}: {path} is not a GGUF LoRA adapter (general.type "
            f"{meta.get('general.type')!r}, adapter.type {meta.get('adapter.type')!r})"
        )
    arch = str(meta.get("general.architecture", "llama"))
    alpha = float(meta.get("adapter.lora.alpha", 0.0) or 0.0)
    tensors: dict[str, torch.Tensor] = {}
    for t in gguf.tensors:
        m = _GGUF_LORA.fullmatch(t.name)
        target = hf_name(f"blk.{m[1]}.{m[2]}.weight", arch) if m else None
        if m is None or target is None or not target.endswith("_proj.weight"):
            raise LoRAError(
                f"LoRA adapter {name!r}: tensor {t.name} is not a LoRA weight of an attention "
                "or MLP projection (embedding and LM-head adapters are not supported)"
            )
        try:
            w = torch.from_numpy(np.array(gguf.dequantize(t), dtype=np.float32))
        except Exception as exc:
            raise LoRAError(f"LoRA adapter {name!r}: cannot decode {t.name}: {exc}") from None
        if m[3] == "b" and arch == "llama" and shapes.head_dim:
            if target.endswith("q_proj.weight"):
                w = reverse_rope_permute(w, shapes.q_size // shapes.head_dim)
            elif target.endswith("k_proj.weight"):
                w = reverse_rope_permute(w, shapes.kv_size // shapes.head_dim)
        tensors[target.removesuffix(".weight") + f".lora_{m[3].upper()}.weight"] = w

    def scale(module: str, rank: int) -> float:
        return alpha / rank if alpha else 1.0

    return _build(name, str(path), scale, tensors, shapes, dtype, max_rank)


def read_peft(
    name: str, path: str | Path, shapes: LoRAShapes, dtype: torch.dtype, max_rank: int
) -> LoRAAdapter:
    """The PEFT adapter in folder ``path`` (``adapter_config.json`` and
    ``adapter_model.safetensors``) as served weights; ``LoRAError`` naming the problem for
    anything it cannot serve exactly."""
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not folder.is_dir():
        raise LoRAError(
            f"LoRA adapter {name!r}: {path} is neither a folder (a PEFT adapter) nor a .gguf "
            "file (a llama.cpp LoRA)"
        )
    if not config_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {path} has no adapter_config.json")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is not an object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {kind!r} is not LoRA")
    for option, bad in (
        ("use_dora", lambda v: bool(v)),
        ("fan_in_fan_out", lambda v: bool(v)),
        ("bias", lambda v: v not in (None, "none")),
        ("modules_to_save", lambda v: bool(v)),
        ("rank_pattern", lambda v: False),
    ):
        if option in config and bad(config[option]):
            raise LoRAError(
                f"LoRA adapter {name!r}: {option}={config[option]!r} is not supported "
                "(plain LoRA on the attention and MLP projections only)"
            )
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoRAError(
            f"LoRA adapter {name!r}: {path} has no adapter_model.safetensors "
            "(a .bin adapter is not read: no pickle)"
        )
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError) as exc:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_model.safetensors: {exc}") from None
    return _build(
        name, str(folder), lambda m, r: _scale(config, m, r), tensors, shapes, dtype, max_rank
    )


def _build(
    name: str,
    path: str,
    scaling: Callable[[str, int], float],
    tensors: dict[str, torch.Tensor],
    shapes: LoRAShapes,
    dtype: torch.dtype,
    max_rank: int,
) -> LoRAAdapter:
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tname, tensor in tensors.items():
        m = _TENSOR.search(tname)
        if m is None:
            raise LoRAError(
                f"LoRA adapter {name!r}: tensor {tname} is not a LoRA weight of an attention "
                "or MLP projection (embedding and LM-head adapters are not supported)"
            )
        layer, module, which = int(m[1]), m[2], m[3]
        if layer >= shapes.num_layers:
            raise LoRAError(
                f"LoRA adapter {name!r}: tensor {tname} is for layer {layer}; "
                f"the base model has {shapes.num_layers}"
            )
        if _MODULE_GROUP[module] in ("gate_up", "down") and layer in shapes.sparse_layers:
            raise LoRAError(
                f"LoRA adapter {name!r}: tensor {tname}: layer {layer}'s MLP is a mixture "
                "of experts, whose LoRA is not supported"
            )
        if which in pairs.get((layer, module), {}):
            raise LoRAError(
                f"LoRA adapter {name!r}: tensor {tname}: a second lora_{which} of layer "
                f"{layer} {module}"
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_model.safetensors has no LoRA weights")
    # bfloat16 with the native kernel: Bt held blocked for it (the PyTorch path of long
    # segments unblocks a copy); otherwise plain
    native = dtype == torch.bfloat16 and load_lora() is not None
    weights: list[dict[str, LoRAModule]] = [{} for _ in range(shapes.num_layers)]
    nbytes = 0
    rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(
                f"LoRA adapter {name!r}: layer {layer} {module} has lora_"
                f"{next(iter(ab))} without lora_{'B' if 'A' in ab else 'A'}"
            )
        a, b = ab["A"], ab["B"]
        group = _MODULE_GROUP[module]
        first, rows = shapes.out_slices(group)[module]
        r = a.shape[0] if a.dim() == 2 else -1
        if (
            a.dim() != 2
            or b.dim() != 2
            or tuple(a.shape) != (r, shapes.in_size(group))
            or tuple(b.shape) != (rows, r)
        ):
            raise LoRAError(
                f"LoRA adapter {name!r}: layer {layer} {module}: lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)} do not fit the base model's "
                f"[{rows}, {shapes.in_size(group)}] projection"
            )
        if r < 1:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module} has rank 0")
        if r > max_rank:
            raise LoRAError(
                f"LoRA adapter {name!r}: rank {r} (layer {layer} {module}) is above "
                f"--max-lora-rank {max_rank}"
            )
        rank = max(rank, r)
        scale = scaling(module_path(layer, module), r)
        b_t = (b.float() * scale).t().to(dtype).contiguous()
        held = _blocked(b_t) if native else b_t
        m = LoRAModule(a.to(dtype).contiguous(), held, first, rows, native)
        weights[layer][module] = m
        nbytes += sum(t.numel() * t.element_size() for t in (m.a, m.b))
    modules = tuple(sorted({module for _, module in pairs}))
    return LoRAAdapter(name, path, rank, _content_key(tensors, scaling), weights, nbytes, modules)


def _content_key(tensors: dict[str, torch.Tensor], scaling: Callable[[str, int], float]) -> str:
    """What the adapter computes, as a key: a hash of its tensors (names and values) and of
    each one's scale. Two loads of the same weights share cached KV (the same numbers),
    before and after a restart (the disk tier keeps pages by namespace); any change of a
    weight or of alpha is another namespace."""
    digest = hashlib.blake2b(digest_size=16)
    for tname in sorted(tensors):
        t = tensors[tname].detach().to(torch.float32).contiguous()
        m = _TENSOR.search(tname)
        scale = scaling(module_path(int(m[1]), m[2]), t.shape[0]) if m and m[3] == "A" else 0.0
        digest.update(f"{tname}:{tuple(t.shape)}:{scale!r}:".encode())
        digest.update(t.numpy().tobytes())
    return "lora:" + digest.hexdigest()


class LoRARegistry:
    """The adapters a server knows by name: ``paths`` every registered one, ``loaded`` those
    in memory, at most ``max_cpu_loras`` of them (least recently used dropped first: it is
    read again from its path when next asked for). A request holds its adapter object from
    ``get`` on, so an adapter dropped or unloaded meanwhile keeps serving the requests
    that have it. Thread-safe (the HTTP frontend loads while the engine steps)."""

    def __init__(
        self,
        shapes: LoRAShapes,
        dtype: torch.dtype,
        max_rank: int = 16,
        max_cpu_loras: int | None = None,
        refusal: str | None = None,
        device: torch.device | None = None,
    ) -> None:
        if max_rank < 1:
            raise ValueError("--max-lora-rank must be >= 1")
        if max_cpu_loras is not None and max_cpu_loras < 1:
            raise ValueError("--max-cpu-loras must be >= 1")
        self.shapes = shapes
        self.dtype = dtype
        self.device = device or torch.device("cpu")  # where the model's weights are
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.refusal = refusal  # why this engine serves no adapter (e.g. TP), or None
        self.paths: dict[str, str] = {}
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read and register adapter ``name`` from ``path`` (``LoRAError`` if it cannot be
        served; nothing registered then). Loading a name again replaces it (its requests in
        flight finish on the old one; new ones get the new one, under its own cache key
        unless the weights are the same)."""
        if self.refusal is not None:
            raise LoRAError(self.refusal)
        if not name:
            raise LoRAError(f"a LoRA adapter needs a name, got {name!r}")
        adapter = read_adapter(name, path, self.shapes, self.dtype, self.max_rank).to(self.device)
        with self._lock:
            self.paths[name] = str(path)
            self.loaded[name] = adapter
            self.loaded.move_to_end(name)
            self._trim()
        return adapter

    def unload(self, name: str) -> None:
        """Forget adapter ``name`` (``LoRANotFound`` if unknown)."""
        with self._lock:
            if name not in self.paths:
                raise LoRANotFound(name)
            del self.paths[name]
            self.loaded.pop(name, None)

    def get(self, name: str) -> LoRAAdapter:
        """Adapter ``name``, read again from its path if it was dropped from memory
        (``LoRANotFound`` if never registered or unloaded)."""
        with self._lock:
            adapter = self.loaded.get(name)
            if adapter is not None:
                self.loaded.move_to_end(name)
                return adapter
            path = self.paths.get(name)
        if path is None:
            raise LoRANotFound(name)
        adapter = read_adapter(name, path, self.shapes, self.dtype, self.max_rank).to(self.device)
        with self._lock:
            current = self.loaded.get(name)
            if current is not None:  # (loaded again meanwhile)
                return current
            if self.paths.get(name) != path:  # unloaded meanwhile
                raise LoRANotFound(name)
            self.loaded[name] = adapter
            self._trim()
        return adapter

    def names(self) -> list[str]:
        with self._lock:
            return list(self.paths)

    def _trim(self) -> None:
        while self.max_cpu_loras is not None and len(self.loaded) > self.max_cpu_loras:
            self.loaded.popitem(last=False)
