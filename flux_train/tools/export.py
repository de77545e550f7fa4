"""`python -m flux_train.checkpoint export`: a checkpoint's model as a diffusers `FluxTransformer2DModel` folder,
or as one .safetensors file in black-forest-labs' layout (`flux1-schnell.safetensors`, what ComfyUI and Forge read:
our parameter names are theirs), written in one process without a GPU or a process group, then loaded back as
diffusers loads it and checked against the checkpoint's model (flux_train.tools.export_check).

    python -m flux_train.checkpoint export --config CFG --checkpoint DIR/step_00001234 --out FOLDER
    python -m flux_train.checkpoint export --format bfl --config CFG --checkpoint DIR --out FILE.safetensors
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dataprep.staging import staging_file, staging_folder
from flux_train.cli import checkpoint_parser
from flux_train.config import ConfigError, ModelConfig, load_config
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


@contextlib.contextmanager
def staged(out: Path, flag: str, make: Callable[[Path], Path]) -> Iterator[Path]:
    """A staging name of its own beside `out` (`make`: dataprep.staging's folder or file), to be written and renamed
    into place: on any failure it is removed, and a failed write (no such place, a full disk: safetensors raises an
    error of its own for it) is one line."""
    from safetensors import SafetensorError

    partial = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = make(out)
        yield partial
    except BaseException as exc:
        if partial is not None and partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        elif partial is not None:
            partial.unlink(missing_ok=True)
        if isinstance(exc, (OSError, SafetensorError)):
            raise StorageError(f"writing the export {flag} {out} failed ({brief(exc)})") from None
        raise


def write_export(weights: dict[str, torch.Tensor], mcfg, out: Path, flag: str) -> None:
    """`weights` as a diffusers folder at `out` (check_new_folder's), written into a staging folder of its own beside
    it and renamed into place when complete: a folder of the user's is never written into or removed."""
    from flux_train.model.diffusers_adapter import save_diffusers

    check_new_folder(out, flag)
    with staged(out, flag, staging_folder) as partial:
        save_diffusers(weights, mcfg, partial)
        partial.rename(out)


def export_checkpoint(cfg, checkpoint: Path, out: Path) -> None:
    """Offline export of a DCP checkpoint's weights as a diffusers folder at `out` (write_export)."""
    from flux_train.model.diffusers_adapter import quiet_diffusers

    quiet_diffusers()
    check_new_folder(out, "--out")  # before the weights are read
    write_export(read_weights(cfg, checkpoint), cfg.model, out, "--out")


# FLUX.1's hidden size: the single-file layout's readers take it as given (diffusers' from_single_file and ComfyUI
# split the fused q/k/v/MLP weights at 3072 and 4 x 3072, whatever the file holds)
BFL_HIDDEN = 3072


def check_single_file_target(mcfg: ModelConfig, out: Path) -> None:
    """Refuse, before any reading, an export in black-forest-labs' layout that no reader of it could load, or one
    that would overwrite a file."""
    hidden = mcfg.num_attention_heads * mcfg.attention_head_dim
    if hidden != BFL_HIDDEN:
        raise UserError(
            f"--format bfl: its readers (ComfyUI, diffusers' from_single_file) assume FLUX.1's hidden size "
            f"{BFL_HIDDEN}; model flavor '{mcfg.flavor}' has {hidden}: export it as a diffusers folder (--format "
            "diffusers)"
        )
    if out.suffix != ".safetensors":
        raise UserError(f"--out {out}: --format bfl writes one .safetensors file; give a path ending in .safetensors")
    if out.exists() or out.is_symlink():
        raise UserError(f"--out {out} exists; give a new file to write the export into (nothing is overwritten)")


def export_single_file(cfg, checkpoint: Path, out: Path) -> None:
    """Offline export of a DCP checkpoint's weights as one .safetensors file under our (black-forest-labs')
    parameter names, in the dtype the checkpoint holds; written beside `out` under a name of its own and renamed into
    place when complete."""
    from safetensors.torch import save_file

    from flux_train.model.diffusers_adapter import give_default_mode

    weights = read_weights(cfg, checkpoint)
    with staged(out, "--out", staging_file) as partial:
        save_file(weights, str(partial))
        give_default_mode(partial)  # safetensors writes through a private temporary file (mode 0600)
        partial.rename(out)


@reports_user_errors
def main(argv=None) -> int:
    from flux_train.model.diffusers_adapter import quiet_diffusers
    from flux_train.tools.export_check import LOADERS, check_export

    args = checkpoint_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    out = Path(args.out)
    if args.format == "bfl":
        check_single_file_target(cfg.model, out)
    path = find_checkpoint(Path(args.checkpoint))
    quiet_diffusers()  # before the reads: DCP's note on reading in one process
    if args.format == "bfl":
        export_single_file(cfg, path, out)
    else:
        export_checkpoint(cfg, path, out)
    difference = check_export(cfg.model, read_weights(cfg, path), out, args.format)
    print(
        f"exported {path} -> {out} (loaded back with {LOADERS[args.format]}; its forward pass differs from the "
        f"checkpoint's model by {difference:.1g}, relative)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
