"""FP8 on a GPU beside tests/gpu/test_gpu.py's: the code Inductor generates around the cast kernel (the CPU's FP8
tests: tests/unit/test_fp8.py, which run on the GPU where there is one)."""

import pytest
import torch
from torch import nn

from flux_train.kernels.fp8 import FP8Linear, FP8Scaling, convert_to_fp8

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


@pytest.mark.parametrize("compiled", [False, True])
def test_a_single_block_s_mlp_casting_its_gelu_input_computes_what_the_gelu_then_the_cast_does(compiled):
    """The single block's MLP path: linear1's output split (the GELU's input a view whose rows are 7 widths apart),
    the GELU and the join done by linear2's FP8 cast, against the GELU and the join computed first, run the same way
    (eager, or compiled: then the cast must read the view where it lies, Inductor passing the strides it traced):
    the output and the gradients bit for bit, over a step without and one with a history."""
    from flux_train.kernels.fp8_cast import gelu_tanh_joined
    from flux_train.model.flux import gelu_linear

    width = 128
    torch.manual_seed(0)
    linear1 = nn.Linear(width, 7 * width).to(DEVICE, torch.bfloat16)
    weights = {k: v.clone() for k, v in nn.Linear(5 * width, width).to(DEVICE, torch.bfloat16).state_dict().items()}
    batches = [torch.randn(2, 64, width, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    seen = {}
    for fused in (False, True):
        linear2 = nn.Linear(5 * width, width).to(DEVICE, torch.bfloat16)
        linear2.load_state_dict(weights)
        convert_to_fp8(linear2, "delayed", E4M3, lambda fqn, m: True, gelu_in_cast=True)
        scaling = FP8Scaling.of(linear2, torch.device(DEVICE))
        assert scaling is not None and isinstance(linear2, FP8Linear)
        assert linear2.fuses_gelu(torch.empty(2, 64, 4 * width))  # the MLP input's rows

        def mlp(x, linear2=linear2, fused=fused):
            qkv, tail = linear1(x).split([3 * width, 4 * width], dim=-1)
            head = qkv[..., :width].contiguous()  # as the attention's output
            return gelu_linear(linear2, head, tail) if fused else linear2(gelu_tanh_joined(head, tail))

        step = torch.compile(mlp, fullgraph=True) if compiled else mlp
        seen[fused] = []
        for x in batches:
            x = x.clone().requires_grad_()
            y = step(x)
            y.float().square().mean().backward()
            seen[fused] += [
                y.detach(),
                x.grad,
                linear2.weight.grad,
                linear1.weight.grad,
                linear2.get_buffer("fp8_amax").clone(),
            ]
            linear1.weight.grad = linear2.weight.grad = None
            scaling.update()
    assert all(torch.equal(a, b) for a, b in zip(seen[False], seen[True], strict=True))
