"""The training loop: `python -m flux_train.train --config configs/debug.yaml [--set section.key=value ...]`.

Order (MLPerf rules): run parameters + init_start -> build, shard, initialise, warm up -> init_stop +
run_start -> first touch of real data -> steps, an eval every ceil(262144/GBS) steps -> stop at the first
eval <= target (success) or at train.max_steps (aborted) -> run_stop.
"""

from __future__ import annotations

import argparse
import enum
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from flux_train import checkpoint, flow, preemption, preflight, run_folder
from flux_train.config import Config, ConfigError, accumulation_steps, eval_interval_steps, load_config, validate
from flux_train.data import DataError, DataSource, build_synthetic, synthetic_samples
from flux_train.diffusers_adapter import load_pretrained
from flux_train.errors import Parser, StorageError, reports_user_errors
from flux_train.evaluate import evaluate
from flux_train.heartbeat import Heartbeat, stragglers
from flux_train.kernels.fp8 import FP8Scaling
from flux_train.masking import masked
from flux_train.metrics import Metrics
from flux_train.mllog import C, MLLogger
from flux_train.model import build_model, check_weights, count_params, flops_per_sample, reference_init
from flux_train.optim import lr_at
from flux_train.parallel import all_reduce_sum, build_training, checkpoint_blocks, init_distributed, shutdown
from flux_train.perf import CudaGraph, apply_fp8, compile_blocks, select_attention_backend
from flux_train.report import REPORT_FILE, write_report
from flux_train.sample import Sampler, gathered_weights

# blocks return slices of their joint sequence; we never modify them in place, which this FSDP2 warning is about
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

EXIT_DIVERGED = 3  # a non-finite loss or gradient norm stopped the run
EXIT_COLLECTIVE = 4  # a collective failed or timed out (parallel.timeout_s); the message names the stragglers
EXIT_OUT_OF_MEMORY = 5  # a GPU ran out of memory; the message says how much torch held and what to change

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class Status(str, enum.Enum):
    """How a run ended; MLLOG's run_stop says success or aborted (a diverged run is aborted)."""

    SUCCESS = "success"  # an eval reached the target
    ABORTED = "aborted"  # the step cap
    PREEMPTED = "preempted"  # Slurm's warning signal: checkpoint saved, the launcher requeues
    DIVERGED = "diverged"  # a non-finite loss or gradient norm


class LogWindow:
    """What the loop learns at each host sync (every logging.log_every steps, and before an eval or a checkpoint),
    in one all-reduce: the mean loss of the window's steps, whether any rank got the stop signal, and whether
    any step's loss or gradient norm was not finite (and which step first, on this rank)."""

    def __init__(self, device: torch.device, world: int):
        self.device, self.world = device, world
        self.loss_sum = torch.zeros((), device=device)
        self.first_bad = torch.zeros((), device=device)
        self.steps = 0

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Device-side only: no sync."""
        self.loss_sum += loss
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        self.first_bad = torch.where(bad & (self.first_bad == 0), float(step), self.first_bad)
        self.steps += 1

    def close(self, stop_requested: bool) -> tuple[float, bool, int | None]:
        """(mean loss over ranks and steps, whether any rank asked to stop, None if every step was finite, else the
        first non-finite step this rank saw, 0 if only other ranks saw one); resets the window."""
        stats = torch.stack(
            [self.loss_sum, torch.tensor(float(stop_requested), device=self.device), (self.first_bad > 0).float()]
        )
        loss_sum, stop_votes, bad_ranks = all_reduce_sum(stats).tolist()
        first_bad = int(self.first_bad.item()) if bad_ranks else None
        mean = loss_sum / max(self.steps * self.world, 1)
        self.loss_sum.zero_()
        self.first_bad.zero_()
        self.steps = 0
        return mean, stop_votes > 0, first_bad


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.out_dir = Path(cfg.logging.out_dir)
        self.dist = init_distributed(cfg.parallel, cfg.train.device, str(self.out_dir / "flight_recorder"))
        validate(cfg, self.dist.world_size)
        if cfg.preflight.enabled:
            preflight.run(
                cfg, self.dist.device, int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            )
        # the main rank owns the run folder from here on (a second run there is refused), and chooses for every
        # rank the checkpoint to resume from
        self.folder = run_folder.claim(cfg, self.dist.rank, self.dist.world_size)
        self.resume_from = self.folder.resume_from
        self._check_before_init()
        # from here on every rank says where it is (a bad input above has ended the run without a thread)
        self.heartbeat = Heartbeat(self.out_dir / "heartbeats", self.dist.rank)
        if self.dist.is_main:
            config_file = self.out_dir / "config.yaml"  # secrets masked (env.masked_vars)
            try:
                config_file.write_text(yaml.safe_dump(masked(cfg).to_dict(), sort_keys=False))
            except OSError as exc:
                raise StorageError(f"writing {config_file} failed ({exc})") from None
        self.checkpointer = checkpoint.Checkpointer(
            checkpoint.checkpoint_dir(cfg), cfg.checkpoint.keep, cfg.checkpoint.async_save, cfg.checkpoint.every_steps
        )
        # a resumed run continues the same MLLOG file and does not start a second run in it
        self.mllog = MLLogger(
            self.out_dir / cfg.logging.mllog_file,
            enabled=self.dist.is_main,
            append=self.resume_from is not None,
            stdout=cfg.logging.mllog_stdout,
        )
        if not self.mllog.continued:
            self.mllog.run_parameters(cfg, self.dist.world_size)
            self.mllog.start(C.INIT_START)

        t = cfg.train
        self.device = self.dist.device
        self.dtype = DTYPES[t.compute_dtype]
        self.accum = accumulation_steps(cfg, self.dist.world_size)
        if self.device.type == "cuda" and cfg.perf.attention in ("flash", "cudnn") and self.dtype == torch.float32:
            raise ConfigError(
                f"perf.attention={cfg.perf.attention} needs train.compute_dtype=bfloat16 (it has no fp32 "
                "kernel); set perf.attention=auto for fp32 runs"
            )
        if cfg.perf.cuda_graphs and self.device.type != "cuda":
            raise ConfigError("perf.cuda_graphs needs a GPU; set perf.cuda_graphs=false on the CPU")
        self.attention = select_attention_backend(cfg.perf.attention, self.dtype, self.device)
        model = build_model(cfg.model, cfg.perf.rmsnorm)
        self.n_params = count_params(model)
        initial = self._initial_weights(model)
        apply_fp8(model, cfg.perf.fp8, cfg.perf.fp8_impl, self.device, cfg.perf.fp8_amax_history)
        if cfg.parallel.activation_checkpointing:
            checkpoint_blocks(model)
        compile_blocks(model, cfg.perf.compile)
        self.training = build_training(model, self.dist.mesh, cfg.parallel, t, self.dtype, self.device)
        self.model = self.training.model
        self.training.assign_weights(initial)
        self.fp8 = FP8Scaling.of(self.model, self.device, cfg.perf.fp8_margin)  # perf.fp8=delayed: its scales
        # perf.cuda_graphs: the whole step as one CUDA graph, captured during warm-up, reading every
        # micro-batch's inputs from static buffers
        self.step_graph: CudaGraph | None = None
        self.static: list[tuple[dict, torch.Tensor]] = []
        self.data = build_data(cfg, self.dist.rank, self.dist.world_size)
        self.empty_t5 = self.data.empty_t5.to(self.device)
        self.empty_clip = self.data.empty_clip.to(self.device)
        self.sampler = None  # eval.sample_prompts: rank 0 draws a grid of samples after each eval (_after_eval)
        if cfg.eval.sample_prompts and self.dist.is_main:
            self.sampler = Sampler.for_run(cfg, self.device, self.dtype)
        self.step = 0
        self.eval_count = 0
        self.stop_requested = False
        self.flops_per_sample: float | None = None

    def _resume(self) -> None:
        """The checkpoint's state, after the warm-up (whose steps would overwrite the optimizer's moments)."""
        progress, loader_state = checkpoint.load(self.resume_from, self.training)
        self.step, self.eval_count = progress["step"], progress["eval_count"]
        self.data.train.load_state_dict(loader_state)
        if self.fp8 is not None and "fp8" in progress:  # else (no FP8 before): the history starts empty
            try:
                self.fp8.load_state_dict(progress["fp8"])
            except ValueError as exc:  # another history length or set of FP8 layers: the scales start over
                self._say(f"the checkpoint's FP8 scales do not fit this run ({exc}); they start from no history")
        self._say(f"resumed from {self.resume_from} at step {self.step}")

    def _check_before_init(self) -> None:
        """Inputs that would otherwise fail after init_start, or after minutes of building: one line each."""
        cfg = self.cfg
        if cfg.data.source == "energon" and cfg.data.path and not Path(cfg.data.path).is_dir():
            raise ConfigError(
                f"data.path {cfg.data.path} does not exist here; point it at the prepared dataset "
                "(python -m dataprep) or use data.source=synthetic"
            )
        if self.dist.device.type == "cpu":
            need = count_params(build_model(cfg.model)) * 16 * self.dist.world_size  # weights, grads, AdamW, fp32
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            if need > have:
                raise ConfigError(
                    f"model {cfg.model.flavor} needs ~{need / 2**30:.0f} GiB on the CPU, this host has "
                    f"{have / 2**30:.0f} GiB; use GPUs (train.device=cuda) or configs/debug.yaml"
                )

    def save_checkpoint(self) -> Path:
        self.heartbeat.beat(self.step, "checkpoint")
        progress = {
            "step": self.step,
            "eval_count": self.eval_count,
            "samples": self.step * self.cfg.train.global_batch_size,
            **checkpoint.resume_settings(self.cfg, self.dist.world_size),
        }
        if self.fp8 is not None:
            progress["fp8"] = self.fp8.state_dict()
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
        batch["t5"], batch["clip"], _ = flow.caption_dropout(
            batch["t5"], batch["clip"], self.empty_t5, self.empty_clip, t.caption_dropout_prob, drop_gen
        )
        timesteps = torch.rand(batch["t5"].shape[0], device=self.device, generator=gen)
        inputs, target = flow.build_inputs(batch, timesteps, gen, t.latent_shift, t.latent_scale, self.dtype)
        if self.flops_per_sample is None:  # from the data's shapes, known at the first batch
            self.flops_per_sample = flops_per_sample(self.cfg.model, inputs.txt.shape[1], inputs.img.shape[1])
        return inputs.as_kwargs(), target

    def _forward_backward(self, inputs: dict, target: torch.Tensor, micro: int) -> torch.Tensor:
        """Loss / accum of one micro-batch, gradients accumulated; after the last one, reduced (ddp)."""
        self.training.start_micro_batch(micro, self.accum)
        loss = flow.mse_loss(self.model(**inputs), target) / self.accum
        if self.step + 1 == self.cfg.train.inject_nan_at_step:
            loss = loss * float("nan")
        loss.backward()
        if micro == self.accum - 1:
            self.training.finish_backward()
        return loss.detach()

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step over `accum` micro-batches; returns (loss, grad norm, data wait seconds)."""
        self.heartbeat.beat(self.step + 1, "train")
        return self._step(
            lambda: next(self.data.train), lr_at(self.step, self.cfg.train.lr, self.cfg.train.warmup_steps)
        )

    def _step(self, next_batch, lr: float) -> tuple[torch.Tensor, torch.Tensor, float]:
        graphed = self.cfg.perf.cuda_graphs
        self.training.begin_step(lr)
        data_wait = 0.0
        staged, losses = [], []
        for micro in range(self.accum):
            t0 = time.perf_counter()
            batch = next_batch()
            data_wait += time.perf_counter() - t0
            inputs, target = self._inputs(batch, micro)
            if graphed:
                staged.append((inputs, target))
            else:
                losses.append(self._forward_backward(inputs, target, micro))
        if graphed:
            loss_sum, grad_norm = self._replay_step(staged)
        else:
            loss_sum, grad_norm = sum(losses), self._optimizer_step()
        self.step += 1
        return loss_sum, grad_norm, data_wait

    def _replay_step(self, staged: list[tuple[dict, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step as one CUDA graph: every micro-batch's forward and backward, the gradient reduction,
        clipping, AdamW and the weight all-gathers, with no host work between kernels. Captured at the first
        call (in the warm-up, lr 0: the capture's eager run and the replay change no weight)."""
        if self.step_graph is None:
            self.static = [({k: v.clone() for k, v in inputs.items()}, target.clone()) for inputs, target in staged]
            self.step_graph = CudaGraph(self._device_step)
        else:
            for (inputs, target), (static_inputs, static_target) in zip(staged, self.static):
                for k, v in inputs.items():
                    if v.shape != static_inputs[k].shape:
                        raise DataError(
                            f"perf.cuda_graphs: batch input '{k}' has shape {tuple(v.shape)}, the captured "
                            f"graph {tuple(static_inputs[k].shape)} (perf.warmup_latent_size and the empty "
                            "encodings' text length must match the data)"
                        )
                    static_inputs[k].copy_(v)
                static_target.copy_(target)
        loss_sum, grad_norm = self.step_graph()
        return loss_sum.clone(), grad_norm.clone()

    def _device_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum = torch.zeros((), device=self.device)
        for micro, (inputs, target) in enumerate(self.static):
            loss_sum += self._forward_backward(inputs, target, micro)
        grad_norm = self._optimizer_step()
        self.training.wait_params()  # the all-gathers end inside the graph
        return loss_sum, grad_norm

    def _optimizer_step(self) -> torch.Tensor:
        """Clipping and AdamW (returns the gradient norm), then the FP8 scales of the next step."""
        grad_norm = self.training.step()
        if self.fp8 is not None:
            self.fp8.update()
        return grad_norm

    def warm_up(self, iters: int) -> None:
        """Compile, tune and capture graphs before run_start on synthetic tensors (the rules start the clock
        before any data is read): steps with lr 0 leave the weights as they are, then the optimizer state is
        reset. Text length comes from the empty encodings, the latent side from perf.warmup_latent_size."""
        if iters <= 0:
            return
        m, side = self.cfg.model, self.cfg.perf.warmup_latent_size
        batch = synthetic_samples(
            self.cfg.train.micro_batch_size,
            self.data.empty_t5.shape[1],
            side,
            side,
            m.joint_attention_dim,
            m.pooled_projection_dim,
            seed=0,
        )
        step = self.step
        for _ in range(iters):
            self._step(lambda: batch, lr=0.0)
        self.step = step
        self.training.reset_optimizer()  # AdamW starts from zero moments and step 0 at the first real step
        if self.fp8 is not None:
            self.fp8.reset()  # and FP8 from no amax history
        self.flops_per_sample = None  # measured again on the first real batch

    # ------------------------------------------------------------------ eval and the loop

    def run_eval(self) -> float:
        """One validation pass, its MLLOG events included."""
        t = self.cfg.train
        samples = self.step * t.global_batch_size
        self.heartbeat.beat(self.step, "eval")
        self.mllog.eval_start(samples)
        val_loss, count = evaluate(
            self.model,
            self.data.val(),
            device=self.device,
            dtype=self.dtype,
            seed=t.seed,
            eval_index=self.eval_count,
            rank=self.dist.rank,
            shift=t.latent_shift,
            scale=t.latent_scale,
        )
        self.eval_count += 1
        if count != self.data.val_size:
            raise RuntimeError(f"eval counted {count} samples, the val set has {self.data.val_size}")
        self.mllog.eval_result(val_loss, samples)
        return val_loss

    def _after_eval(self) -> None:
        """After the eval's MLLOG events: the run report and, with eval.sample_prompts, a grid of samples."""
        self._report()
        if self.cfg.eval.sample_prompts:
            weights = gathered_weights(self.model)  # collective: the full weights on rank 0
            if self.sampler is not None:
                path = self.out_dir / "samples" / f"step_{self.step:08d}.png"

                def draw() -> None:
                    path.parent.mkdir(exist_ok=True)
                    self.sampler.grid(weights).save(path)

                if self._best_effort(path, draw):
                    self._say(f"samples of step {self.step}: {path}")

    def _report(self) -> None:
        if self.dist.is_main:
            self._best_effort(
                self.out_dir / REPORT_FILE,
                lambda: write_report(self.out_dir, self.cfg.train.global_batch_size, self.cfg.eval.target),
            )

    @staticmethod
    def _best_effort(path: Path, write) -> bool:
        """Pictures for people (the report, sample grids): a failed write (a full disk) is a warning, training goes on."""
        try:
            write()
            return True
        except OSError as exc:
            print(f"flux-train: warning: could not write {path} ({exc}); training goes on", file=sys.stderr, flush=True)
            return False

    def _install_stop_signal(self) -> None:
        # Slurm's warning signal asks for a checkpoint at the next logging boundary (flux_train.preemption)
        def handler(signum, frame):
            self.stop_requested = True

        signal.signal(preemption.SIGNAL, handler)

    def _say(self, text: str) -> None:
        if self.dist.is_main:
            print(f"flux-train: {text}", flush=True)

    def run(self) -> Status:
        """Warm up, start the clock, train until an eval reaches the target, the step cap, Slurm's warning signal
        or a non-finite step; then stop the clock."""
        cfg, t = self.cfg, self.cfg.train
        self._say(
            f"{cfg.model.flavor} {self.n_params / 1e9:.3f} B params, world {self.dist.world_size}, "
            f"GBS {t.global_batch_size} (micro {t.micro_batch_size} x accum {self.accum}), "
            f"eval every {eval_interval_steps(cfg)} steps, {cfg.parallel.strategy} on {self.device}, "
            f"attention {self.attention}, FP8 {cfg.perf.fp8}"
        )
        self._install_stop_signal()
        self.warm_up(cfg.perf.warmup_iters)
        if self.resume_from is not None:
            self._resume()
        if not self.mllog.continued:
            self.mllog.end(C.INIT_STOP)
            self.mllog.start(C.RUN_START)
        metrics = Metrics(
            self.out_dir,
            self.device,
            self.dist.world_size,
            t.max_steps,
            self.dist.is_main,
            cfg.logging.progress_bar,
            cfg.logging.tensorboard,
            append=self.resume_from is not None,
            start_step=self.step,
        )
        status = self._train(metrics)
        self.training.wait_params()  # no collective may be in flight when the process group goes down
        self.checkpointer.close()
        metrics.close()
        samples = self.step * t.global_batch_size
        if status != Status.PREEMPTED:  # a preempted run continues in the same log after the requeue
            self.mllog.run_stop(C.SUCCESS if status == Status.SUCCESS else C.ABORTED, samples)
        if status == Status.SUCCESS:  # the successful eval's report and samples, after run_stop
            self._after_eval()
        else:
            self._report()
        self._say(f"finished at step {self.step}, status {status.value}")
        return status

    def _train(self, metrics: Metrics) -> Status:
        """The steps, from block_start to the step that ends the run (its block_stop written)."""
        cfg, t = self.cfg, self.cfg.train
        evals = cfg.eval.enabled
        eval_every = eval_interval_steps(cfg)
        window = LogWindow(self.device, self.dist.world_size)
        self.mllog.block_start(self.step * t.global_batch_size)
        metrics.reset_window()
        while self.step < t.max_steps:
            loss, grad_norm, wait = self.train_step()
            window.add(self.step, loss, grad_norm)
            metrics.add_step(t.global_batch_size, wait)
            samples = self.step * t.global_batch_size
            eval_due = evals and self.step % eval_every == 0
            checkpoint_due = self.checkpointer.due(self.step)
            if self.step % cfg.logging.log_every and not eval_due and not checkpoint_due:
                continue
            # a host sync: nothing below may act on a non-finite state
            mean_loss, stop, first_bad = window.close(self.stop_requested)
            if first_bad is not None:
                self.mllog.block_stop(samples)
                return self._diverged(first_bad)
            metrics.log(
                self.step,
                self.flops_per_sample,
                loss=mean_loss,
                lr=lr_at(self.step - 1, t.lr, t.warmup_steps),
                grad_norm=float(grad_norm),
                **({"fp8_overflows": int(self.fp8.overflows)} if self.fp8 is not None else {}),
            )
            if eval_due:  # before a stop: a checkpoint of this step stands for its eval having run
                self.mllog.block_stop(samples)
                val_loss = self.run_eval()
                metrics.emit({"step": self.step, "samples": samples, "val_loss": val_loss})
                if val_loss <= cfg.eval.target:
                    return Status.SUCCESS
                self._after_eval()
                if stop:
                    self.save_checkpoint()
                    return Status.PREEMPTED
                self.mllog.block_start(samples)
                metrics.reset_window()
            if stop:
                self.mllog.block_stop(samples)
                self.save_checkpoint()
                return Status.PREEMPTED
            if checkpoint_due:
                self.save_checkpoint()
        self.mllog.block_stop(self.step * t.global_batch_size)
        return Status.ABORTED

    def _diverged(self, first_bad: int) -> Status:
        at = f"at step {first_bad}" if first_bad > 0 else f"in the steps up to {self.step}"
        self.checkpointer.wait()
        self._say(
            f"stopped: the loss or gradient norm was not finite {at}; {checkpoint.last_good(self.checkpointer.root)}. "
            "Lower train.lr, lengthen train.warmup_steps or look at the data of that step before resuming"
        )
        return Status.DIVERGED


def build_data(cfg: Config, rank: int, world: int) -> DataSource:
    """rank/world are the data-parallel rank and size."""
    if cfg.data.source == "synthetic":
        return build_synthetic(cfg, rank, world)
    from flux_train.energon_data import build_energon  # energon is needed only for real data

    return build_energon(cfg, rank, world)


def out_of_memory_line(exc: BaseException, rank: int) -> str | None:
    """One line for an out-of-memory anywhere in the step -- torch's allocator, or NCCL's own buffers, which
    surface as a collective's error ("Failed to CUDA calloc") -- else None."""
    text = str(exc)
    if not (isinstance(exc, torch.OutOfMemoryError) or "CUDA calloc" in text or "out of memory" in text.lower()):
        return None
    held = ""
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
        held = f" (torch's peak {torch.cuda.max_memory_allocated() / 2**30:.1f} of {total:.1f} GiB)"
    return (
        f"out of GPU memory on rank {rank}{held}: {type(exc).__name__}: {text.strip().splitlines()[0][:160]}; "
        "lower train.micro_batch_size (accumulation keeps the global batch) or take parallel.strategy=fsdp "
        "(1/GPUs of the model state per GPU)"
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="python -m flux_train.train", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/debug.yaml", help="YAML config (default: configs/debug.yaml)")
    p.add_overrides()
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (defaults: merged, --set applied) as YAML and exit",
    )
    return p.parse_args(argv)


@reports_user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = trainer = None
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None), end="")
            return 0
        trainer = Trainer(cfg)
        status = trainer.run()
    except StorageError as exc:  # a file the run must write could not be written: say where to resume from
        raise StorageError(f"{exc}; {checkpoint.last_good(checkpoint.checkpoint_dir(cfg))}") from None
    except RuntimeError as exc:  # out of memory; a collective failed or timed out (gloo says "Timed out")
        oom = out_of_memory_line(exc, dist.get_rank() if dist.is_initialized() else 0)
        if oom:
            print(oom, file=sys.stderr, flush=True)
            return EXIT_OUT_OF_MEMORY
        if not (isinstance(exc, dist.DistError) or "Timed out" in str(exc)):
            raise
        world = dist.get_world_size() if dist.is_initialized() else 0
        who = stragglers(Path(cfg.logging.out_dir) / "heartbeats", world) if cfg and world else "unknown"
        print(
            f"collective failed on rank {dist.get_rank() if world else '?'} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]}); {who}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_COLLECTIVE
    finally:
        if trainer is not None:
            trainer.heartbeat.stop()
        shutdown()
    return {Status.PREEMPTED: preemption.EXIT_CODE, Status.DIVERGED: EXIT_DIVERGED}.get(status, 0)


if __name__ == "__main__":
    sys.exit(main())
