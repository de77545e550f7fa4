"""Checkpoints: DCP save/resume of model, optimizer and progress, per-rank loader state, atomic, last K kept;
export of the model to a diffusers folder.

Layout: <dir>/step_00001234/ holds the DCP shards of {"model", "optim"}, `loader_rank<r>.pt` per rank and
`progress.pt` (step, eval count, world size, strategy). A save goes to `step_XXXX.tmp/` and is renamed once
every rank has finished, so a crash mid-save leaves the previous checkpoint the latest valid one. No RNG
state is needed: every random stream is seeded from (seed, step, micro-batch) (flow.seeded_generator).

With `checkpoint.async_save` a save copies the state to host memory and returns (on a GPU into pinned buffers
that are kept for the next save: several times faster than pageable copies); the files are written by a
background thread (over a gloo group of its own, so training's collectives are not shared with it) while
training goes on, and the checkpoint is completed (renamed) when the next save starts or the run ends.

    python -m flux_train.checkpoint export --config CFG --checkpoint DIR/step_00001234 --out FOLDER
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from flux_train.config import ConfigError
from flux_train.errors import Parser, reports_user_errors

STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoint_dir(cfg) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.logging.out_dir) / "checkpoints")


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary `.tmp` folders of interrupted saves are ignored)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / "progress.pt").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def resolve_resume(cfg) -> Path | None:
    """`checkpoint.resume`: auto = the latest complete checkpoint if any, none = fresh, else a path."""
    choice = cfg.checkpoint.resume
    if choice == "none":
        return None
    if choice == "auto":
        found = list_checkpoints(checkpoint_dir(cfg))
        return found[-1] if found else None
    path = Path(choice)
    if not (path / "progress.pt").is_file():
        raise ConfigError(
            f"checkpoint.resume={choice}: not a complete checkpoint folder (no progress.pt); use a "
            "step_XXXXXXXX folder, auto (the latest in checkpoint.dir) or none"
        )
    return path


class Checkpointer:
    """Collective saves of a training layout (parallel.FSDPTraining or ddp.DDP) under `root`, last `keep` kept."""

    def __init__(self, root: Path, keep: int, async_save: bool = False, every_steps: int = 0):
        self.root, self.keep, self.async_save, self.every_steps = root, keep, async_save, every_steps
        # the background writer's collectives run on a gloo group of their own
        self.group = dist.new_group(backend="gloo") if async_save else None
        self.pending: tuple | None = None  # (future, tmp folder, final folder, progress) of an async save
        self.stager = None
        if async_save and torch.cuda.is_available():
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            # pinned host buffers, allocated at the first save and reused; the copy ends before save returns
            # (DefaultStager with pinned memory failed at its second save with torch 2.11: KeyError <class 'type'>)
            self.stager = BlockingAsyncStager(cache_staged_state_dict=True)

    def due(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def save(self, step: int, training, loader_state: dict, progress: dict) -> Path:
        """Write a checkpoint of the current state; returns its final folder (complete on return unless async)."""
        self.wait()
        rank = dist.get_rank()
        final, tmp = self.root / f"step_{step:08d}", self.root / f"step_{step:08d}.tmp"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        torch.save(loader_state, tmp / f"loader_rank{rank}.pt")
        if self.async_save:
            future = dcp.async_save(
                training.state_dict(), checkpoint_id=str(tmp), process_group=self.group, async_stager=self.stager
            )
            self.pending = (future, tmp, final, progress)
        else:
            dcp.save(training.state_dict(), checkpoint_id=str(tmp))
            self._complete(tmp, final, progress)
        return final

    def wait(self) -> Path | None:
        """Finish an async save in flight (collective); returns its folder."""
        if self.pending is None:
            return None
        future, tmp, final, progress = self.pending
        self.pending = None
        future.result()
        self._complete(tmp, final, progress)
        return final

    def close(self) -> None:
        """At the end of the run: the save in flight finished, the pinned buffers released."""
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def _complete(self, tmp: Path, final: Path, progress: dict) -> None:
        dist.barrier(group=self.group)
        if dist.get_rank() == 0:
            torch.save(progress, tmp / "progress.pt")  # written last: its presence marks a complete checkpoint
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for old in list_checkpoints(self.root)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier(group=self.group)


def load(path: Path, training) -> tuple[dict, dict]:
    """Collective: restores weights and optimizer in place; returns (progress, this rank's loader state)."""
    progress = torch.load(path / "progress.pt", weights_only=True)
    world = dist.get_world_size()
    if progress["world_size"] != world:
        raise RuntimeError(
            f"checkpoint {path} was written by {progress['world_size']} ranks, this run has {world}; "
            "the loader state cannot be split differently (resume with the same node/GPU count)"
        )
    if progress.get("strategy", "fsdp") != training.strategy:
        raise RuntimeError(
            f"checkpoint {path} was written with parallel.strategy={progress.get('strategy', 'fsdp')}, "
            f"this run uses {training.strategy}; resume with the same strategy"
        )
    state = training.state_dict()
    dcp.load(state, checkpoint_id=str(path))
    training.load_state_dict(state)
    loader = torch.load(path / f"loader_rank{dist.get_rank()}.pt", weights_only=True)
    return progress, loader


def find_checkpoint(path: Path) -> Path | None:
    """`path` if it is a complete checkpoint, else the latest complete one in it; None if there is none."""
    if (path / "progress.pt").is_file():
        return path
    found = list_checkpoints(path)
    return found[-1] if found else None


def read_weights(cfg, checkpoint: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint's model weights (our layout), read in one process (no GPU, no process group). fsdp runs
    save fp32 weights, ddp runs their bf16 copy (the fp32 master is sharded by flat position, not by tensor)."""
    from flux_train.model import build_model

    model = build_model(cfg.model, rmsnorm_impl="torch")
    model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    saved = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    for name, tensor in state["model"].items():
        have = saved.get(f"model.{name}")
        if have is None or tuple(have.size) != tuple(tensor.shape):
            raise ConfigError(
                f"checkpoint {checkpoint} does not hold model flavor '{cfg.model.flavor}' ('{name}' is "
                f"{tuple(have.size) if have else 'missing'} there, {tuple(tensor.shape)} here); pass "
                "the config the run trained with"
            )
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return state["model"]


def export_checkpoint(cfg, checkpoint: Path, out: Path) -> None:
    """Offline export of a DCP checkpoint's weights as a diffusers folder."""
    from flux_train.diffusers_adapter import save_diffusers

    save_diffusers(read_weights(cfg, checkpoint), cfg.model, out)


@reports_user_errors
def main(argv=None) -> int:
    from flux_train.config import load_config

    p = Parser(prog="python -m flux_train.checkpoint")
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a checkpoint's model as a diffusers FluxTransformer2DModel folder")
    ex.add_argument("--config", required=True, help="the run's config (for the model flavor)")
    ex.add_argument("--checkpoint", required=True, help="a step_XXXXXXXX folder, or a checkpoint dir (latest)")
    ex.add_argument("--out", required=True, help="the diffusers folder to write (config.json + safetensors)")
    ex.add_overrides()
    args = p.parse_args(argv)
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
