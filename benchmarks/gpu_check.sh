#!/usr/bin/env bash
# The CUDA path's check on a lent GPU machine (PyTorch and Triton installed, no network), in
# one device call of at most 8 minutes:
#
#   bash benchmarks/fetch_gpu_wheels.sh            # here, once: the wheels the image lacks
#   device run: command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540
#
# 1. installs radixserve from the working tree plus the wheels in .whl/ (into /tmp/site);
# 2. runs the tests marked `cuda` (bf16 kernels against torch references; greedy tokens of
#    tiny random Llama / Qwen3 models equal to transformers on CUDA and to radixserve's CPU
#    path in float32, with CUDA graphs and eager: the TP=1 CUDA path through the runner
#    seam the tensor-parallel runner shares; and a one-rank tensor-parallel group over NCCL
#    whose greedy tokens equal the plain CUDA runner's);
# 2b. tensor parallelism on one GPU: NCCL present, and `-tp` / `-dp x -tp` asking for more
#    GPUs than are visible fails at start-up with the GPU-count error (TP=2 over NCCL needs
#    two GPUs: never run here);
# 3. runs benchmarks/gpu_bench.py on the Llama-3.1-8B-shaped dummy model in bf16;
# 4. with time left, benchmarks/gpu_fused_ops.py (our Triton row-wise kernels against eager
#    PyTorch and torch.compile).
# Everything is logged to $OUT/gpu_check.log as it comes; the benchmark's last-line JSON is
# also written to $OUT/gpu_check.json and printed again as the script's last line.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/radixserve-gpu-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
BUDGET_S=${GPU_CHECK_BUDGET_S:-465}
start=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - start))); }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "installing .whl/ failed"; exit 1; }
else
  echo "no .whl/ here: run benchmarks/fetch_gpu_wheels.sh and carry .whl"
fi
if python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
  --target /tmp/site . >/tmp/radixserve-install.log 2>&1; then
  echo "radixserve installed from the working tree into /tmp/site"
  export PYTHONPATH=/tmp/site
else
  echo "pip could not build radixserve here ($(tail -1 /tmp/radixserve-install.log)); using the tree"
  export PYTHONPATH=/tmp/site:$PWD
fi
python3 - <<'PY' || exit 1
import torch, triton, transformers, radixserve
print(f"torch {torch.__version__}, triton {triton.__version__}, transformers "
      f"{transformers.__version__}, cuda {torch.cuda.is_available()} "
      f"({torch.cuda.get_device_name() if torch.cuda.is_available() else '-'}); radixserve from "
      f"{radixserve.__file__}")
PY

echo "== tests marked cuda ($(left) s left)"
timeout 190 python3 -m pytest -m cuda tests/executor/cuda -q -p no:cacheprovider --durations=8
echo "cuda tests: exit $?"

echo "== tensor parallelism on one GPU ($(left) s left)"
timeout 60 python3 - <<'PY'
import torch
import torch.distributed as dist

from radixserve.engine.config import EngineConfig
from radixserve.executor.placement import replica_environments

n = torch.cuda.device_count()
nccl = dist.is_nccl_available()
print(f"NCCL available: {nccl} (version {torch.cuda.nccl.version() if nccl else '-'}); {n} GPU(s)")
try:
    EngineConfig(device="cuda", tensor_parallel_size=n + 1)
    print(f"FAIL: -tp {n + 1} on {n} GPU(s) was accepted")
except ValueError as exc:
    print(f"ok: -tp {n + 1} refused at start-up: {exc}")
try:
    replica_environments(2, n, {}, n)
    print(f"FAIL: -dp 2 x -tp {n} on {n} GPU(s) was accepted")
except ValueError as exc:
    print(f"ok: -dp 2 x -tp {n} refused: {exc}")
PY
echo "tensor parallelism checks: exit $?"

echo "== benchmark ($(left) s left)"
timeout $(( $(left) > 60 ? $(left) : 60 )) python3 benchmarks/gpu_bench.py | tee "$OUT/bench.log"
echo "benchmark: exit ${PIPESTATUS[0]}"
tail -1 "$OUT/bench.log" | grep '^{' > "$OUT/gpu_check.json" || echo "no JSON line (see the log)"

if [ "$(left)" -gt 90 ]; then  # Triton vs torch.compile for the fused ops, if time is left
  echo "== fused ops: Triton vs eager vs torch.compile ($(left) s left)"
  timeout $(( $(left) - 15 )) python3 benchmarks/gpu_fused_ops.py | tee "$OUT/fused_ops.log"
else
  echo "== fused ops comparison skipped: $(left) s left"
fi
echo "gpu_check: $(( $(date +%s) - start )) s"
cat "$OUT/gpu_check.json" 2>/dev/null
