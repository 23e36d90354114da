"""Where radixserve keeps what it builds once per machine (native kernels, tokenizers)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$RADIXSERVE_CACHE``, else ``~/.cache/radixserve``."""
    root = os.environ.get("RADIXSERVE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "radixserve"
