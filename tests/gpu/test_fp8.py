"""FP8 on a GPU beside tests/gpu/test_gpu.py's: the code Inductor generates around the cast kernel (the CPU's FP8
tests: tests/unit/test_fp8.py, which run on the GPU where there is one)."""

import torch
from torch import nn

from flux_train.kernels.fp8 import FP8Scaling, convert_to_fp8

E4M3 = torch.float8_e4m3fn
DEVICE = "cuda"


def test_a_compiled_fp8_linear_launches_no_fill_kernel_beside_its_casts():
    """Inductor gives a 0-dim torch.empty a kernel that fills it; the cast allocates its scale outputs with a
    dimension, so a compiled forward + backward runs the cast kernel with nothing launched to fill its outputs
    (before: two launches per cast, 288 a step at 6 + 12 blocks). Inductor names those kernels after `empty`."""
    from torch._inductor.utils import run_and_get_code

    lin = nn.Linear(256, 512).to(DEVICE, torch.bfloat16)
    convert_to_fp8(lin, "delayed", E4M3, lambda fqn, m: True)
    FP8Scaling.of(lin, torch.device(DEVICE))
    forward = torch.compile(lin, fullgraph=True)
    x = torch.randn(64, 256, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    _, codes = run_and_get_code(lambda: forward(x).float().square().mean().backward())
    assert len(codes) == 2 and all("_cast_transpose_kernel" in code for code in codes)  # forward and backward
    assert not [line for code in codes for line in code.splitlines() if "fused_empty" in line]
