"""Our training forwards (fused q/k/v GEMMs, own attention/RoPE) compute diffusers' Flux exactly."""
import torch
from diffusers import FluxTransformer2DModel

from flux_train.config import ModelConfig
from flux_train.layers import apply_rope
from flux_train.model import build_model, materialize


def test_training_forward_equals_diffusers_forward():
    cfg = ModelConfig(flavor="t", num_layers=2, num_single_layers=2, attention_head_dim=32, num_attention_heads=4,
                      axes_dims_rope=[8, 12, 12], joint_attention_dim=64, pooled_projection_dim=32)
    model = materialize(build_model(cfg, "torch"), torch.device("cpu"), 3)
    with torch.no_grad():  # move off the zero init so every branch contributes
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.zeros(16), torch.arange(16) // 4, torch.arange(16) % 4], dim=1)
    kw = dict(hidden_states=torch.randn(2, 16, 64, generator=g), encoder_hidden_states=torch.randn(2, 8, 64, generator=g),
              pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.rand(2, generator=g),
              img_ids=ids, txt_ids=torch.zeros(8, 3))
    ours = model(**kw)
    reference = FluxTransformer2DModel.forward(model, **kw, return_dict=False)[0]
    assert ours.abs().max() > 0.1
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_rope_rotates_interleaved_pairs():
    x = torch.tensor([[[[1.0, 0.0, 0.0, 2.0]]]])  # B=1, L=1, H=1, D=4
    angle = torch.tensor([[0.5, 0.5, 1.0, 1.0]])
    out = apply_rope(x, angle.cos(), angle.sin())
    # pair (1, 0) rotated by 0.5 rad, pair (0, 2) by 1 rad
    expected = torch.tensor([0.5, 0.5, 1.0, 1.0]).cos() * torch.tensor([1.0, 0.0, 0.0, 2.0]) + \
        torch.tensor([0.5, 0.5, 1.0, 1.0]).sin() * torch.tensor([-0.0, 1.0, -2.0, 0.0])
    torch.testing.assert_close(out.flatten(), expected)
