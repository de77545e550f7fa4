"""The training loop: `python -m flux_train.train --config configs/debug.yaml [--set section.key=value ...]`.

Order (MLPerf rules): run parameters + init_start -> build, shard, initialise, warm up -> init_stop +
run_start -> first touch of real data -> steps, an eval every ceil(262144/GBS) steps -> stop at the first
eval <= target (success) or at train.max_steps (aborted) -> run_stop.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import yaml

from flux_train import checkpoint, flow, preflight
from flux_train.config import Config, ConfigError, accumulation_steps, eval_interval_steps, load_config, validate
from flux_train.data import LATENT_CHANNELS, DataError, build_data
from flux_train.diffusers_adapter import load_pretrained
from flux_train.evaluate import evaluate
from flux_train.metrics import Metrics
from flux_train.mllog import C, MLLogger
from flux_train.model import build_model, check_weights, count_params, flops_per_sample, reference_init
from flux_train.optim import lr_at
from flux_train.parallel import all_reduce_sum, build_training, checkpoint_blocks, init_distributed, shutdown
from flux_train.perf import CudaGraph, apply_fp8, compile_blocks, select_attention_backend

# blocks return slices of their joint sequence; we never modify them in place, which this FSDP2 warning is about
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: saved a checkpoint on Slurm's warning signal; the launcher requeues

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.dist = init_distributed(cfg.parallel, cfg.train.device)
        validate(cfg, self.dist.world_size)
        if cfg.preflight.enabled:
            preflight.run(cfg, self.dist.device, int(os.environ.get("LOCAL_RANK", 0)),
                          int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        self.out_dir = Path(cfg.logging.out_dir)
        if self.dist.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        self.resume_from = checkpoint.resolve_resume(cfg)
        self.checkpointer = checkpoint.Checkpointer(checkpoint.checkpoint_dir(cfg), cfg.checkpoint.keep,
                                                    cfg.checkpoint.async_save)
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
        if self.device.type == "cuda" and cfg.perf.attention == "flash" and self.dtype == torch.float32:
            raise ConfigError("perf.attention=flash needs train.compute_dtype=bfloat16 (flash SDPA has no fp32 "
                              "kernel); set perf.attention=auto for fp32 runs")
        if cfg.perf.cuda_graphs and self.device.type != "cuda":
            raise ConfigError("perf.cuda_graphs needs a GPU; set perf.cuda_graphs=false on the CPU")
        select_attention_backend(cfg.perf.attention)
        model = build_model(cfg.model, cfg.perf.rmsnorm)
        self.n_params = count_params(model)
        initial = self._initial_weights(model)
        apply_fp8(model, cfg.perf.fp8, cfg.perf.fp8_impl, self.device)
        if cfg.parallel.activation_checkpointing:
            checkpoint_blocks(model)
        compile_blocks(model, cfg.perf.compile)
        self.training = build_training(model, self.dist.mesh, cfg.parallel, t, self.dtype, self.device)
        self.model = self.training.model
        self.training.assign_weights(initial)
        # CUDA graphs of forward + backward, one per micro-batch position (first/middle/last), captured during
        # warm-up; the inputs live in static buffers
        self.graphs: dict[tuple[bool, bool], CudaGraph] = {}
        self.static: tuple[dict, torch.Tensor] | None = None
        self.data = build_data(cfg, self.dist.rank, self.dist.world_size)
        self.empty_t5 = self.data.empty_t5.to(self.device)
        self.empty_clip = self.data.empty_clip.to(self.device)
        self.step = 0
        self.eval_count = 0
        self.stop_requested = False
        self.flops_per_sample: float | None = None
        if self.resume_from is not None:
            progress, loader_state = checkpoint.load(self.resume_from, self.training)
            self.step, self.eval_count = progress["step"], progress["eval_count"]
            self.data.train.load_state_dict(loader_state)
            if self.dist.is_main:
                print(f"flux-train: resumed from {self.resume_from} at step {self.step}", flush=True)

    def save_checkpoint(self) -> Path:
        progress = {"step": self.step, "eval_count": self.eval_count, "world_size": self.dist.world_size,
                    "samples": self.step * self.cfg.train.global_batch_size, "strategy": self.training.strategy}
        path = self.checkpointer.save(self.step, self.training, self.data.train.state_dict(), progress)
        if self.dist.is_main:
            print(f"flux-train: {'saving' if self.checkpointer.async_save else 'saved'} checkpoint {path}", flush=True)
        return path

    def _initial_weights(self, model):
        """(name, full tensor) for every parameter: model.init_from's weights, or the reference init."""
        source = self.cfg.model.init_from
        if source is None:
            return reference_init(model, self.cfg.train.seed, self.device)
        try:
            values = load_pretrained(source, self.cfg.model)
            check_weights(model, values, f"model.init_from={source}")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return iter(values.items())

    # ------------------------------------------------------------------ one optimizer step

    def _inputs(self, batch: dict, micro_index: int) -> tuple[dict, torch.Tensor]:
        """Model inputs (kwargs) and target of one micro-batch: latent sampling, caption dropout, noising."""
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
            self.flops_per_sample = flops_per_sample(self.cfg.model, inputs.txt.shape[1], inputs.img.shape[1])
        return inputs.as_kwargs(), target

    def _forward_backward(self, inputs: dict, target: torch.Tensor, micro: int) -> torch.Tensor:
        """Loss / accum of one micro-batch, gradients accumulated; after the last one, reduced (ddp)."""
        self.training.start_micro_batch(micro, self.accum)
        loss = flow.mse_loss(self.model(**inputs), target) / self.accum
        loss.backward()
        if micro == self.accum - 1:
            self.training.finish_backward()
        return loss.detach()

    def _graphed_forward_backward(self, inputs: dict, target: torch.Tensor, micro: int) -> torch.Tensor:
        if self.static is None:
            self.static = ({k: v.clone() for k, v in inputs.items()}, target.clone())
        static_inputs, static_target = self.static
        for k, v in inputs.items():
            if v.shape != static_inputs[k].shape:
                raise DataError(f"perf.cuda_graphs: batch input '{k}' has shape {tuple(v.shape)}, the captured "
                                f"graphs {tuple(static_inputs[k].shape)} (perf.warmup_latent_size and the empty "
                                "encodings' text length must match the data)")
            static_inputs[k].copy_(v)
        static_target.copy_(target)
        kind = (micro == 0, micro == self.accum - 1)
        if kind not in self.graphs:
            pool = next(iter(self.graphs.values())).pool() if self.graphs else None
            self.graphs[kind] = CudaGraph(lambda: self._forward_backward(static_inputs, static_target, micro),
                                          pool=pool)
        return self.graphs[kind]().clone()

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step over `accum` micro-batches; returns (loss, grad norm, data wait seconds)."""
        return self._step(lambda: next(self.data.train), lr_at(self.step, self.cfg.train.lr, self.cfg.train.warmup_steps))

    def _step(self, next_batch, lr: float) -> tuple[torch.Tensor, torch.Tensor, float]:
        loss_sum = torch.zeros((), device=self.device)
        data_wait = 0.0
        if self.cfg.perf.cuda_graphs:  # a replay does not run the gather waits of the forward hooks
            self.training.wait_params()
        for micro in range(self.accum):
            t0 = time.perf_counter()
            batch = next_batch()
            data_wait += time.perf_counter() - t0
            inputs, target = self._inputs(batch, micro)
            run = self._graphed_forward_backward if self.cfg.perf.cuda_graphs else self._forward_backward
            loss_sum += run(inputs, target, micro)
        grad_norm = self.training.step(lr)
        self.step += 1
        return loss_sum, grad_norm, data_wait

    def warm_up(self, iters: int) -> None:
        """Compile, tune and capture graphs before run_start on synthetic tensors (the rules start the clock
        before any data is read): steps with lr 0 leave the weights as they are, then the optimizer state is
        reset. Text length comes from the empty encodings, the latent side from perf.warmup_latent_size."""
        if iters <= 0:
            return
        b, side = self.cfg.train.micro_batch_size, self.cfg.perf.warmup_latent_size
        batch = {"t5": self.data.empty_t5.expand(b, -1, -1).clone(), "clip": self.data.empty_clip.expand(b, -1).clone(),
                 "mean": torch.zeros(b, LATENT_CHANNELS, side, side, dtype=torch.bfloat16),
                 "logvar": torch.full((b, LATENT_CHANNELS, side, side), -4.0, dtype=torch.bfloat16)}
        step = self.step
        for _ in range(iters):
            self._step(lambda: batch, lr=0.0)
        self.step = step
        self.training.reset_optimizer()  # AdamW starts from zero moments and step 0 at the first real step
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
        self.training.wait_params()  # no collective may be in flight when the process group goes down
        self.checkpointer.wait()
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
    except preflight.PreflightError as exc:
        print(exc, file=sys.stderr)
        return 2
    finally:
        shutdown()
    return EXIT_PREEMPTED if status == "preempted" else 0


if __name__ == "__main__":
    sys.exit(main())
