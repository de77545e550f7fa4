"""The Flux DiT: diffusers' FluxTransformer2DModel, built on meta, with the MLPerf reference initialisation.

The reference (torchtitan flux, black-forest-labs layers) fuses q/k/v into one Linear and, in single blocks,
q/k/v with the MLP input. diffusers splits them, so xavier-uniform bounds here use the fused layers' fans
(fan_out 3h for q/k/v, 7h for the single-block q/k/v/mlp-in) to draw from exactly the reference's
distribution. Every parameter is drawn from its own generator (seed, parameter index) as a full tensor
and then sharded, so the initial weights do not depend on the number of ranks.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from flux_train.config import ModelConfig
from flux_train.kernels import RMSNorm
from flux_train.layers import install_forwards

NORM_NAMES = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


def build_model(mcfg: ModelConfig, rmsnorm_impl: str = "auto", fp8: str = "none") -> nn.Module:
    """The model on the meta device (no memory) with our training forwards (flux_train.layers);
    materialise with `materialize`."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(
            patch_size=1,
            in_channels=mcfg.in_channels,
            num_layers=mcfg.num_layers,
            num_single_layers=mcfg.num_single_layers,
            attention_head_dim=mcfg.attention_head_dim,
            num_attention_heads=mcfg.num_attention_heads,
            joint_attention_dim=mcfg.joint_attention_dim,
            pooled_projection_dim=mcfg.pooled_projection_dim,
            guidance_embeds=False,
            axes_dims_rope=tuple(mcfg.axes_dims_rope),
        )
        for module in list(model.modules()):
            for name in NORM_NAMES:
                old = getattr(module, name, None)
                if isinstance(old, nn.RMSNorm):
                    setattr(module, name, RMSNorm(old.normalized_shape[0], eps=old.eps, impl=rmsnorm_impl))
    return install_forwards(model, fp8)


def block_stacks(model: nn.Module) -> tuple[nn.ModuleList, nn.ModuleList]:
    """The double-stream and single-stream block lists (the regions we compile and shard)."""
    return model.transformer_blocks, model.single_transformer_blocks


def _is_zero_init(name: str) -> bool:
    # adaLN modulation of double blocks (norm1, norm1_context), single blocks (norm), final layer, output proj
    return (name.endswith(("norm1.linear", "norm1_context.linear", "norm_out.linear"))
            or (name.startswith("single_transformer_blocks.") and name.endswith(".norm.linear"))
            or name == "proj_out")


def _reference_fans(name: str, weight_shape: torch.Size, hidden: int) -> tuple[int, int]:
    """(fan_in, fan_out) of the reference layer this diffusers Linear is a slice of."""
    fan_out, fan_in = weight_shape
    leaf = name.rsplit(".", 1)[-1]
    if name.startswith("transformer_blocks.") and leaf in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj",
                                                           "add_v_proj"):
        return fan_in, 3 * hidden
    if name.startswith("single_transformer_blocks.") and leaf in ("to_q", "to_k", "to_v", "proj_mlp"):
        return fan_in, 3 * hidden + int(4 * hidden)
    return fan_in, fan_out


def init_rule(name: str, module: nn.Module, hidden: int) -> tuple[str, float]:
    """('zero'|'normal'|'xavier'|'ones', parameter) for a Linear or norm module name."""
    if isinstance(module, RMSNorm):
        return "ones", 0.0
    if name.startswith("time_text_embed."):
        return "normal", 0.02
    if _is_zero_init(name):
        return "zero", 0.0
    fan_in, fan_out = _reference_fans(name, module.weight.shape, hidden)
    return "xavier", math.sqrt(6.0 / (fan_in + fan_out))


def _full_init(rule: str, scale: float, shape: torch.Size, gen: torch.Generator, device) -> torch.Tensor:
    if rule == "zero":
        return torch.zeros(shape, device=device)
    if rule == "ones":
        return torch.ones(shape, device=device)
    if rule == "normal":
        return torch.empty(shape, device=device).normal_(0.0, scale, generator=gen)
    return torch.empty(shape, device=device).uniform_(-scale, scale, generator=gen)


@torch.no_grad()
def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    if hasattr(param, "device_mesh"):  # DTensor from FSDP2: keep this rank's shard of the full tensor
        from torch.distributed.tensor import distribute_tensor

        shard = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Reference initialisation; identical weights for any sharding (see module docstring)."""
    hidden = model.config.num_attention_heads * model.config.attention_head_dim
    index = 0
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, RMSNorm)):
            continue
        rule, scale = init_rule(name, module, hidden)
        weight = module.weight
        device = weight.device
        gen = torch.Generator(device=device).manual_seed(seed * 100_003 + index)
        _assign(weight, _full_init(rule, scale, weight.shape, gen, device))
        index += 1
        if getattr(module, "bias", None) is not None:
            _assign(module.bias, torch.zeros(module.bias.shape, device=device))


def materialize(model: nn.Module, device: torch.device, seed: int) -> nn.Module:
    """Allocate the meta model's storage on `device` (sharded if FSDP wrapped it) and initialise it."""
    model.to_empty(device=device)
    init_weights(model, seed)
    return model


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_sample(mcfg: ModelConfig, text_len: int, image_tokens: int) -> float:
    """Training FLOPs (forward + backward = 3x forward) per sample; encoders are precomputed."""
    h = mcfg.num_attention_heads * mcfg.attention_head_dim
    blocks = mcfg.num_layers + mcfg.num_single_layers
    seq = text_len + image_tokens
    # each token passes 12h^2 weights per block in either block type (anchors.md §4)
    block_matmul = 2 * blocks * 12 * h * h * seq
    attention = blocks * 4 * seq * seq * h
    io = 2 * (mcfg.in_channels * h * image_tokens + mcfg.joint_attention_dim * h * text_len
              + h * mcfg.in_channels * image_tokens)
    # once per sample: adaLN modulations (6h^2 per double stream, 3h^2 single, 2h^2 final), time/text MLPs
    per_sample_weights = (mcfg.num_layers * 2 * 6 * h * h + mcfg.num_single_layers * 3 * h * h + 2 * h * h
                          + 256 * h + h * h + mcfg.pooled_projection_dim * h + h * h)
    return 3.0 * (block_matmul + attention + io + 2 * per_sample_weights)
