"""Validation: `evaluate` is the pass (one forward per val sample at t = k/8, fresh noise, no caption dropout,
per-sample MSE summed with the sample count across all ranks; val loss = sum / count); `Evaluator` is the
trainer's eval: when one is due, its MLLOG events and checks, and what follows it (the run report, samples)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from flux_train.config import Config, eval_interval_steps
from flux_train.model import flow
from flux_train.outputs.report import REPORT_FILE, write_report
from flux_train.training.distributed import all_reduce_sum
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


def best_effort(path: Path, write) -> bool:
    """Pictures for people (the report, sample grids): a failed write (a full disk) is a warning, training goes on."""
    try:
        write()
        return True
    except OSError as exc:
        print(f"flux-train: warning: could not write {path} ({exc}); training goes on", file=sys.stderr, flush=True)
        return False


class Evaluator:
    """The trainer's eval. Due every eval_interval_steps(cfg) steps (never with eval.enabled=false); a pass is
    seeded by (train.seed, the eval's index) and must count the whole val set; afterwards rank 0 redraws the run
    report and, with eval.sample_prompts, saves a grid of samples (a collective gathers the weights for it)."""

    def __init__(self, cfg: Config, trainer):
        self.cfg, self.t = cfg, trainer
        self.every = eval_interval_steps(cfg) if cfg.eval.enabled else 0
        self.out_dir = Path(cfg.logging.out_dir)
        self.sampler = None
        if cfg.eval.sample_prompts and trainer.dist.is_main:
            from flux_train.training.sample import Sampler  # diffusers and the encoders only where samples are drawn

            self.sampler = Sampler.for_run(cfg, trainer.device, trainer.dtype)

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def loss(self, eval_index: int) -> tuple[float, int]:
        """One validation pass with the run's model and settings: (val loss, samples counted over all ranks)."""
        t, tc = self.t, self.cfg.train
        return evaluate(
            t.model,
            t.data.val(),
            device=t.device,
            dtype=t.dtype,
            seed=tc.seed,
            eval_index=eval_index,
            rank=t.dist.rank,
            shift=tc.latent_shift,
            scale=tc.latent_scale,
        )

    def run(self, state: TrainState) -> float:
        """The eval of `state`'s step, its MLLOG events included; counts it in `state`."""
        self.t.heartbeat.beat(state.step, "eval")
        self.t.mllog.eval_start(state.samples)
        val_loss, count = self.loss(state.eval_count)
        state.eval_count += 1
        if count != self.t.data.val_size:
            raise RuntimeError(f"eval counted {count} samples, the val set has {self.t.data.val_size}")
        self.t.mllog.eval_result(val_loss, state.samples)
        return val_loss

    def after(self, step: int) -> None:
        """After the eval's MLLOG events: the run report and, with eval.sample_prompts, a grid of samples."""
        self.report()
        if not self.cfg.eval.sample_prompts:
            return
        from flux_train.training.sample import gathered_weights

        weights = gathered_weights(self.t.model)  # collective: the full weights on rank 0
        if self.sampler is not None:
            path = self.out_dir / "samples" / f"step_{step:08d}.png"

            def draw() -> None:
                path.parent.mkdir(exist_ok=True)
                self.sampler.grid(weights).save(path)

            if best_effort(path, draw):
                print(f"flux-train: samples of step {step}: {path}", flush=True)

    def report(self) -> None:
        """The run's report.png from metrics.jsonl (rank 0)."""
        if self.t.dist.is_main:
            target = self.cfg.eval.target
            best_effort(
                self.out_dir / REPORT_FILE,
                lambda: write_report(self.out_dir, self.cfg.train.global_batch_size, target),
            )
