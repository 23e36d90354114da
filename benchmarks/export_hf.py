"""Write the embedded SmolLM2 GGUF (or any GGUF transformers reads) out as a Hugging Face
folder, for engines that take only HF folders (vLLM) and for same-weights comparisons.

    python benchmarks/export_hf.py OUT_DIR [--gguf FILE] [--dtype bfloat16|float32]

transformers dequantizes the GGUF tensors; the folder gets config.json, safetensors, the
tokenizer (with its chat template) and generation_config.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def export_hf(out_dir: Path, gguf: Path | None = None, dtype: str = "bfloat16") -> Path:
    """Export ``gguf`` (default: the embedded SmolLM2) to ``out_dir``; returns ``out_dir``.
    An existing export (config.json present) is kept as it is."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radixserve.engine.model_source import default_model_path

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    gguf = Path(gguf) if gguf is not None else default_model_path()
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=DTYPES[dtype]
    )
    # a GGUF-loaded model refuses save_pretrained (it carries a GGUF "quantization"): copy the
    # dequantized weights into a plain model of the same config
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(out_dir)  # only a complete export gets the final name
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--gguf", type=Path, default=None, help="default: embedded SmolLM2")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = parser.parse_args()
    print(export_hf(args.out_dir, args.gguf, args.dtype))


if __name__ == "__main__":
    main()
