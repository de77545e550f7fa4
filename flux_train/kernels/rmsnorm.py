"""Flux's Q/K RMSNorm and the RoPE rotation after it, fused: `rms_norm_rope(x, weight, cos, sin, eps)`.

Per head (dim 128): y = RoPE(bf16(x / rms(x) * weight)), the norm's math in fp32 with eps the machine epsilon
of x's dtype by default (torch's `nn.RMSNorm` without an eps, as the reference's), rounded to x's dtype as the
reference's norm returns it, then rotated in fp32 on interleaved pairs and rounded once more. On a GPU one Triton
kernel reads each token's heads once (the q/k slices of the qkv GEMM's output, where they lie) and writes the
rotated heads contiguous for attention; the backward is one kernel too (the rotation's transpose, then the norm's
backward, with the weight's gradient from per-program partial sums in a fixed order). Both are
`torch.library.triton_op`s, so torch.compile calls them as they are and CUDA graphs capture them.
`rms_norm_rope_torch` is the same in torch ops: the CPU path and the tests' reference.
"""

from __future__ import annotations

import torch
from torch import nn

from flux_train.kernels.triton_support import HAVE_TRITON, kernels_run_on, tl, triton

if HAVE_TRITON:
    from torch.library import triton_op, wrap_triton


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    math_dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 for bf16 inputs, float64 stays float64
    xf = x.to(math_dtype)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(math_dtype)
    return y.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs in fp32 (as the reference, also for a float64 x); x [B, L, H, D], cos/sin [L, D]."""
    xf = x.float()
    pairs = xf.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (xf * cos[None, :, None, :] + rotated * sin[None, :, None, :]).to(x.dtype)


def rms_norm_rope_torch(x, weight, cos, sin, eps: float) -> torch.Tensor:
    return apply_rope(rms_norm_torch(x, weight, eps), cos, sin)


if HAVE_TRITON:

    @triton.jit
    def _fwd_kernel(X, W, COS, SIN, Y, RSTD, L, H, sxb, sxl, sxh, eps, D: tl.constexpr, BLOCK_H: tl.constexpr):
        # one token per program: its H heads of D, even and odd elements of each pair apart
        token = tl.program_id(0)
        b, pos = token // L, token % L
        h = tl.arange(0, BLOCK_H)
        i = tl.arange(0, D // 2)
        mask = h[:, None] < H
        x_at = X + b.to(tl.int64) * sxb + pos.to(tl.int64) * sxl + h[:, None] * sxh + 2 * i[None, :]
        xe = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
        xo = tl.load(x_at + 1, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt((tl.sum(xe * xe, axis=1) + tl.sum(xo * xo, axis=1)) / D + eps)
        we = tl.load(W + 2 * i).to(tl.float32)
        wo = tl.load(W + 2 * i + 1).to(tl.float32)
        # the norm's output in x's dtype, as the reference's norm returns it before the rotation
        ne = (xe * rstd[:, None] * we[None, :]).to(Y.dtype.element_ty).to(tl.float32)
        no = (xo * rstd[:, None] * wo[None, :]).to(Y.dtype.element_ty).to(tl.float32)
        c = tl.load(COS + pos * D + 2 * i)[None, :]
        s = tl.load(SIN + pos * D + 2 * i)[None, :]
        y_at = Y + token.to(tl.int64) * H * D + h[:, None] * D + 2 * i[None, :]
        tl.store(y_at, (ne * c - no * s).to(Y.dtype.element_ty), mask=mask)
        tl.store(y_at + 1, (no * c + ne * s).to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + token * H + h, rstd, mask=h < H)

    @triton.jit
    def _bwd_kernel(
        DY,
        X,
        W,
        COS,
        SIN,
        RSTD,
        DX,
        DW_PARTIAL,
        n_tokens,
        L,
        H,
        sxb,
        sxl,
        sxh,
        syb,
        syl,
        syh,
        D: tl.constexpr,
        BLOCK_H: tl.constexpr,
        TOKENS: tl.constexpr,
    ):
        h = tl.arange(0, BLOCK_H)
        i = tl.arange(0, D // 2)
        we = tl.load(W + 2 * i).to(tl.float32)[None, :]
        wo = tl.load(W + 2 * i + 1).to(tl.float32)[None, :]
        dwe = tl.zeros((D // 2,), dtype=tl.float32)
        dwo = tl.zeros((D // 2,), dtype=tl.float32)
        for t in range(TOKENS):
            token = tl.program_id(0) * TOKENS + t
            heads = tl.where(token < n_tokens, H, 0)  # the tail program's extra tokens: no heads
            live = h[:, None] < heads
            b, pos = token // L, token % L
            dy_at = DY + b.to(tl.int64) * syb + pos.to(tl.int64) * syl + h[:, None] * syh + 2 * i[None, :]
            dye = tl.load(dy_at, mask=live, other=0.0).to(tl.float32)
            dyo = tl.load(dy_at + 1, mask=live, other=0.0).to(tl.float32)
            c = tl.load(COS + pos * D + 2 * i, mask=i < heads * D, other=0.0)[None, :]
            s = tl.load(SIN + pos * D + 2 * i, mask=i < heads * D, other=0.0)[None, :]
            # the rotation's transpose
            dne = dye * c + dyo * s
            dno = dyo * c - dye * s
            x_at = X + b.to(tl.int64) * sxb + pos.to(tl.int64) * sxl + h[:, None] * sxh + 2 * i[None, :]
            xe = tl.load(x_at, mask=live, other=0.0).to(tl.float32)
            xo = tl.load(x_at + 1, mask=live, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + token * H + h, mask=h < heads, other=0.0)[:, None]
            xhe, xho = xe * rstd, xo * rstd
            wdne, wdno = we * dne, wo * dno
            dot = (tl.sum(wdne * xhe, axis=1) + tl.sum(wdno * xho, axis=1))[:, None] / D
            dx_at = DX + token.to(tl.int64) * H * D + h[:, None] * D + 2 * i[None, :]
            tl.store(dx_at, ((wdne - xhe * dot) * rstd).to(DX.dtype.element_ty), mask=live)
            tl.store(dx_at + 1, ((wdno - xho * dot) * rstd).to(DX.dtype.element_ty), mask=live)
            dwe += tl.sum(dne * xhe, axis=0)
            dwo += tl.sum(dno * xho, axis=0)
        tl.store(DW_PARTIAL + tl.program_id(0) * D + 2 * i, dwe)
        tl.store(DW_PARTIAL + tl.program_id(0) * D + 2 * i + 1, dwo)

    _TOKENS_PER_PROGRAM = 16  # backward: fewer weight-gradient partials to sum

    def _heads(x: torch.Tensor) -> torch.Tensor:
        return x if x.stride(-1) == 1 else x.contiguous()

    @triton_op("flux_train::rms_norm_rope_fwd", mutates_args=())
    def _rms_norm_rope_fwd(
        x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, length, heads, d = x.shape
        y = torch.empty((bsz, length, heads, d), device=x.device, dtype=x.dtype)
        rstd = torch.empty((bsz * length, heads), device=x.device, dtype=torch.float32)
        wrap_triton(_fwd_kernel)[(bsz * length,)](
            x,
            weight,
            cos,
            sin,
            y,
            rstd,
            length,
            heads,
            *x.stride()[:3],
            eps,
            D=d,
            BLOCK_H=triton.next_power_of_2(heads),
        )
        return y, rstd

    @triton_op("flux_train::rms_norm_rope_bwd", mutates_args=())
    def _rms_norm_rope_bwd(
        dy: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rstd: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, length, heads, d = x.shape
        n = bsz * length
        dx = torch.empty((bsz, length, heads, d), device=x.device, dtype=x.dtype)
        programs = triton.cdiv(n, _TOKENS_PER_PROGRAM)
        partial = torch.empty((programs, d), device=x.device, dtype=torch.float32)
        wrap_triton(_bwd_kernel)[(programs,)](
            dy,
            x,
            weight,
            cos,
            sin,
            rstd,
            dx,
            partial,
            n,
            length,
            heads,
            *x.stride()[:3],
            *dy.stride()[:3],
            D=d,
            BLOCK_H=triton.next_power_of_2(heads),
            TOKENS=_TOKENS_PER_PROGRAM,
        )
        return dx, partial.sum(0).to(weight.dtype)

    def _setup_context(ctx, inputs, output):
        x, weight, cos, sin, _eps = inputs
        ctx.save_for_backward(x, weight, cos, sin, output[1])

    def _backward(ctx, dy, _drstd):
        x, weight, cos, sin, rstd = ctx.saved_tensors
        dx, dw = _rms_norm_rope_bwd(_heads(dy), x, weight, cos, sin, rstd)
        return dx, dw, None, None, None

    _rms_norm_rope_fwd.register_autograd(_backward, setup_context=_setup_context)


def rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, impl: str = "auto"
) -> torch.Tensor:
    """x [B, L, H, D] (any strides with D contiguous: the q or k slice of a qkv output), cos/sin [L, D] fp32 ->
    [B, L, H, D] contiguous. `impl`: auto (Triton on a GPU, torch elsewhere), triton, or torch."""
    use_triton = impl == "triton" or (impl == "auto" and HAVE_TRITON and x.is_cuda)
    if use_triton:
        if not kernels_run_on(x.device):
            raise RuntimeError("perf.rmsnorm=triton needs a GPU and Triton; use perf.rmsnorm=auto or torch")
        return _rms_norm_rope_fwd(_heads(x), weight, cos.contiguous(), sin.contiguous(), eps)[0]
    return rms_norm_rope_torch(x, weight, cos, sin, eps)


class RMSNorm(nn.Module):
    """RMSNorm with a learned `scale` (the reference's parameter name), applied with the RoPE rotation after it.
    eps None: the input dtype's machine epsilon."""

    def __init__(self, dim: int, eps: float | None = None, impl: str = "auto", device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.impl = impl
        self.scale = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return rms_norm_rope(x, self.scale, cos, sin, eps, self.impl)

    def extra_repr(self) -> str:
        return f"{self.scale.shape[0]}, eps={self.eps}, impl={self.impl}"
