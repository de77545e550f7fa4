"""Validation: `evaluate` is the pass (one forward per val sample at t = k/8, fresh noise, no caption dropout,
per-sample MSE summed with the sample count across all ranks; val loss = sum / count); `Evaluator` is the
trainer's eval: when one is due, its MLLOG events, metrics row and count check, and whether it reached the target.
What follows an eval (the run report, samples: flux_train.training.pictures) is handed in as `after_eval`."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from flux_train.model import flow
from flux_train.outputs.mllog import MLLogger
from flux_train.training.distributed import all_reduce_sum
from flux_train.training.heartbeat import Heartbeat
from flux_train.training.train_state import TrainState


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


class Evaluator:
    """The trainer's eval, given its parts (tests build one without a Trainer). Due every `every` steps (0: never);
    a pass is seeded by (`seed`, the eval's index) and must count the whole val set (`val_size` samples); an eval
    that does not reach `target` is followed by `after_eval(step)` (the trainer's report and samples)."""

    def __init__(
        self,
        *,
        model: nn.Module,
        val: Callable[[], Iterable[dict]],
        val_size: int,
        mllog: MLLogger,
        heartbeat: Heartbeat,
        rank: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        latent_shift: float,
        latent_scale: float,
        every: int,
        target: float,
        after_eval: Callable[[int], None],
    ):
        self.model, self.val, self.val_size = model, val, val_size
        self.mllog, self.heartbeat = mllog, heartbeat
        self.rank, self.device, self.dtype = rank, device, dtype
        self.seed, self.latent_shift, self.latent_scale = seed, latent_shift, latent_scale
        self.every, self.target, self.after_eval = every, target, after_eval

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def loss(self, eval_index: int) -> tuple[float, int]:
        """One validation pass: (val loss, samples counted over all ranks)."""
        return evaluate(
            self.model,
            self.val(),
            device=self.device,
            dtype=self.dtype,
            seed=self.seed,
            eval_index=eval_index,
            rank=self.rank,
            shift=self.latent_shift,
            scale=self.latent_scale,
        )

    def run(self, state: TrainState, emit: Callable[[dict], None]) -> bool:
        """The eval of `state`'s step: its MLLOG events, then its metrics row through `emit`; counts it in `state`.
        True when it reached the target: that ends the run, and the trainer calls after_eval after run_stop (its
        samples off the clock); else after_eval follows here."""
        self.heartbeat.beat(state.step, "eval")
        self.mllog.eval_start(state.samples)
        val_loss, count = self.loss(state.eval_count)
        state.eval_count += 1
        if count != self.val_size:
            raise RuntimeError(f"eval counted {count} samples, the val set has {self.val_size}")
        self.mllog.eval_result(val_loss, state.samples)
        emit({"step": state.step, "samples": state.samples, "val_loss": val_loss})
        if val_loss <= self.target:
            return True
        self.after_eval(state.step)
        return False
