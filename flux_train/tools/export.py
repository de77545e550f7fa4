"""`python -m flux_train.checkpoint export`: a checkpoint's model as a diffusers `FluxTransformer2DModel` folder,
written in one process without a GPU or a process group.

    python -m flux_train.checkpoint export --config CFG --checkpoint DIR/step_00001234 --out FOLDER
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dataprep.staging import staging_folder
from flux_train.cli import checkpoint_parser
from flux_train.config import ConfigError, load_config
from flux_train.errors import StorageError, UserError, reports_user_errors
from flux_train.training.checkpoint import (
    PROGRESS,
    CheckpointError,
    brief,
    failure_text,
    list_checkpoints,
    model_mismatch,
    unreadable,
)


def find_checkpoint(path: Path) -> Path:
    """`path` if it is a complete checkpoint, else the latest complete one in it (--checkpoint's meaning)."""
    if (path / PROGRESS).is_file():
        return path
    found = list_checkpoints(path)
    if not found:
        raise UserError(
            f"--checkpoint {path}: no complete checkpoint there (a step_XXXXXXXX folder with progress.pt, or the "
            "folder holding them)"
        )
    return found[-1]


def read_weights(cfg, checkpoint: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint's model weights (our layout), read in one process (no GPU, no process group). fsdp runs
    save fp32 weights, ddp runs their bf16 copy (the fp32 master is sharded by flat position, not by tensor)."""
    from flux_train.model.flux import build_model

    why = unreadable(checkpoint)
    if why:
        raise CheckpointError(f"checkpoint {checkpoint} cannot be read: {why}; give another step_XXXXXXXX folder")
    mismatch = model_mismatch(cfg.model, checkpoint)
    if mismatch:
        raise ConfigError(
            f"checkpoint {checkpoint} does not hold model flavor '{cfg.model.flavor}' ({mismatch}); pass the config "
            "the run trained with"
        )
    model = build_model(cfg.model, rmsnorm_impl="torch")
    model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    try:
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    except CheckpointException as exc:
        raise CheckpointError(f"checkpoint {checkpoint} could not be read ({failure_text(exc)})") from None
    return state["model"]


def check_new_folder(out: Path, flag: str) -> None:
    """Refuse an export's destination that holds anything: nothing there is written into (an empty folder aside)."""
    if out.is_symlink() or (out.exists() and not (out.is_dir() and not any(out.iterdir()))):
        raise UserError(f"{flag} {out} exists; give a new folder to write the export into (nothing is overwritten)")


def write_export(weights: dict[str, torch.Tensor], mcfg, out: Path, flag: str) -> None:
    """`weights` as a diffusers folder at `out` (check_new_folder's), written into a staging folder of its own beside
    it and renamed into place when complete: a folder of the user's is never written into or removed."""
    from safetensors import SafetensorError

    from flux_train.model.diffusers_adapter import save_diffusers

    check_new_folder(out, flag)
    partial = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = staging_folder(out)
        save_diffusers(weights, mcfg, partial)
        partial.rename(out)
    except BaseException as exc:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        if isinstance(exc, (OSError, SafetensorError)):  # safetensors' for a failed write (a full disk)
            raise StorageError(f"writing the export {flag} {out} failed ({brief(exc)})") from None
        raise


def export_checkpoint(cfg, checkpoint: Path, out: Path) -> None:
    """Offline export of a DCP checkpoint's weights as a diffusers folder at `out` (write_export)."""
    from flux_train.model.diffusers_adapter import quiet_diffusers

    quiet_diffusers()
    check_new_folder(out, "--out")  # before the weights are read
    write_export(read_weights(cfg, checkpoint), cfg.model, out, "--out")


@reports_user_errors
def main(argv=None) -> int:
    args = checkpoint_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    path = find_checkpoint(Path(args.checkpoint))
    export_checkpoint(cfg, path, Path(args.out))
    print(f"exported {path} -> {args.out} (load with FluxTransformer2DModel.from_pretrained)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
