"""FP8 (e4m3) linear layers for training, with dynamic scaling: `FP8Linear`, `linear(x, weight, bias, recipe)`.

recipe "rowwise": one scale per row of each GEMM operand along its contraction dim (x per token, W per output
channel in forward; dY per token and W per input channel for dX; dY and X per column for dW), the recipe that
keeps Flux's outlier channels from flattening everything else. "tensorwise": one scale per tensor.
Weights stay bf16/fp32 masters; only GEMM inputs are cast, per call. Accumulation is fp32 in the tensor cores
(torch._scaled_mm) and outputs are bf16. On a CPU the same quantisation is emulated with a dequantised matmul,
so the recipe's numerics can be checked anywhere. Shapes with a dimension not divisible by 16 fall back to bf16.

The e4m3 format depends on the GPU: OCP `float8_e4m3fn` (max 448) on NVIDIA Hopper/Blackwell and AMD gfx950
(MI355X), `float8_e4m3fnuz` (max 240, no negative zero) on AMD gfx942 (MI300X/MI325X), whose matrix cores
reject the OCP format.

FP8 tensor cores take both operands K-major, so every operand is needed in two layouts (X and W^T forward, dY
and W for dX, dY^T and X^T for dW). Tensorwise, each operand is cast once into both: `cast_transpose` (one
Triton kernel on a GPU: reads each high-precision tile, the second time from L2, and writes the e4m3 tile and
its transpose) after an
amax pass that torch.compile fuses into the operand's producer. A 1-byte transpose as a separate copy reads
and writes with the wrong stride on one side and ran far below the memory rate on an H200.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flux_train.kernels.triton_support import HAVE_TRITON, kernels_run_on, tl, triton

if HAVE_TRITON:
    from torch.library import triton_op, wrap_triton

E4M3 = torch.float8_e4m3fn


def e4m3_dtype(gpu_arch: str | None) -> torch.dtype:
    """The e4m3 dtype for a GPU architecture name (torch.cuda.get_device_properties().gcnArchName on ROCm;
    None or any NVIDIA/CPU name: OCP e4m3)."""
    if gpu_arch and gpu_arch.split(":")[0] == "gfx942":
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def device_e4m3(device: torch.device) -> torch.dtype:
    if device.type == "cuda" and torch.version.hip:
        return e4m3_dtype(torch.cuda.get_device_properties(device).gcnArchName)
    return e4m3_dtype(None)


def scale_of(x: torch.Tensor, dim: int | None, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """fp32 scales: amax over `dim` (None = the whole tensor, a 0-dim scale) / the format's max."""
    xf = x.float().abs()
    amax = xf.amax() if dim is None else xf.amax(dim=dim, keepdim=True)
    return amax.clamp(min=1e-12) / torch.finfo(dtype).max


def cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


def quantize(x: torch.Tensor, dim: int | None, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scale) with x ~= values * scale; amax over `dim` (None = whole tensor)."""
    scale = scale_of(x, dim, dtype)
    return cast(x, scale, dtype), scale


def cast_transpose_torch(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(`cast(x)`, the same transposed and row-major) for a 2-D x."""
    q = cast(x, scale, dtype)
    return q, q.t().contiguous()


if HAVE_TRITON:

    @triton.jit
    def _cast_transpose_kernel(X, Q, QT, SCALE, M, N, fmax, BM: tl.constexpr, BN: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        scale = tl.load(SCALE)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(X + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -fmax, fmax).to(Q.dtype.element_ty)
        tl.store(Q + rows[:, None].to(tl.int64) * N + cols[None, :], q, mask=mask)
        # the transpose: the same tile read again along the other axis (from L2), written along QT's rows
        mask_t = (cols[:, None] < N) & (rows[None, :] < M)
        xt = tl.load(X + rows[None, :].to(tl.int64) * N + cols[:, None], mask=mask_t, other=0.0).to(tl.float32)
        qt = tl.clamp(tl.math.div_rn(xt, scale), -fmax, fmax).to(QT.dtype.element_ty)
        tl.store(QT + cols[:, None].to(tl.int64) * M + rows[None, :], qt, mask=mask_t)

    @triton_op("flux_train::fp8_cast_transpose", mutates_args=())
    def _cast_transpose(
        x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, storage: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m, n = x.shape
        q = torch.empty(m, n, device=x.device, dtype=storage)
        qt = torch.empty(n, m, device=x.device, dtype=storage)
        block = 64
        wrap_triton(_cast_transpose_kernel)[(triton.cdiv(m, block), triton.cdiv(n, block))](
            x, q, qt, scale, m, n, torch.finfo(dtype).max, BM=block, BN=block
        )
        return q, qt


def cast_transpose_triton(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, storage: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel; `storage` other than `dtype` writes the clamped values unconverted (fp32), which is how
    the tests check it under Triton's CPU interpreter, whose e4m3 conversion is not faithful."""
    if not kernels_run_on(x.device):
        raise RuntimeError(f"the Triton cast kernel cannot run on {x.device} here (no Triton, or no GPU)")
    return _cast_transpose(x.contiguous(), scale, dtype, storage or dtype)


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M,K] -> (e4m3 x / scale [M,K], its transpose [K,M]), both row-major: one kernel on a GPU."""
    impl = cast_transpose_triton if HAVE_TRITON and x.is_cuda else cast_transpose_torch
    return impl(x, scale, dtype)


def _column_major(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """a [M,K] row-major, b [K,N] column-major, scales [M,1]/[1,N] (or scalars) -> bf16 a @ b."""
    if a.is_cuda:
        return torch._scaled_mm(
            a,
            b,
            scale_a=a_scale.reshape(-1, 1) if a_scale.dim() else a_scale,
            scale_b=b_scale.reshape(1, -1) if b_scale.dim() else b_scale,
            out_dtype=torch.bfloat16,
        )
    return ((a.float() * a_scale) @ (b.float() * b_scale)).to(torch.bfloat16)


def _dims(recipe: str, dim: int) -> int | None:
    return dim if recipe == "rowwise" else None


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2: torch.Tensor, weight: torch.Tensor, recipe: str, dtype: torch.dtype) -> torch.Tensor:
        ctx.recipe, ctx.weight_dtype, ctx.dtype = recipe, weight.dtype, dtype
        if recipe == "tensorwise":
            # the scales serve the backward GEMMs too: cast each operand once into both layouts and keep the
            # transposes the backward needs (e4m3: half the bytes of the high-precision operands)
            xs, ws = scale_of(x2, None, dtype), scale_of(weight, None, dtype)
            xq, xq_t = cast_transpose(x2, xs, dtype)
            wq, wq_t = cast_transpose(weight, ws, dtype)
            ctx.save_for_backward(xq_t, xs, wq_t, ws)
            return scaled_mm(xq, xs, wq.t(), ws)
        # rowwise backward scales run along the other axis and need the high-precision operands
        xq, xs = quantize(x2, 1, dtype)  # per token
        wq, ws = quantize(weight, 1, dtype)  # per output channel
        ctx.save_for_backward(x2, weight)
        return scaled_mm(xq, xs, wq.t(), ws.t())

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if ctx.recipe == "tensorwise":
            xq_t, xs, wq_t, ws = ctx.saved_tensors
            dys = scale_of(dy, None, ctx.dtype)
            dyq, dyq_t = cast_transpose(dy, dys, ctx.dtype)
            dx = scaled_mm(dyq, dys, wq_t.t(), ws)  # dX = dY @ W, W as [N,K] column-major
            dw = scaled_mm(dyq_t, dys, xq_t.t(), xs)  # dW = dY^T @ X, X as [M,K] column-major
            return dx, dw.to(ctx.weight_dtype), None, None
        x2, weight = ctx.saved_tensors
        wq, ws = quantize(weight, 0, ctx.dtype)  # per input channel (over N)
        dyq, dys = quantize(dy, 1, ctx.dtype)  # per token (over N)
        dyq0, dys0 = quantize(dy, 0, ctx.dtype)  # per column, over the tokens
        xq0, xs0 = quantize(x2, 0, ctx.dtype)
        dx = scaled_mm(dyq, dys, _column_major(wq), ws)  # dX = dY @ W
        dw = scaled_mm(dyq0.t().contiguous(), dys0.t(), _column_major(xq0), xs0)  # dY^T X
        return dx, dw.to(ctx.weight_dtype), None, None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str = "none", dtype: torch.dtype = E4M3
) -> torch.Tensor:
    """F.linear, in FP8 when `recipe` names one and the shapes allow it."""
    n, k = weight.shape
    m = x.numel() // k
    if recipe == "none" or n % 16 or k % 16 or m % 16:
        return F.linear(x, weight, bias)
    y = _FP8Linear.apply(x.reshape(m, k), weight.to(x.dtype), recipe, dtype).reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias.to(y.dtype)


class FP8Linear(nn.Linear):
    """nn.Linear whose GEMMs run in FP8 (`recipe`); same parameters, so checkpoints do not change."""

    recipe: str = "tensorwise"
    fp8_dtype: torch.dtype = E4M3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.recipe, self.fp8_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}, fp8={self.fp8_dtype}"


def convert_to_fp8(model: nn.Module, recipe: str, dtype: torch.dtype, module_filter) -> nn.Module:
    """Turn the Linears that `module_filter(fqn, module)` selects into FP8Linear in place (meta or real)."""
    for fqn, module in list(model.named_modules()):
        if module_filter(fqn, module) and type(module) is nn.Linear:
            module.__class__ = FP8Linear
            module.recipe, module.fp8_dtype = recipe, dtype
    return model
