"""Validation loss: one forward per val sample at t = k/8, fresh noise, no caption dropout, per-sample MSE
summed with the sample count across all ranks; val loss = sum / count."""

from __future__ import annotations

import torch
from torch import nn

from flux_train import flow
from flux_train.parallel import all_reduce_sum


def _reshard(model: nn.Module) -> None:
    # leave FSDP modules sharded as after a train step, so checkpoints see one layout (torchtitan PR #1167)
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches,
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    eval_index: int,
    rank: int,
    shift: float,
    scale: float,
) -> tuple[float, int]:
    """Returns (val loss, number of samples counted over all ranks)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, count]
    for i, batch in enumerate(batches):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        gen = flow.seeded_generator(device, seed, eval_index, rank * 1_000_000 + i, flow.STREAM_EVAL)
        t = flow.eval_timesteps(batch["timestep"])
        inputs, target = flow.build_inputs(batch, t, gen, shift, scale, dtype)
        pred = model(**inputs.as_kwargs())
        valid = batch["valid"].to(torch.float64)
        total[0] += (flow.per_sample_mse(pred, target).double() * valid).sum()
        total[1] += valid.sum()
    all_reduce_sum(total)
    _reshard(model)
    model.train(was_training)
    count = int(total[1].item())
    return float(total[0].item() / max(count, 1)), count
