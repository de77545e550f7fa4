"""Every export is loaded back as its users load it before `checkpoint export` reports success: a diffusers folder by
`FluxTransformer2DModel.from_pretrained`, a black-forest-labs single file by `FluxTransformer2DModel.from_single_file`
(given the flavor's config from a local folder: nothing downloads), then one forward pass of it is compared with our
model's on the checkpoint's weights, in float32 on the CPU. A wrong split, swap or name differs by the order of the
output itself; float32's rounding stays far below TOLERANCE. An export that fails the check is removed."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from flux_train.config import ModelConfig
from flux_train.errors import UserError
from flux_train.kernels import RMSNorm
from flux_train.model import flow
from flux_train.model.diffusers_adapter import diffusers_config, diffusers_inputs
from flux_train.model.flux import build_model
from flux_train.training.checkpoint import brief

LOADERS = {"diffusers": "FluxTransformer2DModel.from_pretrained", "bfl": "FluxTransformer2DModel.from_single_file"}
TOLERANCE = 1e-3  # relative (L2) difference of the two outputs


class ExportCheckError(UserError):
    """An export that does not load, or does not compute what the checkpoint's model computes."""

    exit_code = 1


def probe_inputs(mcfg: ModelConfig) -> dict:
    """One sample of seeded random inputs in our model's keywords: 4 x 4 image patches, 8 text tokens."""
    g = torch.Generator().manual_seed(0)
    return dict(
        img=torch.randn(1, 16, mcfg.in_channels, generator=g),
        img_ids=flow.image_ids(8, 8),
        txt=torch.randn(1, 8, mcfg.joint_attention_dim, generator=g),
        txt_ids=flow.text_ids(8),
        timesteps=torch.tensor([0.5]),
        y=torch.randn(1, mcfg.pooled_projection_dim, generator=g),
    )


@torch.no_grad()
def our_output(mcfg: ModelConfig, weights: dict[str, torch.Tensor], inputs: dict) -> torch.Tensor:
    """Our model's output with `weights` (taken out of the dict one at a time as their float32 copies go in: the
    model is held once, also for a bf16 checkpoint)."""
    with torch.device("meta"):
        model = build_model(mcfg, rmsnorm_impl="torch")
    model.load_state_dict({name: weights.pop(name).float() for name in list(weights)}, assign=True, strict=True)
    for norm in model.modules():  # diffusers' Q/K norms take eps 1e-6, ours the reference's: the check is of weights
        if isinstance(norm, RMSNorm):
            norm.eps = 1e-6
    return model(**inputs)


def load_export(out: Path, fmt: str, mcfg: ModelConfig):
    """The export as a float32 FluxTransformer2DModel, loaded the way its users load it."""
    from diffusers import FluxTransformer2DModel

    if fmt == "diffusers":
        return FluxTransformer2DModel.from_pretrained(str(out), torch_dtype=torch.float32, local_files_only=True)
    with tempfile.TemporaryDirectory() as config:
        config_file = Path(config) / "config.json"
        config_file.write_text(json.dumps({"_class_name": "FluxTransformer2DModel", **diffusers_config(mcfg)}))
        return FluxTransformer2DModel.from_single_file(
            str(out), config=config, torch_dtype=torch.float32, local_files_only=True
        )


def check_export(mcfg: ModelConfig, weights: dict[str, torch.Tensor], out: Path, fmt: str) -> float:
    """Load the export at `out` (format `fmt`) and compare one forward pass with our model's on `weights` (the
    checkpoint's, consumed); returns the relative difference. A failed load or a difference above TOLERANCE
    removes the export and raises ExportCheckError."""
    inputs = probe_inputs(mcfg)
    want = our_output(mcfg, weights, inputs)
    try:
        with torch.no_grad():
            got = load_export(out, fmt, mcfg)(**diffusers_inputs(inputs))[0]
        difference = float((got - want).norm() / want.norm().clamp_min(torch.finfo(torch.float32).tiny))
    except Exception as exc:  # noqa: BLE001 - whatever stops a user loading it stops the export
        why = f"does not load with {LOADERS[fmt]} ({brief(exc)})"
    else:
        if difference <= TOLERANCE:
            return difference
        why = (
            f"loaded with {LOADERS[fmt]} computes another output than the checkpoint's model (relative difference "
            f"{difference:.2g} in one forward pass, more than {TOLERANCE:g})"
        )
    if out.is_dir():
        shutil.rmtree(out)
    else:
        out.unlink()
    raise ExportCheckError(f"the export {out} {why}; it was removed: report this with the checkpoint's config")
