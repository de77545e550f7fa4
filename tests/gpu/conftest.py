"""tests/gpu: what needs a CUDA/ROCm GPU. Every test here is marked `gpu`, and skips without a GPU (the root
conftest.py); `bash tests/gpu_check.sh tests` runs them on a GPU host, with the unit tests of the kernels and FP8,
which run on the GPU where there is one."""

import pytest


def pytest_itemcollected(item):
    item.add_marker(pytest.mark.gpu)
