"""Soak-and-chaos test of a live radixserve server: ``radixserve soak`` (the code and what
it checks: radixserve/tools/soak.py).

    # 10 minutes on SmolLM2 with a small KV cache (preemption), a launched server:
    python benchmarks/soak.py --duration 600 -- --kv-cache-memory 0.02 --max-waiting-requests 32
    # the same with injected faults (RADIXSERVE_FAULTS for the launched server):
    python benchmarks/soak.py --duration 600 --faults step_exception:0.01,engine_crash_after:3000 -- ...
    # a server already running with --enable-debug-endpoints:
    python benchmarks/soak.py --url http://127.0.0.1:8000 --duration 120

Prints outcome counts, TTFT/TPOT percentiles by time window and, last, one JSON line.
"""

import sys

from radixserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["soak", *sys.argv[1:]]))
