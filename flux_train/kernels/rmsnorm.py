"""RMSNorm over the last dim with fp32 math and a learned scale: the Q/K norms of Flux (dim 128). Its eps is, as
torch's `nn.RMSNorm` built without one (the reference's), the machine epsilon of the op-math type: float32's 2^-23
for bf16, fp16 and fp32 inputs, float64's for float64 (`default_eps`). Not the input dtype's: bf16's 2^-7 would be
65,536 times larger and shrink small q/k rows.

`rms_norm(x, weight, eps)` runs the Triton forward/backward kernels on a GPU when Triton is importable and
`impl` allows it, otherwise the torch expression below (also the CPU path and the test reference).
The Triton path is a `torch.library.triton_op`, so torch.compile traces it and CUDA graphs capture it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.library import triton_op, wrap_triton  # plain torch: importable without Triton

from flux_train.kernels.triton_support import HAVE_TRITON, kernels_run_on, tl, triton


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The op-math type torch computes a norm of `dtype` in: fp32 for bf16/fp16/fp32, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def default_eps(dtype: torch.dtype) -> float:
    """torch's eps for an RMSNorm built without one: its op-math type's machine epsilon (2^-23 for bf16 inputs)."""
    return torch.finfo(math_dtype(dtype)).eps


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    compute = math_dtype(x.dtype)
    xf = x.to(compute)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(compute)
    return y.to(x.dtype)


if HAVE_TRITON:

    @triton.jit
    def _rmsnorm_fwd_kernel(X, W, Y, RSTD, n_rows, eps, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_D)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
        offs = rows[:, None].to(tl.int64) * D + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        y = x * rstd[:, None] * w[None, :]
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=rows < n_rows)

    @triton.jit
    def _rmsnorm_bwd_kernel(
        DY,
        X,
        W,
        RSTD,
        DX,
        DW_PARTIAL,
        n_rows,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        ROWS: tl.constexpr,
        TILES: tl.constexpr,
    ):
        # each program walks TILES tiles of ROWS rows and keeps one fp32 partial of dW
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for t in range(TILES):
            rows = (pid * TILES + t) * ROWS + tl.arange(0, ROWS)
            mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
            offs = rows[:, None].to(tl.int64) * D + cols[None, :]
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
            xhat = x * rstd[:, None]
            wdy = w[None, :] * dy
            c = tl.sum(wdy * xhat, axis=1) / D
            dx = (wdy - xhat * c[:, None]) * rstd[:, None]
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * xhat, axis=0)
        tl.store(DW_PARTIAL + pid * BLOCK_D + cols, dw, mask=cols < D)

    def _launch_shape(d: int) -> tuple[int, int]:
        block_d = triton.next_power_of_2(d)
        rows = max(1, min(64, 8192 // block_d))
        return block_d, rows

    @triton_op("flux_train::rmsnorm_fwd", mutates_args=())
    def _rmsnorm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        d = x.shape[-1]
        x2 = x.reshape(-1, d)
        n = x2.shape[0]
        y = torch.empty_like(x2)
        rstd = torch.empty(n, device=x.device, dtype=torch.float32)
        block_d, rows = _launch_shape(d)
        wrap_triton(_rmsnorm_fwd_kernel)[(triton.cdiv(n, rows),)](
            x2, weight, y, rstd, n, eps, D=d, BLOCK_D=block_d, ROWS=rows
        )
        return y.view(x.shape), rstd

    @triton_op("flux_train::rmsnorm_bwd", mutates_args=())
    def _rmsnorm_bwd(
        dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d = x.shape[-1]
        x2 = x.reshape(-1, d)
        dy2 = dy.reshape(-1, d)
        n = x2.shape[0]
        dx = torch.empty_like(x2)
        block_d, rows = _launch_shape(d)
        tiles = 8
        programs = triton.cdiv(n, rows * tiles)
        partial = torch.empty(programs, block_d, device=x.device, dtype=torch.float32)
        wrap_triton(_rmsnorm_bwd_kernel)[(programs,)](
            dy2, x2, weight, rstd, dx, partial, n, D=d, BLOCK_D=block_d, ROWS=rows, TILES=tiles
        )
        dw = partial[:, :d].sum(0).to(weight.dtype)
        return dx.view(x.shape), dw

    def _setup_context(ctx, inputs, output):
        x, weight, _eps = inputs
        ctx.save_for_backward(x, weight, output[1])

    def _backward(ctx, dy, _drstd):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _rmsnorm_bwd(dy.contiguous(), x, weight, rstd)
        return dx, dw, None

    _rmsnorm_fwd.register_autograd(_backward, setup_context=_setup_context)  # pyright: ignore[reportFunctionMemberAccess] - a CustomOpDef


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str = "auto") -> torch.Tensor:
    """`impl`: auto (Triton on a GPU, torch elsewhere), triton, or torch."""
    use_triton = impl == "triton" or (impl == "auto" and HAVE_TRITON and x.is_cuda)
    if use_triton:
        if not kernels_run_on(x.device):
            raise RuntimeError("perf.rmsnorm=triton needs a GPU and Triton; use perf.rmsnorm=auto or torch")
        return _rmsnorm_fwd(x.contiguous(), weight, eps)[0]
    return rms_norm_torch(x, weight, eps)


class RMSNorm(nn.Module):
    """RMSNorm with a learned `scale` (the reference's parameter name)."""

    def __init__(self, dim: int, eps: float | None = None, impl: str = "auto", device=None, dtype=None):
        super().__init__()
        self.eps = eps  # None: torch's default, the op-math type's machine epsilon (default_eps)
        self.impl = impl
        self.scale = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = default_eps(x.dtype) if self.eps is None else self.eps
        return rms_norm(x, self.scale, eps, self.impl)

    def extra_repr(self) -> str:
        return f"{self.scale.shape[0]}, eps={self.eps}, impl={self.impl}"
