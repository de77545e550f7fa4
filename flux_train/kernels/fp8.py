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
and W for dX, dY^T and X^T for dW). Tensorwise, each operand is cast once into both (`cast_transpose`), which
torch.compile turns into one pass over the operand after an amax it fuses into the operand's producer; the
backward then finds its layouts ready instead of copying 1-byte tensors into the other layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(`cast(x)`, the same transposed and row-major) for a 2-D x: under torch.compile one kernel that reads x
    once and writes both (0.24 ms for 8192 x 12288 with its producer and amax on an H200, 1.3x the byte floor;
    a hand-written Triton kernel measured 0.86 ms)."""
    q = cast(x, scale, dtype)
    return q, q.t().contiguous()


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
