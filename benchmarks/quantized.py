"""bf16 vs int8 vs int4 weights on SmolLM2-135M-Instruct (CPU), one run:

* perplexity of the W1 prompts (teacher-forced prompt log-probs, ``prompt_logprobs``);
* decode tokens/s with 1 and with 64 running requests;
* a Llama-3.2-1B-shaped model with random weights in each precision: its weight memory
  and its decode tokens/s with 1 and 16 running requests.

The shipped SmolLM2 file is Q4_1: "bf16" runs it dequantized to bfloat16 (``--quantization
none``), "int4" re-quantizes it to int4 g32 with zero points (the file's own codes), "int8"
to int8 per channel (from the dequantized Q4_1 values).

    python benchmarks/quantized.py [--prompts 64] [--decode-tokens 32] [--skip-1b | --only-1b]
        [--decode-tokens-1b 16]

Last line: JSON with ppl_bf16, ppl_int8, ppl_int4, decode_ratio_int8_bs1,
decode_ratio_int4_bs1 (and _bs64), tokens/s, weights_gib_1b_*, tokens_per_s_1b_<precision>_bs{1,16}
and decode_ratio_1b_{int8,int4}_bs{1,16} keys.

GGUF files as they come (``--gguf LABEL=PATH``, repeatable; ``smollm2`` alone is the
shipped file): ``auto`` (each tensor at its own type's precision, from its codes) against
the same file dequantized (``--quantization none``: the file's own values, in bfloat16),
both with bfloat16 activations: perplexity of the W1 prompts and decode tokens/s with 1 and
16 running requests.

    python benchmarks/quantized.py --gguf smollm2 --gguf gemma3=PATH [--prompts 16]

Last line: JSON with ppl_{auto,none}_<label>, ppl_change_pct_<label>,
tokens_per_s_{auto,none}_bs{1,16}_<label> and decode_ratio_bs{1,16}_<label> (auto / none).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import tempfile
import time
from pathlib import Path

W1 = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "w1_offline.jsonl"
PRECISIONS = {"bf16": "none", "int8": "int8", "int4": "int4"}
LLAMA_1B = {  # Llama-3.2-1B's config.json (shapes only)
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def perplexity(llm, prompts: list[list[int]]) -> float:
    from radixserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_idle()
    nll = [-lp.logprob for o in outs for lp in o.prompt_logprobs[1:]]
    return math.exp(sum(nll) / len(nll))


def decode_tokens_per_s(llm, prompts: list[list[int]], tokens: int) -> float:
    """Decode rate with ``len(prompts)`` running requests: the time of ``tokens`` output
    tokens each minus that of one (prefill and the first token), over the extra steps."""
    from radixserve import SamplingParams

    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        llm.engine.check_idle()
        return dt

    timed(2)  # warm-up
    t1 = min(timed(1) for _ in range(2))
    tn = min(timed(tokens) for _ in range(2))
    return len(prompts) * (tokens - 1) / max(tn - t1, 1e-9)


def llama_1b(quantization: str, decode_tokens: int) -> tuple[dict[str, float], dict[int, float]]:
    """A Llama-3.2-1B-shaped model with random weights in one precision: its weight memory
    (GiB per kind) and its decode tokens/s with 1 and 16 running requests (random 32-token
    prompts; ``decode_tokens`` 0 skips the timing)."""
    import random

    from radixserve import LLM

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(LLAMA_1B))
        llm = LLM(
            folder,
            load_format="dummy",
            quantization=quantization,
            quantization_group_size=128,
            kv_cache_memory_gb=0.25,
            max_model_len=256,
            max_num_seqs=16,
        )
        sizes = {k: v / 2**30 for k, v in llm.engine.weight_bytes.items()}
        print(f"1B-shaped, {quantization}: {llm.engine.startup_line}", flush=True)
        rates: dict[int, float] = {}
        if decode_tokens:
            rng = random.Random(0)
            prompts = [[rng.randrange(1000, 100000) for _ in range(32)] for _ in range(16)]
            for bs in (1, 16):
                rates[bs] = decode_tokens_per_s(llm, prompts[:bs], decode_tokens)
        llm.engine.close()
        del llm
        gc.collect()
    return sizes, rates


def gguf_files(specs: list[str], prompts_n: int, decode_tokens: int) -> None:
    """The ``--gguf`` mode: one table row per file and setting, then the JSON line."""
    from radixserve import LLM
    from radixserve.engine.model_source import default_model_path

    requests = [json.loads(line) for line in W1.read_text().splitlines() if line.strip()]
    result: dict[str, float] = {}
    print(f"{'file':<10}{'setting':<8}{'ppl':>10}{'tok/s bs1':>12}{'tok/s bs16':>12}  start-up")
    for spec in specs:
        label, _, path = spec.partition("=")
        path = path or str(default_model_path())
        for setting in ("none", "auto"):
            llm = LLM(path, dtype="bfloat16", quantization=setting, max_num_seqs=16)
            tok = llm.engine.tokenize
            prompts = [tok(r["prompt"]) for r in requests[:prompts_n]]
            ppl = perplexity(llm, prompts)
            short = [tok(r["prompt"])[:32] for r in requests[:16]]
            bs1 = decode_tokens_per_s(llm, short[:1], decode_tokens)
            bs16 = decode_tokens_per_s(llm, short, decode_tokens)
            result[f"ppl_{setting}_{label}"] = round(ppl, 4)
            result[f"tokens_per_s_{setting}_bs1_{label}"] = round(bs1, 1)
            result[f"tokens_per_s_{setting}_bs16_{label}"] = round(bs16, 1)
            print(
                f"{label:<10}{setting:<8}{ppl:>10.4f}{bs1:>12.1f}{bs16:>12.1f}  "
                f"{llm.engine.startup_line}",
                flush=True,
            )
            llm.engine.close()
            del llm
            gc.collect()
        change = 100 * (result[f"ppl_auto_{label}"] / result[f"ppl_none_{label}"] - 1)
        result[f"ppl_change_pct_{label}"] = round(change, 3)
        for bs in (1, 16):
            auto = result[f"tokens_per_s_auto_bs{bs}_{label}"]
            result[f"decode_ratio_bs{bs}_{label}"] = round(
                auto / result[f"tokens_per_s_none_bs{bs}_{label}"], 3
            )
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--gguf",
        action="append",
        default=[],
        metavar="LABEL[=PATH]",
        help="GGUF mode: auto vs the file dequantized, per file (smollm2: the shipped file)",
    )
    ap.add_argument("--prompts", type=int, default=64, help="W1 prompts for the perplexity")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--skip-1b", action="store_true", help="no 1B-shaped weight memory")
    ap.add_argument(
        "--only-1b", action="store_true", help="only the 1B-shaped model (memory, decode)"
    )
    ap.add_argument(
        "--decode-tokens-1b",
        type=int,
        default=16,
        help="output tokens per request timed on the 1B-shaped model (0: memory only)",
    )
    args = ap.parse_args()
    if args.gguf:
        gguf_files(args.gguf, args.prompts, args.decode_tokens)
        return
    from radixserve import LLM

    requests = [json.loads(line) for line in W1.read_text().splitlines() if line.strip()]
    result: dict[str, float | None] = {}
    rates: dict[str, dict[int, float]] = {}
    print(f"{'precision':<10}{'ppl':>10}{'tok/s bs1':>12}{'tok/s bs64':>12}  weights")
    for name, quantization in PRECISIONS.items():
        if args.only_1b:
            break
        llm = LLM(None, dtype="bfloat16", quantization=quantization, max_num_seqs=64)
        tok = llm.engine.tokenize
        prompts = [tok(r["prompt"]) for r in requests[: args.prompts]]
        ppl = perplexity(llm, prompts)
        short = [p[:32] for p in prompts[:64]]
        rates[name] = {
            1: decode_tokens_per_s(llm, short[:1], args.decode_tokens),
            64: decode_tokens_per_s(llm, short, args.decode_tokens),
        }
        result[f"ppl_{name}"] = round(ppl, 4)
        result[f"tokens_per_s_{name}_bs1"] = round(rates[name][1], 1)
        result[f"tokens_per_s_{name}_bs64"] = round(rates[name][64], 1)
        print(
            f"{name:<10}{ppl:>10.4f}{rates[name][1]:>12.1f}{rates[name][64]:>12.1f}  "
            f"{llm.engine.startup_line}",
            flush=True,
        )
        llm.engine.close()
        del llm
        gc.collect()
    for name in ("int8", "int4") if rates else ():
        for bs in (1, 64):
            result[f"decode_ratio_{name}_bs{bs}"] = round(rates[name][bs] / rates["bf16"][bs], 3)
        change = 100 * (result[f"ppl_{name}"] / result["ppl_bf16"] - 1)
        result[f"ppl_change_{name}_pct"] = round(change, 3)
    if not args.skip_1b:
        print(f"{'1B-shaped':<10}{'GiB':>10}{'tok/s bs1':>12}{'tok/s bs16':>12}")
        rates_1b: dict[str, dict[int, float]] = {}
        for name, quantization in PRECISIONS.items():
            sizes, rates_1b[name] = llama_1b(quantization, args.decode_tokens_1b)
            copy = sizes.pop("onednn_copy", 0.0)  # the tied LM head's reordered copy
            result[f"weights_gib_1b_{name}"] = round(sum(sizes.values()), 3)
            result[f"onednn_copy_gib_1b_{name}"] = round(copy, 3)
            for bs, rate in rates_1b[name].items():
                result[f"tokens_per_s_1b_{name}_bs{bs}"] = round(rate, 1)
            shown = [f"{rates_1b[name].get(bs, float('nan')):>12.1f}" for bs in (1, 16)]
            print(f"{name:<10}{sum(sizes.values()):>10.3f}{''.join(shown)}", flush=True)
        for name in ("int8", "int4"):
            for bs in rates_1b["bf16"]:
                ratio = rates_1b[name][bs] / rates_1b["bf16"][bs]
                result[f"decode_ratio_1b_{name}_bs{bs}"] = round(ratio, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
