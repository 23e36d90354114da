"""Speed of the CUDA path on a dummy-weight model (default: the Llama-3.1-8B shape, bf16).

Measures, through the engine as users run it:
  * decode tokens/s at batch 1, 16, 64, 256 with 1,024-token prompts, CUDA graphs on and
    off (the same running batch, switched between the two windows);
  * time per output token (one decode step) against the HBM roofline: weight bytes + KV
    bytes read per step / 4.3 TB/s (the device copy bandwidth measured on these machines);
  * prefill tokens/s for 8 x 2,048-token prompts in one step, and its MFU against
    790 TFLOP/s (the bf16 matmul rate measured on these machines);
  * the GPU's idle fraction at batch 64: 1 - (sum of CUDA-event time from the start to the
    end of each step) / wall time, with the overlapped loop (the CUDA default) and serial.

Prints a table as figures come, and a last line of JSON. Run by benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from radixserve.core.sampling_params import SamplingParams
from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import Engine

HBM_BYTES_PER_S = 4.3e12
BF16_FLOPS = 790e12
ROOT = Path(__file__).resolve().parent


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def log(*args: object) -> None:
    print(*args, flush=True)


def weight_bytes_per_step(engine: Engine) -> int:
    """Bytes of every matrix a decode step reads (all but the embedding table, of which it
    reads only a row per request) and the norms."""
    m = engine.model
    if engine.model_config.moe is not None:
        raise SystemExit("gpu_bench's bandwidth model is for dense models (this one has experts)")
    total = 0
    for w in m.layers:
        for lin in (w.qkv, w.o, w.gate_up, w.down):
            total += lin.weight.numel() * lin.weight.element_size()
    total += m.lm_head.weight.numel() * m.lm_head.weight.element_size()
    return total


def kv_bytes_per_token(engine: Engine) -> int:
    c = engine.model_config
    elem = torch.finfo(engine.dtype).bits // 8
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * elem


def matmul_flops_per_token(engine: Engine) -> int:
    m = engine.model
    params = sum(lin.weight.numel() for w in m.layers for lin in (w.qkv, w.o, w.gate_up, w.down))
    return 2 * params


class Batch:
    """``bs`` running requests with random, distinct prompts (no prefix-cache hits)."""

    def __init__(self, engine: Engine, bs: int, prompt_len: int, max_tokens: int, seed: int):
        rng = np.random.default_rng(seed)
        self.engine = engine
        self.ids = [f"b{seed}-{i}" for i in range(bs)]
        self.produced = dict.fromkeys(self.ids, 0)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for rid in self.ids:
            prompt = rng.integers(10, engine.vocab_size - 10, prompt_len).tolist()
            engine.add_request(rid, prompt, params)

    def step(self) -> int:
        tokens = 0
        for d in self.engine.step():
            self.produced[d.request_id] += len(d.token_ids)
            tokens += len(d.token_ids)
        return tokens

    def run_until_decoding(self) -> None:
        while min(self.produced.values()) < 2:
            self.step()

    def window(self, steps: int) -> tuple[float, int]:
        """Seconds and tokens of ``steps`` engine steps (synchronised at both ends)."""
        sync()
        start = time.perf_counter()
        tokens = sum(self.step() for _ in range(steps))
        sync()
        return time.perf_counter() - start, tokens

    def finish(self) -> None:
        for rid in self.ids:
            self.engine.abort(rid)
        self.engine.drain()
        while self.engine.has_unfinished():
            self.engine.step()


def set_overlap(engine: Engine, on: bool) -> None:
    engine.drain()
    engine.device.close()
    engine.config.enable_overlap = on
    engine.overlap = engine.config.overlap
    engine.device = engine._make_device(engine.config)


KEYS = (
    "decode_bs1_tok_s",
    "decode_bs1_roofline_frac",
    "decode_bs64_tok_s",
    "decode_bs256_tok_s",
    "prefill_tok_s",
    "prefill_mfu",
    "gpu_idle_frac_bs64",
)


def build_engine(args: argparse.Namespace, max_bs: int, graphs: bool) -> Engine:
    return Engine(
        EngineConfig(
            model=args.model,
            load_format="dummy",
            dtype="bfloat16",
            device=args.device,
            kv_cache_memory_gb=args.kv_cache_memory,
            max_num_seqs=max_bs,
            max_num_batched_tokens=args.prefill_batch * args.prefill_len,
            max_model_len=max(args.context + 6 * args.steps + 64, args.prefill_len + 16),
            cuda_graph_max_bs=max_bs,
            disable_cuda_graph=not graphs,
        ),
        detokenize=False,
    )


def measure_decode(
    engine: Engine, args: argparse.Namespace, bs: int, seed: int, results: dict
) -> None:
    runner = engine.runner
    graphs = getattr(runner, "graphs", None)
    cuda = args.device == "cuda"
    wbytes = weight_bytes_per_step(engine)
    kv_tok = kv_bytes_per_token(engine)
    batch = Batch(engine, bs, args.context, 16 + 6 * args.steps, seed=seed)
    try:
        batch.run_until_decoding()
        for use_graphs in (True, False) if graphs is not None else (False,):
            if cuda:
                runner.graphs = graphs if use_graphs else None
            batch.window(2)  # settle
            seconds, tokens = batch.window(args.steps)
            tok_s = tokens / seconds
            tpot = seconds / args.steps
            context = args.context + 2 + args.steps  # mean context over the window, about
            roofline = (wbytes + bs * context * kv_tok) / HBM_BYTES_PER_S
            frac = roofline / tpot
            log(
                f"{bs:>5} {'on' if use_graphs else 'off':>6} {tok_s:>9.1f} {tpot * 1e3:>8.2f} "
                f"{roofline * 1e3:>11.2f} {frac:>5.2f}"
            )
            suffix = "" if use_graphs or graphs is None else "_eager"
            results[f"decode_bs{bs}_tok_s{suffix}"] = round(tok_s, 1)
            results[f"decode_bs{bs}_roofline_frac{suffix}"] = round(frac, 3)
        if cuda:
            runner.graphs = graphs
        if bs == 64 and cuda:
            for overlap in (True, False):
                set_overlap(engine, overlap)
                runner.step_events = []
                seconds, _ = batch.window(args.steps)
                busy = sum(s.elapsed_time(e) for s, e in runner.step_events) / 1e3
                runner.step_events = None
                idle = max(0.0, 1 - busy / seconds)
                results["gpu_idle_frac_bs64" + ("" if overlap else "_serial")] = round(idle, 4)
                log(
                    f"GPU idle fraction at batch 64, {'overlapped' if overlap else 'serial'} "
                    f"loop: {idle:.4f} (busy {busy:.3f} s of {seconds:.3f} s)"
                )
            set_overlap(engine, True)
    finally:
        if cuda:
            runner.graphs = graphs
        batch.finish()


def measure_prefill(engine: Engine, args: argparse.Namespace, results: dict) -> None:
    """8 x 2048 fresh prompts in one step, four times; the best of the last three."""
    tokens = args.prefill_batch * args.prefill_len
    c = engine.model_config
    attn_flops = (
        args.prefill_batch
        * c.num_hidden_layers
        * 4
        * (args.prefill_len**2 / 2)
        * c.num_attention_heads
        * c.head_dim
    )
    flops = matmul_flops_per_token(engine) * tokens + attn_flops
    times = []
    for rep in range(4):
        Batch(engine, args.prefill_batch, args.prefill_len, 1, seed=100 + rep)
        sync()
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        sync()
        times.append(time.perf_counter() - start)
    best = min(times[1:])  # the first includes compiling the extend kernel
    results["prefill_tok_s"] = round(tokens / best, 1)
    results["prefill_mfu"] = round(flops / best / BF16_FLOPS, 3)
    log(
        f"prefill {args.prefill_batch} x {args.prefill_len}: {tokens / best:.0f} tok/s, "
        f"{flops / best / 1e12:.0f} TFLOP/s, MFU {flops / best / BF16_FLOPS:.3f} "
        f"(runs: {', '.join(f'{t:.3f}' for t in times)} s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "configs" / "Llama-3.1-8B"))
    ap.add_argument("--batch-sizes", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per timed window")
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", type=float, default=60.0)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    args = ap.parse_args()
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    max_bs = max(batch_sizes)
    results: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        try:
            engine = build_engine(args, max_bs, graphs=args.device == "cuda")
        except Exception:  # a failed capture must not cost the eager figures
            traceback.print_exc()
            log("engine with CUDA graphs failed (above); measuring without them")
            engine = build_engine(args, max_bs, graphs=False)
        graphs = getattr(engine.runner, "graphs", None)
        log(
            f"engine ready in {time.perf_counter() - t0:.1f} s (graph capture "
            f"{graphs.capture_seconds if graphs else 0:.1f} s); overlap={engine.overlap}"
        )
        log(
            f"weights read per decode step: {weight_bytes_per_step(engine) / 1e9:.2f} GB; "
            f"KV per token: {kv_bytes_per_token(engine)} B"
        )
        log(
            f"{'batch':>5} {'graphs':>6} {'tok/s':>9} {'TPOT ms':>8} {'roofline ms':>11} {'frac':>5}"
        )
        for i, bs in enumerate(batch_sizes):
            try:
                measure_decode(engine, args, bs, i, results)
            except Exception:
                traceback.print_exc()
                log(f"decode at batch {bs} failed (above)")
        try:
            measure_prefill(engine, args, results)
        except Exception:
            traceback.print_exc()
            log("prefill failed (above)")
        engine.close()
    finally:
        summary = {k: results.get(k) for k in KEYS}
        summary.update({k: v for k, v in results.items() if k not in summary})
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    sys.exit(main())
