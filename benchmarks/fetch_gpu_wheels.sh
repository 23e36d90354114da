#!/usr/bin/env bash
# Downloads, on a machine with network, the wheels radixserve needs on the GPU machine but
# its image lacks (see shared/gpu-notes.md), at the lock file's versions, into .whl/
# (git-ignored). The device call then names .whl in `carry`; benchmarks/gpu_check.sh installs
# them with --no-index --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
names="gguf msgspec pyzmq orjson httptools uvicorn pydantic pydantic-core annotated-types typing-inspection typing-extensions"
pins=()
for n in $names; do
  pin=$(grep -E "^${n}==" constraints.txt) || { echo "no pin for $n in constraints.txt" >&2; exit 1; }
  pins+=("$pin")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
ls -la .whl
