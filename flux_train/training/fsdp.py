"""The FSDP2 layout (`parallel.strategy: fsdp`, HSDP across nodes): every block sharded over the mesh, torch's
fused AdamW on the sharded fp32 weights, clipping by the global norm as its own pass. Our FP8 layers cast their
weights again in the backward (FP8Linear.recast_weight) rather than keep an e4m3 copy of every gathered weight from
the forward: on the full model that copy was 11 GiB a rank, and at 77 GiB reserved on an 80 GB H100 the allocator
freed its cache and retried 28 times in a few steps (FP8 5.01 samples/s/GPU at micro-batch 8 on 4 H100). With
activation checkpointing they keep it: the recomputed forward's casts write it anyway, for one block's backward."""

from __future__ import annotations

import typing

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from flux_train.config import ParallelConfig, TrainConfig
from flux_train.kernels.fp8 import FP8Linear
from flux_train.model.flux import assign_weights, block_stacks
from flux_train.training.optim import build_optimizer, clip_grad_norm, set_lr


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """2-D (HSDP) when replicating, else the 1-D shard mesh (plain FSDP)."""
    return mesh if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]


def parallelize(
    model: nn.Module, mesh: DeviceMesh, pcfg: ParallelConfig, param_dtype: torch.dtype, reduce_dtype: torch.dtype
) -> nn.Module:
    """FSDP2 per block (blocks already compiled / checkpoint-wrapped), root last, gradients reduce-scattered in
    `reduce_dtype`. Inputs are not cast: the trainer passes them in the compute dtype and the RoPE tables stay
    fp32. Each block prefetches the next one's weights in forward and the previous one's in backward."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    shard_mesh = fsdp_mesh(mesh)
    blocks = [
        fully_shard(block, mesh=shard_mesh, mp_policy=mp, reshard_after_forward=pcfg.reshard_after_forward)
        for stack in block_stacks(model)
        for block in stack
    ]
    for before, after in zip(blocks, blocks[1:]):
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])
    # the root's parameters are used again first in backward: keep them gathered after forward
    fully_shard(model, mesh=shard_mesh, mp_policy=mp, reshard_after_forward=False)
    return model


class FSDPTraining:
    """`parallel.strategy: fsdp`: FSDP2 over the mesh, torch's fused AdamW on the sharded fp32 weights; a
    flux_train.training.layout.Layout."""

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        pcfg: ParallelConfig,
        tcfg: TrainConfig,
        dtype: torch.dtype,
        device: torch.device,
        reduce_dtype: torch.dtype,
    ):
        # the FP8 layers' weights are gathered again for the backward: cast them there, unless the backward
        # recomputes the block (activation checkpointing), whose forward casts give the transposes anyway, kept
        # for that block's backward alone
        for m in model.modules():
            if isinstance(m, FP8Linear):
                m.recast_weight = not pcfg.activation_checkpointing
        self.model = parallelize(model, mesh, pcfg, dtype, reduce_dtype)
        self.model.to_empty(device=device)
        self.optimizer = build_optimizer(self.model, tcfg)
        self.tcfg = tcfg

    def assign_weights(self, values) -> None:
        """Full fp32 tensors by name (model.reference_init, or loaded weights) into the shards."""
        assign_weights(self.model, values)

    def start_micro_batch(self, index: int, count: int) -> None:
        # every micro-batch reduce-scatters into the sharded fp32 grads (skipping it keeps unsharded grads of
        # all 12B parameters: out of memory on H200 at micro-batch 16); the HSDP all-reduce across replicas
        # waits for the last micro-batch
        # fully_shard made the root an FSDPModule too (a mixin its type cannot show)
        typing.cast(FSDPModule, self.model).set_requires_all_reduce(index == count - 1)

    def finish_backward(self) -> None:
        pass

    def begin_step(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def step(self) -> torch.Tensor:
        norm = clip_grad_norm(self.model, self.tcfg.grad_clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def wait_params(self) -> None:
        pass

    def after_eval(self) -> None:
        # forwards without a backward leave weights gathered: sharded again as after a train step, so checkpoints
        # see one layout (torchtitan PR #1167)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def reset_optimizer(self) -> None:
        self.optimizer.state.clear()  # AdamW re-creates zero moments and step 0 at the next step

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict) -> None:
        model, optim = state_dict["model"], state_dict["optim"]
        set_state_dict(self.model, self.optimizer, model_state_dict=model, optim_state_dict=optim)
