"""What a process holds in memory, read from /proc (no dependency: the soak client and the
server's model set both use it)."""

from __future__ import annotations


def rss_bytes(pid: int) -> int | None:
    """Resident memory of process ``pid`` (None where /proc does not say: gone, another OS)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
