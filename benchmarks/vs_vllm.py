"""radixserve vs vLLM's CPU build, side by side on the same HF folder, in one invocation.

    python benchmarks/export_hf.py HF_DIR          # vLLM needs an HF folder
    python benchmarks/vs_vllm.py --vllm-python VENV/bin/python --model HF_DIR

W1 (offline throughput) and W2 (shared prefix) run one ``generate`` over the whole workload
per engine (start-up and a two-prompt warm-up excluded, empty prefix cache, greedy,
``ignore_eos``, the same token ids on both sides); W3 sends the same streaming requests to
both OpenAI servers at concurrency 16 with the client of ``benchmarks/serving.py``. Engines
alternate, ``--rounds`` rounds (default 2); each engine runs in its own process, vLLM in its
own virtualenv. A bf16 matmul microbenchmark gives this machine's peak, and W1's FLOPs over
radixserve's best wall time give its whole-run efficiency.

Prints every run, the ratios of the best runs, and a last-line JSON with ``w1_ratio``,
``w2_ratio``, ``w3_ratio`` (radixserve ÷ vLLM output tok/s; W2: vLLM wall ÷ radixserve
wall) and ``w1_efficiency``. Without a working vLLM it says so and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"
OFFLINE = {"w1": "w1_offline.jsonl", "w2": "w2_shared_prefix.jsonl"}
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}


# -- worker side: runs inside one engine's interpreter (no radixserve import for vLLM) ------
def worker(engine: str, model: str, requests_file: str) -> None:
    """One timed ``generate`` over the requests; prints one JSON line."""
    reqs = json.loads(Path(requests_file).read_text())
    ids = [r["ids"] for r in reqs]
    if engine == "radixserve":
        from radixserve import LLM, SamplingParams

        llm = LLM(model, dtype="bfloat16")
        params = [
            SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs
        ]

        def generate(prompts, ps):
            outs = llm.generate(prompts, ps, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)

        reset = llm.engine.check_idle  # also empties the radix tree
    else:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model, dtype="bfloat16", max_num_seqs=256, seed=0)
        params = [
            SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs
        ]

        def generate(prompts, ps):
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], ps, use_tqdm=False
            )
            return sum(len(o.outputs[0].token_ids) for o in outs)

        reset = llm.reset_prefix_cache
    generate(ids[:2], params[:2])  # warm-up
    reset()
    start = time.perf_counter()
    tokens = generate(ids, params)
    wall = time.perf_counter() - start
    print("RESULT " + json.dumps({"wall_s": wall, "output_tokens": tokens}), flush=True)


# -- driver side ----------------------------------------------------------------------------
def tokenized_workload(name: str, model: str, out_dir: Path) -> Path:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    lines = [json.loads(x) for x in (WORKLOADS / OFFLINE[name]).read_text().splitlines() if x]
    reqs = [
        {
            "ids": tok.encode(r["prompt"], add_special_tokens=False).ids,
            "max_tokens": r["max_tokens"],
        }
        for r in lines
    ]
    for r, line in zip(reqs, lines, strict=True):
        assert len(r["ids"]) == line["prompt_tokens"], "workload token counts changed"
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(reqs))
    return path


def run_offline(python: str, engine: str, model: str, requests_file: Path) -> dict:
    env = {**os.environ, **(VLLM_ENV if engine == "vllm" else {})}
    cmd = [python, __file__, "--worker", engine, "--model", model, "--requests", str(requests_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{engine} worker failed:\n{proc.stderr[-3000:]}")


class Server:
    """One engine's OpenAI server on 127.0.0.1, started and waited for."""

    def __init__(self, python: str, engine: str, model: str, port: int) -> None:
        import httpx

        self.url = f"http://127.0.0.1:{port}"
        if engine == "radixserve":
            cmd = [
                python,
                "-m",
                "radixserve.cli",
                "serve",
                "--model",
                model,
                "--dtype",
                "bfloat16",
            ]
            env = dict(os.environ)
        else:
            cmd = [
                python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model,
                "--dtype",
                "bfloat16",
                "--max-num-seqs",
                "256",
            ]
            env = {**os.environ, **VLLM_ENV}
        cmd += ["--port", str(port)]
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - read on failure, closed by GC
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{engine} server exited:\n{self.log.read()[-3000:].decode()}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{engine} server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_online(python: str, engine: str, model: str, concurrency: int) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from serving import Job, run_async, run_load, summarize

    lines = [json.loads(x) for x in (WORKLOADS / "w3_online.jsonl").read_text().splitlines() if x]
    jobs = [Job(x["prompt"], int(x["max_tokens"])) for x in lines]
    server = Server(python, engine, model, 8790)
    try:
        run_async(run_load(server.url, server.model, jobs[:4], 4, float("inf")))  # warm-up
        results, wall = run_async(
            run_load(server.url, server.model, jobs, concurrency, float("inf"))
        )
    finally:
        server.stop()
    s = summarize(results, wall)
    if s["failed"]:
        raise RuntimeError(f"{engine}: {s['failed']} W3 requests failed")
    return {
        "wall_s": wall,
        "output_tokens": s["output_tok_s"] * wall,
        "ttft_median_ms": s["median_ttft_ms"],
    }


def matmul_peak_gflops() -> float:
    """This machine's bf16 matmul peak through PyTorch (oneDNN), best of several shapes."""
    import torch

    best = 0.0
    for m, n, k in ((2048, 2048, 2048), (4096, 1536, 576), (2048, 3072, 576)):
        a = torch.randn(m, k, dtype=torch.bfloat16)
        b = torch.randn(k, n, dtype=torch.bfloat16)
        torch.mm(a, b)
        for _ in range(5):
            start = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * m * n * k / (time.perf_counter() - start) / 1e9)
    return best


def workload_flops(model: str, name: str) -> float:
    """FLOPs of running a workload: dense layers for every token, causal attention over each
    sequence's context, the LM head for every output token (prefix-cache hits not counted
    as saved work: W1's prompts share little)."""
    c = json.loads((Path(model) / "config.json").read_text())
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or h // heads
    per_layer = h * (heads * d + 2 * kv * d) + heads * d * h + 3 * h * inter
    lines = [json.loads(x) for x in (WORKLOADS / OFFLINE[name]).read_text().splitlines() if x]
    flops = 0.0
    for r in lines:
        p, o = r["prompt_tokens"], r["max_tokens"]
        tokens = p + o - 1  # the last output token is sampled, never fed back
        flops += 2 * per_layer * layers * tokens
        # attention: q·k and p·v over the context of every computed position
        ctx = tokens * (tokens + 1) / 2
        flops += 4 * heads * d * layers * ctx
        flops += 2 * h * c["vocab_size"] * o
    return flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=False, help="HF folder (benchmarks/export_hf.py)")
    parser.add_argument("--vllm-python", default=None, help="python of vLLM's virtualenv")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", default="w1,w2,w3")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--worker", choices=["radixserve", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--requests", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model, args.requests)
        return
    if not args.model or not (Path(args.model) / "config.json").is_file():
        sys.exit("--model must be an HF folder (write one with benchmarks/export_hf.py)")
    python = args.vllm_python
    if not python:
        sys.exit("vLLM is needed for this comparison: pass --vllm-python (no figure without it)")
    check = subprocess.run(
        [python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    )
    if check.returncode != 0:
        sys.exit(f"vLLM does not import with {python}: {check.stderr.strip()[-500:]}")
    print(f"vLLM {check.stdout.strip()} ({python}); model {args.model}")

    names = args.workloads.split(",")
    pythons = {"radixserve": sys.executable, "vllm": python}
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        files = {n: tokenized_workload(n, args.model, Path(tmp)) for n in names if n in OFFLINE}
        for rnd in range(args.rounds):
            order = ["radixserve", "vllm"] if rnd % 2 == 0 else ["vllm", "radixserve"]
            for name in names:
                for engine in order:
                    if name in OFFLINE:
                        r = run_offline(pythons[engine], engine, args.model, files[name])
                    else:
                        r = run_online(pythons[engine], engine, args.model, args.concurrency)
                    r["tok_s"] = r["output_tokens"] / r["wall_s"]
                    runs.setdefault((name, engine), []).append(r)
                    extra = (
                        f", TTFT median {r['ttft_median_ms']:.0f} ms"
                        if "ttft_median_ms" in r
                        else ""
                    )
                    print(
                        f"round {rnd + 1} {name} {engine:>10}: {r['wall_s']:7.2f} s, {r['tok_s']:7.1f} output tok/s{extra}",
                        flush=True,
                    )

    print(f"\n{'workload':>8} {'radixserve best':>16} {'vLLM best':>12} {'ratio':>7}")
    result: dict[str, float] = {}
    for name in names:
        ours = max(runs[(name, "radixserve")], key=lambda r: r["tok_s"])
        theirs = max(runs[(name, "vllm")], key=lambda r: r["tok_s"])
        if name == "w2":  # wall time, vLLM ÷ radixserve
            ratio = theirs["wall_s"] / ours["wall_s"]
            print(f"{name:>8} {ours['wall_s']:>14.2f} s {theirs['wall_s']:>10.2f} s {ratio:>7.2f}")
        else:
            ratio = ours["tok_s"] / theirs["tok_s"]
            print(
                f"{name:>8} {ours['tok_s']:>10.1f} tok/s {theirs['tok_s']:>6.1f} tok/s {ratio:>7.2f}"
            )
        result[f"{name}_ratio"] = round(ratio, 3)
    if "w1" in names:
        peak = matmul_peak_gflops()
        best = min(r["wall_s"] for r in runs[("w1", "radixserve")])
        achieved = workload_flops(args.model, "w1") / best / 1e9
        result["w1_gflops"] = round(achieved, 1)
        result["matmul_peak_gflops"] = round(peak, 1)
        result["w1_efficiency"] = round(achieved / peak, 3)
        print(
            f"W1: {achieved:.0f} GFLOP/s achieved, bf16 matmul peak {peak:.0f} GFLOP/s, efficiency {achieved / peak:.2f}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
