"""Where our Triton kernels can run. GPU builds of torch ship Triton; on a CPU host with Triton installed and
TRITON_INTERPRET=1 (set before Triton is imported), Triton's interpreter runs the same kernels on CPU tensors,
slowly: that is how the tests check the kernels without a GPU. Training on a CPU always takes the torch paths."""

from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA/ROCm builds of torch only
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice  # CUDA's or ROCm's math library, as the GPU's backend takes it

    HAVE_TRITON = True
except ImportError:  # CPU-only installs
    triton = tl = libdevice = None
    HAVE_TRITON = False


def interpreted() -> bool:
    return HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"


def kernels_run_on(device: torch.device | str) -> bool:
    """Whether the Triton kernels can take tensors of `device`: a GPU, or the CPU under the interpreter."""
    kind = torch.device(device).type
    return HAVE_TRITON and (kind == "cuda" or (kind == "cpu" and interpreted()))
