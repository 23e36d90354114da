"""Loading the native kernels must not change the process's floating-point state."""

import subprocess
import sys

import pytest

from radixserve.executor import native

_CHECK = """
import numpy as np
import torch
from radixserve.executor import native
loaded = [name for name in ("load_paged_decode", "load_elementwise", "load_paged_prefill",
          "load_qlinear", "load_token_mask", "load_int4_panels")
          if getattr(native, name)() is not None]
tiny = np.float32(1e-40)  # a float32 denormal
assert float(tiny * np.float32(1.0)) != 0.0, "denormal flushed to zero in numpy"
t = torch.tensor([1e-40], dtype=torch.float32)
assert float((t * 1.0).item()) != 0.0, "denormal flushed to zero in torch"
print(" ".join(loaded))
"""


@pytest.mark.slow  # a fresh interpreter
def test_native_libraries_leave_denormals_alone():
    if native.load_elementwise() is None:
        pytest.skip("native kernels unavailable here")
    out = subprocess.run(
        [sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "load_elementwise" in out.stdout  # the one built with -ffast-math
