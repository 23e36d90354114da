"""The int8 KV cache (``--kv-cache-dtype int8``) against the model's own dtype, in one run.

    python benchmarks/kv_int8.py                  # SmolLM2 (the default model)
    python benchmarks/kv_int8.py --model PATH

Three measures, each on the same model loaded twice (``auto``, then ``int8``):

* **perplexity** of the W1 prompts, teacher-forced (``prompt_logprobs``), with the prompts
  prefilled in chunks of ``--chunk`` tokens (``max_num_batched_tokens``): every token
  attends to the keys before it, its own chunk's included, as the cache holds them (over an
  int8 cache every prompt token is a row of the int8 decode kernel);
  ``ppl_change_int8_kv`` is int8's over auto's, less 1;
* **capacity**: the pages a ``--kv-cache-memory`` of 1 GiB holds, and how many requests
  of ``--context`` tokens fit at once (``capacity_ratio_int8_kv``);
* **throughput**: W3's 128 requests (256 prompt tokens, 128 output tokens, greedy,
  ``ignore_eos``) offline at ``--concurrency`` running requests, output tokens/s.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from radixserve import LLM, SamplingParams

WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"


def perplexity(llm: LLM, prompts: list[list[int]]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    nll = [-lp.logprob for o in outs for lp in o.prompt_logprobs[1:]]
    return math.exp(sum(nll) / len(nll))


def measure(
    model: str | None = None,
    chunk: int = 32,
    num_prompts: int = 64,
    context: int = 4096,
    concurrency: int = 64,
    requests: int = 128,
    echo: bool = True,
) -> dict:
    """The three measures, both caches; returns the last line's JSON keys."""
    w1 = [json.loads(x) for x in (WORKLOADS / "w1_offline.jsonl").read_text().splitlines()]
    w3 = [json.loads(x) for x in (WORKLOADS / "w3_online.jsonl").read_text().splitlines()]
    results = {}
    for kv in ("auto", "int8"):
        common = dict(model=model, kv_cache_dtype=kv, kv_cache_memory_gb=1.0)
        llm = LLM(**common, max_num_batched_tokens=chunk)
        tok = llm.tokenizer
        prompts = [tok.encode(r["prompt"]) for r in w1[:num_prompts]]
        ppl = perplexity(llm, prompts)
        pages, page_size = llm.engine.pool.num_pages, llm.engine.pool.page_size
        del llm
        llm = LLM(**common, max_num_seqs=concurrency)
        params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        jobs = [r["prompt"] for r in w3[:requests]]
        llm.generate(jobs[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(jobs, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        del llm
        results[kv] = {
            "ppl": ppl,
            "pages": pages,
            "requests_at_context": pages * page_size // context,
            "output_tok_s": tokens / wall,
        }
        r = results[kv]
        if echo:
            print(
                f"{kv:>5}: perplexity {ppl:.4f}, {pages} pages of {page_size} in 1 GiB "
                f"({r['requests_at_context']} requests of {context} tokens), "
                f"W3 at {concurrency}: {r['output_tok_s']:.1f} output tok/s"
            )
    auto, int8 = results["auto"], results["int8"]
    return {
        "ppl_change_int8_kv": round(int8["ppl"] / auto["ppl"] - 1, 5),
        "capacity_ratio_int8_kv": round(
            int8["requests_at_context"] / max(1, auto["requests_at_context"]), 3
        ),
        "pages_ratio_int8_kv": round(int8["pages"] / auto["pages"], 3),
        "throughput_ratio_int8_kv": round(int8["output_tok_s"] / auto["output_tok_s"], 3),
        "ppl_auto": round(auto["ppl"], 4),
        "ppl_int8": round(int8["ppl"], 4),
        "output_tok_s_auto": round(auto["output_tok_s"], 1),
        "output_tok_s_int8": round(int8["output_tok_s"], 1),
        "chunk": chunk,
        "context": context,
        "concurrency": concurrency,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--chunk", type=int, default=32, help="prefill chunk for the perplexity")
    ap.add_argument("--prompts", type=int, default=64, help="W1 prompts for the perplexity")
    ap.add_argument("--context", type=int, default=4096, help="tokens per request (capacity)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128, help="W3 requests for throughput")
    args = ap.parse_args()
    print(
        json.dumps(
            measure(
                args.model, args.chunk, args.prompts, args.context, args.concurrency, args.requests
            )
        )
    )


if __name__ == "__main__":
    main()
