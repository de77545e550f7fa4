"""The training layout the trainer drives without knowing which one runs: the `Layout` protocol, the two that
satisfy it (flux_train.training.fsdp.FSDPTraining, flux_train.training.ddp.DDP), and `build_training`, which
builds the one `parallel.strategy` names with the gradient-reduction dtype `parallel.reduce_dtype` asks for."""

from __future__ import annotations

from typing import Iterable, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flux_train.config import ParallelConfig, TrainConfig
from flux_train.training.ddp import DDP
from flux_train.training.distributed import reduce_dtype
from flux_train.training.fsdp import FSDPTraining


class Layout(Protocol):
    """Where the weights, gradients and optimizer state live, and the step over them. Per optimizer step:
    `begin_step(lr)` (host only), `start_micro_batch(i, n)` before each micro-batch's forward,
    `finish_backward()` after the last backward, then `step()`."""

    model: nn.Module  # the module to call forward on (sharded or wrapped by the layout)

    def assign_weights(self, values: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full fp32 tensors by name (model.reference_init, or loaded weights) into the layout's weights."""
        ...

    def begin_step(self, lr: float) -> None:
        """This step's learning rate, before any of its device work (a CUDA graph replays what follows)."""
        ...

    def start_micro_batch(self, index: int, count: int) -> None:
        """Before micro-batch `index` of `count`: how its gradients accumulate and when they are reduced."""
        ...

    def finish_backward(self) -> None:
        """After the last micro-batch's backward: every gradient summed over the ranks."""
        ...

    def step(self) -> torch.Tensor:
        """Clip by the global gradient norm and take the AdamW step (ddp with a graphed step: applied in the next
        forward or by wait_params); the pre-clip norm (a device tensor)."""
        ...

    def wait_params(self) -> None:
        """Before the weights are read outside a forward (checkpoints, export, the end of the run)."""
        ...

    def after_eval(self) -> None:
        """After an eval's forwards: the weights as a train step leaves them, so checkpoints see one layout."""
        ...

    def reset_optimizer(self) -> None:
        """Zero moments and step count, keeping the weights (after the warm-up's steps with lr 0)."""
        ...

    def state_dict(self) -> dict:
        """DCP state {"model": weights by name, "optim": optimizer state}, filled in place by dcp.load."""
        ...

    def load_state_dict(self, state_dict: dict) -> None:
        """After dcp.load filled `state_dict()`'s tensors."""
        ...


def build_training(
    model: nn.Module,
    mesh: DeviceMesh,
    pcfg: ParallelConfig,
    tcfg: TrainConfig,
    dtype: torch.dtype,
    device: torch.device,
    graphed: bool = False,
) -> Layout:
    """The model's training layout, weights allocated on `device`, not yet initialised; `graphed`: its step will
    be captured as a CUDA graph (ddp then applies each update in the next forward)."""
    reduce = reduce_dtype(pcfg, dtype)
    if pcfg.strategy == "ddp":
        return DDP(model, mesh, tcfg, dtype, device, reduce, defer_updates=graphed)
    return FSDPTraining(model, mesh, pcfg, tcfg, dtype, device, reduce)
