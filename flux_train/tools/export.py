"""`python -m flux_train.checkpoint export`: a checkpoint's model as a diffusers `FluxTransformer2DModel` folder,
written in one process without a GPU or a process group.

    python -m flux_train.checkpoint export --config CFG --checkpoint DIR/step_00001234 --out FOLDER
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from flux_train.cli import checkpoint_parser
from flux_train.config import ConfigError, load_config
from flux_train.errors import StorageError, UserError, reports_user_errors
from flux_train.training.checkpoint import brief, find_checkpoint, read_weights


def export_checkpoint(cfg, checkpoint: Path, out: Path) -> None:
    """Offline export of a DCP checkpoint's weights as a diffusers folder, written beside it and renamed into place
    when complete; nothing that exists at `out` is written into (an empty folder aside)."""
    from flux_train.model.diffusers_adapter import quiet_diffusers, save_diffusers

    quiet_diffusers()
    if out.is_symlink() or (out.exists() and not (out.is_dir() and not any(out.iterdir()))):
        raise UserError(f"--out {out} exists; give a new folder to write the export into (nothing is overwritten)")
    weights = read_weights(cfg, checkpoint)
    partial = out.with_name(out.name + ".partial")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        save_diffusers(weights, cfg.model, partial)
        partial.rename(out)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise StorageError(f"writing the export {out} failed ({brief(exc)})") from None


@reports_user_errors
def main(argv=None) -> int:
    args = checkpoint_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    path = find_checkpoint(Path(args.checkpoint))
    if path is None:
        raise ConfigError(
            f"--checkpoint {args.checkpoint}: no complete checkpoint there (a step_XXXXXXXX folder "
            "with progress.pt, or the folder holding them)"
        )
    export_checkpoint(cfg, path, Path(args.out))
    print(f"exported {path} -> {args.out} (load with FluxTransformer2DModel.from_pretrained)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
