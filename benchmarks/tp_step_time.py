"""Tensor parallelism on CPU, for the record: step times of TP=1 and TP=2 (gloo, worker
processes) on the same random-weight model.

    python benchmarks/tp_step_time.py            # ~1 minute on 2 cores
    python benchmarks/tp_step_time.py --layers 4 --decode-steps 16

The model is a Llama-shaped config with random weights (``load_format="dummy"``; default:
hidden 1024, 16 heads, 4 kv heads, intermediate 2816, vocab 32000, 8 layers, bfloat16).
Each TP size runs one prefill step of ``--batch`` prompts of ``--prompt-len`` tokens and
then ``--decode-steps`` decode steps of that batch; the prefill step and the median decode
step are reported. TP=2 splits the cores between the two ranks (one process each), so on a
machine with few cores it is no faster: this measures the price of the collectives, not a
speed-up. Last line: JSON with ``tp1_decode_ms``, ``tp2_decode_ms``, ``tp1_prefill_ms``,
``tp2_prefill_ms``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from radixserve.core.sampling_params import SamplingParams
from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import Engine


def write_config(folder: Path, args: argparse.Namespace) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def measure(path: Path, tp: int, args: argparse.Namespace) -> tuple[float, float]:
    engine = Engine(
        EngineConfig(
            model=str(path),
            load_format="dummy",
            dtype="bfloat16",
            tensor_parallel_size=tp,
            kv_cache_memory_gb=0.25,
            max_num_batched_tokens=args.batch * args.prompt_len,
        ),
        detokenize=False,
    )
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 1, ignore_eos=True)
    for i in range(args.batch):
        prompt = rng.integers(3, 32000, size=args.prompt_len).tolist()
        engine.add_request(f"r{i}", prompt, params)
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.close()
    return times[0] * 1e3, float(np.median(times[1:-1])) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    args = parser.parse_args()
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_config(Path(tmp), args)
        for tp in (1, 2):
            prefill_ms, decode_ms = measure(path, tp, args)
            print(f"TP={tp}: prefill step {prefill_ms:8.1f} ms, decode step {decode_ms:7.2f} ms")
            result[f"tp{tp}_prefill_ms"] = round(prefill_ms, 1)
            result[f"tp{tp}_decode_ms"] = round(decode_ms, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
