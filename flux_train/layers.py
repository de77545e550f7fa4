"""Training forwards for diffusers' Flux modules: the same math and parameters, arranged for speed.

Installed on a built model by `install_forwards` (instance-level `forward`, so parameter names, FSDP units
and the diffusers export stay as they are). Against diffusers' own forwards:
- q/k/v (and, in single blocks, the MLP input) run as one GEMM on concatenated weights, as the reference's
  fused `qkv` / `linear1` layers do: fewer, larger GEMMs;
- the timestep enters the sinusoidal embedding as given (diffusers casts it to the activation dtype first);
- no controlnet / IP-adapter branches, so torch.compile sees one short graph per block;
- optionally FP8 GEMMs (perf.fp8, flux_train.kernels.fp8).
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from flux_train.kernels.fp8 import linear


class _ConcatLinear(torch.autograd.Function):
    """x @ cat(weights).T + bias as one GEMM that saves the weights themselves for backward, not their
    concatenation: a saved concatenation is a copy of every block's q/k/v(/MLP-in) weights held from forward to
    backward (6.7 GiB for flux-schnell in bf16). Backward runs one GEMM per weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, *weights)
        return F.linear(x, torch.cat(weights), bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, *weights = ctx.saved_tensors
        parts = dy.split([w.shape[0] for w in weights], dim=-1)
        dx = parts[0] @ weights[0]
        for part, weight in zip(parts[1:], weights[1:]):
            dx = dx + part @ weight
        x2 = x.reshape(-1, x.shape[-1])
        dweights = [part.reshape(-1, part.shape[-1]).t() @ x2 for part in parts]
        return dx, dy.reshape(-1, dy.shape[-1]).sum(0), *dweights


def _fused_linear(x: torch.Tensor, linears: list[nn.Linear], fp8: str) -> torch.Tensor:
    bias = torch.cat([lin.bias for lin in linears])
    if fp8 == "none":
        return _ConcatLinear.apply(x, bias, *(lin.weight for lin in linears))
    return linear(x, torch.cat([lin.weight for lin in linears]), bias, fp8)


def _linear(x: torch.Tensor, layer: nn.Linear, fp8: str) -> torch.Tensor:
    return linear(x, layer.weight, layer.bias, fp8)


def _mlp(ff: nn.Module, x: torch.Tensor, fp8: str) -> torch.Tensor:
    """diffusers FeedForward (proj -> tanh GELU -> dropout 0 -> Linear) with our linear."""
    hidden = F.gelu(_linear(x, ff.net[0].proj, fp8), approximate="tanh")
    return _linear(hidden, ff.net[2], fp8)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs in fp32 (reference); x [B, L, H, D], cos/sin [L, D]."""
    xf = x.float()
    pairs = xf.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (xf * cos[None, :, None, :] + rotated * sin[None, :, None, :]).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Joint bidirectional attention, no mask; q/k/v [B, L, H, D] -> [B, L, H*D]."""
    cos, sin = rope
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.unflatten(-1, (-1, head_dim))


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


def double_block_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                         joint_attention_kwargs=None):
    attn = self.attn
    shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1.linear(F.silu(temb)).chunk(6, dim=1)
    c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = \
        self.norm1_context.linear(F.silu(temb)).chunk(6, dim=1)
    img = _modulate(self.norm1.norm(hidden_states), shift, scale)
    txt = _modulate(self.norm1_context.norm(encoder_hidden_states), c_shift, c_scale)

    fp8 = self.fp8
    q, k, v = _heads(_fused_linear(img, [attn.to_q, attn.to_k, attn.to_v], fp8), attn.head_dim).chunk(3, dim=2)
    tq, tk, tv = _heads(_fused_linear(txt, [attn.add_q_proj, attn.add_k_proj, attn.add_v_proj], fp8),
                        attn.head_dim).chunk(3, dim=2)
    q = torch.cat([attn.norm_added_q(tq), attn.norm_q(q)], dim=1)
    k = torch.cat([attn.norm_added_k(tk), attn.norm_k(k)], dim=1)
    out = attention(q, k, torch.cat([tv, v], dim=1), image_rotary_emb)
    text_len = encoder_hidden_states.shape[1]
    txt_out, img_out = out[:, :text_len], out[:, text_len:]

    hidden_states = hidden_states + gate[:, None] * _linear(img_out, attn.to_out[0], fp8)
    hidden_states = hidden_states + gate_mlp[:, None] * _mlp(
        self.ff, _modulate(self.norm2(hidden_states), shift_mlp, scale_mlp), fp8)
    encoder_hidden_states = encoder_hidden_states + c_gate[:, None] * _linear(txt_out, attn.to_add_out, fp8)
    encoder_hidden_states = encoder_hidden_states + c_gate_mlp[:, None] * _mlp(
        self.ff_context, _modulate(self.norm2_context(encoder_hidden_states), c_shift_mlp, c_scale_mlp), fp8)
    return encoder_hidden_states, hidden_states


def single_block_forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                         joint_attention_kwargs=None):
    attn = self.attn
    text_len = encoder_hidden_states.shape[1]
    x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    shift, scale, gate = self.norm.linear(F.silu(temb)).chunk(3, dim=1)
    h = x.shape[-1]
    fused = _fused_linear(_modulate(self.norm.norm(x), shift, scale),
                          [attn.to_q, attn.to_k, attn.to_v, self.proj_mlp], self.fp8)
    q, k, v, mlp = fused.split([h, h, h, fused.shape[-1] - 3 * h], dim=-1)
    q, k = attn.norm_q(_heads(q, attn.head_dim)), attn.norm_k(_heads(k, attn.head_dim))
    out = attention(q, k, _heads(v, attn.head_dim), image_rotary_emb)
    x = x + gate[:, None] * _linear(torch.cat([out, self.act_mlp(mlp)], dim=2), self.proj_out, self.fp8)
    return x[:, :text_len], x[:, text_len:]


def model_forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids):
    """Velocity prediction [B, N, in_channels] for packed latents."""
    x = self.x_embedder(hidden_states)
    temb = self.time_text_embed(timestep * 1000, pooled_projections)
    txt = self.context_embedder(encoder_hidden_states)
    rope = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
    txt, x = self.run_double_stack(self.transformer_blocks, x, txt, temb, rope)
    txt, x = self.run_single_stack(self.single_transformer_blocks, x, txt, temb, rope)
    return self.proj_out(self.norm_out(x, temb))


def run_stack(blocks: nn.ModuleList, x, txt, temb, rope):
    for block in blocks:
        txt, x = block(x, txt, temb, rope)
    return txt, x


def install_forwards(model: nn.Module, fp8: str = "none") -> nn.Module:
    """`fp8`: "none" or a recipe of flux_train.kernels.fp8 for the blocks' GEMMs (attention, norms, adaLN
    modulation, embedders and the final layer stay bf16)."""
    for block in model.transformer_blocks:
        block.forward = types.MethodType(double_block_forward, block)
        block.fp8 = fp8
    for block in model.single_transformer_blocks:
        block.forward = types.MethodType(single_block_forward, block)
        block.fp8 = fp8
    model.forward = types.MethodType(model_forward, model)
    # replaced by compiled regions when perf.compile=stack (flux_train.compile)
    model.run_double_stack = run_stack
    model.run_single_stack = run_stack
    return model
