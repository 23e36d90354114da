"""Cold time to first token of long single prompts: radixserve, and vLLM's CPU build when given.

    python benchmarks/long_prefill.py                                  # radixserve only
    python benchmarks/long_prefill.py --vllm-python VENV/bin/python

One prompt at a time, no prefix-cache hit (radixserve empties its tree between runs, vLLM
runs with prefix caching off), ``max_tokens=1``: TTFT is the prefill of the whole prompt.
Prompts are pydoc text from ``../shared/workloads/*.jsonl``, tokenized with SmolLM2's
tokenizer and cut to exactly 1,000 / 2,000 / 4,000 / 6,000 / 8,000 tokens; both engines get
the same token ids. With ``--vllm-python``, vLLM runs in a worker process started with that
interpreter, and the two engines alternate (radixserve, vLLM, radixserve, ...) so that noise
on this shared machine hits both alike; both load the same Hugging Face folder (``--model``,
or the embedded SmolLM2 GGUF exported once with ``benchmarks/export_hf.py``). The best of
``--runs`` runs counts for each side; every run is printed.

Prints a table (TTFT, prefill tokens/s, vLLM TTFT / radixserve TTFT), then one JSON line with
``ttft_ratio_2k``, ``ttft_ratio_6k`` (null without vLLM) and ``prefill_tok_s_8k``.

    python benchmarks/long_prefill.py --sweep-chunk 512,1024,2048,4096,8192

radixserve alone: TTFT per prompt length for each prefill chunk size (the step budget, no
separate per-request cap), and what each chunk of the longest prompt cost per token at the
context it reached (the marginal prefill cost of a token at 1K, 2K, ... 8K context).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOADS = HERE.parents[1] / "shared" / "workloads"
DEFAULT_HF_EXPORT = Path.home() / ".cache" / "radixserve" / "smollm2-135m-instruct-hf"
MARK = "@@long_prefill@@ "  # prefix of the worker's protocol lines (vLLM logs to stdout too)

# Runs inside vLLM's interpreter: one LLM, then one JSON request per stdin line.
VLLM_WORKER = r"""
import json, sys, time
from vllm import LLM, SamplingParams
import vllm
model, max_len = sys.argv[1], int(sys.argv[2])
llm = LLM(model=model, dtype="bfloat16", max_model_len=max_len, enable_prefix_caching=False,
          seed=0)
params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
print("MARK" + json.dumps({"ready": True, "version": vllm.__version__}), flush=True)
for line in sys.stdin:
    ids = json.loads(line)["ids"]
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    print("MARK" + json.dumps({"ttft": elapsed, "token": out[0].outputs[0].token_ids[0]}),
          flush=True)
""".replace("MARK", MARK)


def prompt_text() -> str:
    """The workloads' distinct prompts joined: ~116K SmolLM2 tokens of Python docs."""
    seen: dict[str, None] = {}
    for path in sorted(WORKLOADS.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                seen.setdefault(json.loads(line)["prompt"], None)
    return " ".join(seen)


class VllmWorker:
    """vLLM in its own interpreter. Invariant: after ``__init__`` the worker has loaded the
    model and waits for one request at a time; ``ttft`` returns only after its answer."""

    def __init__(self, python: str, model: Path, max_len: int) -> None:
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.pop("PYTHONPATH", None)  # its own site-packages, not radixserve's
        self.proc = subprocess.Popen(
            [python, "-c", VLLM_WORKER, str(model), str(max_len)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.version = self._read()["version"]

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        tail: list[str] = []
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
            tail = [*tail[-30:], line]
        raise RuntimeError("the vLLM worker exited:\n" + "".join(tail))

    def ttft(self, ids: list[int]) -> tuple[float, int]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"ids": ids}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        return reply["ttft"], reply["token"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def sweep_chunk(llm, prompts: dict[int, list[int]], chunks: list[int], runs: int) -> None:
    """TTFT per prompt length and chunk size (best of ``runs``), then the per-token cost of
    each chunk of the longest prompt (from its best run) against the context it reached."""
    from dataclasses import replace

    from radixserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine = llm.engine
    runner = engine.runner
    execute = runner.execute
    steps: list[tuple[int, int, float]] = []  # (context after the step, tokens, seconds)

    def timed_execute(batch):
        start = time.perf_counter()
        result = execute(batch)
        req = batch.requests[0]
        n = int(batch.num_new_tokens[0])
        steps.append((req.num_computed_tokens + n, n, time.perf_counter() - start))
        return result

    runner.execute = timed_execute
    base = engine.scheduler.config
    lengths = sorted(prompts)
    ttft: dict[int, dict[int, float]] = {c: {} for c in chunks}
    chunk_costs: dict[int, list[tuple[int, int, float]]] = {}
    try:
        for run in range(runs):
            for chunk in chunks:
                engine.scheduler.config = replace(
                    base, max_num_batched_tokens=chunk, long_prefill_threshold=None
                )
                for n in lengths:
                    steps.clear()
                    start = time.perf_counter()
                    llm.generate([prompts[n]], params, use_tqdm=False)
                    elapsed = time.perf_counter() - start
                    engine.check_idle()
                    print(f"run {run + 1} chunk {chunk:>5}: {n:>5} tokens {elapsed:6.2f} s")
                    if elapsed < ttft[chunk].get(n, float("inf")):
                        ttft[chunk][n] = elapsed
                        if n == lengths[-1]:
                            chunk_costs[chunk] = list(steps)
    finally:
        runner.execute = execute
        engine.scheduler.config = base
    print()
    print("| chunk | " + " | ".join(f"{n:,} tokens: TTFT s (tok/s)" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for chunk in chunks:
        cells = [f"{ttft[chunk][n]:.2f} ({n / ttft[chunk][n]:.0f})" for n in lengths]
        print(f"| {chunk:,} | " + " | ".join(cells) + " |")
    print()
    print(f"per-token cost of each chunk of the {lengths[-1]:,}-token prompt:")
    for chunk in chunks:
        cells = [f"{end:,}: {1e3 * s / n:.3f}" for end, n, s in chunk_costs[chunk]]
        print(f"  chunk {chunk:,}: context reached: ms/token  " + ", ".join(cells))
    print(
        json.dumps(
            {"ttft_s": {str(c): {str(n): round(t, 3) for n, t in ttft[c].items()} for c in chunks}}
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1000,2000,4000,6000,8000")
    parser.add_argument("--runs", type=int, default=2, help="runs per engine and length")
    parser.add_argument("--vllm-python", default=None, help="interpreter with vLLM (CPU build)")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="HF folder for both engines (default: the embedded SmolLM2; exported to "
        f"{DEFAULT_HF_EXPORT} when vLLM runs)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=1.0,
        help="seconds of idle before each timed run (the other engine's OpenMP threads may "
        "still spin after its run)",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--long-prefill-threshold", type=int, default=None)
    parser.add_argument(
        "--sweep-chunk", default=None, help="comma-separated chunk sizes: radixserve alone"
    )
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    from radixserve import LLM, SamplingParams

    model = args.model
    vllm_note = None
    if args.vllm_python is not None and not Path(args.vllm_python).exists():
        vllm_note = f"vLLM not run: {args.vllm_python} does not exist"
        args.vllm_python = None
    if args.vllm_python is not None and model is None:
        sys.path.insert(0, str(HERE))
        from export_hf import export_hf

        model = export_hf(DEFAULT_HF_EXPORT)
    engine_kwargs = {}
    if args.max_num_batched_tokens is not None:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.long_prefill_threshold is not None:
        engine_kwargs["long_prefill_threshold"] = args.long_prefill_threshold
    llm = LLM(
        str(model) if model is not None else None,
        dtype="bfloat16",
        # bfloat16 weights like vLLM's (the shipped GGUF is Q4_1: the engine's default,
        # auto, would run it in int4)
        quantization="none",
        max_model_len=max(lengths) + 16,
        **engine_kwargs,
    )
    corpus = llm.engine.tokenize(prompt_text())
    if len(corpus) < max(lengths) + 1024:
        raise SystemExit(f"only {len(corpus)} tokens of prompt text")
    prompts = {n: corpus[:n] for n in lengths}
    warmup = corpus[-1000:]  # text no measured prompt starts with
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    config = llm.engine.config
    print(
        f"radixserve: {model or 'embedded SmolLM2-135M-Instruct (GGUF)'}, bfloat16, "
        f"{os.cpu_count()} CPUs, torch threads {__import__('torch').get_num_threads()}, "
        f"max_num_batched_tokens {config.max_num_batched_tokens}, "
        f"long_prefill_threshold {config.long_prefill_threshold or 'budget'}",
        flush=True,
    )

    def radixserve_ttft(ids: list[int]) -> tuple[float, int]:
        time.sleep(args.settle)
        start = time.perf_counter()
        out = llm.generate([ids], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        llm.engine.check_idle()  # empties the radix tree: the next run is cold again
        return elapsed, out[0].token_ids[0]

    radixserve_ttft(warmup)
    if args.sweep_chunk:
        sweep_chunk(llm, prompts, [int(x) for x in args.sweep_chunk.split(",")], args.runs)
        return

    vllm = None
    if args.vllm_python is not None:
        print(f"starting vLLM ({args.vllm_python}) on {model} ...", flush=True)
        try:
            vllm = VllmWorker(args.vllm_python, model, max(lengths) + 16)
            vllm.ttft(warmup)
            print(f"vLLM {vllm.version} ready", flush=True)
        except RuntimeError as exc:  # e.g. vLLM not installed in that interpreter
            last = str(exc).strip().splitlines()[-1]
            vllm_note = f"vLLM not run: its worker failed ({last}): ratios are null"
            vllm = None
    elif vllm_note is None:
        vllm_note = "vLLM not run (no --vllm-python): ratios are null"

    ours: dict[int, list[float]] = {n: [] for n in lengths}
    theirs: dict[int, list[float]] = {n: [] for n in lengths}
    try:
        for run in range(args.runs):
            for n in lengths:
                t, tok = radixserve_ttft(prompts[n])
                ours[n].append(t)
                line = f"run {run + 1} {n:>5} tokens: radixserve {t:6.2f} s (token {tok})"
                if vllm is not None:
                    time.sleep(args.settle)
                    tv, tok_v = vllm.ttft(prompts[n])
                    theirs[n].append(tv)
                    line += f"   vLLM {tv:6.2f} s (token {tok_v})"
                print(line, flush=True)
    finally:
        if vllm is not None:
            vllm.close()

    print()
    print(
        "| prompt tokens | radixserve TTFT s | radixserve prefill tok/s | vLLM TTFT s "
        "| vLLM prefill tok/s | vLLM TTFT / radixserve TTFT |"
    )
    print("|---|---|---|---|---|---|")
    best = {n: min(ours[n]) for n in lengths}
    best_v = {n: min(theirs[n]) for n in lengths if theirs[n]}
    ratios = {n: best_v[n] / best[n] for n in best_v}
    for n in lengths:
        row = f"| {n:,} | {best[n]:.2f} | {n / best[n]:.0f} | "
        if n in best_v:
            row += f"{best_v[n]:.2f} | {n / best_v[n]:.0f} | **{ratios[n]:.2f}x** |"
        else:
            row += "– | – | – |"
        print(row)
    if vllm_note:
        print(vllm_note)
    result = {
        "ttft_ratio_2k": round(ratios[2000], 3) if 2000 in ratios else None,
        "ttft_ratio_6k": round(ratios[6000], 3) if 6000 in ratios else None,
        "prefill_tok_s_8k": round(8000 / best[8000], 1) if 8000 in best else None,
        "prefill_tok_s": {str(n): round(n / best[n], 1) for n in lengths},
        "radixserve_ttft_s": {str(n): round(best[n], 3) for n in lengths},
        "vllm_ttft_s": {str(n): round(best_v[n], 3) for n in best_v} or None,
        "vllm_version": vllm.version if vllm is not None else None,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
