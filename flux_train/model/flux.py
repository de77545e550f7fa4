"""The Flux DiT in the reference's layout (black-forest-labs `flux`, torchtitan `experiments/flux`).

Parameter names are the reference's, so a BFL checkpoint loads as it is and diffusers' layout is a rename
away (flux_train.model.diffusers_adapter): double-stream blocks with fused `img_attn.qkv` / `txt_attn.qkv`,
single-stream blocks with `linear1` (q, k, v and the MLP input in one GEMM) and `linear2`, QK-RMSNorm,
RoPE in fp32, the time/vector embedders and the final adaLN layer.

Numerics as the reference computes them: RMSNorm and RoPE in (at least) fp32, the RMSNorm's eps the machine
epsilon of its op-math type, float32's 2^-23 for bf16 q/k (torch's default, which the reference's `nn.RMSNorm`
takes), the sinusoidal timestep
embedding's argument `timesteps * 1000` formed in fp32 from the timesteps the model is given (the reference
casts its inputs to its fp32 parameters' dtype first), no attention mask. The model is built on the meta
device and materialised with the reference initialisation (`init_weights`): every Linear xavier-uniform
from its own fans with zero bias, the time/vector embedders N(0, 0.02), every adaLN modulation and the final
projection zero. Each parameter is drawn as a full tensor from its own generator (seed, parameter index)
and then sharded, so the initial weights do not depend on the number of ranks or the parallel layout.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Iterable, Iterator, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from flux_train.config import ModelConfig
from flux_train.kernels import RMSNorm
from flux_train.kernels.fp8 import FP8Linear
from flux_train.kernels.fp8_cast import gelu_tanh_joined

TIME_EMBED_DIM = 256
TIME_FACTOR = 1000.0
ROPE_THETA = 10_000
MLP_RATIO = 4


# ------------------------------------------------------------------------------------------------ math


def time_argument(timesteps: torch.Tensor) -> torch.Tensor:
    """The timestep embedding's argument: t * 1000 in at least fp32, whatever the dtype t comes in (a bf16 t of
    k/8 gives exactly 125 k; formed in bf16 it would give 376, 624, 752 and 876 for k = 3, 5, 6, 7)."""
    return timesteps.to(torch.promote_types(timesteps.dtype, torch.float32)) * TIME_FACTOR


def timestep_embedding(t: torch.Tensor, dim: int = TIME_EMBED_DIM, max_period: float = 10_000) -> torch.Tensor:
    """Sinusoidal embedding [cos | sin] of `t` (already scaled by TIME_FACTOR), computed in fp32."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device)
    freqs = torch.exp(exponent / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_tables(ids: torch.Tensor, axes_dim: list[int], theta: int = ROPE_THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [L, head_dim] fp32 for positions `ids` [L, n_axes]: angles in float64, each repeated for the
    two entries of its interleaved pair."""
    pos = ids.float()
    cos, sin = [], []
    for axis, dim in enumerate(axes_dim):
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim)
        angles = torch.outer(pos[:, axis], freqs)
        cos.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs in fp32; x [B, L, H, D], cos/sin [L, D]."""
    xf = x.float()
    pairs = xf.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (xf * cos[None, :, None, :] + rotated * sin[None, :, None, :]).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pe: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Bidirectional attention over the joint sequence, no mask; q/k/v [B, L, H, D] -> [B, L, H*D]."""
    q, k = apply_rope(q, *pe), apply_rope(k, *pe)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    """LayerNorm without affine parameters (eps 1e-6), as every norm before a modulation."""
    return F.layer_norm(x, x.shape[-1:], eps=1e-6)


# ------------------------------------------------------------------------------------------------ modules


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, hidden: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden)
        self.out_layer = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class QKNorm(nn.Module):
    def __init__(self, head_dim: int, rmsnorm_impl: str):
        super().__init__()
        self.query_norm = RMSNorm(head_dim, impl=rmsnorm_impl)
        self.key_norm = RMSNorm(head_dim, impl=rmsnorm_impl)


class Modulation(nn.Module):
    """adaLN: `chunks` vectors (shift, scale, gate, ...) from the conditioning vector."""

    def __init__(self, hidden: int, chunks: int):
        super().__init__()
        self.chunks = chunks
        self.lin = nn.Linear(hidden, chunks * hidden)

    def forward(self, vec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.lin(F.silu(vec)).chunk(self.chunks, dim=-1)


class StreamAttention(nn.Module):
    """One stream's attention weights; the double block runs the joint attention over both streams."""

    def __init__(self, hidden: int, head_dim: int, rmsnorm_impl: str):
        super().__init__()
        self.head_dim = head_dim
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.norm = QKNorm(head_dim, rmsnorm_impl)
        self.proj = nn.Linear(hidden, hidden)

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).unflatten(-1, (3, -1, self.head_dim)).unbind(2)
        return self.norm.query_norm(q), self.norm.key_norm(k), v


def gelu_linear(linear: nn.Module, head: torch.Tensor | None, tail: torch.Tensor) -> torch.Tensor:
    """linear([head | gelu(tail)]) with the reference's GELU (tanh approximation): an MLP's output projection (no
    head) and a single block's linear2 (head: the attention's output). An FP8 layer with delayed scaling joins the
    parts and applies the GELU as its cast reads them (FP8Linear.gelu_forward): no bf16 copy written and read."""
    if isinstance(linear, FP8Linear) and linear.fuses_gelu(tail):
        return linear.gelu_forward(head, tail)
    return linear(F.gelu(tail, approximate="tanh") if head is None else gelu_tanh_joined(head, tail))


class MLP(nn.Sequential):
    """Linear, GELU (tanh approximation), Linear, indexed as the reference's nn.Sequential (`img_mlp.2.weight`);
    the forward applies the GELU (no weights) through gelu_linear."""

    def __init__(self, hidden: int):
        super().__init__(
            nn.Linear(hidden, MLP_RATIO * hidden), nn.GELU(approximate="tanh"), nn.Linear(MLP_RATIO * hidden, hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pyright: ignore[reportIncompatibleMethodOverride]
        project_in, _, project_out = self  # the GELU, between them, is gelu_linear's
        return gelu_linear(project_out, None, project_in(x))


class DoubleStreamBlock(nn.Module):
    def __init__(self, hidden: int, head_dim: int, rmsnorm_impl: str):
        super().__init__()
        self.img_mod = Modulation(hidden, 6)
        self.img_attn = StreamAttention(hidden, head_dim, rmsnorm_impl)
        self.img_mlp = MLP(hidden)
        self.txt_mod = Modulation(hidden, 6)
        self.txt_attn = StreamAttention(hidden, head_dim, rmsnorm_impl)
        self.txt_mlp = MLP(hidden)

    def forward(
        self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor, pe: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = self.img_mod(vec)
        t_shift, t_scale, t_gate, t_shift_mlp, t_scale_mlp, t_gate_mlp = self.txt_mod(vec)
        img_q, img_k, img_v = self.img_attn.qkv_heads(modulate(layer_norm(img), shift, scale))
        txt_q, txt_k, txt_v = self.txt_attn.qkv_heads(modulate(layer_norm(txt), t_shift, t_scale))
        out = attention(torch.cat((txt_q, img_q), 1), torch.cat((txt_k, img_k), 1), torch.cat((txt_v, img_v), 1), pe)
        txt_out, img_out = out[:, : txt.shape[1]], out[:, txt.shape[1] :]
        img = img + gate[:, None] * self.img_attn.proj(img_out)
        img = img + gate_mlp[:, None] * self.img_mlp(modulate(layer_norm(img), shift_mlp, scale_mlp))
        txt = txt + t_gate[:, None] * self.txt_attn.proj(txt_out)
        txt = txt + t_gate_mlp[:, None] * self.txt_mlp(modulate(layer_norm(txt), t_shift_mlp, t_scale_mlp))
        return img, txt


class SingleStreamBlock(nn.Module):
    """Parallel attention + MLP over the joint [txt, img] sequence."""

    def __init__(self, hidden: int, head_dim: int, rmsnorm_impl: str):
        super().__init__()
        self.hidden, self.head_dim = hidden, head_dim
        self.linear1 = nn.Linear(hidden, 3 * hidden + MLP_RATIO * hidden)
        self.linear2 = nn.Linear(hidden + MLP_RATIO * hidden, hidden)
        self.norm = QKNorm(head_dim, rmsnorm_impl)
        self.modulation = Modulation(hidden, 3)

    def forward(self, x: torch.Tensor, vec: torch.Tensor, pe: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        shift, scale, gate = self.modulation(vec)
        qkv, mlp_in = self.linear1(modulate(layer_norm(x), shift, scale)).split(
            [3 * self.hidden, MLP_RATIO * self.hidden], dim=-1
        )
        q, k, v = qkv.unflatten(-1, (3, -1, self.head_dim)).unbind(2)
        out = attention(self.norm.query_norm(q), self.norm.key_norm(k), v, pe)
        return x + gate[:, None] * gelu_linear(self.linear2, out, mlp_in)


class LastLayer(nn.Module):
    def __init__(self, hidden: int, out_channels: int):
        super().__init__()
        self.linear = nn.Linear(hidden, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=-1)
        return self.linear(modulate(layer_norm(x), shift, scale))


class FluxModel(nn.Module):
    """Velocity prediction for packed latents.

    forward(img [B, N, in_channels], img_ids [N, 3], txt [B, L, 4096] T5, txt_ids [L, 3], timesteps [B] in [0, 1],
    y [B, 768] pooled CLIP) -> [B, N, in_channels]."""

    def __init__(self, cfg: ModelConfig, rmsnorm_impl: str = "auto"):
        super().__init__()
        self.cfg = cfg
        hidden = cfg.num_attention_heads * cfg.attention_head_dim
        head = cfg.attention_head_dim
        self.img_in = nn.Linear(cfg.in_channels, hidden)
        self.time_in = MLPEmbedder(TIME_EMBED_DIM, hidden)
        self.vector_in = MLPEmbedder(cfg.pooled_projection_dim, hidden)
        self.txt_in = nn.Linear(cfg.joint_attention_dim, hidden)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(hidden, head, rmsnorm_impl) for _ in range(cfg.num_layers))
        self.single_blocks = nn.ModuleList(
            SingleStreamBlock(hidden, head, rmsnorm_impl) for _ in range(cfg.num_single_layers)
        )
        self.final_layer = LastLayer(hidden, cfg.in_channels)

    def forward(self, img, img_ids, txt, txt_ids, timesteps, y) -> torch.Tensor:
        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(time_argument(timesteps)).to(img.dtype)) + self.vector_in(y)
        txt = self.txt_in(txt)
        pe = rope_tables(torch.cat((txt_ids, img_ids), dim=0), self.cfg.axes_dims_rope)
        for block in self.double_blocks:
            img, txt = block(img, txt, vec, pe)
        x = torch.cat((txt, img), dim=1)
        for block in self.single_blocks:
            x = block(x, vec, pe)
        return self.final_layer(x[:, txt.shape[1] :], vec)


def build_model(mcfg: ModelConfig, rmsnorm_impl: str = "auto") -> FluxModel:
    """The model on the meta device (no memory); materialise with `materialize`."""
    with torch.device("meta"):
        return FluxModel(mcfg, rmsnorm_impl)


def block_stacks(model: nn.Module) -> tuple[nn.ModuleList, nn.ModuleList]:
    """The double-stream and single-stream block lists (the regions we compile and shard) of a FluxModel, also
    once wrapped (sharded, its blocks compiled)."""
    double, single = model.get_submodule("double_blocks"), model.get_submodule("single_blocks")
    if not (isinstance(double, nn.ModuleList) and isinstance(single, nn.ModuleList)):
        raise TypeError(f"{type(model).__name__} is not a Flux model: no double_blocks/single_blocks lists")
    return double, single


def is_token_linear(fqn: str, module: nn.Module) -> bool:
    """The blocks' Linears that run on every token (where FP8 pays); not the adaLN modulations, which run on
    one row per sample (their weight-gradient GEMM has K = batch)."""
    return (
        isinstance(module, nn.Linear)
        and fqn.startswith(("double_blocks.", "single_blocks."))
        and not fqn.endswith(("_mod.lin", "modulation.lin"))
    )


# ------------------------------------------------------------------------------------------------ init


def init_rule(fqn: str, module: nn.Linear | RMSNorm) -> tuple[str, float]:
    """('zero' | 'ones' | 'normal' | 'xavier', scale) for the weight of a Linear or RMSNorm by its name."""
    if isinstance(module, RMSNorm):
        return "ones", 0.0
    if fqn.startswith(("time_in.", "vector_in.")):
        return "normal", 0.02
    if fqn.endswith(("_mod.lin", "modulation.lin", "adaLN_modulation.1")) or fqn == "final_layer.linear":
        return "zero", 0.0
    fan_out, fan_in = module.weight.shape
    return "xavier", math.sqrt(6.0 / (fan_in + fan_out))


def _draw(rule: str, scale: float, shape: torch.Size, gen: torch.Generator, device) -> torch.Tensor:
    if rule == "zero":
        return torch.zeros(shape, device=device)
    if rule == "ones":
        return torch.ones(shape, device=device)
    if rule == "normal":
        return torch.empty(shape, device=device).normal_(0.0, scale, generator=gen)
    return torch.empty(shape, device=device).uniform_(-scale, scale, generator=gen)


def canonical_name(fqn: str) -> str:
    """A parameter or module name without the wrappers compile and activation checkpointing insert."""
    return fqn.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", "")


def reference_init(model: nn.Module, seed: int, device) -> Iterator[tuple[str, torch.Tensor]]:
    """(parameter name, full fp32 initial value) for every parameter, in a fixed order; each weight from its
    own generator (seed, module index), so the values do not depend on how the parameters are laid out."""
    index = 0
    for fqn, module in model.named_modules():
        if not isinstance(module, (nn.Linear, RMSNorm)):
            continue
        prefix = canonical_name(fqn)
        weight = module.scale if isinstance(module, RMSNorm) else module.weight
        rule, scale = init_rule(prefix, module)
        gen = torch.Generator(device=device).manual_seed(seed * 100_003 + index)
        index += 1
        yield (
            f"{prefix}.scale" if isinstance(module, RMSNorm) else f"{prefix}.weight",
            _draw(rule, scale, weight.shape, gen, device),
        )
        if isinstance(module, nn.Linear) and module.bias is not None:
            yield f"{prefix}.bias", torch.zeros(module.bias.shape, device=device)


@torch.no_grad()
def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):  # from FSDP2: keep this rank's shard of the full tensor
        shard = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


def check_weights(model: FluxModel, values: dict[str, torch.Tensor], source: str) -> None:
    """Raise ValueError naming the first missing, unexpected or misshapen tensor of a full state dict."""
    params = {canonical_name(n): p for n, p in model.named_parameters()}
    for name, p in params.items():
        if name not in values:
            raise ValueError(f"{source}: no tensor '{name}' (is it a FLUX.1 transformer of flavor {model.cfg.flavor}?)")
        if tuple(values[name].shape) != tuple(p.shape):
            raise ValueError(
                f"{source}: '{name}' has shape {tuple(values[name].shape)}, the model "
                f"'{model.cfg.flavor}' needs {tuple(p.shape)}"
            )
    extra = sorted(set(values) - set(params))
    if extra:
        raise ValueError(
            f"{source}: unexpected tensor '{extra[0]}' ({len(extra)} in all) for flavor {model.cfg.flavor}"
        )


def assign_weights(model: nn.Module, values: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy full tensors into a plain or FSDP-sharded model's parameters, by canonical name."""
    params = {canonical_name(n): p for n, p in model.named_parameters()}
    for name, full in values:
        _assign(params[name], full.to(params[name].device, torch.float32))


def init_weights(model: nn.Module, seed: int) -> None:
    """Reference initialisation in place, for a plain or FSDP-sharded model."""
    device = next(model.parameters()).device
    assign_weights(model, reference_init(model, seed, device))


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def materialize(model: ModuleT, device: torch.device, seed: int) -> ModuleT:
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
    # each token passes 12h^2 weights per block in either block type (qkv 3h^2 + proj h^2 + MLP 8h^2, or
    # linear1 7h^2 + linear2 5h^2)
    block_matmul = 2 * blocks * 12 * h * h * seq
    attention_flops = blocks * 4 * seq * seq * h
    io = 2 * (
        mcfg.in_channels * h * image_tokens
        + mcfg.joint_attention_dim * h * text_len
        + h * mcfg.in_channels * image_tokens
    )
    # once per sample: adaLN modulations (6h^2 per double stream, 3h^2 single, 2h^2 final), time/text MLPs
    per_sample_weights = (
        mcfg.num_layers * 2 * 6 * h * h
        + mcfg.num_single_layers * 3 * h * h
        + 2 * h * h
        + TIME_EMBED_DIM * h
        + h * h
        + mcfg.pooled_projection_dim * h
        + h * h
    )
    return 3.0 * (block_matmul + attention_flops + io + 2 * per_sample_weights)


@functools.lru_cache
def _parameter_counts(model_json: str) -> tuple[int, int, int]:
    """(all, the token Linears', the largest block's) parameters of a model config, from one model built on the
    meta device."""
    model = build_model(ModelConfig(**json.loads(model_json)))
    token_linears = sum(count_params(m) for fqn, m in model.named_modules() if is_token_linear(fqn, m))
    largest_block = max((count_params(b) for stack in block_stacks(model) for b in stack), default=0)
    return count_params(model), token_linears, largest_block


def _counts(mcfg: ModelConfig) -> tuple[int, int, int]:
    return _parameter_counts(json.dumps(dataclasses.asdict(mcfg)))


def param_count(mcfg: ModelConfig) -> int:
    """The parameter count of the model `mcfg` builds, from the model built on the meta device (once per model)."""
    return _counts(mcfg)[0]


def token_linear_param_count(mcfg: ModelConfig) -> int:
    """The parameters of the Linears `is_token_linear` selects (those perf.fp8 runs in FP8)."""
    return _counts(mcfg)[1]


def largest_block_param_count(mcfg: ModelConfig) -> int:
    """The parameters of the model's largest block (a double block of flux-schnell's: 339.8 M), the unit FSDP
    gathers and reduces."""
    return _counts(mcfg)[2]
