"""torch.distributed from the environment, the data-parallel mesh, FSDP2/HSDP wrapping.

A run always has a process group (world size 1 when started without a launcher), so one code path
shards, reduces and checkpoints whether it runs on one CPU or on many nodes.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flux_train.config import ParallelConfig


@dataclass
class Dist:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no GPU is visible; use train.device=cpu or auto")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(pcfg: ParallelConfig, device_choice: str = "auto", timeout_min: int = 30) -> Dist:
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = pick_device(device_choice, local_rank)
    backend = pcfg.backend if pcfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_min)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                                    device_id=device if device.type == "cuda" else None)
        else:  # plain `python -m flux_train.train`: a one-process group, no network
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    mesh = build_mesh(pcfg, world, local_world, device.type)
    return Dist(rank, world, device, mesh)


def mesh_shape(pcfg: ParallelConfig, world: int, local_world: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard); defaults shard within a node and replicate across nodes."""
    shard = pcfg.dp_shard if pcfg.dp_shard > 0 else (
        world // pcfg.dp_replicate if pcfg.dp_replicate > 0 else min(local_world, world))
    replicate = pcfg.dp_replicate if pcfg.dp_replicate > 0 else world // shard
    if shard * replicate != world:
        raise ValueError(f"parallel.dp_replicate {replicate} x parallel.dp_shard {shard} != world size {world}")
    return replicate, shard


def build_mesh(pcfg: ParallelConfig, world: int, local_world: int, device_type: str) -> DeviceMesh:
    replicate, shard = mesh_shape(pcfg, world, local_world)
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard"))


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """2-D (HSDP) when replicating, else the 1-D shard mesh (plain FSDP)."""
    return mesh if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]


def parallelize(model: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig, param_dtype: torch.dtype,
                wrap_block: Optional[Callable[[nn.Module], nn.Module]] = None) -> nn.Module:
    """Per block: activation checkpointing (optional) -> `wrap_block` (compile) -> fully_shard; root last."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from flux_train.model import block_stacks

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    shard_mesh = fsdp_mesh(mesh)
    for stack in block_stacks(model):
        for i, block in enumerate(stack):
            if pcfg.activation_checkpointing:
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

                block = checkpoint_wrapper(block, preserve_rng_state=False)
            if wrap_block is not None:
                block = wrap_block(block)
            fully_shard(block, mesh=shard_mesh, mp_policy=mp, reshard_after_forward=pcfg.reshard_after_forward)
            stack[i] = block
    # the root's parameters are used again first in backward: keep them gathered after forward
    fully_shard(model, mesh=shard_mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
