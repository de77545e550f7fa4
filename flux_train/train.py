"""The training loop: `python -m flux_train.train --config configs/debug.yaml [--set section.key=value ...]`.

Order (MLPerf rules): run parameters + init_start -> build, shard, initialise, warm up -> init_stop +
run_start -> first touch of real data -> steps, an eval every ceil(262144/GBS) steps -> stop at the first
eval <= target (success) or at train.max_steps (aborted) -> run_stop.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import yaml

from flux_train import checkpoint, flow
from flux_train.compile import block_wrapper, select_attention_backend
from flux_train.config import Config, ConfigError, accumulation_steps, eval_interval_steps, load_config, validate
from flux_train.data import LATENT_CHANNELS, DataError, build_data
from flux_train.evaluate import evaluate
from flux_train.metrics import Metrics
from flux_train.mllog import C, MLLogger
from flux_train.model import build_model, count_params, flops_per_sample, materialize
from flux_train.optim import build_optimizer, clip_grad_norm, lr_at, set_lr
from flux_train.parallel import all_reduce_sum, init_distributed, parallelize, shutdown

# diffusers blocks return views; we never modify them in place, which is what this FSDP2 warning is about
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: saved a checkpoint on Slurm's warning signal; the launcher requeues

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.dist = init_distributed(cfg.parallel, cfg.train.device)
        validate(cfg, self.dist.world_size)
        self.out_dir = Path(cfg.logging.out_dir)
        if self.dist.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        self.resume_from = checkpoint.resolve_resume(cfg)
        # a resumed run continues the same MLLOG file and does not start a second run in it
        self.mllog = MLLogger(self.out_dir / cfg.logging.mllog_file, enabled=self.dist.is_main,
                              append=self.resume_from is not None)
        if self.resume_from is None:
            self.mllog.run_parameters(cfg, self.dist.world_size)
            self.mllog.start(C.INIT_START)

        t = cfg.train
        self.device = self.dist.device
        self.dtype = DTYPES[t.compute_dtype]
        self.accum = accumulation_steps(cfg, self.dist.world_size)
        if cfg.perf.cuda_graphs:
            raise ConfigError("perf.cuda_graphs: FSDP2 training steps cannot be captured (per-step all-gather and "
                              "reduce-scatter buffers); graphs apply to the one-GPU path of python -m flux_train.bench")
        if self.device.type == "cuda" and cfg.perf.attention == "flash" and self.dtype == torch.float32:
            raise ConfigError("perf.attention=flash needs train.compute_dtype=bfloat16 (flash SDPA has no fp32 "
                              "kernel); set perf.attention=auto for fp32 runs")
        select_attention_backend(cfg.perf.attention)
        self.model = build_model(cfg.model, cfg.perf.rmsnorm, cfg.perf.fp8)
        self.n_params = count_params(self.model)
        try:
            wrap = block_wrapper(cfg.perf.compile)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        parallelize(self.model, self.dist.mesh, cfg.parallel, self.dtype, wrap_block=wrap)
        materialize(self.model, self.device, t.seed)
        self.optimizer = build_optimizer(self.model, t)
        self.data = build_data(cfg, self.dist.rank, self.dist.world_size)
        self.empty_t5 = self.data.empty_t5.to(self.device)
        self.empty_clip = self.data.empty_clip.to(self.device)
        self.step = 0
        self.eval_count = 0
        self.stop_requested = False
        self.flops_per_sample: float | None = None
        if self.resume_from is not None:
            progress, loader_state = checkpoint.load(self.resume_from, self.model, self.optimizer)
            self.step, self.eval_count = progress["step"], progress["eval_count"]
            self.data.train.load_state_dict(loader_state)
            if self.dist.is_main:
                print(f"flux-train: resumed from {self.resume_from} at step {self.step}", flush=True)

    def save_checkpoint(self) -> Path:
        progress = {"step": self.step, "eval_count": self.eval_count, "world_size": self.dist.world_size,
                    "samples": self.step * self.cfg.train.global_batch_size}
        path = checkpoint.save(checkpoint.checkpoint_dir(self.cfg), self.step, self.model, self.optimizer,
                               self.data.train.state_dict(), progress, self.cfg.checkpoint.keep)
        if self.dist.is_main:
            print(f"flux-train: saved checkpoint {path}", flush=True)
        return path

    # ------------------------------------------------------------------ one optimizer step

    def _micro_batch(self, batch: dict, micro_index: int) -> torch.Tensor:
        t = self.cfg.train
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        global_micro = self.dist.rank * self.accum + micro_index
        gen = flow.seeded_generator(self.device, t.seed, self.step, global_micro, flow.STREAM_NOISE)
        drop_gen = flow.seeded_generator(self.device, t.seed, self.step, global_micro, flow.STREAM_DROPOUT)
        batch["t5"], batch["clip"], _ = flow.caption_dropout(batch["t5"], batch["clip"], self.empty_t5,
                                                             self.empty_clip, t.caption_dropout_prob, drop_gen)
        timesteps = torch.rand(batch["t5"].shape[0], device=self.device, generator=gen)
        inputs, target = flow.build_inputs(batch, timesteps, gen, t.latent_shift, t.latent_scale, self.dtype)
        if self.flops_per_sample is None:  # from the data's shapes, known at the first batch
            self.flops_per_sample = flops_per_sample(self.cfg.model, inputs.encoder_hidden_states.shape[1],
                                                     inputs.hidden_states.shape[1])
        pred = self.model(**inputs.as_kwargs())
        return flow.mse_loss(pred, target)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step over `accum` micro-batches; returns (loss, grad norm, data wait seconds)."""
        t = self.cfg.train
        set_lr(self.optimizer, lr_at(self.step, t.lr, t.warmup_steps))
        loss_sum = torch.zeros((), device=self.device)
        data_wait = 0.0
        for micro in range(self.accum):
            t0 = time.perf_counter()
            batch = next(self.data.train)
            data_wait += time.perf_counter() - t0
            # every micro-batch reduce-scatters into the sharded fp32 grads (skipping it keeps unsharded grads of
            # all 12B parameters: out of memory on H200 at micro-batch 16); the HSDP all-reduce across
            # replicas waits for the last micro-batch
            self.model.set_requires_all_reduce(micro == self.accum - 1)
            loss = self._micro_batch(batch, micro) / self.accum
            loss.backward()
            loss_sum += loss.detach()
        grad_norm = clip_grad_norm(self.model, t.grad_clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_sum, grad_norm, data_wait

    def warm_up(self, iters: int) -> None:
        """Compile and tune before run_start on synthetic tensors (the rules start the clock before any data is
        read): steps with lr 0 leave the weights as they are, then the optimizer state and grads are reset.
        Text length comes from the empty encodings, the latent side from perf.warmup_latent_size."""
        if iters <= 0:
            return
        b, side = self.cfg.train.micro_batch_size, self.cfg.perf.warmup_latent_size
        batch = {"t5": self.data.empty_t5.expand(b, -1, -1).clone(), "clip": self.data.empty_clip.expand(b, -1).clone(),
                 "mean": torch.zeros(b, LATENT_CHANNELS, side, side, dtype=torch.bfloat16),
                 "logvar": torch.full((b, LATENT_CHANNELS, side, side), -4.0, dtype=torch.bfloat16)}
        set_lr(self.optimizer, 0.0)
        for _ in range(iters):
            self._micro_batch(batch, 0).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()  # AdamW re-creates zero moments and step 0 at the first real step
        self.flops_per_sample = None  # measured again on the first real batch

    # ------------------------------------------------------------------ eval and the loop

    def run_eval(self) -> float:
        t = self.cfg.train
        samples = self.step * t.global_batch_size
        self.mllog.start(C.EVAL_START, samples_count=samples)
        val_loss, count = evaluate(self.model, self.data.val(), device=self.device, dtype=self.dtype, seed=t.seed,
                                   eval_index=self.eval_count, rank=self.dist.rank, shift=t.latent_shift,
                                   scale=t.latent_scale)
        self.eval_count += 1
        if count != self.data.val_size:
            raise RuntimeError(f"eval counted {count} samples, the val set has {self.data.val_size}")
        self.mllog.event(C.EVAL_ACCURACY, val_loss, samples_count=samples)
        self.mllog.end(C.EVAL_STOP, samples_count=samples)
        return val_loss

    def _install_stop_signal(self) -> None:
        # Slurm's warning signal (submitit uses USR2) asks for a checkpoint at the next agreed step boundary
        def handler(signum, frame):
            self.stop_requested = True

        if hasattr(signal, "SIGUSR2"):
            signal.signal(signal.SIGUSR2, handler)

    def run(self) -> str:
        cfg, t = self.cfg, self.cfg.train
        interval = eval_interval_steps(cfg)
        metrics = Metrics(self.out_dir, self.device, self.dist.world_size, t.max_steps, self.dist.is_main,
                          cfg.logging.progress_bar, cfg.logging.tensorboard, append=self.resume_from is not None,
                          start_step=self.step)
        if self.dist.is_main:
            print(f"flux-train: {cfg.model.flavor} {self.n_params / 1e9:.3f} B params, world {self.dist.world_size}, "
                  f"GBS {t.global_batch_size} (micro {t.micro_batch_size} x accum {self.accum}), "
                  f"eval every {interval} steps, device {self.device}", flush=True)
        self._install_stop_signal()
        self.warm_up(cfg.perf.warmup_iters)
        if self.resume_from is None:
            self.mllog.end(C.INIT_STOP)
            self.mllog.start(C.RUN_START)
        self.mllog.start(C.BLOCK_START, samples_count=self.step * t.global_batch_size)
        status = C.ABORTED
        window_loss = torch.zeros((), device=self.device)
        window_steps = 0
        metrics.reset_window()
        while self.step < t.max_steps:
            loss, grad_norm, wait = self.train_step()
            window_loss += loss
            window_steps += 1
            metrics.add_step(t.global_batch_size, wait)
            if self.step % cfg.logging.log_every == 0:
                # one all-reduce: the window's loss and whether any rank got Slurm's warning signal
                stats = torch.stack([window_loss, torch.tensor(float(self.stop_requested), device=self.device)])
                loss_sum, stop_votes = all_reduce_sum(stats).tolist()
                metrics.log(self.step, self.flops_per_sample, loss=loss_sum / (window_steps * self.dist.world_size),
                            lr=lr_at(self.step - 1, t.lr, t.warmup_steps), grad_norm=float(grad_norm))
                window_loss.zero_()
                window_steps = 0
                if stop_votes > 0:
                    status = "preempted"
                    self.mllog.end(C.BLOCK_STOP, samples_count=self.step * t.global_batch_size)
                    self.save_checkpoint()
                    break
            if cfg.eval.enabled and self.step % interval == 0:
                samples = self.step * t.global_batch_size
                self.mllog.end(C.BLOCK_STOP, samples_count=samples)
                val_loss = self.run_eval()
                metrics.emit({"step": self.step, "samples": samples, "val_loss": val_loss})
                if val_loss <= cfg.eval.target:
                    status = C.SUCCESS
                    break
                self.mllog.start(C.BLOCK_START, samples_count=samples)
                metrics.reset_window()
            if cfg.checkpoint.every_steps and self.step % cfg.checkpoint.every_steps == 0:
                self.save_checkpoint()
        else:
            self.mllog.end(C.BLOCK_STOP, samples_count=self.step * t.global_batch_size)
        metrics.close()
        if status != "preempted":
            self.mllog.end(C.RUN_STOP, status=status, samples_count=self.step * t.global_batch_size)
        if self.dist.is_main:
            print(f"flux-train: finished at step {self.step}, status {status}", flush=True)
        return status


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flux_train.train", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/debug.yaml", help="YAML config (default: configs/debug.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value; repeatable")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        status = Trainer(load_config(args.config, args.overrides)).run()
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except DataError as exc:
        print(f"data error: {exc}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    return EXIT_PREEMPTED if status == "preempted" else 0


if __name__ == "__main__":
    sys.exit(main())
