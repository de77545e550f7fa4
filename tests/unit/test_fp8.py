"""FP8 linear layers: the cast kernel (Triton's CPU interpreter) against its torch reference, the delayed scales'
history logic, the recipes' numerics (CPU emulation of the same quantisation the GPU feeds torch._scaled_mm).
An FP8 run's exact resume: tests/runs/test_checkpoint.py."""

import pytest
import torch
from torch import nn

from flux_train.config import ModelConfig, ParallelConfig, PerfConfig
from flux_train.kernels.fp8 import FP8Linear, FP8Scaling, convert_to_fp8, e4m3_dtype, quantize
from flux_train.kernels.fp8_cast import cast_transpose_torch

TINY = ModelConfig(  # two blocks of a width FP8 takes (multiples of 16)
    flavor="t",
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    axes_dims_rope=[4, 6, 6],
)
E4M3 = torch.float8_e4m3fn
# the cast kernel runs on the GPU where there is one, else in Triton's CPU interpreter (conftest)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "arch,dtype",
    [
        (None, torch.float8_e4m3fn),  # NVIDIA (and the CPU emulation)
        ("gfx942:sramecc+:xnack-", torch.float8_e4m3fnuz),  # MI300X / MI325X: the fnuz formats only
        ("gfx942", torch.float8_e4m3fnuz),
        ("gfx950:sramecc+:xnack-", torch.float8_e4m3fn),  # MI355X: OCP formats
        ("gfx90a", torch.float8_e4m3fn),
    ],
)
def test_e4m3_format_follows_the_gpu(arch, dtype):
    assert e4m3_dtype(arch) == dtype


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("dim", [None, 0, 1])
def test_quantize_round_trip_within_e4m3_precision(dim, fp8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g) * torch.logspace(-3, 3, 48)  # outlier columns
    q, scale = quantize(x, dim, fp8)
    assert q.dtype == fp8
    assert q.float().abs().max() <= torch.finfo(fp8).max  # 448 (fn) or 240 (fnuz)
    back = q.float() * scale
    # 3 mantissa bits: relative rounding error <= 2^-4 for values in the normal range of their scale group
    normal = x.abs() >= scale * 2**-6
    assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-12)[normal].all()


# ------------------------------------------------------------------------------------------ the cast kernel


# whole tiles, ragged edges, one column tile, more tiles (15) than the second kernel's programs (4 on the CPU)
@pytest.mark.parametrize("shape", [(64, 128), (100, 200), (192, 48), (320, 300)])
@pytest.mark.parametrize("history_scale", [0.0, 0.004])  # current scaling / a delayed scale (some values saturate)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_cast_kernel_matches_its_torch_reference(shape, history_scale, fp8):
    """The Triton kernel scales, clamps, transposes, takes the amax and the column sums (a bias gradient) as the
    torch reference does, with a history and without one (the tensor's amax first, every tile cast after it).
    Triton's interpreter does not convert to e4m3 faithfully (127.9 -> 64), so the kernel writes its values in
    fp32 here, before the conversion; tests/gpu/test_gpu.py compares the e4m3 bits on a GPU."""
    from flux_train.kernels.fp8_cast import _cast_transpose_triton

    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 2).bfloat16()
    x[3, 5] = -11.0  # the amax, negative
    scale = torch.tensor(history_scale)
    prior = torch.tensor([1.5])  # an earlier call's maximum (a previous micro-batch): kept if larger
    amax_k, amax_t = prior.to(DEVICE), prior.clone()
    fmax = torch.finfo(fp8).max
    q, qt, s, sums = (
        t.cpu()
        for t in _cast_transpose_triton(x.to(DEVICE), scale.to(DEVICE), amax_k, torch.float32, fmax, True, True, True)
    )
    want_s = history_scale if history_scale else 11.0 / fmax
    assert s.item() == pytest.approx(want_s, rel=1e-7)
    assert amax_k.item() == 11.0
    ref = (x.float() * (1.0 / s)).clamp(-fmax, fmax)
    assert torch.equal(q, ref) and torch.equal(qt, ref.t())
    assert torch.allclose(sums, x.double().sum(0).float(), rtol=1e-5, atol=1e-4)
    # the torch path (CPU training) agrees on amax and scale, and its e4m3 values are the reference's rounded
    q8, qt8, s8, sums8 = cast_transpose_torch(x, scale, amax_t, fp8, column_sums=True)
    assert amax_t.item() == 11.0 and s8.item() == s.item()
    assert torch.equal(q8.float(), ref.to(fp8).float()) and torch.equal(qt8, q8.t())
    assert torch.allclose(sums8, sums, rtol=1e-5, atol=1e-4)
    if history_scale:
        assert (q.abs() == fmax).any()  # saturated, not wrapped or NaN


@pytest.mark.parametrize("scales", [(0.0, 0.004), (0.003, 0.0), (0.0, 0.0)])  # current and delayed, either way round
def test_cast_pair_kernel_casts_each_operand_as_the_single_kernel_does(scales):
    """x and W of one GEMM cast in the same launches (ragged tiles, more rows in either) give each operand the values,
    both layouts, scale and amax that a launch of its own gives, and the torch path agrees."""
    from flux_train.kernels.fp8_cast import _cast_transpose_pair_triton, _cast_transpose_triton, cast_transpose_pair

    g = torch.Generator().manual_seed(1)
    for rows in ((100, 48), (40, 130)):
        x, w = ((torch.randn(r, 200, generator=g) * 3).bfloat16() for r in rows)
        w[2, 7] = 9.0
        prior = torch.tensor([1.5, 20.0])  # an earlier call's maxima: x's raised, w's kept
        amax_pair = prior.to(DEVICE)
        scale_t = torch.tensor(scales)
        pair = _cast_transpose_pair_triton(
            x.to(DEVICE), w.to(DEVICE), scale_t.to(DEVICE), amax_pair, torch.float32, 448.0
        )
        xq, xq_t, xs, wq, wq_t, ws = (t.cpu() for t in pair)
        singles = []
        for i, t in enumerate((x, w)):
            amax = prior[i : i + 1].to(DEVICE)
            q, qt, s, _ = _cast_transpose_triton(
                t.to(DEVICE), scale_t[i].to(DEVICE), amax, torch.float32, 448.0, True, False, True
            )
            singles.append((q.cpu(), qt.cpu(), s.cpu(), amax.cpu()))
        assert torch.equal(xq, singles[0][0]) and torch.equal(xq_t, singles[0][1])
        assert torch.equal(wq, singles[1][0]) and torch.equal(wq_t, singles[1][1])
        assert torch.equal(xs, singles[0][2]) and torch.equal(ws, singles[1][2])
        assert torch.equal(amax_pair.cpu(), torch.cat([singles[0][3], singles[1][3]]))
        assert amax_pair[0].item() == x.float().abs().max().item() and amax_pair[1].item() == 20.0
        amax_t = prior.clone()
        tq = cast_transpose_pair(x, w, scale_t, amax_t, E4M3, impl="torch")
        assert torch.equal(tq[2], xs) and torch.equal(tq[5], ws) and torch.equal(amax_t, amax_pair.cpu())
        assert torch.equal(tq[3].float(), wq.to(E4M3).float()) and torch.equal(tq[1], tq[0].t())


# (rows, head columns, tail columns, W's rows): an MLP's output projection (no head) / a single block's linear2;
# the kernel's tiles (64 x 128) of the tail alone, across the join, of the head alone; ragged, and whole tiles
# (the kernel's path without bounds checks, which every Flux operand takes)
@pytest.mark.parametrize(
    "shape",
    [
        (100, 0, 160, 48),
        (100, 48, 160, 48),
        (100, 160, 160, 48),
        (128, 0, 256, 64),
        (128, 64, 192, 64),
        (128, 128, 256, 64),
    ],
)
@pytest.mark.parametrize("scales", [(0.0, 0.0), (0.05, 0.004)])  # no history (the amax first) / delayed
def test_cast_pair_kernel_applies_the_gelu_as_it_reads_bit_for_bit_as_torchs_gelu_then_the_cast(shape, scales):
    """The first operand given as [head | gelu(tail)] (tail a view whose rows are apart, as linear1's split leaves
    the MLP's input): the kernel applies torch's GELU as it reads, and its e4m3 values in both layouts, scale and
    amax are those of torch's GELU, the concatenation, then the same kernel: bit for bit, W's too."""
    from flux_train.kernels.fp8_cast import _cast_transpose_pair_triton, cast_transpose_pair, gelu_tanh_joined

    rows, head_columns, tail_columns, w_rows = shape
    g = torch.Generator().manual_seed(head_columns)
    wide = (torch.randn(rows, 400, generator=g) * 3).bfloat16()  # tails from -13 to 13: GELU's whole range
    head, tail = wide[:, 400 - head_columns :].contiguous(), wide[:, 40 : 40 + tail_columns]
    w = (torch.randn(w_rows, head_columns + tail_columns, generator=g)).bfloat16()
    x = gelu_tanh_joined(head, tail)
    results = []
    for first, gelu_tail in ((x, None), (head, tail)):
        amax = torch.tensor([1.5, 0.5], device=DEVICE)
        out = _cast_transpose_pair_triton(
            first.to(DEVICE), w.to(DEVICE), torch.tensor(scales, device=DEVICE), amax, torch.float32,
            448.0, None if gelu_tail is None else gelu_tail.to(DEVICE),
        )  # fmt: skip
        results.append([t.cpu() for t in out] + [amax.cpu()])
    (xq, xq_t, xs, wq, wq_t, ws, amax), fused = results
    bits = lambda t: t.to(E4M3).view(torch.uint8)  # noqa: E731 - the GPU's conversion of the kernel's fp32 values
    assert torch.equal(bits(fused[0]), bits(xq)) and torch.equal(bits(fused[1]), bits(xq_t))
    assert torch.equal(fused[2], xs) and torch.equal(fused[6], amax) and amax[0] == x.float().abs().max()
    assert all(torch.equal(a, b) for a, b in zip(fused[3:6], (wq, wq_t, ws)))
    # the torch path (CPU training) joins as the reference does
    tq = cast_transpose_pair(head, w, torch.tensor(scales), torch.tensor([1.5, 0.5]), E4M3, "torch", gelu_tail=tail)
    assert torch.equal(tq[2], xs) and torch.equal(bits(tq[0].float()), bits(xq))


def test_cast_pair_kernel_keeps_an_fp32_gelu_in_fp32():
    """An fp32 model's GELU output is not rounded to bf16 by the kernel that applies it (only a bf16 one is, as
    torch's bf16 GELU rounds): its values are torch's fp32 GELU's to fp32 precision (a bf16 rounding is 2^-9)."""
    from flux_train.kernels.fp8_cast import _cast_transpose_pair_triton

    g = torch.Generator().manual_seed(7)
    tail, w = torch.randn(64, 160, generator=g) * 3, torch.randn(32, 160, generator=g)
    amax, scales = torch.zeros(2, device=DEVICE), torch.tensor([1.0, 1.0], device=DEVICE)  # q = x: the values
    out = _cast_transpose_pair_triton(
        tail.new_empty(64, 0).to(DEVICE), w.to(DEVICE), scales, amax, torch.float32, 448.0, tail.to(DEVICE)
    )
    want = torch.nn.functional.gelu(tail, approximate="tanh")
    assert torch.allclose(out[0].cpu(), want, rtol=2**-20, atol=2**-20)


@pytest.mark.parametrize("history", [0.0, 0.01])
def test_cast_kernel_writes_only_the_transpose_when_asked(history):
    """The backward's cast of a weight gathered again (FP8Linear.recast_weight) writes only the transposed layout,
    with the same values, scale and amax as the full cast."""
    from flux_train.kernels.fp8_cast import _cast_transpose_triton

    x = torch.randn(100, 200) * 3
    both, one = (
        [t.cpu() for t in _cast_transpose_triton(
            x.to(DEVICE), torch.tensor(history, device=DEVICE), torch.zeros(1, device=DEVICE), torch.float32, 448.0,
            True, False, rows,
        )]
        for rows in (True, False)
    )  # fmt: skip
    assert one[0].numel() == 0 and torch.equal(one[1], both[1]) and torch.equal(one[2], both[2])


def test_cast_kernel_keeps_nan_and_casts_zeros_to_zeros():
    """A non-finite operand stays visible (the run's NaN check must see it); an all-zero gradient (the gates are
    zero at init) casts to zeros with a finite scale."""
    from flux_train.kernels.fp8_cast import _cast_transpose_triton

    def cast(x, history):
        out = _cast_transpose_triton(
            x.to(DEVICE),
            torch.tensor(history, device=DEVICE),
            torch.zeros(1, device=DEVICE),
            torch.float32,
            448.0,
            True,
            False,
            True,
        )
        return [t.cpu() for t in out[:3]]

    x = torch.ones(32, 64, dtype=torch.bfloat16)
    x[7, 9] = float("nan")
    q, _, _ = cast(x, 0.01)
    assert q[7, 9].isnan() and torch.isfinite(q[~q.isnan()]).all()
    q, qt, s = cast(torch.zeros(32, 64, dtype=torch.bfloat16), 0.0)
    assert torch.isfinite(s) and s > 0 and not q.any() and not qt.any()


# ------------------------------------------------------------------------------------------ delayed scales


def fp8_layers(recipe="delayed", history=3, margin=0, n=2):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(n)])
    convert_to_fp8(model, recipe, E4M3, lambda fqn, m: isinstance(m, nn.Linear), history)
    return model, FP8Scaling.of(model, torch.device("cpu"), margin)


def train_step(model, scaling, x_scale: float, dy_scale: float = 1.0):
    x = (torch.randn(32, 64) * x_scale).bfloat16().requires_grad_()
    y = model(x)
    y.backward(torch.randn_like(y) * dy_scale)
    scaling.update()


def test_delayed_scales_come_from_the_amax_history():
    """First step: current scaling; then scale = max of the last H steps' maxima / max(e4m3), the newest first in
    the history, a maximum dropping out after H steps; the step's maxima start again from zero."""
    model, scaling = fp8_layers(history=3)
    first = model[0]
    fmax = torch.finfo(E4M3).max
    assert not first.fp8_scale.any()  # no history: the first step scales from current maxima
    seen = []
    for step, x_scale in enumerate([8.0, 1.0, 1.0, 1.0]):
        x = (torch.randn(32, 64) * x_scale).bfloat16()
        seen.append(x.float().abs().max().item())
        y = model(x.requires_grad_())
        assert first.fp8_amax[0].item() == seen[-1]  # this step's maximum of x, taken by the cast
        y.backward(torch.randn_like(y))
        scaling.update()
        assert first.fp8_history[0, 0].item() == seen[-1]  # newest first
        window = seen[-3:]
        assert first.fp8_scale[0].item() == pytest.approx(max(window) / fmax, rel=1e-6), step
        assert not first.fp8_amax.any() and not first.fp8_amax_grad.any()
    assert first.fp8_scale[0].item() < 8.0 / fmax / 2  # the step-0 outlier has left the 3-step window
    w_amax = first.weight.detach().bfloat16().float().abs().max().item()
    assert first.fp8_scale[1].item() == pytest.approx(w_amax / fmax, rel=1e-6)
    assert first.fp8_scale[2].item() > 0  # dY's scale, from the backward's maxima


def test_operands_without_history_are_counted_until_a_maximum_enters_and_again_once_it_leaves():
    """What the bench's step rows wait on before timing: an operand whose history holds only zeros (no step yet,
    or a gradient held at zero, as behind the zero-initialised gates) is cast alone from its current maximum."""
    model, scaling = fp8_layers(history=3)
    assert scaling.without_history() == 6  # 2 layers x (x, w, dY)
    train_step(model, scaling, 1.0, dy_scale=0.0)
    assert scaling.without_history() == 2  # the output gradients were zero
    train_step(model, scaling, 1.0)
    assert scaling.without_history() == 0
    for _ in range(3):
        train_step(model, scaling, 1.0, dy_scale=0.0)
    assert scaling.without_history() == 2  # the last non-zero gradient has left the 3-step window


def test_margin_and_overflow_count():
    model, scaling = fp8_layers(history=2, margin=1)
    train_step(model, scaling, 1.0)
    fmax = torch.finfo(E4M3).max
    assert model[0].fp8_scale[0].item() == pytest.approx(2 * model[0].fp8_history[0, 0].item() / fmax, rel=1e-6)
    assert scaling.overflows.item() == 0  # the first step scales from current maxima: nothing can saturate
    train_step(model, scaling, 1.0)
    assert scaling.overflows.item() == 0  # same magnitudes, 2x headroom
    train_step(model, scaling, 10.0)  # x of the first layer jumps 10x: beyond 2x headroom
    assert scaling.overflows.item() >= 1
    before = scaling.overflows.item()
    train_step(model, scaling, 10.0)  # the history has caught up
    assert scaling.overflows.item() - before == 0


def test_forwards_outside_training_record_no_maxima():
    model, scaling = fp8_layers()
    with torch.no_grad():
        model(torch.randn(32, 64).bfloat16() * 100)
    assert not model[0].fp8_amax.any()


def test_scaling_state_round_trips_and_resets():
    model, scaling = fp8_layers(history=4)
    for x_scale in (1.0, 3.0, 2.0):
        train_step(model, scaling, x_scale)
    state = scaling.state_dict()
    other, other_scaling = fp8_layers(history=4)
    other_scaling.load_state_dict(state)
    assert torch.equal(other[1].fp8_scale, model[1].fp8_scale)
    assert torch.equal(other[1].fp8_history, model[1].fp8_history)
    with pytest.raises(ValueError, match="perf.fp8_amax_history=5"):
        fp8_layers(history=5)[1].load_state_dict(state)
    scaling.reset()
    assert not any(m.fp8_history.any() or m.fp8_scale.any() for m in model)


# ------------------------------------------------------------------------------------------ recipes


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "delayed"])
def test_fp8_linear_forward_and_grads_track_full_precision(recipe):
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(64, 96)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 64, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(96, generator=g))
    ref = nn.Linear(64, 96)
    ref.load_state_dict(lin.state_dict())
    convert_to_fp8(lin, recipe, E4M3, lambda fqn, m: True)
    scaling = FP8Scaling.of(lin, torch.device("cpu"))
    for step in range(3):  # delayed: the first step scales from current maxima, the next from the history
        x = torch.randn(4, 32, 64, generator=g).bfloat16().requires_grad_()
        dy = torch.randn(4, 32, 96, generator=g).bfloat16()
        y = lin(x)
        y.backward(dy)
        x_ref = x.detach().float().requires_grad_()
        y_ref = ref(x_ref)
        y_ref.backward(dy.float())

        def rel(a, want):
            return ((a.float() - want).norm() / want.norm()).item()

        assert y.dtype == torch.bfloat16 and lin.weight.grad.dtype == torch.float32
        assert rel(y, y_ref) < 0.05, step
        for got, want in ((x.grad, x_ref.grad), (lin.weight.grad, ref.weight.grad), (lin.bias.grad, ref.bias.grad)):
            assert rel(got, want) < 0.06, step
        for p in (*lin.parameters(), *ref.parameters()):
            p.grad = None
        if scaling is not None:
            scaling.update()


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_casting_its_weight_again_in_backward_computes_the_same(recipe, dtype):
    """FSDP's FP8 layers cast the weight again in the backward (recast_weight) instead of keeping its e4m3 copy: the
    same bits, so the same output and gradients, over steps with and without a history; the output and the input
    gradient come in the input's dtype (an fp32 model stays fp32 past its FP8 layers)."""
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(96, 64, generator=g) * 0.05, torch.randn(96, generator=g)
    batches = [(torch.randn(4, 32, 64, generator=g).to(dtype), torch.randn(4, 32, 96, generator=g)) for _ in range(3)]
    grads = {}
    for recast in (False, True):
        lin = nn.Linear(64, 96).to(dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
            lin.bias.copy_(b)
        convert_to_fp8(lin, recipe, E4M3, lambda fqn, m: True)
        lin.recast_weight = recast
        scaling = FP8Scaling.of(lin, torch.device("cpu"))
        grads[recast] = []
        for x, dy in batches:
            x = x.clone().requires_grad_()
            y = lin(x)
            y.backward(dy.to(y.dtype))
            assert y.dtype == x.grad.dtype == dtype
            grads[recast] += [y.detach(), x.grad, lin.weight.grad, lin.bias.grad]
            lin.weight.grad = lin.bias.grad = None
            if scaling is not None:
                scaling.update()
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))


@pytest.mark.parametrize("head_columns", [0, 32])  # an MLP's output projection / a single block's linear2
def test_fp8_linear_applying_the_gelu_as_it_casts_computes_what_the_gelu_then_the_layer_does(head_columns):
    """gelu_forward(head, tail) (the GELU and the join done by the input's cast, the tail a view whose rows are
    apart) gives the output, the gradients of head, tail, weight and bias, and the maxima the layer gives
    [head | gelu(tail)] computed first: bit for bit, over steps without and with a history (on a GPU where there is
    one: the Triton kernels, else the CPU's torch path)."""
    from flux_train.kernels.fp8_cast import gelu_tanh_joined

    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, head_columns + 64, generator=g) * 0.05, torch.randn(96, generator=g)
    batches = [
        (
            torch.randn(4, 32, head_columns, generator=g),
            torch.randn(4, 32, 100, generator=g) * 3,
            torch.randn(4, 32, 96, generator=g),
        )
        for _ in range(3)
    ]
    seen = {}
    for fused in (False, True):
        lin = nn.Linear(head_columns + 64, 96).to(DEVICE, torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(w)
            lin.bias.copy_(b)
        convert_to_fp8(lin, "delayed", E4M3, lambda fqn, m: True, gelu_in_cast=True)
        scaling = FP8Scaling.of(lin, torch.device(DEVICE))
        assert isinstance(lin, FP8Linear) and lin.fuses_gelu(torch.empty(4, 32, 64))
        seen[fused] = []
        for head, wide, dy in batches:
            head, wide = (t.to(DEVICE, torch.bfloat16).requires_grad_() for t in (head, wide))
            tail = wide[..., 20:84]  # rows 100 apart
            y = lin.gelu_forward(head if head_columns else None, tail) if fused else lin(gelu_tanh_joined(head, tail))
            y.backward(dy.to(y))
            seen[fused] += [y.detach(), wide.grad, lin.weight.grad, lin.bias.grad, lin.fp8_amax.clone()]
            if head_columns:
                seen[fused].append(head.grad)
            lin.weight.grad = lin.bias.grad = None
            scaling.update()
    assert all(torch.equal(a, b) for a, b in zip(seen[False], seen[True], strict=True))


@pytest.mark.parametrize("in_cast", [True, False])
def test_perf_fp8_gelu_in_cast_sends_every_gelu_through_its_layers_cast(in_cast, monkeypatch):
    """perf.fp8_gelu_in_cast: with it each MLP's and single block's GELU goes through its FP8 layer's gelu_forward;
    without it (the default) none does: the bf16 GELU first."""
    from flux_train.config import PerfConfig, load_config
    from flux_train.model.flux import build_model, init_weights
    from flux_train.training.precision import precision_for
    from tests.unit.test_model import inputs64

    cfg = load_config("configs/debug.yaml").model
    model = build_model(cfg)
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    perf = PerfConfig(fp8="delayed", fp8_gelu_in_cast=in_cast)
    precision = precision_for(perf, torch.device("cpu"))
    precision.convert(model)
    precision.attach(model)
    calls = []
    fused = FP8Linear.gelu_forward
    monkeypatch.setattr(FP8Linear, "gelu_forward", lambda *a: calls.append(1) or fused(*a))
    with torch.no_grad():
        model(**{k: v.float() for k, v in inputs64(cfg).items()})
    assert len(calls) == (2 * cfg.num_layers + cfg.num_single_layers if in_cast else 0)


@pytest.mark.parametrize("impl", ["ours", "torchao"])
def test_fp8_conversion_swaps_only_the_token_linears_and_keeps_the_weights(impl):
    """Ours and torchao's Float8Linear take the same modules (not the adaLN modulations, whose weight-gradient
    GEMM has K = batch) and leave parameter names and values as they were, so checkpoints do not change."""
    from torchao.float8.float8_linear import Float8Linear

    from flux_train.model.flux import build_model, materialize
    from flux_train.training.precision import precision_for

    model = materialize(build_model(TINY), torch.device("cpu"), seed=0)
    before = {n: p.clone() for n, p in model.named_parameters()}
    precision_for(PerfConfig(fp8="tensorwise", fp8_impl=impl), torch.device("cpu")).convert(model)
    fp8 = sorted(n for n, m in model.named_modules() if isinstance(m, (FP8Linear, Float8Linear)))
    assert fp8 == [
        "double_blocks.0.img_attn.proj",
        "double_blocks.0.img_attn.qkv",
        "double_blocks.0.img_mlp.0",
        "double_blocks.0.img_mlp.2",
        "double_blocks.0.txt_attn.proj",
        "double_blocks.0.txt_attn.qkv",
        "double_blocks.0.txt_mlp.0",
        "double_blocks.0.txt_mlp.2",
        "single_blocks.0.linear1",
        "single_blocks.0.linear2",
    ]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_our_fp8_linears_carry_the_platform_format():
    from flux_train.model.flux import build_model, is_token_linear

    model = build_model(TINY)
    convert_to_fp8(model, "rowwise", torch.float8_e4m3fnuz, is_token_linear)
    fp8 = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert fp8 and all(m.fp8_dtype == torch.float8_e4m3fnuz and m.recipe.per_row for m in fp8)


def test_shapes_not_divisible_by_16_fall_back_to_bf16():
    lin = nn.Linear(10, 24).bfloat16()
    ref = lin(torch.ones(3, 10, dtype=torch.bfloat16))
    convert_to_fp8(lin, "delayed", E4M3, lambda fqn, m: True)
    FP8Scaling.of(lin, torch.device("cpu"))
    assert torch.equal(lin(torch.ones(3, 10, dtype=torch.bfloat16)), ref)


def ddp_writes_fp8_weight_gradients_into_its_buckets_as_autograd_computes_them(compiled: bool) -> None:
    """The ddp layout's first micro-batch takes each FP8 weight gradient where its GEMM wrote it, in the bucket:
    no copy lands on an FP8 weight's slice, the parameter's gradient is a view of it. The second micro-batch adds
    to it, so the buckets hold what plain autograd sums over both micro-batches (eager: bit for bit; compiled
    regions: within a bf16 rounding)."""
    import copy

    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from flux_train.config import TrainConfig
    from flux_train.model import flow
    from flux_train.model.flux import build_model, materialize
    from flux_train.training.ddp import DDP
    from flux_train.training.distributed import build_mesh
    from flux_train.training.perf import compile_blocks
    from flux_train.training.precision import precision_for

    device = torch.device(DEVICE)
    model = materialize(build_model(TINY), device, seed=0).bfloat16()
    with torch.no_grad():  # the reference init zeroes the last layers, and with them every block's gradient
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    precision = precision_for(PerfConfig(fp8="delayed"), device)
    precision.convert(model)
    precision.attach(model)
    reference = copy.deepcopy(model)
    weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    compile_blocks(model, "block" if compiled else "none")
    compile_blocks(reference, "block" if compiled else "none")
    g = torch.Generator(device=DEVICE).manual_seed(3)

    def batch():
        return dict(
            img=torch.randn(2, 64, 64, device=device, generator=g).bfloat16(),
            img_ids=flow.image_ids(16, 16, device),
            txt=torch.randn(2, 16, 4096, device=device, generator=g).bfloat16(),
            txt_ids=flow.text_ids(16, device),
            timesteps=torch.rand(2, device=device, generator=g).bfloat16(),
            y=torch.randn(2, 768, device=device, generator=g).bfloat16(),
        )

    micro_batches = [batch(), batch()]

    class CopiesInto(TorchDispatchMode):  # the destinations of every copy the hooks make
        def __init__(self):
            super().__init__()
            self.destinations = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default:
                self.destinations.add(args[0].data_ptr())
            return func(*args, **(kwargs or {}))

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = build_mesh(ParallelConfig(strategy="ddp"), 1, 1, DEVICE)
        ddp = DDP(model, mesh, TrainConfig(), torch.bfloat16, device, torch.bfloat16)
        ddp.assign_weights(weights.items())
        sinks = {sink.data_ptr() for _, sink in ddp._sinks}
        assert len(sinks) == 10  # every token Linear of the two blocks
        for index, kw in enumerate(micro_batches):
            ddp.start_micro_batch(index, 2)
            loss = model(**kw).float().square().mean()
            with CopiesInto() as copies:
                loss.backward()
            if index == 0:
                assert copies.destinations and not copies.destinations & sinks
        ddp.finish_backward()
        for kw in micro_batches:
            reference(**kw).float().square().mean().backward()
    finally:
        dist.destroy_process_group()
    got = {name: b.grad_of(i) for b in ddp.buckets for i, name in enumerate(b.names)}
    for name, p in reference.named_parameters():
        name = name.replace("._orig_mod", "")
        want = p.grad
        if compiled:
            torch.testing.assert_close(got[name], want, rtol=0, atol=2e-2 * want.abs().max().item())
        else:
            assert torch.equal(got[name], want), name
        assert want.abs().max() > 0, name


def test_ddp_writes_fp8_weight_gradients_into_its_buckets_as_autograd_computes_them():
    """Eager: bit for bit (compiled regions: tests/runs/test_fp8.py, a compile of minutes on a cold cache)."""
    ddp_writes_fp8_weight_gradients_into_its_buckets_as_autograd_computes_them(compiled=False)


def test_fsdp_fp8_with_activation_checkpointing_keeps_the_recomputed_casts_and_computes_the_same_gradients():
    """Under fsdp the FP8 layers cast their gathered weights again in the backward, unless activation checkpointing
    recomputes the block: then the recomputed forward's casts serve its backward. Two delayed-scaling steps (the
    first without a history) of a two-block model on one rank give, with and without checkpointing, the same
    gradients bit for bit, as the layers' recorded maxima."""
    import torch.distributed as dist

    from flux_train.config import TrainConfig
    from flux_train.model.flux import build_model, canonical_name, materialize
    from flux_train.training.distributed import build_mesh
    from flux_train.training.layout import build_training
    from flux_train.training.perf import prepare_model
    from flux_train.training.precision import precision_for

    plain = materialize(build_model(TINY), torch.device("cpu"), seed=0)
    g = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(p.shape, generator=g) * 0.2 for n, p in plain.named_parameters()}  # gates open
    tokens, text = 16, 8
    ids = torch.stack([torch.zeros(tokens), torch.arange(tokens) // 4, torch.arange(tokens) % 4], 1)
    batches = [
        dict(img=torch.randn(2, tokens, TINY.in_channels, generator=g), img_ids=ids,
             txt=torch.randn(2, text, TINY.joint_attention_dim, generator=g), txt_ids=torch.zeros(text, 3),
             timesteps=torch.rand(2, generator=g), y=torch.randn(2, TINY.pooled_projection_dim, generator=g))
        for _ in range(2)
    ]  # fmt: skip
    seen = {}
    for checkpointing in (False, True):
        pcfg = ParallelConfig(strategy="fsdp", activation_checkpointing=checkpointing)
        perf = PerfConfig(fp8="delayed", compile="none")
        precision = precision_for(perf, torch.device("cpu"))
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            model = prepare_model(build_model(TINY), perf, checkpointing, precision)
            layout = build_training(
                model, build_mesh(pcfg, 1, 1, "cpu"), pcfg, TrainConfig(), torch.float32, torch.device("cpu")
            )
            layout.assign_weights(weights.items())
            precision.attach(layout.model)
            layers = [m for m in layout.model.modules() if isinstance(m, FP8Linear)]
            assert layers and all(m.recast_weight != checkpointing for m in layers)
            seen[checkpointing] = []
            for batch in batches:
                layout.model(**batch).square().mean().backward()
                for name, p in layout.model.named_parameters():
                    seen[checkpointing].append((canonical_name(name), p.grad.full_tensor().clone()))
                    p.grad = None
                maxima = torch.cat([torch.cat([m.fp8_amax, m.fp8_amax_grad]) for m in layers])
                seen[checkpointing].append(("maxima", maxima.clone()))
                precision.after_step()
        finally:
            dist.destroy_process_group()
    names = [n for n, _ in seen[False]]
    assert names == [n for n, _ in seen[True]] and any(".linear2." in n for n in names)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(seen[False], seen[True], strict=True))
