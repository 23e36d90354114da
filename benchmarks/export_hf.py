"""Write a GGUF model (default: the embedded SmolLM2-135M-Instruct) out as a Hugging Face
folder, so engines that need one (vLLM, transformers) run exactly radixserve's weights.

    python benchmarks/export_hf.py OUT_DIR [--gguf FILE] [--dtype bfloat16]

The tensors are the ones radixserve's own GGUF loader produces (dequantized, Hugging Face
names); config.json, generation_config.json and the tokenizer (with its chat template) are
rebuilt from the GGUF metadata.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from radixserve.engine.model_source import resolve_model
from radixserve.engine.tokenizer import tokenizer_from_gguf
from radixserve.executor.loader import load_checkpoint

MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def export(out: Path, gguf: str | None, dtype: torch.dtype) -> Path:
    source = resolve_model(gguf)
    if source.kind != "gguf":
        raise SystemExit(f"{source.path} is not a GGUF file")
    checkpoint = load_checkpoint("gguf", source.path)
    out.mkdir(parents=True, exist_ok=True)
    weights = {name: t.to(dtype).contiguous() for name, t in checkpoint.weights.items()}
    config = dict(checkpoint.hf_config)
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    arch = config["architectures"][0]
    config.setdefault("model_type", MODEL_TYPES[arch])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = tokenizer_from_gguf(checkpoint.gguf_metadata or {})
    tokenizer.save_pretrained(str(out))
    eos = tokenizer.eos_token_id
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out


def export_hf(out: Path, gguf: str | None = None) -> Path:
    """The bfloat16 export at ``out`` (written once; reused when it already exists)."""
    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    return export(out, gguf, torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--gguf", default=None, help="GGUF file (default: SmolLM2-135M)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    path = export(args.out, args.gguf, getattr(torch, args.dtype))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
