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


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"
