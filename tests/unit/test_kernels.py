"""Our Triton kernels (RMSNorm forward/backward, one-pass AdamW) against references, on the GPU where there is
one, else in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1 on hosts without a GPU). Without Triton
installed these skip, and fail under CI=1 (CI installs Triton through the dev extra)."""

import os

import pytest
import torch

from flux_train.kernels import rms_norm, rms_norm_torch
from flux_train.kernels.adamw import adamw_hyper, adamw_step_triton
from flux_train.kernels.triton_support import kernels_run_on

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the kernels' low-precision outputs: Triton's interpreter rounds to bf16 by truncation where GPUs round to
# nearest, so on the CPU the same kernels write fp32 and the checks hold the math to fp32
LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float32
# relative tolerance unit: bf16's rounding on a GPU; in fp32, the fp32 sums over rows set the floor
EPS = torch.finfo(LOW).eps if LOW == torch.bfloat16 else 2**-16

if not kernels_run_on(DEVICE):
    if os.environ.get("CI"):
        raise RuntimeError("CI must test the Triton kernels: install Triton (pip install -e '.[dev]')")
    pytest.skip("no Triton here (pip install triton, or run on a GPU)", allow_module_level=True)


def reference64(x, w, eps):
    x64, w64 = x.double(), w.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64


@pytest.mark.parametrize("shape", [(2, 512, 24, 128), (3, 77, 128), (1, 5, 64), (4096, 256), (7, 3, 2, 96)])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 30.0])
def test_triton_rmsnorm_forward_backward_vs_float64(shape, scale):
    g = torch.Generator(device=DEVICE).manual_seed(hash((shape, scale)) % 2**31)
    d = shape[-1]
    x = (torch.randn(shape, device=DEVICE, generator=g) * scale).to(LOW).requires_grad_()
    w = (1 + 0.1 * torch.randn(d, device=DEVICE, generator=g)).to(LOW).requires_grad_()
    dy = torch.randn(shape, device=DEVICE, generator=g).to(LOW)
    y = rms_norm(x, w, 1e-6, impl="triton")
    y.backward(dy)

    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = reference64(xr, wr, 1e-6)
    yr.backward(dy.double())
    # output: one rounding of an fp32 result
    torch.testing.assert_close(y.double(), yr, rtol=EPS, atol=EPS * scale / 1000)
    # dx: fp32 math, one rounding; dW sums over rows in fp32 then rounds once
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=2 * EPS, atol=EPS * xr.grad.abs().max().item() / 4)
    torch.testing.assert_close(w.grad.double(), wr.grad, rtol=2 * EPS, atol=EPS * wr.grad.abs().max().item() / 8)
    # and no worse than the torch fallback against the same reference
    y_torch = rms_norm_torch(x.detach(), w.detach(), 1e-6)
    assert (y.double() - yr).abs().max() <= (y_torch.double() - yr).abs().max() * 1.5 + 1e-6


def torch_reference_norm(d: int, weight: torch.Tensor) -> torch.nn.RMSNorm:
    """The reference's Q/K norm: torch's nn.RMSNorm with eps unset, in bf16 as FSDP2 casts it."""
    norm = torch.nn.RMSNorm(d, device=weight.device, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def qk_rows(g: torch.Generator) -> torch.Tensor:
    """bf16 q/k-like rows at scales from 1 down to 1e-4: below ~0.1 eps 2^-7 (bf16's) and 2^-23 (what torch takes)
    give different outputs, by up to 100x at 1e-4."""
    scales = torch.tensor([1.0, 0.3, 0.1, 1e-2, 1e-3, 1e-4], device=DEVICE).repeat_interleave(16)[:, None]
    return (torch.randn(scales.shape[0], 128, device=DEVICE, generator=g) * scales).bfloat16()


@pytest.mark.parametrize("compiled", [False, True])
def test_rmsnorm_default_eps_is_torchs_for_bf16_inputs(compiled):
    """Our Q/K norm built without an eps (as the model builds it) against torch's nn.RMSNorm without one, on bf16:
    the torch path bit for bit, eager and under torch.compile (each against torch's own norm run the same way).
    torch takes its op-math type's epsilon (float32's 2^-23), not bf16's 2^-7."""
    from flux_train.kernels import RMSNorm, default_eps

    assert default_eps(torch.bfloat16) == default_eps(torch.float32) == 2**-23
    assert default_eps(torch.float64) == torch.finfo(torch.float64).eps
    g = torch.Generator(device=DEVICE).manual_seed(3)
    x = qk_rows(g)
    ours = RMSNorm(128, impl="torch", device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        ours.scale.copy_(1 + 0.1 * torch.randn(128, device=DEVICE, generator=g))
    theirs = torch_reference_norm(128, ours.scale.detach())
    if compiled:
        torch._dynamo.reset()
        ours, theirs = torch.compile(ours), torch.compile(theirs)
    with torch.no_grad():
        want = theirs(x)
        assert torch.equal(ours(x), want)
        # the rule it replaces differs from torch's where rows are small
        wrong = rms_norm_torch(x, ours.scale if not compiled else ours._orig_mod.scale, 2**-7)
        assert not torch.equal(wrong, want)


def test_triton_rmsnorm_default_eps_matches_torch_nn_rmsnorm_on_bf16():
    """The Triton kernel (GPU, or the CPU interpreter) with the eps our norm passes it, against nn.RMSNorm with eps
    unset on the same bf16 rows: within one bf16 rounding of each output (the interpreter truncates to bf16 where
    a GPU rounds to nearest: two ulps there), at every scale down to 1e-4. bf16's own epsilon misses by far."""
    from flux_train.kernels import RMSNorm

    g = torch.Generator(device=DEVICE).manual_seed(4)
    x = qk_rows(g)
    ours = RMSNorm(128, impl="triton", device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        ours.scale.copy_(1 + 0.1 * torch.randn(128, device=DEVICE, generator=g))
        want = torch_reference_norm(128, ours.scale)(x).float()
        got = ours(x).float()
        ulps = 1 if DEVICE == "cuda" else 2
        assert ((got - want).abs() <= ulps * 2**-7 * want.abs() + 1e-30).all()
        ours.eps = 2**-7
        assert ((ours(x).float() - want).abs() > 0.1 * want.abs()).any()


@pytest.mark.parametrize("n", [1, 4097, 3_000_000 if DEVICE == "cuda" else 300_000])
def test_triton_adamw_matches_torch_adamw_with_clipping(n):
    """Our one-pass AdamW (bf16 grads, fp32 master and moments, bf16 copy out, clip factor on the device) against
    torch.optim.AdamW on fp32 copies after clipping the same way, over 5 steps with weight decay; a call with the
    device flag `live` at 0 (an update issued a second time) changes nothing."""

    g = torch.Generator(device=DEVICE).manual_seed(n)
    master = torch.randn(n, device=DEVICE, generator=g)
    ref = torch.nn.Parameter(master.clone())
    opt = torch.optim.AdamW([ref], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    m, v, out = (
        torch.zeros_like(master),
        torch.zeros_like(master),
        torch.full((n,), float("nan"), device=DEVICE, dtype=LOW),
    )
    for step in range(1, 6):
        grad = (torch.randn(n, device=DEVICE, generator=g) * 3).bfloat16()
        coef = torch.tensor([0.5 if step % 2 else 1.0], device=DEVICE)  # clipping on every other step
        hyper = torch.tensor(adamw_hyper(1e-3, 0.9, 0.95, 0.1, step), device=DEVICE)
        live = torch.ones(1, dtype=torch.int32, device=DEVICE)
        adamw_step_triton(master, m, v, grad, out, coef, hyper, live, beta1=0.9, beta2=0.95, eps=1e-8)
        before = [t.clone() for t in (master, m, v, out)]
        adamw_step_triton(master, m, v, grad, out, coef, hyper, live.zero_(), beta1=0.9, beta2=0.95, eps=1e-8)
        assert all(torch.equal(a, b) for a, b in zip(before, (master, m, v, out)))
        ref.grad = grad.float() * coef
        opt.step()
        torch.testing.assert_close(master, ref.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(out, master.to(LOW))
    # torch's lerp switches formula at weight 0.5: the moments agree to fp32 rounding of the larger terms
    torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, opt.state[ref]["exp_avg_sq"], rtol=1e-5, atol=1e-9)
