"""FP8 linear (CPU emulation of the same quantisation the GPU path feeds torch._scaled_mm)."""

import pytest
import torch
import torch.nn.functional as F

from flux_train.kernels.fp8 import FP8Linear, convert_to_fp8, e4m3_dtype, linear, quantize
from flux_train.config import ModelConfig
from run_outputs import column

TINY = ModelConfig(  # two blocks of a width FP8 takes (multiples of 16)
    flavor="t",
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    axes_dims_rope=[4, 6, 6],
)


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


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_linear_forward_and_grads_track_bf16(recipe):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, 64, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(96, 64, generator=g) * 0.05).requires_grad_()
    b = torch.randn(96, generator=g).requires_grad_()
    dy = torch.randn(4, 32, 96, generator=g).bfloat16()

    y = linear(x, w, b, recipe)
    y.backward(dy)
    grads = (x.grad.float(), w.grad.float(), b.grad.float())
    x.grad = w.grad = b.grad = None
    y_ref = F.linear(x.float(), w, b)
    y_ref.backward(dy.float())

    def rel(a, ref):
        return ((a.float() - ref).norm() / ref.norm()).item()

    assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert rel(y, y_ref) < 0.05
    for got, ref in zip(grads, (x.grad, w.grad, b.grad)):
        assert rel(got, ref.float()) < 0.06


@pytest.mark.parametrize("impl", ["ours", "torchao"])
def test_fp8_conversion_swaps_only_the_token_linears_and_keeps_the_weights(impl):
    """Ours and torchao's Float8Linear take the same modules (not the adaLN modulations, whose weight-gradient
    GEMM has K = batch) and leave parameter names and values as they were, so checkpoints do not change."""
    from torchao.float8.float8_linear import Float8Linear

    from flux_train.model import build_model, materialize
    from flux_train.perf import apply_fp8

    model = materialize(build_model(TINY), torch.device("cpu"), seed=0)
    before = {n: p.clone() for n, p in model.named_parameters()}
    apply_fp8(model, "tensorwise", impl, torch.device("cpu"))
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
    from flux_train.model import build_model, is_token_linear

    model = build_model(TINY)
    convert_to_fp8(model, "rowwise", torch.float8_e4m3fnuz, is_token_linear)
    fp8 = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert fp8 and all(m.fp8_dtype == torch.float8_e4m3fnuz and m.recipe == "rowwise" for m in fp8)


def test_shapes_not_divisible_by_16_fall_back_to_bf16():
    x = torch.randn(3, 10, dtype=torch.bfloat16)
    w = torch.randn(24, 10, dtype=torch.bfloat16)
    assert torch.equal(linear(x, w, None, "rowwise"), F.linear(x, w))


@pytest.mark.slow
def test_fp8_debug_run_converges_like_bf16(tmp_path):
    """Convergence sanity: 50 debug steps with emulated FP8 GEMMs land where the full-precision run does."""
    from flux_train.train import main

    vals = {}
    for recipe in ("none", "rowwise"):
        out = tmp_path / recipe
        assert (
            main(
                [
                    "--config",
                    "configs/debug.yaml",
                    "--set",
                    "data.source=synthetic",
                    "--set",
                    f"perf.fp8={recipe}",
                    "--set",
                    "train.max_steps=50",
                    "--set",
                    f"logging.out_dir={out}",
                ]
            )
            == 0
        )
        vals[recipe] = column(out, "val_loss")
    assert len(vals["none"]) == 2 and vals["none"][-1] < vals["none"][0]
    assert vals["rowwise"] == pytest.approx(vals["none"], rel=0.03)
