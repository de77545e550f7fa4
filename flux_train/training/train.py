"""The training loop: `python -m flux_train.train --config configs/debug.yaml [--set section.key=value ...]`.

Order (MLPerf rules): run parameters + init_start -> build, shard, initialise, warm up -> init_stop +
run_start -> first touch of real data -> steps, an eval every ceil(262144/GBS) steps -> stop at the first
eval <= target (success) or at train.max_steps (aborted) -> run_stop.
"""

from __future__ import annotations

import enum
import functools
import operator
import os
import signal
import sys
import time
import warnings
from multiprocessing import resource_sharer
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from flux_train.cli import train_parser
from flux_train.config import (
    Config,
    ConfigError,
    accumulation_steps,
    checkpoint_dir,
    eval_interval_steps,
    graphs_on,
    load_config,
    validate,
)
from flux_train.data.sources import build_data, synthetic_samples
from flux_train.errors import StorageError, UserError, report, reports_user_errors
from flux_train.model import flow
from flux_train.model.diffusers_adapter import load_pretrained
from flux_train.model.flux import build_model, check_weights, count_params, flops_per_sample, reference_init
from flux_train.outputs.mllog import C, MLLogger
from flux_train.training import checkpoint, preemption, preflight, run_folder
from flux_train.training.distributed import collective_failure_line, init_distributed, out_of_memory_line, shutdown
from flux_train.training.evaluate import Evaluator
from flux_train.training.heartbeat import ExitDeadline, Heartbeat
from flux_train.training.layout import build_training
from flux_train.training.metrics import Eta, LogWindow, Metrics, eta_goals, say
from flux_train.training.optim import lr_at
from flux_train.training.perf import GraphedStep, prepare_model, select_attention_backend
from flux_train.training.pictures import Pictures, SamplerFactory
from flux_train.training.precision import precision_for
from flux_train.training.train_state import TrainState

# blocks return slices of their joint sequence; we never modify them in place, which this FSDP2 warning is about
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

EXIT_DIVERGED = 3  # a non-finite loss or gradient norm stopped the run
EXIT_COLLECTIVE = 4  # a collective failed or timed out (parallel.timeout_s); the message names the stragglers
EXIT_OUT_OF_MEMORY = 5  # a GPU ran out of memory; the message says how much torch held and what to change
EXIT_INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C, as a shell reports it

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class Status(str, enum.Enum):
    """How a run ended; MLLOG's run_stop says success or aborted (a diverged run is aborted)."""

    SUCCESS = "success"  # an eval reached the target
    ABORTED = "aborted"  # the step cap
    PREEMPTED = "preempted"  # Slurm's warning signal: checkpoint saved, the launcher requeues
    DIVERGED = "diverged"  # a non-finite loss or gradient norm
    COMPLETED = "completed"  # a finished run's final checkpoint, which a kill had cut, written (no MLLOG event)


class End(enum.Enum):
    """Why a block of steps ended."""

    EVAL = "eval"  # one is due
    STOP = "stop"  # a rank got Slurm's warning signal
    DIVERGED = "diverged"  # a non-finite step
    CAP = "cap"  # train.max_steps


class Boundary(NamedTuple):
    """Where a block of steps ends: why (`kind`), whether a rank got the warning signal (`stop`, with an eval too),
    the first non-finite step this rank saw (`first_bad`; 0 if only other ranks did) and whether a checkpoint is
    due at this step, saved after its eval (`checkpoint`)."""

    kind: End
    stop: bool = False
    first_bad: int = 0
    checkpoint: bool = False


class Trainer:
    """One run of `cfg`. With eval.sample_prompts, `sampler` builds the sampler that draws a grid after each eval
    (flux_train.tools.sample.Sampler.for_run, handed in by the modules that start a run: tools sit above training)."""

    def __init__(self, cfg: Config, sampler: SamplerFactory | None = None):
        self.cfg = cfg
        if cfg.eval.sample_prompts and sampler is None:  # before anything is written to the run folder
            raise ConfigError(
                "eval.sample_prompts: this trainer was given no sampler to draw them with; start the run with "
                "python -m flux_train.train"
            )
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
        dataset = preflight.check_inputs(cfg, self.dist.device, self.dist.world_size)
        # from here on every rank says where it is (a bad input above has ended the run without a thread)
        self.heartbeat = Heartbeat(self.out_dir / "heartbeats", self.dist.rank)
        if self.dist.is_main:
            run_folder.write_masked_config(cfg)
        self.checkpointer = checkpoint.Checkpointer(
            checkpoint_dir(cfg), cfg.checkpoint.keep, cfg.checkpoint.async_save, cfg.checkpoint.every_steps
        )
        # a resumed run continues the same MLLOG file and does not start a second run in it; completing a finished
        # run's final checkpoint writes none
        self.mllog = MLLogger(
            self.out_dir / cfg.logging.mllog_file,
            enabled=self.dist.is_main and self.folder.final_step is None,
            append=self.resume_from is not None,
            stdout=cfg.logging.mllog_stdout,
        )
        if not self.mllog.continued:
            self.mllog.run_parameters(cfg, self.dist.world_size)
            self.mllog.start(C.INIT_START)

        self.state = TrainState.of_run(cfg, self.dist.world_size)
        self.device = self.dist.device
        self.dtype = DTYPES[cfg.train.compute_dtype]
        self.accum = accumulation_steps(cfg, self.dist.world_size)
        self.attention = select_attention_backend(cfg.perf.attention, self.dtype, self.device)
        model = build_model(cfg.model, cfg.perf.rmsnorm)
        self.n_params = count_params(model)
        initial = self._initial_weights(model)
        self.precision = precision_for(cfg.perf, self.device)
        prepare_model(model, cfg.perf, cfg.parallel.activation_checkpointing, self.precision)
        graphed = graphs_on(cfg, self.device.type)
        self.layout = build_training(
            model, self.dist.mesh, cfg.parallel, cfg.train, self.dtype, self.device, graphed=graphed
        )
        self.model = self.layout.model
        self.layout.assign_weights(initial)
        self.precision.attach(self.model)
        self.graphed = GraphedStep(self._device_step) if graphed else None
        self.data = build_data(cfg, self.dist.rank, self.dist.world_size, dataset)
        self.empty = (self.data.empty_t5.to(self.device), self.data.empty_clip.to(self.device))
        draws = bool(cfg.eval.sample_prompts)
        self.pictures = Pictures(
            out_dir=self.out_dir,
            global_batch_size=cfg.train.global_batch_size,
            target=cfg.eval.target,
            model=self.model,
            is_main=self.dist.is_main,
            samples=draws,
            # diffusers and the encoders only where samples are drawn
            sampler=sampler(cfg, self.device, self.dtype) if sampler and draws and self.dist.is_main else None,
        )
        self.evaluator = Evaluator(
            model=self.model,
            val=self.data.val,
            val_size=self.data.val_size,
            mllog=self.mllog,
            heartbeat=self.heartbeat,
            rank=self.dist.rank,
            device=self.device,
            dtype=self.dtype,
            seed=cfg.train.seed,
            latent_shift=cfg.train.latent_shift,
            latent_scale=cfg.train.latent_scale,
            every=eval_interval_steps(cfg) if cfg.eval.enabled else 0,
            target=cfg.eval.target,
            after_eval=self.pictures.after_eval,
            after_pass=self.layout.after_eval,
        )
        self.stop_requested = False
        self.flops_per_sample: float | None = None

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

    def _resume(self) -> None:
        """The checkpoint's state, after the warm-up (whose steps would overwrite the optimizer's moments)."""
        assert self.resume_from is not None  # run() resumes only where the run folder chose a checkpoint
        started = time.monotonic()
        checkpoint.load(self.resume_from, self.parts)
        self._say(
            f"resumed from {self.resume_from} at step {self.state.step} (read in {time.monotonic() - started:.1f} s)"
        )

    @property
    def parts(self) -> dict[str, Stateful]:
        """What a checkpoint holds, by name (flux_train.training.checkpoint)."""
        return {"progress": self.state, "layout": self.layout, "loader": self.data.train, "precision": self.precision}

    def save_checkpoint(self, last: bool = False) -> Path:
        """A checkpoint of this step; `last` where the run ends after it (Checkpointer.save)."""
        self.heartbeat.beat(self.state.step, "checkpoint")
        started = time.monotonic()
        path = self.checkpointer.save(self.state.step, self.parts, last)
        took = time.monotonic() - started
        if self.checkpointer.pending:  # an async save: the write goes on in the background
            self._say(f"saving checkpoint {path} (training paused {took:.1f} s for the copy to host memory)")
        elif self.dist.is_main:  # a 12B model's state is 143 GB: how fast this storage writes it matters
            gb = checkpoint.folder_bytes(path) / 1e9
            self._say(f"saved checkpoint {path}: {gb:.3g} GB in {took:.1f} s ({gb / max(took, 1e-3):.2f} GB/s)")
        return path

    def close(self) -> None:
        """Release the captured step graph before the process group goes down: NCCL destroys no communicator
        while a graph that captured its collectives is alive, so a graphed run at two ranks never exited."""
        if self.graphed is not None:
            self.graphed.close()

    # ------------------------------------------------------------------ one optimizer step

    def _forward_backward(self, inputs: dict, target: torch.Tensor, micro: int) -> torch.Tensor:
        """Loss / accum of one micro-batch, gradients accumulated; after the last one, reduced (ddp)."""
        self.layout.start_micro_batch(micro, self.accum)
        loss = flow.mse_loss(self.model(**inputs), target) / self.accum
        if self.state.step + 1 == self.cfg.train.inject_nan_at_step:
            loss = loss * float("nan")
        loss.backward()
        if micro == self.accum - 1:
            self.layout.finish_backward()
        return loss.detach()

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step over `accum` micro-batches; returns (loss, grad norm, data wait seconds)."""
        self.heartbeat.beat(self.state.step + 1, "train")
        t = self.cfg.train
        return self._step(lambda: next(self.data.train), lr_at(self.state.step, t.lr, t.warmup_steps))

    def _step(self, next_batch, lr: float) -> tuple[torch.Tensor, torch.Tensor, float]:
        self.layout.begin_step(lr)
        data_wait, staged = 0.0, []
        for micro in range(self.accum):
            t0 = time.perf_counter()
            batch = next_batch()
            data_wait += time.perf_counter() - t0
            global_micro = self.dist.rank * self.accum + micro
            inputs, target = flow.training_inputs(
                batch, self.cfg.train, self.state.step, global_micro, self.empty, self.device, self.dtype
            )
            staged.append((inputs.as_kwargs(), target))
        if self.flops_per_sample is None:  # from the data's shapes, known at the first batch
            self.flops_per_sample = flops_per_sample(self.cfg.model, inputs.txt.shape[1], inputs.img.shape[1])
        loss_sum, grad_norm = (self.graphed or self._device_step)(staged)
        self.state.step += 1
        return loss_sum, grad_norm, data_wait

    def _device_step(self, staged: list[tuple[dict, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's device work (what perf.cuda_graphs captures): forward and backward of every micro-batch,
        clipping and AdamW (graphed ddp: the clipping factor here, the update and all-gathers interleaved with the
        next forward), the FP8 scales of the next step."""
        losses = [self._forward_backward(inputs, target, micro) for micro, (inputs, target) in enumerate(staged)]
        loss_sum = functools.reduce(operator.add, losses)  # the micro-batches' losses, summed in order
        grad_norm = self.layout.step()  # graphed ddp: the update runs in the next forward, no gather in flight
        self.precision.after_step()
        return loss_sum, grad_norm

    def warm_up(self, iters: int) -> None:
        """Compile, tune and capture graphs before run_start on synthetic tensors (the rules start the clock
        before any data is read): steps with lr 0 leave the weights as they are, then the optimizer state is
        reset. Text length comes from the empty encodings, the latent side from perf.warmup_latent_size."""
        if iters <= 0:
            return
        m, side = self.cfg.model, self.cfg.perf.warmup_latent_size
        text_len = self.data.empty_t5.shape[1]
        mb = self.cfg.train.micro_batch_size
        batch = synthetic_samples(mb, text_len, side, side, m.joint_attention_dim, m.pooled_projection_dim, seed=0)
        step = self.state.step
        for _ in range(iters):
            self._step(lambda: batch, lr=0.0)
        self.state.step = step
        self.layout.reset_optimizer()  # AdamW starts from zero moments and step 0 at the first real step
        self.precision.reset()  # and FP8 delayed scaling from no amax history
        self.flops_per_sample = None  # measured again on the first real batch

    # ------------------------------------------------------------------ the loop

    def _install_stop_signal(self) -> None:
        # Slurm's warning signal asks for a checkpoint at the next logging boundary (flux_train.training.preemption)
        def handler(signum, frame):
            self.stop_requested = True

        signal.signal(preemption.SIGNAL, handler)

    def _say(self, text: str) -> None:
        if self.dist.is_main:
            say(f"flux-train: {text}")

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
        if self.folder.final_step is not None:
            return self._complete_final(self.folder.final_step)
        if not self.mllog.continued:
            self.mllog.end(C.INIT_STOP)
            self.mllog.start(C.RUN_START)
        metrics = Metrics(
            self.out_dir,
            self.device,
            self.dist.world_size,
            cfg.train.global_batch_size,
            Eta(self.evaluator.every, eta_goals(cfg, self.evaluator.every)),
            self.dist.is_main,
            cfg.logging.progress_bar,
            cfg.logging.tensorboard,
            append=self.resume_from is not None,
            start_step=self.state.step,
        )
        status = self._train(metrics)
        self.layout.wait_params()  # no collective may be in flight when the process group goes down
        self.checkpointer.close()
        metrics.close()
        if status != Status.PREEMPTED:  # a preempted run continues in the same log after the requeue
            self.mllog.run_stop(C.SUCCESS if status == Status.SUCCESS else C.ABORTED, self.state.samples)
        self._save_final(status)
        if status == Status.SUCCESS:  # the successful eval's report and samples, after run_stop
            self.pictures.after_eval(self.state.step)
        else:
            self.pictures.report()
        ended = {  # the step cap is a normal end for a user; "aborted" is the benchmark's word for it
            Status.SUCCESS: f"status success (an eval reached the target {cfg.eval.target})",
            Status.ABORTED: f"the step cap train.max_steps {t.max_steps}, before an eval reached the target "
            f"{cfg.eval.target} (MLLOG's run_stop status: aborted)",
            Status.PREEMPTED: "status preempted (Slurm's warning signal: checkpoint saved, the job requeues)",
            Status.DIVERGED: "status diverged (a non-finite loss or gradient norm)",
        }[status]
        self._say(f"finished at step {self.state.step}, {ended}")
        return status

    def _save_final(self, status: Status) -> None:
        """The state a run ended with (checkpoint.final), after run_stop (off the clock), complete when this returns. A
        preempted run has just saved it; a diverged one keeps its last good checkpoint, not the non-finite state."""
        if not self.cfg.checkpoint.final or status not in (Status.SUCCESS, Status.ABORTED):
            return
        if checkpoint.step_folder(self.checkpointer.root, self.state.step).is_dir():  # the cap was a checkpoint step
            return
        self.save_checkpoint(last=True)
        self.checkpointer.close()

    def _complete_final(self, step: int) -> Status:
        """The final checkpoint of a finished run that a kill cut (run_folder.cut_final): its steps since the
        checkpoint resumed from trained again (the same data and draws, all seeded by step), then saved; mllog.log
        and metrics.jsonl stay as the run left them, with its one run_stop."""
        start = self.state.step
        while self.state.step < step:
            self.train_step()
        path = self.save_checkpoint(last=True)
        self.checkpointer.close()
        self._say(f"completed the final checkpoint {path} of the finished run (steps {start + 1}-{step} again)")
        return Status.COMPLETED

    def _train(self, metrics: Metrics) -> Status:
        """Blocks of steps, each between MLLOG's block_start and block_stop, until one ends the run."""
        window = LogWindow(self.device, self.dist.world_size)
        while True:
            with self.mllog.block(lambda: self.state.samples):
                metrics.reset_window()
                end = self._block(metrics, window)
            if end.kind is End.DIVERGED:
                return self._diverged(end.first_bad)
            # the eval before a stop or a checkpoint: a checkpoint of this step stands for its eval having run
            if end.kind is End.EVAL and self._eval_reached(metrics):
                return Status.SUCCESS
            if end.stop:
                self.save_checkpoint(last=True)
                return Status.PREEMPTED
            if end.checkpoint:
                self.save_checkpoint()
            if self.state.step >= self.cfg.train.max_steps:  # the cap, or it fell on an eval: run_stop follows it
                return Status.ABORTED

    def _eval_reached(self, metrics: Metrics) -> bool:
        """The eval that is due; whether it reached the target."""
        done = self.evaluator.run(self.state, metrics.emit)
        metrics.eta.eval_s = done.seconds  # with what follows it (report, sample grid)
        return done.reached

    def _block(self, metrics: Metrics, window: LogWindow) -> Boundary:
        """Steps until an eval is due, a stop, a non-finite step or the step cap; the metrics and checkpoints of
        the steps in between."""
        cfg, t = self.cfg, self.cfg.train
        while self.state.step < t.max_steps:
            loss, grad_norm, wait = self.train_step()
            step = self.state.step
            window.add(step, loss, grad_norm)
            metrics.add_step(wait)
            eval_due, checkpoint_due = self.evaluator.due(step), self.checkpointer.due(step)
            if step % cfg.logging.log_every and not eval_due and not checkpoint_due:
                continue
            # a host sync: nothing below may act on a non-finite state
            mean_loss, stop, first_bad = window.close(self.stop_requested)
            if first_bad is not None:
                return Boundary(End.DIVERGED, first_bad=first_bad)
            lr = lr_at(step - 1, t.lr, t.warmup_steps)
            metrics.log(
                step,
                self.flops_per_sample or 0.0,
                loss=mean_loss,
                lr=lr,
                grad_norm=float(grad_norm),
                **self.precision.metrics(),
            )
            warning = self.precision.warning(step)
            if warning and self.dist.is_main:
                say(f"flux-train: warning: {warning}", file=sys.stderr)
            if eval_due or stop:
                return Boundary(End.EVAL if eval_due else End.STOP, stop, checkpoint=checkpoint_due)
            if checkpoint_due:
                self.save_checkpoint()
        return Boundary(End.CAP)

    def _diverged(self, first_bad: int) -> Status:
        at = f"at step {first_bad}" if first_bad > 0 else f"in the steps up to {self.state.step}"
        self.checkpointer.wait()
        self._say(
            f"stopped: the loss or gradient norm was not finite {at}; {checkpoint.last_good(self.checkpointer.root)}. "
            "Lower train.lr, lengthen train.warmup_steps or look at the data of that step before resuming"
        )
        return Status.DIVERGED


def _quiet_resource_sharer() -> None:
    """Ctrl-C from a terminal stops the loader's workers with the run: the one handing the trainer a tensor's file
    descriptor then finds its peer gone, and multiprocessing's resource sharer reports that broken pipe or reset
    through sys.excepthook from its thread, a traceback after the run's one line (seen in a whole test run). Set
    before the workers fork, so they inherit it: such errors say nothing the run does not say itself."""
    hook = sys.excepthook

    def quiet(kind, value, traceback) -> None:
        from_sharer = traceback is not None and traceback.tb_frame.f_code.co_filename == resource_sharer.__file__
        if not (from_sharer and issubclass(kind, (BrokenPipeError, ConnectionResetError))):
            hook(kind, value, traceback)

    sys.excepthook = quiet


@reports_user_errors
def main(argv=None, sampler: SamplerFactory | None = None) -> int:
    """The run of the command line `argv`; `sampler` as for Trainer."""
    args = train_parser().parse_args(argv)
    cfg = trainer = status = ignored = None
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(cfg.to_yaml(), end="")
            return 0
        _quiet_resource_sharer()
        trainer = Trainer(cfg, sampler)
        status = trainer.run()
    except StorageError as exc:  # a file the run must write could not be written: say where to resume from
        where = checkpoint.last_good(checkpoint_dir(cfg)) if cfg else "no checkpoint yet"
        return report(StorageError(f"{exc}; {where}"))
    except UserError as exc:  # said now: a teardown that hangs (below) ends the process before main returns
        return report(exc)
    except RuntimeError as exc:  # out of memory; a collective failed or timed out
        rank = dist.get_rank() if dist.is_initialized() else 0
        oom, stalled = out_of_memory_line(exc, rank), collective_failure_line(exc, cfg.logging.out_dir if cfg else ".")
        if not (oom or stalled):
            raise
        print(oom or stalled, file=sys.stderr, flush=True)
        return EXIT_OUT_OF_MEMORY if oom else EXIT_COLLECTIVE
    except KeyboardInterrupt:  # Ctrl-C: one line, not the traceback of wherever the loop was
        ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second one must not cut the teardown short
        if not dist.is_initialized() or dist.get_rank() == 0:
            at = f"at step {trainer.state.step}" if trainer else "while starting"
            where = f"; the same command {run_folder.next_start(cfg)}" if cfg else ""
            print(f"flux-train: interrupted {at}{where}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        # from here the heartbeat no longer speaks for this rank: the deadline does, if the teardown hangs
        deadline = None
        if cfg is not None and dist.is_initialized():
            error = sys.exc_info()[1]  # one on its way out: its traceback would come after a teardown that hangs
            why = checkpoint.brief(error) if error else "an error"
            ended = f"status {status.value}" if status is not None else f"stopped by {why}"
            deadline = ExitDeadline(cfg.parallel.exit_timeout_s, dist.get_rank(), ended)
        if trainer is not None:
            trainer.heartbeat.stop()
            trainer.close()
        shutdown()
        run_folder.release()
        if deadline is not None:
            deadline.cancel()
        if ignored is not None:
            signal.signal(signal.SIGINT, ignored)
    return {Status.PREEMPTED: preemption.EXIT_CODE, Status.DIVERGED: EXIT_DIVERGED}.get(status or Status.SUCCESS, 0)
