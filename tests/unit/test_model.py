"""Our Flux modules in the reference layout: size, equality with diffusers' FluxTransformer2DModel through the
state-dict adapter, the reference initialisation, loading local weights."""

import math

import pytest
import torch
from diffusers import FluxTransformer2DModel
from torch import nn

from flux_train.config import ModelConfig, load_config
from flux_train.kernels import RMSNorm
from flux_train.model import flow
from flux_train.model import flux as flux_model
from flux_train.model.diffusers_adapter import (
    diffusers_config,
    diffusers_inputs,
    from_diffusers,
    load_pretrained,
    save_diffusers,
    to_diffusers,
)
from flux_train.model.flux import apply_rope, build_model, count_params, flops_per_sample, init_rule, materialize

SCHNELL = load_config("configs/model/flux-schnell.yaml").model
TINY = ModelConfig(
    flavor="tiny",
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=32,
    num_attention_heads=4,
    axes_dims_rope=[8, 12, 12],
    joint_attention_dim=64,
    pooled_projection_dim=32,
)


def test_flux_schnell_has_exact_parameter_count_and_reference_layout():
    model = build_model(SCHNELL)
    assert count_params(model) == 11_891_178_560
    assert all(p.device.type == "meta" for p in model.parameters())
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    h = 3072
    # fused q/k/v with bias (reference qkv_bias=True); single blocks: q, k, v and the 4h MLP input in linear1
    assert shapes["double_blocks.0.img_attn.qkv.weight"] == (3 * h, h)
    assert shapes["double_blocks.18.txt_attn.qkv.bias"] == (3 * h,)
    assert shapes["single_blocks.37.linear1.weight"] == (7 * h, h)
    assert shapes["single_blocks.0.linear2.weight"] == (h, 5 * h)
    assert shapes["final_layer.adaLN_modulation.1.weight"] == (2 * h, h)
    assert shapes["time_in.in_layer.weight"] == (h, 256) and shapes["vector_in.in_layer.weight"] == (h, 768)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    # eps None: torch's default (the op-math type's machine epsilon), as the reference's nn.RMSNorm built without one
    assert len(norms) == 19 * 4 + 38 * 2 and all(n.eps is None for n in norms)
    assert not any("guidance" in n for n in shapes)


def test_flops_per_sample_matches_analytic_count():
    assert flops_per_sample(SCHNELL, 256, 256) / 1e12 == pytest.approx(20.4, abs=0.05)


def random_diffusers(cfg: ModelConfig, seed: int = 0) -> FluxTransformer2DModel:
    """A diffusers model with every tensor random (none left at zero or one) in float64."""
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**diffusers_config(cfg)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model


def inputs64(cfg: ModelConfig, batch: int = 2, text: int = 8, side: int = 8):
    g = torch.Generator().manual_seed(1)
    tokens = (side // 2) ** 2
    ids = torch.stack([torch.zeros(tokens), torch.arange(tokens) // (side // 2), torch.arange(tokens) % (side // 2)], 1)
    return dict(
        img=torch.randn(batch, tokens, cfg.in_channels, generator=g, dtype=torch.float64),
        img_ids=ids,
        txt=torch.randn(batch, text, cfg.joint_attention_dim, generator=g, dtype=torch.float64),
        txt_ids=torch.zeros(text, 3),
        timesteps=torch.rand(batch, generator=g, dtype=torch.float64),
        y=torch.randn(batch, cfg.pooled_projection_dim, generator=g, dtype=torch.float64),
    )


def ours_from(state: dict, cfg: ModelConfig) -> nn.Module:
    """Our model with diffusers' weights; its Q/K norms take diffusers' eps (1e-6; ours, as the reference's, is the
    op-math type's machine epsilon), so that the comparison is of the layout and the arithmetic."""
    model = build_model(cfg, "torch")
    model.to_empty(device="cpu")
    model.double().load_state_dict(state, strict=True)
    for norm in model.modules():
        if isinstance(norm, RMSNorm):
            norm.eps = 1e-6
    return model


def test_converted_model_equals_diffusers_in_float64_and_converts_back_identically():
    reference = random_diffusers(TINY)
    ours = ours_from(from_diffusers(reference.state_dict(), TINY), TINY)
    kw = inputs64(TINY)
    with torch.no_grad():
        want = reference(**diffusers_inputs(kw))[0]
        got = ours(**kw)
    assert want.abs().max() > 0.1
    assert ((got - want).norm() / want.norm()).item() <= 1e-10
    back = to_diffusers(ours.state_dict(), TINY)
    original = reference.state_dict()
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)


def test_gradients_equal_diffusers_in_float64():
    reference = random_diffusers(TINY, seed=3)
    ours = ours_from(from_diffusers(reference.state_dict(), TINY), TINY)
    kw = inputs64(TINY)
    weights = torch.randn(kw["img"].shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (reference(**diffusers_inputs(kw))[0] * weights).sum().backward()
    (ours(**kw) * weights).sum().backward()
    ours_grads = {n: p.grad for n, p in ours.named_parameters()}
    theirs = to_diffusers(ours_grads, TINY)
    # both run RoPE in fp32 (x.float()), so gradients reaching q/k (and upstream) carry fp32 rounding of the
    # rotation's backward, done in a different op order: ~1e-8 relative, float64 elsewhere
    for name, p in reference.named_parameters():
        assert ((theirs[name] - p.grad).norm() / p.grad.norm()).item() <= 1e-6, name


def test_rope_rotates_interleaved_pairs():
    x = torch.tensor([[[[1.0, 0.0, 0.0, 2.0]]]])  # B=1, L=1, H=1, D=4
    angle = torch.tensor([[0.5, 0.5, 1.0, 1.0]])
    out = apply_rope(x, angle.cos(), angle.sin())
    # pair (1, 0) rotated by 0.5 rad, pair (0, 2) by 1 rad
    expected = torch.tensor([0.5, 0.5, 1.0, 1.0]).cos() * torch.tensor([1.0, 0.0, 0.0, 2.0]) + torch.tensor(
        [0.5, 0.5, 1.0, 1.0]
    ).sin() * torch.tensor([-0.0, 1.0, -2.0, 0.0])
    torch.testing.assert_close(out.flatten(), expected)


def test_init_rules_follow_the_reference():
    model = build_model(SCHNELL)
    named = dict(model.named_modules())
    h = 3072

    def rule(name):
        return init_rule(name, named[name])

    # xavier bounds from the fused layers' own fans
    assert rule("double_blocks.0.img_attn.qkv") == ("xavier", math.sqrt(6 / (h + 3 * h)))
    assert rule("single_blocks.3.linear1") == ("xavier", math.sqrt(6 / (h + 7 * h)))
    assert rule("single_blocks.3.linear2") == ("xavier", math.sqrt(6 / (5 * h + h)))
    assert rule("double_blocks.0.img_mlp.0") == ("xavier", math.sqrt(6 / (h + 4 * h)))
    assert rule("txt_in") == ("xavier", math.sqrt(6 / (4096 + h)))
    for zero in (
        "double_blocks.5.img_mod.lin",
        "double_blocks.5.txt_mod.lin",
        "single_blocks.0.modulation.lin",
        "final_layer.adaLN_modulation.1",
        "final_layer.linear",
    ):
        assert rule(zero)[0] == "zero", zero
    for emb in ("time_in.in_layer", "time_in.out_layer", "vector_in.in_layer", "vector_in.out_layer"):
        assert rule(emb) == ("normal", 0.02)


MID = ModelConfig(
    flavor="mid",
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=64,
    num_attention_heads=4,
    axes_dims_rope=[16, 24, 24],
)


@pytest.fixture(scope="module")
def mid_model():
    """A 256-wide model: big enough for variance estimates, small enough for the CPU."""
    return materialize(build_model(MID), torch.device("cpu"), seed=7)


def test_init_statistics_per_layer_kind(mid_model):
    kinds = set()
    for name, module in mid_model.named_modules():
        if isinstance(module, RMSNorm):
            assert torch.all(module.scale == 1)
            continue
        if not isinstance(module, nn.Linear):
            continue
        w = module.weight.detach()
        kind, scale = init_rule(name, module)
        kinds.add(kind)
        assert torch.all(module.bias == 0), name
        if kind == "zero":
            assert torch.all(w == 0), name
        elif kind == "normal":
            assert abs(w.mean().item()) < 0.003 and w.std().item() == pytest.approx(0.02, rel=0.05), name
        else:
            fan_out, fan_in = w.shape
            assert scale == math.sqrt(6 / (fan_in + fan_out))
            assert w.abs().max().item() <= scale, name
            # uniform(-a, a) has variance a^2/3; 2 % is several standard errors for >= 16k draws
            assert w.var().item() == pytest.approx(scale**2 / 3, rel=0.05 if w.numel() < 16384 else 0.02), name
    assert kinds == {"zero", "normal", "xavier"}


def test_init_is_reproducible_and_follows_the_seed(mid_model):
    again = materialize(build_model(MID), torch.device("cpu"), seed=7)
    other = materialize(build_model(MID), torch.device("cpu"), seed=8)
    a, b, c = (dict(m.named_parameters()) for m in (mid_model, again, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["double_blocks.0.img_attn.qkv.weight"], c["double_blocks.0.img_attn.qkv.weight"])


def test_zero_init_model_predicts_zero_velocity(mid_model):
    out = mid_model(
        img=torch.randn(2, 16, 64),
        img_ids=torch.zeros(16, 3),
        txt=torch.randn(2, 8, 4096),
        txt_ids=torch.zeros(8, 3),
        timesteps=torch.rand(2),
        y=torch.randn(2, 768),
    )
    assert out.shape == (2, 16, 64) and torch.all(out == 0)


def test_load_pretrained_reads_diffusers_folders_and_bfl_files(tmp_path):
    from safetensors.torch import save_file

    reference = random_diffusers(TINY, seed=4).float()
    ours = from_diffusers(reference.state_dict(), TINY)
    reference.save_pretrained(str(tmp_path / "pipeline" / "transformer"))
    save_file({k: v.contiguous() for k, v in ours.items()}, str(tmp_path / "flux1-tiny.safetensors"))
    save_diffusers(ours, TINY, tmp_path / "exported")
    for source in (
        tmp_path / "pipeline",
        tmp_path / "pipeline" / "transformer",
        tmp_path / "flux1-tiny.safetensors",
        tmp_path / "exported",
    ):
        loaded = load_pretrained(source, TINY)
        assert loaded.keys() == ours.keys(), source
        assert all(torch.equal(loaded[k], ours[k]) for k in ours), source
    wrong = ModelConfig(**{**TINY.__dict__, "num_layers": 3})
    with pytest.raises(ValueError, match="num_layers=2, model flavor 'tiny' has 3"):
        load_pretrained(tmp_path / "exported", wrong)
    with pytest.raises(ValueError, match="expected a diffusers transformer folder"):
        load_pretrained(tmp_path / "nothing-here", TINY)


def test_eval_timesteps_embed_at_exactly_125_k():
    """t = k/8 reaches the model in bf16 (as the reference's batch does); the embedding's argument t * 1000 is
    formed in fp32 from it, as the reference's forward does after casting its inputs to its fp32 parameters'
    dtype: exactly 125 k. Formed in bf16 it would be 376, 624, 752, 876 for k = 3, 5, 6, 7."""
    k = torch.arange(8)
    t = flow.eval_timesteps(k).to(torch.bfloat16)
    assert torch.equal(flux_model.time_argument(t), (125 * k).float())
    assert (t * flux_model.TIME_FACTOR).float()[[3, 5, 6, 7]].tolist() == [376, 624, 752, 876]


def test_bf16_forward_follows_the_reference_casting_rules(monkeypatch):
    """Our bf16 forward of flux-debug (random weights, modulations non-zero) against a float64 forward of the
    same bf16-rounded weights and inputs under the reference's rules (timestep argument in fp32 from the bf16 t,
    Q/K norms with fp32's machine epsilon as nn.RMSNorm takes for bf16 inputs, everything else exact): 0.58 % apart (bf16 rounding of the
    activations). With the argument formed in bf16, as before, 1.62 %."""
    from copy import deepcopy

    cfg = load_config("configs/model/flux-debug.yaml").model
    ours = materialize(build_model(cfg, "torch"), torch.device("cpu"), seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    ours = ours.bfloat16()
    reference = deepcopy(ours).double()
    for norm in reference.modules():
        if isinstance(norm, RMSNorm):
            norm.eps = 2**-23  # what nn.RMSNorm takes for a bf16 input: its fp32 op-math type's epsilon
    batch, text, side = 8, 16, 8
    kw = dict(
        img=torch.randn(batch, (side // 2) ** 2, cfg.in_channels, generator=g).bfloat16(),
        img_ids=flow.image_ids(side, side),
        txt=torch.randn(batch, text, cfg.joint_attention_dim, generator=g).bfloat16(),
        txt_ids=flow.text_ids(text),
        timesteps=torch.rand(batch, generator=g).bfloat16(),
        y=torch.randn(batch, cfg.pooled_projection_dim, generator=g).bfloat16(),
    )
    with torch.no_grad():
        want = reference(**{k: v.double() if v.dtype == torch.bfloat16 else v for k, v in kw.items()})

        def error() -> float:
            return ((ours(**kw).double() - want).norm() / want.norm()).item()

        now = error()
        monkeypatch.setattr(flux_model, "time_argument", lambda t: t * flux_model.TIME_FACTOR)
        before = error()
    assert now < 0.008 and before > 0.012
