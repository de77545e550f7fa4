"""torch.distributed from the environment: the process group, the data-parallel mesh, the sum over ranks, the
teardown, and the one-line reports of a step that ran out of memory or whose collective failed.

A run always has a process group (world size 1 when started without a launcher), so one code path
shards, reduces and checkpoints whether it runs on one CPU or on many nodes.
"""

from __future__ import annotations

import datetime
import gc
import os
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from flux_train.config import ConfigError, ParallelConfig, mesh_shape
from flux_train.errors import raise_on_every_rank
from flux_train.training.heartbeat import stragglers


@dataclass
class Dist:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(choice: str, local_rank: int, is_main: bool) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():  # before init_start: a bad input, one line for the run
        error = ConfigError("train.device=cuda but no GPU is visible here; use train.device=cpu or auto")
        raise_on_every_rank(error, is_main)
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(pcfg: ParallelConfig, device_choice: str = "auto", flight_recorder_dir: str | None = None) -> Dist:
    """The process group (timeout parallel.timeout_s) and mesh. With NCCL, `flight_recorder_dir` receives torch's
    flight-recorder dump of every rank's last collectives when one times out."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = pick_device(device_choice, local_rank, rank == 0)
    backend = pcfg.backend if pcfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=pcfg.timeout_s)
        if backend == "nccl" and flight_recorder_dir:  # read by ProcessGroupNCCL when the group is created
            Path(flight_recorder_dir).mkdir(parents=True, exist_ok=True)
            os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(Path(flight_recorder_dir) / "rank_"))
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world,
                timeout=timeout,
                device_id=device if device.type == "cuda" else None,
            )
        else:  # plain `python -m flux_train.train`: a one-process group, no network
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    mesh = build_mesh(pcfg, world, local_world, device.type)
    return Dist(rank, world, device, mesh)


def build_mesh(pcfg: ParallelConfig, world: int, local_world: int, device_type: str) -> DeviceMesh:
    """The (dp_replicate, dp_shard) mesh. Its process groups are made here with parallel.timeout_s: the ones
    init_device_mesh makes wait torch's 30-minute default, so one stopped rank would hang every other node."""
    replicate, shard = mesh_shape(pcfg, world, local_world)
    layout = torch.arange(world).view(replicate, shard)
    timeout = datetime.timedelta(seconds=pcfg.timeout_s)
    groups = [
        typing.cast(dist.ProcessGroup, dist.new_subgroups_by_enumeration(ranks.tolist(), timeout=timeout)[0])
        for ranks in (layout.T, layout)
    ]
    return DeviceMesh.from_group(groups, device_type, mesh=layout, mesh_dim_names=("dp_replicate", "dp_shard"))


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def shutdown() -> None:
    """Destroy the process groups and collect them now, while the interpreter runs: left to interpreter exit,
    a gloo group's worker thread can still be finishing a collective's callback, and Python ends threads that
    ask for the GIL during finalization -- which aborts the process ("terminate called without an active
    exception") after all its work is done."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's allocator out of memory, or a library's: NCCL's buffers surface as a failed calloc, cuBLAS's
    workspace as CUBLAS_STATUS_ALLOC_FAILED."""
    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or any(
        m in text for m in ("cuda calloc", "alloc_failed", "out of memory")
    )


def out_of_memory_line(exc: BaseException, rank: int) -> str | None:
    """One line for an out-of-memory anywhere in the step -- torch's allocator, NCCL's own buffers ("Failed to CUDA
    calloc") or a library's workspace -- else None."""
    if not is_out_of_memory(exc):
        return None
    text = str(exc)
    held = ""
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
        held = f" (torch's peak {torch.cuda.max_memory_allocated() / 2**30:.1f} of {total:.1f} GiB)"
    return (
        f"out of GPU memory on rank {rank}{held}: {type(exc).__name__}: {text.strip().splitlines()[0][:160]}; "
        "lower train.micro_batch_size (accumulation keeps the global batch) or take parallel.strategy=fsdp "
        "(1/GPUs of the model state per GPU)"
    )


def collective_failure_line(exc: BaseException, out_dir: str) -> str | None:
    """One line for a collective that failed or timed out (parallel.timeout_s; gloo says "Timed out"), naming the
    ranks whose heartbeats stopped first -- else None."""
    if not (isinstance(exc, dist.DistError) or "Timed out" in str(exc)):
        return None
    world = dist.get_world_size() if dist.is_initialized() else 0
    who = stragglers(Path(out_dir) / "heartbeats", world) if world else "unknown"
    rank = dist.get_rank() if world else "?"
    return f"collective failed on rank {rank} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); {who}"


def reduce_dtype(pcfg: ParallelConfig, compute_dtype: torch.dtype) -> torch.dtype:
    """fsdp: the gradient reduce-scatter's dtype (auto: fp32, as the reference reduces). ddp: the cross-node
    all-reduce's, the reduce-scatter within a node summing the compute dtype (auto: the compute dtype, as the
    MLPerf submissions reduce: docs/benchmark.md "Gradient reduction precision")."""
    if pcfg.reduce_dtype == "auto":
        return torch.float32 if pcfg.strategy == "fsdp" else compute_dtype
    return torch.float32 if pcfg.reduce_dtype == "float32" else torch.bfloat16
