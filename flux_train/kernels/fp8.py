"""FP8 (e4m3) linear layers for training: `FP8Linear`, `linear(...)`, and the delayed scales (`FP8Scaling`).

Recipes (`perf.fp8`):
- "delayed": one scale per tensor from the amax history of the last `perf.fp8_amax_history` steps (delayed
  scaling, as Transformer Engine's default recipe). Each operand is read once: one kernel
  (flux_train.kernels.fp8_cast) writes it in both layouts the tensor cores take and folds its amax into this
  step's maximum; after each optimizer step `FP8Scaling.update` turns every layer's maxima into the next
  step's scales in a few batched kernels, on the GPU (no host sync, so it runs inside a captured step). The
  first steps, before an operand has a history, scale it from its current amax (one more read of it, those
  steps only).
- "tensorwise": the same kernels with current scaling (one more read of each operand, for its amax).
- "rowwise": one scale per row of each GEMM operand along its contraction dim (x per token, W per output
  channel in forward; dY per token and W per input channel for dX; dY and X per column for dW), the recipe
  that keeps outlier channels from flattening everything else (torch ops).
Weights stay bf16/fp32 masters; only GEMM inputs are cast. Accumulation is fp32 in the tensor cores
(torch._scaled_mm) and outputs come in the input's dtype; the backward keeps the FP8 operands it needs, not the bf16
ones (under FSDP, `recast_weight`: the weight's are cast again from the weight gathered for the backward).
A layer given a `wgrad_sink` (a flat tensor of the weight's size and dtype: the ddp layout's gradient bucket slice)
has its tensorwise weight-gradient GEMM write there and hands autograd a view of it, so the gradient is not
copied into the bucket afterwards (flux_train.training.ddp). `gelu_forward(head, tail)` takes the input as
[head | gelu(tail)] and has the cast apply the GELU and the join as it reads (the MLPs'
second Linear and the single blocks' linear2: flux_train.model.flux.gelu_linear).
On a CPU the same quantisation is emulated with a dequantised matmul, so the recipes' numerics can be checked
anywhere. Shapes with a dimension not divisible by 16 fall back to bf16.

The e4m3 format depends on the GPU's architecture (flux_train/hardware.py's e4m3 column): OCP `float8_e4m3fn`
(max 448), or `float8_e4m3fnuz` (max 240, no negative zero) where the matrix cores reject the OCP format.
"""

from __future__ import annotations

import typing

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flux_train.hardware import device_arch, of_arch
from flux_train.kernels.fp8_cast import TINY_AMAX, cast_transpose, cast_transpose_pair
from flux_train.precision_recipes import RECIPES, Recipe

E4M3 = torch.float8_e4m3fn


def e4m3_dtype(gpu_arch: str | None) -> torch.dtype:
    """The e4m3 dtype of a GPU architecture (flux_train.hardware.device_arch; None, the CPU's emulation, or one the
    table does not hold: OCP e4m3)."""
    kind = of_arch(gpu_arch) if gpu_arch else None
    return getattr(torch, kind.e4m3) if kind else E4M3


def device_e4m3(device: torch.device) -> torch.dtype:
    return e4m3_dtype(device_arch(device) if device.type == "cuda" else None)


def scale_of(x: torch.Tensor, dim: int | None, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """fp32 scales: amax over `dim` (None = the whole tensor, a 0-dim scale) / the format's max."""
    xf = x.float().abs()
    amax = xf.amax() if dim is None else xf.amax(dim=dim, keepdim=True)
    return amax.clamp(min=TINY_AMAX) / torch.finfo(dtype).max


def cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


def quantize(x: torch.Tensor, dim: int | None, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scale) with x ~= values * scale; amax over `dim` (None = whole tensor)."""
    scale = scale_of(x, dim, dtype)
    return cast(x, scale, dtype), scale


def _column_major(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


def scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    fast_accum: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """a [M,K] row-major, b [K,N] column-major, scales [M,1]/[1,N] (or scalars) -> a @ b (+ bias) in `out_dtype`
    (bf16, or fp32 for a model computing in fp32). A bf16 output takes the bias in the GEMM's epilogue; an fp32 one
    adds it after, in fp32 (the epilogue would round it to bf16). `fast_accum`: Hopper's FP8 tensor cores accumulate
    without promoting partial sums to fp32 (faster; what Transformer Engine and torchao do in the forward, not for
    gradients)."""
    epilogue = bias.to(torch.bfloat16) if bias is not None and out_dtype == torch.bfloat16 else None
    if a.is_cuda:
        out = torch._scaled_mm(
            a,
            b,
            scale_a=a_scale.reshape(-1, 1) if a_scale.dim() else a_scale,
            scale_b=b_scale.reshape(1, -1) if b_scale.dim() else b_scale,
            bias=epilogue,
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )
    else:
        out = (a.float() * a_scale) @ (b.float() * b_scale)
        out = (out if epilogue is None else out + epilogue.float()).to(out_dtype)
    return out if bias is None or epilogue is not None else out + bias.to(out_dtype)


@torch.library.custom_op("flux_train::scaled_mm_into", mutates_args=("out",))
def scaled_mm_into(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out: torch.Tensor
) -> None:
    """`scaled_mm` with per-tensor scales, written in place into the flat `out`: an op that says it mutates
    `out`, so a compiled backward writes the GEMM's result straight there (torch._scaled_mm's out= is
    functionalised into a product and a copy)."""
    out2 = out.view(a.shape[0], b.shape[1])
    if a.is_cuda:
        torch._scaled_mm(a, b, scale_a=a_scale, scale_b=b_scale, out_dtype=out.dtype, out=out2)
    else:  # the CPU emulation, as the unsunk weight gradient computes it
        out2.copy_(scaled_mm(a, a_scale, b, b_scale))


class _TensorwiseLinear(torch.autograd.Function):
    """x2 @ weight^T + bias with one scale per tensor. `scales` [3] (x, w, dY; 0 = current scaling) are read,
    `amax` [2] (x, w) and `amax_grad` [1] (dY) raised to this call's maxima; the weight gradient is written
    into `sink` where one is given. `recast_weight`: the backward casts the weight again (at the forward's scale,
    the same bits) instead of keeping its e4m3 transpose from the forward: under FSDP the weight is gathered again
    for the backward anyway, and the kept copies were one byte per parameter of the whole model on every rank. With
    `gelu_tail` the input is [x2 | gelu(gelu_tail)], joined by the cast as it reads (FP8Linear.gelu_forward)."""

    @staticmethod
    def forward(
        ctx, x2, weight, bias, scales, amax, amax_grad, dtype, sink, recast_weight, gelu_tail
    ):  # fmt: skip
        xq, xq_t, xs, wq, wq_t, ws = cast_transpose_pair(x2, weight, scales[0:2], amax, dtype, gelu_tail=gelu_tail)
        ctx.dtype, ctx.weight_dtype, ctx.x_dtype = dtype, weight.dtype, x2.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.recast_weight = recast_weight
        # the backward's operands in the layouts it needs, in e4m3: half the bytes of the bf16 ones (and the GELU's
        # input, which its backward needs, as the unfused GELU keeps it)
        kept = (xq_t, xs, weight if recast_weight else wq_t, ws, scales, amax, amax_grad, gelu_tail)
        ctx.save_for_backward(*kept)
        ctx.sink = sink  # not saved: every write into its bucket bumps the version counter the views share
        # the output in x's dtype: an fp32 model stays fp32 after its FP8 layers (attention included)
        return scaled_mm(xq, xs, wq.t(), ws, bias, fast_accum=True, out_dtype=x2.dtype)

    @staticmethod
    def backward(ctx, dy):  # pyright: ignore[reportIncompatibleMethodOverride] - one output, one gradient
        xq_t, xs, wq_t, ws, scales, amax, amax_grad, gelu_tail = ctx.saved_tensors
        if ctx.recast_weight:  # wq_t is the weight: its transpose at the forward's scale (its maximum is already in)
            _, wq_t, _, _ = cast_transpose(wq_t, ws, amax[1:2], ctx.dtype, rows=False)
        sink = ctx.sink
        with_bias = ctx.bias_dtype is not None
        # the bias gradient (dY's column sums) comes from the same read of dY as its casts
        dyq, dyq_t, dys, dbias = cast_transpose(dy.contiguous(), scales[2], amax_grad, ctx.dtype, column_sums=with_bias)
        dx = scaled_mm(dyq, dys, wq_t.t(), ws, out_dtype=ctx.x_dtype)  # dX = dY @ W, W as [N,K] column-major
        dtail = None
        if gelu_tail is not None:  # the joined input's gradient, split: the head's, and through the GELU the tail's
            head_columns = dx.shape[1] - gelu_tail.shape[1]
            dtail = torch.ops.aten.gelu_backward(dx[:, head_columns:], gelu_tail, approximate="tanh")
            dx = dx[:, :head_columns]
        # dW = dY^T @ X, X as [M,K] column-major
        if sink is None:
            dw = scaled_mm(dyq_t, dys, xq_t.t(), xs).to(ctx.weight_dtype)
        else:  # a new view (also in a compiled graph), held by autograd alone, becomes the .grad as it is
            scaled_mm_into(dyq_t, dys, xq_t.t(), xs, sink)
            dw = sink.view(dyq_t.shape[0], xq_t.shape[0])
        dbias = dbias.to(ctx.bias_dtype) if with_bias else None
        return dx, dw, dbias, None, None, None, None, None, None, dtail


class _RowwiseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.weight_dtype, ctx.dtype = weight.dtype, dtype
        xq, xs = quantize(x2, 1, dtype)  # per token
        wq, ws = quantize(weight, 1, dtype)  # per output channel
        # rowwise backward scales run along the other axis and need the high-precision operands
        ctx.save_for_backward(x2, weight)
        return scaled_mm(xq, xs, wq.t(), ws.t(), out_dtype=x2.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # pyright: ignore[reportIncompatibleMethodOverride] - one gradient
        x2, weight = ctx.saved_tensors
        wq, ws = quantize(weight, 0, ctx.dtype)  # per input channel (over N)
        dyq, dys = quantize(dy, 1, ctx.dtype)  # per token (over N)
        dyq0, dys0 = quantize(dy, 0, ctx.dtype)  # per column, over the tokens
        xq0, xs0 = quantize(x2, 0, ctx.dtype)
        dx = scaled_mm(dyq, dys, _column_major(wq), ws, out_dtype=x2.dtype)  # dX = dY @ W
        dw = scaled_mm(dyq0.t().contiguous(), dys0.t(), _column_major(xq0), xs0)  # dY^T X
        return dx, dw.to(ctx.weight_dtype), None


class FP8Linear(nn.Linear):
    """nn.Linear whose GEMMs run in FP8 (`recipe`); same parameters, so checkpoints do not change. The
    tensorwise recipes read their scales from `fp8_scale` and write this step's maxima into `fp8_amax` /
    `fp8_amax_grad` (buffers made by `FP8Scaling.of`; outside a training forward, into fresh ones)."""

    recipe: Recipe  # perf.fp8's, set by convert_to_fp8
    fp8_dtype: torch.dtype = E4M3
    history: int = 16
    wgrad_sink: torch.Tensor | None = None  # flat; where the tensorwise recipes write the weight gradient (ddp sets it)
    recast_weight: bool = False  # cast the weight again in backward instead of keeping its e4m3 copy (fsdp sets it)
    gelu_in_cast: bool = False  # gelu_forward where the recipe allows (perf.fp8_gelu_in_cast)
    # buffers FP8Scaling.of registers
    fp8_scale: torch.Tensor
    fp8_amax: torch.Tensor
    fp8_amax_grad: torch.Tensor
    fp8_history: torch.Tensor

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's name for it
        x = input
        n, k = self.weight.shape
        m = x.numel() // k
        if not self._gemm_takes(m):
            return F.linear(x, self.weight, self.bias)
        x2, weight = x.reshape(m, k), self.weight.to(x.dtype)
        if self.recipe.per_row:
            y = _RowwiseLinear.apply(x2, weight, self.fp8_dtype).reshape(*x.shape[:-1], n)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        return self._tensorwise(x2, weight, None).reshape(*x.shape[:-1], n)

    def fuses_gelu(self, tail: torch.Tensor) -> bool:
        """Whether gelu_forward can take this input: a scale per tensor (the cast applies the GELU as it reads), at
        shapes the FP8 GEMMs take, where asked (gelu_in_cast)."""
        return self.gelu_in_cast and not self.recipe.per_row and self._gemm_takes(tail.numel() // tail.shape[-1])

    def gelu_forward(self, head: torch.Tensor | None, tail: torch.Tensor) -> torch.Tensor:
        """self([head | gelu(tail)]) (GELU's tanh approximation; head None: self(gelu(tail))), the GELU and the join
        done by the input's cast as it reads: the activation is never written in bf16 to be read again. Where
        fuses_gelu(tail)."""
        m, n = tail.numel() // tail.shape[-1], self.weight.shape[0]
        head2 = tail.new_empty(m, 0) if head is None else head.reshape(m, -1)
        y = self._tensorwise(head2, self.weight.to(tail.dtype), tail.reshape(m, tail.shape[-1]))
        return y.reshape(*tail.shape[:-1], n)

    def _gemm_takes(self, m: int) -> bool:
        """Whether the FP8 GEMMs take an input of `m` rows: every dimension a multiple of 16."""
        n, k = self.weight.shape
        return not (n % 16 or k % 16 or m % 16)

    def _tensorwise(self, x2: torch.Tensor, weight: torch.Tensor, gelu_tail: torch.Tensor | None) -> torch.Tensor:
        # delayed scaling records the maxima of training steps only; current scaling needs fresh maxima
        record = self.recipe.history and torch.is_grad_enabled()
        amax = self.fp8_amax if record else torch.zeros(2, device=x2.device)
        amax_grad = self.fp8_amax_grad if record else torch.zeros(1, device=x2.device)
        sink = self.wgrad_sink if self.weight.dtype == x2.dtype else None  # the gradient is the parameter's own
        return _TensorwiseLinear.apply(
            x2, weight, self.bias, self.fp8_scale, amax, amax_grad, self.fp8_dtype, sink, self.recast_weight, gelu_tail
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}, fp8={self.fp8_dtype}"


def convert_to_fp8(
    model: nn.Module, recipe: str, dtype: torch.dtype, module_filter, history: int = 16, gelu_in_cast: bool = False
) -> nn.Module:
    """Turn the Linears that `module_filter(fqn, module)` selects into FP8Linear in place (meta or real); their
    scale buffers are made by `FP8Scaling.of` once the model is on its device."""
    for fqn, module in list(model.named_modules()):
        if module_filter(fqn, module) and type(module) is nn.Linear:
            module.__class__ = FP8Linear
            fp8 = typing.cast(FP8Linear, module)
            fp8.recipe, fp8.fp8_dtype, fp8.history, fp8.gelu_in_cast = RECIPES[recipe], dtype, history, gelu_in_cast
    return model


class FP8Scaling:
    """The delayed scales of a model's FP8Linears: per layer an amax history [3, H] (x, w, dY; newest first)
    and the scales [3] the next step casts with: max(history) * 2^margin / max(e4m3), 0 while the history is
    empty (current scaling). All ranks agree on them (this step's maxima are all-reduced), so a checkpoint holds
    one copy. `overflows` counts (layer, operand) pairs whose step maximum exceeded what its scale could hold
    (those values saturated); `saturations` [layers, 3] counts, by pair, the steps whose maximum exceeded it by
    more than an e4m3 step (1/8): the overflows that lose more than the format's own rounding (not checkpointed)."""

    def __init__(self, layers: list[FP8Linear], margin: int, device: torch.device):
        self.layers, self.margin = layers, margin
        self.fmax = torch.finfo(layers[0].fp8_dtype).max
        self.histories = [m.fp8_history for m in layers]
        self.scales = [m.fp8_scale for m in layers]
        self.maxima = [m.fp8_amax for m in layers] + [m.fp8_amax_grad for m in layers]  # [2] each, then [1]
        self.overflows = torch.zeros((), dtype=torch.int64, device=device)
        self.saturations = torch.zeros(len(layers), 3, dtype=torch.int64, device=device)

    @classmethod
    def of(cls, model: nn.Module, device: torch.device, margin: int = 0) -> FP8Scaling | None:
        """Give every FP8Linear of `model` its (zeroed) scale buffers on `device`; the scaling of the delayed
        ones, or None if there are none."""
        layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
        for m in layers:
            m.register_buffer("fp8_scale", torch.zeros(3, device=device), persistent=False)
            m.register_buffer("fp8_amax", torch.zeros(2, device=device), persistent=False)
            m.register_buffer("fp8_amax_grad", torch.zeros(1, device=device), persistent=False)
            m.register_buffer("fp8_history", torch.zeros(3, m.history, device=device), persistent=False)
        delayed = [m for m in layers if m.recipe.history]
        return cls(delayed, margin, device) if delayed else None

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: this step's maxima (max over ranks) into the histories, the next scales."""
        n = len(self.layers)
        maxima = torch.cat(self.maxima)
        step = torch.cat([maxima[: 2 * n].view(n, 2), maxima[2 * n :].view(n, 1)], dim=1)  # [n, 3]: x, w, dY
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(step, op=dist.ReduceOp.MAX)
        used = torch.stack(self.scales)
        held = used * self.fmax
        overflowed = (used > 0) & (step > held)
        self.overflows += overflowed.sum()
        self.saturations += overflowed & (step > held * (1 + 2**-3))
        history = torch.cat([step[..., None], torch.stack(self.histories)[..., :-1]], dim=-1)
        torch._foreach_copy_(self.histories, list(history.unbind(0)))
        torch._foreach_copy_(self.scales, list(self._scales(history).unbind(0)))
        torch._foreach_zero_(self.maxima)

    def without_history(self) -> int:
        """How many (layer, operand) pairs have no maximum in their history yet (scale 0): each is cast from its
        current maximum (one more read of it: kernels/fp8_cast.py) until it has one. Reads the device (a sync)."""
        return int((torch.stack(self.scales) == 0).sum())

    def _scales(self, history: torch.Tensor) -> torch.Tensor:
        return history.amax(-1) * 2.0**self.margin / self.fmax

    @torch.no_grad()
    def reset(self) -> None:
        """No history (after warm-up steps on synthetic data): the next step scales from current maxima."""
        torch._foreach_zero_(self.histories + self.scales + self.maxima)
        self.overflows.zero_()
        self.saturations.zero_()

    def state_dict(self) -> dict:
        return {"history": torch.stack(self.histories).cpu(), "overflows": self.overflows.cpu()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        history = state["history"]
        if tuple(history.shape) != (len(self.layers), 3, self.layers[0].history):
            raise ValueError(
                f"FP8 amax history of shape {tuple(history.shape)}, this model has {len(self.layers)} delayed "
                f"layers with perf.fp8_amax_history={self.layers[0].history}"
            )
        history = history.to(self.overflows.device)
        torch._foreach_copy_(self.histories, list(history.unbind(0)))
        torch._foreach_copy_(self.scales, list(self._scales(history).unbind(0)))
        torch._foreach_zero_(self.maxima)
        self.overflows.copy_(state["overflows"])
