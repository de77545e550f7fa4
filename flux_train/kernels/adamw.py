"""AdamW over flat fp32 master shards in one pass: `adamw_step(master, exp_avg, exp_avg_sq, grad, out, ...)`.

Per element it reads the (bf16) gradient, the fp32 master weight and both moments, and writes the moments,
the master and the weight's compute-dtype copy that the all-gather sends: 28 bytes per parameter with bf16
gradients, the least an AdamW step with fp32 state can move. The gradient is multiplied by `grad_coef`, a
one-element device tensor (the clipping factor times 1/world for summed gradients), so clipping costs no
pass of its own and no host sync. torch's fused AdamW wants gradients in the master's dtype (a 6-byte cast
pass and 4 more bytes of memory per parameter first) and writes no bf16 copy (another 6-byte pass).

`live`, a one-element int32 device tensor, makes the step conditional on the device: where it is 0 the call
changes nothing, so an update issued twice (by a replayed CUDA graph and by whoever applied it in between) is
applied once (flux_train.training.ddp).

The arithmetic follows torch.optim.AdamW (decoupled weight decay, bias corrections, eps outside the sqrt)
step for step; `adamw_step_torch` is the same in torch ops (CPU path and test reference).
"""

from __future__ import annotations

import math

import torch

from flux_train.kernels.triton_support import HAVE_TRITON, tl, triton


def adamw_hyper(lr: float, beta1: float, beta2: float, weight_decay: float, step: int) -> tuple[float, float, float]:
    """What changes from step to step, at 1-based `step`: (step size lr / bias_correction1, sqrt(bias_correction2),
    decay factor 1 - lr * weight_decay). The kernels read these from a 3-element fp32 device tensor, so a
    captured CUDA graph of the step takes each step's values from there."""
    return lr / (1 - beta1**step), math.sqrt(1 - beta2**step), 1 - lr * weight_decay


@torch.no_grad()
def adamw_step_torch(master, exp_avg, exp_avg_sq, grad, out, grad_coef, hyper, live, *, beta1, beta2, eps) -> None:
    if not live.item():
        return
    step_size, bc2_sqrt, decay = hyper
    g = grad.to(master.dtype) * grad_coef
    master.mul_(decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    master.sub_(exp_avg / (exp_avg_sq.sqrt() / bc2_sqrt + eps) * step_size)
    out.copy_(master)


if HAVE_TRITON:

    @triton.jit
    def _adamw_kernel(P, M, V, G, OUT, COEF, HYPER, LIVE, n, beta1, beta2, eps, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < tl.where(tl.load(LIVE) != 0, n, 0)  # nothing where the update is not live
        step_size, bc2_sqrt, decay = tl.load(HYPER), tl.load(HYPER + 1), tl.load(HYPER + 2)
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(COEF)
        p = tl.load(P + offs, mask=mask, other=0.0)
        m = tl.load(M + offs, mask=mask, other=0.0)
        v = tl.load(V + offs, mask=mask, other=0.0)
        p = p * decay
        m = m + (1 - beta1) * (g - m)
        v = v * beta2 + (1 - beta2) * g * g
        p = p - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
        tl.store(P + offs, p, mask=mask)
        tl.store(M + offs, m, mask=mask)
        tl.store(V + offs, v, mask=mask)
        tl.store(OUT + offs, p.to(OUT.dtype.element_ty), mask=mask)


def adamw_step(
    master, exp_avg, exp_avg_sq, grad, out, grad_coef, hyper, live, *, beta1: float, beta2: float, eps: float
) -> None:
    """One AdamW step on 1-D tensors of equal length (see module docstring): Triton on a GPU, torch elsewhere.
    `hyper`: the fp32 device tensor of `adamw_hyper`'s values; `live`: 0 makes the call a no-op."""
    step = adamw_step_triton if HAVE_TRITON and master.is_cuda else adamw_step_torch
    step(master, exp_avg, exp_avg_sq, grad, out, grad_coef, hyper, live, beta1=beta1, beta2=beta2, eps=eps)


def adamw_step_triton(master, exp_avg, exp_avg_sq, grad, out, grad_coef, hyper, live, *, beta1, beta2, eps) -> None:
    """The Triton kernel: on a GPU, or on CPU tensors under Triton's interpreter (triton_support)."""
    n = master.numel()
    block = 2048
    _adamw_kernel[(triton.cdiv(n, block),)](
        master,
        exp_avg,
        exp_avg_sq,
        grad,
        out,
        grad_coef,
        hyper,
        live,
        n,
        beta1,
        beta2,
        eps,
        BLOCK=block,
        num_warps=8,  # pyright: ignore[reportCallIssue] - a launch option, not a kernel argument
    )
