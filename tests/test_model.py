import math

import pytest
import torch
from torch import nn

from flux_train.config import ModelConfig, load_config
from flux_train.kernels import RMSNorm
from flux_train.model import build_model, count_params, flops_per_sample, init_rule, materialize

SCHNELL = load_config("configs/model/flux-schnell.yaml").model


def test_flux_schnell_has_exact_parameter_count_and_design_config():
    model = build_model(SCHNELL)
    assert count_params(model) == 11_891_178_560
    c = model.config
    assert (c.num_layers, c.num_single_layers, c.attention_head_dim, c.num_attention_heads) == (19, 38, 128, 24)
    assert (c.in_channels, c.joint_attention_dim, c.pooled_projection_dim) == (64, 4096, 768)
    assert tuple(c.axes_dims_rope) == (16, 56, 56) and c.guidance_embeds is False and c.patch_size == 1
    assert all(p.device.type == "meta" for p in model.parameters())
    # qkv bias (reference qkv_bias=True) and our fp32 RMSNorm on every Q/K norm
    assert model.transformer_blocks[0].attn.to_q.bias is not None
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 19 * 4 + 38 * 2 and all(n.eps == 1e-6 for n in norms)
    assert not any(isinstance(m, nn.RMSNorm) for m in model.modules())


def test_flops_per_sample_matches_analytic_count():
    assert flops_per_sample(SCHNELL, 256, 256) / 1e12 == pytest.approx(20.4, abs=0.05)


def test_reference_fans_for_split_qkv():
    model = build_model(SCHNELL)
    h = 3072
    named = dict(model.named_modules())
    assert init_rule("transformer_blocks.0.attn.to_q", named["transformer_blocks.0.attn.to_q"], h) == \
        ("xavier", math.sqrt(6 / (h + 3 * h)))
    assert init_rule("single_transformer_blocks.3.proj_mlp", named["single_transformer_blocks.3.proj_mlp"], h) == \
        ("xavier", math.sqrt(6 / (h + 7 * h)))
    assert init_rule("single_transformer_blocks.3.proj_out", named["single_transformer_blocks.3.proj_out"], h) == \
        ("xavier", math.sqrt(6 / (5 * h + h)))
    assert init_rule("transformer_blocks.0.ff.net.0.proj", named["transformer_blocks.0.ff.net.0.proj"], h) == \
        ("xavier", math.sqrt(6 / (h + 4 * h)))
    for zero in ("transformer_blocks.5.norm1.linear", "transformer_blocks.5.norm1_context.linear",
                 "single_transformer_blocks.0.norm.linear", "norm_out.linear", "proj_out"):
        assert init_rule(zero, named[zero], h)[0] == "zero"
    for emb in ("time_text_embed.timestep_embedder.linear_1", "time_text_embed.text_embedder.linear_2"):
        assert init_rule(emb, named[emb], h) == ("normal", 0.02)


@pytest.fixture(scope="module")
def mid_model():
    """A 256-wide model: big enough for variance estimates, small enough for the CPU."""
    cfg = ModelConfig(flavor="mid", num_layers=1, num_single_layers=1, attention_head_dim=64, num_attention_heads=4,
                      axes_dims_rope=[16, 24, 24])
    return materialize(build_model(cfg), torch.device("cpu"), seed=7)


def test_init_zero_normal_xavier_and_biases(mid_model):
    h = 256
    for name, module in mid_model.named_modules():
        if isinstance(module, RMSNorm):
            assert torch.all(module.weight == 1)
            continue
        if not isinstance(module, nn.Linear):
            continue
        w = module.weight.detach()
        rule, scale = init_rule(name, module, h)
        if module.bias is not None:
            assert torch.all(module.bias == 0), name
        if rule == "zero":
            assert torch.all(w == 0), name
        elif rule == "normal":
            assert abs(w.mean().item()) < 0.003 and w.std().item() == pytest.approx(0.02, rel=0.05), name
        else:
            assert w.abs().max().item() <= scale, name
            # uniform(-a, a) has variance a^2/3; 2 % is several standard errors for >= 16k draws
            assert w.var().item() == pytest.approx(scale ** 2 / 3, rel=0.05 if w.numel() < 16384 else 0.02), name


def test_init_is_reproducible_and_follows_the_seed(mid_model):
    cfg = ModelConfig(flavor="mid", num_layers=1, num_single_layers=1, attention_head_dim=64, num_attention_heads=4,
                      axes_dims_rope=[16, 24, 24])
    again = materialize(build_model(cfg), torch.device("cpu"), seed=7)
    other = materialize(build_model(cfg), torch.device("cpu"), seed=8)
    a, b, c = (dict(m.named_parameters()) for m in (mid_model, again, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["transformer_blocks.0.attn.to_q.weight"], c["transformer_blocks.0.attn.to_q.weight"])


def test_zero_init_model_predicts_zero_velocity(mid_model):
    out = mid_model(hidden_states=torch.randn(2, 16, 64), encoder_hidden_states=torch.randn(2, 8, 4096),
                    pooled_projections=torch.randn(2, 768), timestep=torch.rand(2), img_ids=torch.zeros(16, 3),
                    txt_ids=torch.zeros(8, 3))
    assert out.shape == (2, 16, 64) and torch.all(out == 0)
