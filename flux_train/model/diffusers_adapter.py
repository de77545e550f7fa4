"""Our (reference-layout) state dict <-> diffusers' `FluxTransformer2DModel`, and loading local weights.

diffusers splits what the reference fuses: q/k/v of each stream (`attn.to_q/to_k/to_v`, `attn.add_*_proj`),
and in single blocks q/k/v plus the MLP input (`proj_mlp`); it also orders the final adaLN output as
(scale, shift) where the reference has (shift, scale). Everything else is a rename. Tested against
diffusers 0.35-0.42 (pyproject pins the range).

`load_pretrained(path)` reads a FLUX.1 transformer from local files, nothing downloads: a diffusers folder
(`config.json` + `diffusion_pytorch_model*.safetensors`, or a pipeline folder holding `transformer/`) or a
black-forest-labs single-file checkpoint (`flux1-schnell.safetensors`, already in our layout).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import warnings
from pathlib import Path

import torch

from flux_train.config import ModelConfig

# (ours, diffusers) per-module renames; weight and bias follow the module name
_ROOT = [
    ("img_in", "x_embedder"),
    ("txt_in", "context_embedder"),
    ("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
    ("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
    ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
    ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
    ("final_layer.linear", "proj_out"),
]
_DOUBLE = [
    ("img_mod.lin", "norm1.linear"),
    ("txt_mod.lin", "norm1_context.linear"),
    ("img_attn.proj", "attn.to_out.0"),
    ("txt_attn.proj", "attn.to_add_out"),
    ("img_mlp.0", "ff.net.0.proj"),
    ("img_mlp.2", "ff.net.2"),
    ("txt_mlp.0", "ff_context.net.0.proj"),
    ("txt_mlp.2", "ff_context.net.2"),
]
_DOUBLE_NORMS = [
    ("img_attn.norm.query_norm", "attn.norm_q"),
    ("img_attn.norm.key_norm", "attn.norm_k"),
    ("txt_attn.norm.query_norm", "attn.norm_added_q"),
    ("txt_attn.norm.key_norm", "attn.norm_added_k"),
]
_SINGLE = [("linear2", "proj_out"), ("modulation.lin", "norm.linear")]
_SINGLE_NORMS = [("norm.query_norm", "attn.norm_q"), ("norm.key_norm", "attn.norm_k")]
# fused ours <- concatenation of diffusers' parts, in order
_DOUBLE_FUSED = [
    ("img_attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
    ("txt_attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
]
_SINGLE_FUSED = [("linear1", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))]
_FINAL_ADALN = ("final_layer.adaLN_modulation.1", "norm_out.linear")


def diffusers_config(cfg: ModelConfig) -> dict:
    """FluxTransformer2DModel constructor arguments for a flavor."""
    return dict(
        patch_size=1,
        in_channels=cfg.in_channels,
        num_layers=cfg.num_layers,
        num_single_layers=cfg.num_single_layers,
        attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads,
        joint_attention_dim=cfg.joint_attention_dim,
        pooled_projection_dim=cfg.pooled_projection_dim,
        guidance_embeds=False,
        axes_dims_rope=tuple(cfg.axes_dims_rope),
    )


def diffusers_inputs(kw: dict) -> dict:
    """Our model's keyword inputs (img, txt, y, timesteps, img_ids, txt_ids) as FluxTransformer2DModel's."""
    return dict(
        hidden_states=kw["img"],
        encoder_hidden_states=kw["txt"],
        pooled_projections=kw["y"],
        timestep=kw["timesteps"],
        img_ids=kw["img_ids"],
        txt_ids=kw["txt_ids"],
        return_dict=False,
    )


def _renames(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(ours, diffusers) full names of every tensor that is only renamed."""
    modules = list(_ROOT)
    for i in range(cfg.num_layers):
        modules += [(f"double_blocks.{i}.{a}", f"transformer_blocks.{i}.{b}") for a, b in _DOUBLE]
    for i in range(cfg.num_single_layers):
        modules += [(f"single_blocks.{i}.{a}", f"single_transformer_blocks.{i}.{b}") for a, b in _SINGLE]
    names = [(f"{a}.{kind}", f"{b}.{kind}") for a, b in modules for kind in ("weight", "bias")]
    for i in range(cfg.num_layers):
        names += [(f"double_blocks.{i}.{a}.scale", f"transformer_blocks.{i}.{b}.weight") for a, b in _DOUBLE_NORMS]
    for i in range(cfg.num_single_layers):
        names += [
            (f"single_blocks.{i}.{a}.scale", f"single_transformer_blocks.{i}.{b}.weight") for a, b in _SINGLE_NORMS
        ]
    return names


def _fusions(cfg: ModelConfig) -> list[tuple[str, tuple[str, ...]]]:
    """(ours, diffusers parts) for every fused Linear, as module names."""
    fused = [
        (f"double_blocks.{i}.{a}", tuple(f"transformer_blocks.{i}.{p}" for p in parts))
        for i in range(cfg.num_layers)
        for a, parts in _DOUBLE_FUSED
    ]
    fused += [
        (f"single_blocks.{i}.{a}", tuple(f"single_transformer_blocks.{i}.{p}" for p in parts))
        for i in range(cfg.num_single_layers)
        for a, parts in _SINGLE_FUSED
    ]
    return fused


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    first, second = t.chunk(2, dim=0)
    return torch.cat((second, first), dim=0)


def to_diffusers(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {d: state[o] for o, d in _renames(cfg)}
    for ours, parts in _fusions(cfg):
        for kind in ("weight", "bias"):
            sizes = [state[f"{ours}.{kind}"].shape[0] // len(parts)] * len(parts)
            if len(parts) == 4:  # single block: q, k, v of `hidden` rows each, then the MLP input
                hidden = cfg.num_attention_heads * cfg.attention_head_dim
                sizes = [hidden] * 3 + [state[f"{ours}.{kind}"].shape[0] - 3 * hidden]
            for part, value in zip(parts, state[f"{ours}.{kind}"].split(sizes, dim=0)):
                out[f"{part}.{kind}"] = value
    for kind in ("weight", "bias"):
        out[f"{_FINAL_ADALN[1]}.{kind}"] = _swap_halves(state[f"{_FINAL_ADALN[0]}.{kind}"])
    return out


def from_diffusers(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    missing = [d for _, d in _renames(cfg) if d not in state]
    if missing:
        raise ValueError(
            f"not a diffusers FluxTransformer2DModel state of this flavor: no '{missing[0]}' "
            f"({len(missing)} tensors missing)"
        )
    out = {o: state[d] for o, d in _renames(cfg)}
    for ours, parts in _fusions(cfg):
        for kind in ("weight", "bias"):
            out[f"{ours}.{kind}"] = torch.cat([state[f"{p}.{kind}"] for p in parts], dim=0)
    for kind in ("weight", "bias"):
        out[f"{_FINAL_ADALN[0]}.{kind}"] = _swap_halves(state[f"{_FINAL_ADALN[1]}.{kind}"])
    return out


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_pretrained(path: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict from a local diffusers folder or BFL safetensors file (see module docstring)."""
    path = Path(path)
    if path.is_dir() and (path / "transformer" / "config.json").is_file():
        path = path / "transformer"
    if path.is_file() and path.suffix == ".safetensors":
        state = _read_safetensors([path])
        if "double_blocks.0.img_attn.qkv.weight" not in state:
            state = from_diffusers(state, cfg)
        return state
    if path.is_dir() and (path / "config.json").is_file():
        config = json.loads((path / "config.json").read_text())
        ours = diffusers_config(cfg)
        wrong = {k: (config.get(k), v) for k, v in ours.items() if k != "axes_dims_rope" and config.get(k, v) != v}
        if list(config.get("axes_dims_rope", ours["axes_dims_rope"])) != list(ours["axes_dims_rope"]):
            wrong["axes_dims_rope"] = (config["axes_dims_rope"], ours["axes_dims_rope"])
        if wrong:
            key, (theirs, want) = next(iter(wrong.items()))
            raise ValueError(f"{path}/config.json has {key}={theirs}, model flavor '{cfg.flavor}' has {want}")
        files = sorted(path.glob("diffusion_pytorch_model*.safetensors"))
        if not files:
            raise ValueError(f"{path}: no diffusion_pytorch_model*.safetensors files")
        return from_diffusers(_read_safetensors(files), cfg)
    raise ValueError(
        f"{path}: expected a diffusers transformer folder (config.json + safetensors), a FLUX.1 "
        "pipeline folder with transformer/, or a .safetensors file"
    )


def quiet_diffusers() -> None:
    """Silence what means nothing to someone exporting or sampling: notes on optional packages (torchao's
    "Failed to load ..." for kernels of other GPUs, accelerate, torchvision), deprecation notes, weight-loading
    progress bars, DCP's single-process notice. The loggers' levels are set before diffusers is imported: torchao
    writes its notes while diffusers imports it."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from diffusers.utils import logging as diffusers_logging  # sets its loggers' levels when imported: ours after

    libraries = [diffusers_logging]
    if importlib.util.find_spec("transformers"):  # the dataprep extra's: an export runs without it
        from transformers.utils import logging as transformers_logging

        libraries.append(transformers_logging)
    for library in libraries:
        library.set_verbosity_error()
        library.disable_progress_bar()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def save_diffusers(state: dict[str, torch.Tensor], cfg: ModelConfig, out: str | Path) -> None:
    """Write our state dict as a diffusers FluxTransformer2DModel folder (config.json + safetensors)."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**diffusers_config(cfg))
    model.load_state_dict(to_diffusers(state, cfg), assign=True, strict=True)
    model.save_pretrained(str(out), safe_serialization=True)
    # the weights file is written through a private temporary file (mode 0600)
    for f in Path(out).iterdir():
        if f.is_file():
            give_default_mode(f)


def give_default_mode(path: Path) -> None:
    """The mode any file created here gets (the umask's), for a file written through a private temporary file
    (mode 0600): the team can read an export."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)
