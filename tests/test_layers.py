"""Our training forwards (fused q/k/v GEMMs, own attention/RoPE) compute diffusers' Flux exactly, gradients too."""
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
    kw["hidden_states"].requires_grad_()
    weights = torch.randn(2, 16, 64, generator=g)  # a loss that weighs every output element differently

    def output_and_grads(forward):
        out = forward()
        (out * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()} | {"input": kw["hidden_states"].grad.clone()}
        model.zero_grad()
        kw["hidden_states"].grad = None
        return out.detach(), grads

    ours, ours_grads = output_and_grads(lambda: model(**kw))
    reference, reference_grads = output_and_grads(
        lambda: FluxTransformer2DModel.forward(model, **kw, return_dict=False)[0])
    assert ours.abs().max() > 0.1
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    # the fused q/k/v GEMMs have their own backward (flux_train.layers._ConcatLinear)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(ours_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_rope_rotates_interleaved_pairs():
    x = torch.tensor([[[[1.0, 0.0, 0.0, 2.0]]]])  # B=1, L=1, H=1, D=4
    angle = torch.tensor([[0.5, 0.5, 1.0, 1.0]])
    out = apply_rope(x, angle.cos(), angle.sin())
    # pair (1, 0) rotated by 0.5 rad, pair (0, 2) by 1 rad
    expected = torch.tensor([0.5, 0.5, 1.0, 1.0]).cos() * torch.tensor([1.0, 0.0, 0.0, 2.0]) + \
        torch.tensor([0.5, 0.5, 1.0, 1.0]).sin() * torch.tensor([-0.0, 1.0, -2.0, 0.0])
    torch.testing.assert_close(out.flatten(), expected)


def test_concatenated_linear_backward_equals_autograd_through_the_concatenation():
    from flux_train.layers import _ConcatLinear

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(12, generator=g, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(n, 8, generator=g, dtype=torch.float64, requires_grad=True) for n in (3, 4, 5)]
    dy = torch.randn(2, 5, 12, generator=g, dtype=torch.float64)
    leaves = [x, bias, *weights]

    def grads(forward):
        out = forward()
        return [out.detach(), *torch.autograd.grad(out, leaves, dy)]

    ours = grads(lambda: _ConcatLinear.apply(x, bias, *weights))
    reference = grads(lambda: torch.nn.functional.linear(x, torch.cat(weights), bias))
    for got, want in zip(ours, reference):
        torch.testing.assert_close(got, want)
