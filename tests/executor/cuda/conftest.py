"""The CUDA path's tests. Without a GPU, Triton kernels run under Triton's interpreter on
CPU tensors (float32 only: bfloat16 arithmetic is wrong there); tests marked ``cuda`` need
a GPU and are skipped without one."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # read when a kernel is decorated: set before radixserve.executor.cuda is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="the CUDA path's kernels need triton")


_HERE = os.path.dirname(__file__)


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks added here
def pytest_collection_modifyitems(config, items):
    """Without a GPU: tests marked ``cuda`` skip, and the rest of this folder (Triton's
    interpreter on CPU tensors, ~20 s in all) belongs to the full run, not the fast loop
    (``-m "not slow"``), which stays on the CPU path."""
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if HAS_CUDA or not str(item.path).startswith(_HERE):
            continue
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
        else:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"
