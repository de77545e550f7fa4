"""Validation: `evaluate` is the pass (one forward per val sample at t = k/8, fresh noise, no caption dropout,
per-sample MSE summed with the sample count across all ranks; val loss = sum / count, and each timestep's loss
from its own sum and count, reduced with them); `Evaluator` is the trainer's eval: when one is due, its MLLOG
events, metrics row and count check, whether it reached the target and how long it took. What follows an eval
(the run report, samples: flux_train.training.pictures) is handed in as `after_eval`, what the layout does after a
pass (Layout.after_eval: FSDP reshards) as `after_pass`."""

from __future__ import annotations

import time
from typing import Callable, Iterable, NamedTuple

import torch
from torch import nn

from flux_train.model import flow
from flux_train.outputs.mllog import MLLogger
from flux_train.training.distributed import all_reduce_sum
from flux_train.training.heartbeat import Heartbeat
from flux_train.training.train_state import TrainState


class ValLoss(NamedTuple):
    """A validation pass over all ranks: the MLPerf val loss (sum / count), the samples counted, and the loss of
    each timestep t = k/8 that drew samples (where a run, or FP8, goes wrong shows by t)."""

    loss: float
    count: int
    by_timestep: dict[float, float]


class EvalDone(NamedTuple):
    """An eval of the trainer's: whether it reached the target, and its seconds (with after_eval's, when called)."""

    reached: bool
    seconds: float


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
) -> ValLoss:
    """The pass over this rank's `batches`, summed over all ranks."""
    was_training = model.training
    model.eval()
    # [loss sum, count] of every sample (column 0), and of each timestep bin k (column 1 + k): one all-reduce
    total = torch.zeros(2, 1 + flow.EVAL_TIMESTEP_BINS, dtype=torch.float64, device=device)
    for i, batch in enumerate(batches):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        gen = flow.seeded_generator(device, seed, eval_index, rank * 1_000_000 + i, flow.STREAM_EVAL)
        t = flow.eval_timesteps(batch["timestep"])
        inputs, target = flow.build_inputs(batch, t, gen, shift, scale, dtype)
        pred = model(**inputs.as_kwargs())
        valid = batch["valid"].to(torch.float64)
        losses = flow.per_sample_mse(pred, target).double() * valid
        total[0, 0] += losses.sum()
        total[1, 0] += valid.sum()
        # per bin by a matmul, not index_add_'s atomics: the same sums every time
        bins = torch.nn.functional.one_hot(batch["timestep"], flow.EVAL_TIMESTEP_BINS).double()
        total[:, 1:] += torch.stack([losses, valid]) @ bins
    all_reduce_sum(total)
    model.train(was_training)
    sums, counts = total.tolist()
    by_timestep = {k / flow.EVAL_TIMESTEP_BINS: s / n for k, (s, n) in enumerate(zip(sums[1:], counts[1:])) if n}
    return ValLoss(sums[0] / max(counts[0], 1), int(counts[0]), by_timestep)


class Evaluator:
    """The trainer's eval, given its parts (tests build one without a Trainer). Due every `every` steps (0: never);
    a pass is seeded by (`seed`, the eval's index) and must count the whole val set (`val_size` samples), and is
    followed by `after_pass()` (the layout's after_eval); an eval that does not reach `target` is followed by
    `after_eval(step)` (the trainer's report and samples)."""

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
        after_pass: Callable[[], None],
    ):
        self.model, self.val, self.val_size = model, val, val_size
        self.mllog, self.heartbeat = mllog, heartbeat
        self.rank, self.device, self.dtype = rank, device, dtype
        self.seed, self.latent_shift, self.latent_scale = seed, latent_shift, latent_scale
        self.every, self.target, self.after_eval, self.after_pass = every, target, after_eval, after_pass

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def loss(self, eval_index: int) -> ValLoss:
        """One validation pass, over all ranks, the layout's after_pass after it."""
        val = evaluate(
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
        self.after_pass()
        return val

    def run(self, state: TrainState, emit: Callable[[dict], None]) -> EvalDone:
        """The eval of `state`'s step: its MLLOG events, then its metrics row through `emit`; counts it in `state`.
        Reached the target: that ends the run, and the trainer calls after_eval after run_stop (its samples off the
        clock); else after_eval follows here, within the seconds returned."""
        t0 = time.perf_counter()
        self.heartbeat.beat(state.step, "eval")
        self.mllog.eval_start(state.samples)
        val = self.loss(state.eval_count)
        state.eval_count += 1
        if val.count != self.val_size:
            raise RuntimeError(f"eval counted {val.count} samples, the val set has {self.val_size}")
        self.mllog.eval_result(val.loss, state.samples)
        emit({"step": state.step, "samples": state.samples, "val_loss": val.loss, "val_loss_by_t": val.by_timestep})
        if val.loss <= self.target:
            return EvalDone(True, time.perf_counter() - t0)
        self.after_eval(state.step)
        return EvalDone(False, time.perf_counter() - t0)
