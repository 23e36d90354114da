"""Decode at 1 and 16 running requests and a 512-token prefill, tok/s, of the checkout first on
``PYTHONPATH``, on one GGUF file under ``--quantization auto``: run it once per checkout, in
turn, to compare two (the figures of docs/benchmarks.md, "GGUF types executed from their
codes"). Random token-id prompts (no cache hits). Prints one JSON line.

    PYTHONPATH=CHECKOUT python benchmarks/gguf_decode_ab.py FILE.gguf LABEL
    INT8ROWS=2 PYTHONPATH=CHECKOUT python benchmarks/gguf_decode_ab.py FILE.gguf LABEL

``INT8ROWS``: the row count from which int8 group-wise layers dequantize for oneDNN's GEMM
instead of running the panel kernel (``quant.INT8_PANEL_DEQUANT_ROWS``).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import torch


def main() -> None:
    path, label = sys.argv[1], sys.argv[2]
    torch.set_num_threads(2)
    if os.environ.get("INT8ROWS"):
        import radixserve.executor.quant as quant

        quant.INT8_PANEL_DEQUANT_ROWS = int(os.environ["INT8ROWS"])
    from radixserve import LLM, SamplingParams

    llm = LLM(path)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 5000) for _ in range(n)]

    def timed(prompts: list[list[int]], tokens: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - start

    timed([prompt(8)], 8)  # warm-up
    # decode: the run with one output token (its prefill) subtracted from the long run
    decode_bs1 = 128 / (timed([prompt(4)], 129) - timed([prompt(4)], 1))
    prefill = 512 / timed([prompt(512)], 1)
    batch = [prompt(16) for _ in range(16)]
    decode_bs16 = 16 * 64 / (timed(batch, 65) - timed([prompt(16) for _ in range(16)], 1))
    figures = {"decode_bs1": decode_bs1, "prefill512": prefill, "decode_bs16": decode_bs16}
    print(json.dumps({"label": label, **{k: round(v, 1) for k, v in figures.items()}}))


if __name__ == "__main__":
    main()
