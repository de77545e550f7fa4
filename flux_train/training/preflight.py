"""Pre-flight: find a bad node before the clock starts (`preflight.enabled`, before MLLOG init_start).

Every node checks itself (its first worker): the GPUs it should have, of the expected kind, idle (no memory
taken by another process), free disk where checkpoints and logs go, the dataset readable with its splits.
Then every rank joins one all-reduce bandwidth probe over the whole allocation. Any failure ends every rank
with one line per bad node naming the host, the reason and how to leave the node out.

    torchrun --nproc_per_node=8 -m flux_train.training.preflight [--config CFG] [--set k=v]   # the probe alone
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dataprep.format import METADATA
from flux_train.cli import preflight_parser
from flux_train.config import (
    Config,
    ConfigError,
    checkpoint_dir,
    graph_blocker,
    graphs_on,
    load_config,
)
from flux_train.errors import UserError, reports_user_errors
from flux_train.hardware import named
from flux_train.kernels.triton_support import HAVE_TRITON, kernels_run_on
from flux_train.model.flux import build_model, count_params
from flux_train.training.checkpoint_size import checkpoint_disk_gb
from flux_train.training.heartbeat import node_name

if TYPE_CHECKING:  # energon is imported only for real data
    from flux_train.data.energon import DatasetFiles

# a worker's own CUDA context and allocator reserve; more in use before the run allocates means another process
IDLE_GPU_USED_GIB = 4.0


class PreflightError(UserError):
    """One or more nodes failed pre-flight; the message has one line per node ("pre-flight: HOST: ...")."""

    label = ""


def node_problems(cfg: Config, device: torch.device, gpus_per_node: int) -> list[str]:
    """This node's reasons to refuse the run (empty: fit): its GPUs, the free disk and writability of the run's
    folders, the dataset."""
    gpus = gpu_problems(cfg.preflight.gpu_name, gpus_per_node) if device.type == "cuda" else []
    return gpus + folder_problems(cfg) + dataset_problems(cfg)


def gpu_problems(gpu_name: str, gpus_per_node: int) -> list[str]:
    """Too few GPUs, one of another kind than `gpu_name` (preflight.gpu_name), or one another process uses."""
    problems = []
    count = torch.cuda.device_count()
    if count < gpus_per_node:
        problems.append(f"{count} GPUs visible, the run needs {gpus_per_node}")
    for i in range(min(count, gpus_per_node)):
        name = torch.cuda.get_device_name(i)
        if gpu_name and not named(gpu_name, name):  # as the table's kinds are found: a GH200 is no H200
            problems.append(f"GPU {i} is a {name}, expected {gpu_name} (preflight.gpu_name)")
        free, total = torch.cuda.mem_get_info(i)
        if (total - free) / 2**30 > IDLE_GPU_USED_GIB:
            problems.append(f"GPU {i} has {(total - free) / 2**30:.1f} GiB in use by another process")
    return problems


def folder_problems(cfg: Config) -> list[str]:
    """The checkpoint and log folders: less free disk than the run needs, or not writable."""
    p = cfg.preflight
    floor = p.min_free_disk_gb if p.min_free_disk_gb is not None else checkpoint_disk_gb(cfg)
    problems = []
    for what, folder in (
        ("checkpoint", checkpoint_dir(cfg)),
        ("log", cfg.logging.out_dir),
    ):
        existing = Path(folder)
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        free_gb = shutil.disk_usage(existing).free / 1e9
        if free_gb < floor:
            problems.append(
                f"{free_gb:.0f} GB free for the {what} folder {folder}, the run needs {floor:.3g} "
                f"(preflight.min_free_disk_gb; unset: checkpoint.keep + 1 checkpoints)"
            )
        unwritable = not_writable(Path(folder))
        if unwritable:
            problems.append(f"the {what} folder {folder} is not writable here ({unwritable})")
    return problems


def dataset_problems(cfg: Config) -> list[str]:
    """The energon dataset not readable on this node, or without its splits."""
    if cfg.data.source != "energon" or not cfg.data.path:
        return []
    root = Path(cfg.data.path)
    if not (root / ".nv-meta" / "dataset.yaml").is_file():
        return [f"dataset {root} is not readable here (no .nv-meta/dataset.yaml): mount it on every node"]
    missing = [split for split in ("train", "val") if not (root / split).is_dir()]
    return [f"dataset {root} has no {' or '.join(missing)}/ split"] if missing else []


def not_writable(folder: Path) -> str | None:
    """Why this node cannot write into `folder` (None: it can): found by writing, since permission bits do not
    tell (a read-only mount, root squashed on NFS, a quota); the folder is created as the run would."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".preflight-"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def bus_bandwidth(device: torch.device, size_mb: int, iters: int = 5) -> tuple[float, float]:
    """(all-reduce bus bandwidth in GB/s over all ranks, seconds the probe took): busbw = 2(n-1)/n x bytes / t."""
    world = dist.get_world_size()
    x = torch.ones(size_mb * 2**20 // 4, device=device)
    t0 = time.perf_counter()
    dist.all_reduce(x)  # warm-up: connections, buffers
    if device.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    per_op = (time.perf_counter() - t1) / iters
    busbw = 2 * (world - 1) / max(world, 1) * x.numel() * 4 / per_op / 1e9
    return busbw, time.perf_counter() - t0


def check_inputs(cfg: Config, device: torch.device, world_size: int) -> DatasetFiles | None:
    """Inputs that would otherwise fail after init_start, or after minutes of building: one line each (on every
    run, pre-flight or not). Returns the dataset's files it checked (energon), for the loaders to build on."""
    if cfg.data.source == "energon" and cfg.data.path and not Path(cfg.data.path).is_dir():
        what = "is a file, not a folder" if Path(cfg.data.path).exists() else "does not exist here"
        raise ConfigError(
            f"data.path {cfg.data.path} {what}; point it at the prepared dataset (python -m dataprep) or use "
            "data.source=synthetic"
        )
    if device.type == "cuda" and cfg.perf.attention in ("flash", "cudnn"):
        if cfg.train.compute_dtype == "float32":
            raise ConfigError(
                f"perf.attention={cfg.perf.attention} needs train.compute_dtype=bfloat16 (it has no fp32 "
                "kernel); set perf.attention=auto for fp32 runs"
            )
    blocker = graph_blocker(cfg, device.type) if cfg.perf.cuda_graphs is True else None
    if blocker:
        raise ConfigError(blocker)
    if cfg.perf.rmsnorm == "triton" and not kernels_run_on(device):
        raise ConfigError(
            f"perf.rmsnorm=triton needs a GPU and Triton, this run has {device.type}"
            f"{'' if HAVE_TRITON else ' and no Triton'}; set perf.rmsnorm=auto or torch"
        )
    files = None
    if cfg.data.source == "energon":
        from flux_train.data.energon import dataset_files  # energon is needed only for real data

        files = dataset_files(cfg)  # its description of itself against the model, before anything is built
    if graphs_on(cfg, device.type):
        check_graph_latents(cfg, files)
    if device.type == "cpu":
        need = count_params(build_model(cfg.model)) * 16 * world_size  # weights, grads, AdamW, fp32
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > have:
            raise ConfigError(
                f"model {cfg.model.flavor} needs ~{need / 2**30:.0f} GiB on the CPU, this host has "
                f"{have / 2**30:.0f} GiB; use GPUs (train.device=cuda) or configs/debug.yaml"
            )
    return files


def check_graph_latents(cfg: Config, files: DatasetFiles | None) -> None:
    """The step graph is captured in the warm-up on latents of perf.warmup_latent_size and replays only batches of
    that shape: data of another size would stop the run at its first step, after run_start."""
    if files is None:
        height = width = cfg.data.synthetic_latent_size
        said = "data.synthetic_latent_size"
    elif files.dims.info is not None:
        height, width = files.dims.info.shape.height, files.dims.info.shape.width
        said = f"{files.path / METADATA}"
    else:  # a dataset that does not describe itself: the graph's own check names the first batch
        return
    side = cfg.perf.warmup_latent_size
    if (height, width) != (side, side):
        fix = f"set perf.warmup_latent_size={height}" if height == width else "the graph needs square latents"
        raise ConfigError(
            f"perf.cuda_graphs: the data's latents are {height}x{width} ({said}), the step graph is captured on "
            f"{side}x{side} (perf.warmup_latent_size): {fix}, or perf.cuda_graphs=false"
        )


def run(cfg: Config, device: torch.device, local_rank: int, gpus_per_node: int) -> float:
    """Collective over all ranks; returns the measured bus bandwidth or raises PreflightError."""
    host = node_name()
    mine = node_problems(cfg, device, gpus_per_node) if local_rank == 0 else []
    busbw, seconds = bus_bandwidth(device, cfg.preflight.probe_mb) if dist.get_world_size() > 1 else (0.0, 0.0)
    floor = cfg.preflight.min_bus_bandwidth_gbps
    if dist.get_world_size() > 1 and dist.get_rank() == 0 and busbw < floor:
        mine.append(
            f"all-reduce bus bandwidth over the {dist.get_world_size()} ranks is {busbw:.1f} GB/s, below "
            f"preflight.min_bus_bandwidth_gbps {floor:g} (the slowest link sets it)"
        )
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (host, mine))
    bad = {}
    for where, problems in reports:
        bad.setdefault(where, []).extend(problems)
    lines = [
        f"pre-flight: {h}: {'; '.join(ps)} -- leave it out with `python -m flux_train.submit ... --exclude {h}`"
        for h, ps in bad.items()
        if ps
    ]
    if lines:
        raise PreflightError("\n".join(lines))
    if dist.get_rank() == 0 and dist.get_world_size() > 1:
        print(
            f"pre-flight: {len(bad)} node(s) fit; all-reduce bus bandwidth {busbw:.1f} GB/s over "
            f"{dist.get_world_size()} ranks ({cfg.preflight.probe_mb} MB, probe took {seconds:.1f} s)",
            flush=True,
        )
    return busbw


@reports_user_errors
def main(argv=None) -> int:
    from flux_train.training.distributed import init_distributed, shutdown

    args = preflight_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    try:
        d = init_distributed(cfg.parallel, cfg.train.device)
        run(cfg, d.device, int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
