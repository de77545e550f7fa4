"""Training metrics: throughput, TFLOP/s, MFU, memory, data wait; a metrics line, a progress bar with the time to
the next eval and to where the reference converged, TensorBoard."""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from flux_train.config import Config
from flux_train.errors import StorageError
from flux_train.hardware import kind_of
from flux_train.outputs.mllog import rcp_samples
from flux_train.outputs.report import METRICS_FILE
from flux_train.training.distributed import all_reduce_sum


def peak_tflops(device: torch.device) -> float | None:
    """The GPU's dense bf16 peak, for MFU (None: not a GPU the table holds); the bench measures the achievable
    ceiling itself."""
    kind = kind_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return kind.bf16_tflops if kind else None


def eta_goals(cfg: Config, every: int) -> list[tuple[int, str]]:
    """The steps the progress bar gives the time to, in order: for flux-schnell at a global batch size the MLPerf
    reference ran, the eval (one every `every` steps; 0: none, so no convergence point) at which its runs converged
    on average and at the latest (the RCPs); the step cap."""
    gbs, cap = cfg.train.global_batch_size, cfg.train.max_steps
    samples = rcp_samples(gbs) if cfg.model.flavor == "flux-schnell" and every else []
    found = [("RCP mean", statistics.fmean(samples)), ("RCP max", max(samples))] if samples else []
    points = [(math.ceil(n / gbs / every) * every, f"{name} ({n / 1e6:.2f} M samples)") for name, n in found]
    return [(step, label) for step, label in points if step < cap] + [(cap, "step cap")]


def tensorboard_scalars(row: dict) -> dict:
    """A metrics row's values by TensorBoard tag: a group's ({name: number}) as group/name."""
    tags = {}
    for k, v in row.items():
        tags |= {f"{k}/{name}": x for name, x in v.items()} if isinstance(v, dict) else {k: v}
    return tags


class Eta:
    """Time to the next eval and to the next goal, from the last window's seconds per step and the last eval's
    seconds (tqdm's own estimate runs to the step cap and leaves the evals out)."""

    def __init__(self, eval_every: int, goals: list[tuple[int, str]]):
        self.eval_every, self.goals = eval_every, goals
        self.step_s: float | None = None  # measured at the first metrics line
        self.eval_s: float | None = None  # measured at the first eval (the trainer times it)

    def text(self, step: int) -> str:
        if self.step_s is None:
            return ""
        every = self.eval_every
        goal, label = next(((g, label) for g, label in self.goals if g > step), self.goals[-1])
        evals = goal // every - step // every if every else 0
        left = (goal - step) * self.step_s + evals * (self.eval_s or 0.0)
        at_least = ">" if evals and self.eval_s is None else ""
        parts = [f"next eval in {tqdm.format_interval((every - step % every) * self.step_s)}"] if every else []
        return ", ".join([*parts, f"{label} in {at_least}{tqdm.format_interval(left)}"])


def say(text: str, file=None) -> None:
    """A line of the run on stdout (or `file`: sys.stderr), above the progress bar where one is drawn (tqdm clears it
    and draws it again below): a plain print lands on the bar's line, after the bar."""
    file = file or sys.stdout
    tqdm.write(text, file=file)
    file.flush()


class Metrics:
    """Accumulates step timings between log lines; rank 0 prints and writes JSONL/TensorBoard."""

    def __init__(
        self,
        out_dir: Path,
        device: torch.device,
        world_size: int,
        global_batch_size: int,
        eta: Eta,
        enabled: bool,
        progress_bar: bool,
        tensorboard: bool,
        append: bool = False,
        start_step: int = 0,
    ):
        self.device, self.world, self.global_batch_size = device, world_size, global_batch_size
        self.enabled = enabled
        self.peak = peak_tflops(device)
        self.eta = eta
        self._t0 = time.perf_counter()
        self._steps = 0
        self._data_wait = 0.0
        # a resumed run continues the file (cut back to its checkpoint by run_folder.claim); a fresh one replaces it
        self.path = out_dir / METRICS_FILE
        # unbuffered: a row that cannot be written fails here, not again when the file is closed at exit
        self.jsonl = self._written(lambda: self.path.open("ab" if append else "wb", buffering=0)) if enabled else None
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tensorboard"))
            except ImportError:
                print(
                    "logging.tensorboard=true but tensorboard is not installed; pip install tensorboard",
                    file=sys.stderr,
                )
        self.bar = None
        if enabled and progress_bar and sys.stderr.isatty():
            # to the step cap; the time left is Eta's, in the postfix
            self.bar = tqdm(
                total=eta.goals[-1][0],
                initial=start_step,
                unit="step",
                dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]",
            )
            self.postfix: dict[str, str] = {}

    def add_step(self, data_wait_s: float) -> None:
        self._steps += 1
        self._data_wait += data_wait_s
        if self.bar is not None:
            self.bar.update(1)
            self._show()

    def _show(self) -> None:
        if self.bar is None:
            return
        shown = [f"{k}={v}" for k, v in self.postfix.items()]
        self.bar.set_postfix_str(", ".join(p for p in [*shown, self.eta.text(self.bar.n)] if p), refresh=False)

    def reset_window(self) -> None:
        self._t0, self._steps, self._data_wait = time.perf_counter(), 0, 0.0

    def log(self, step: int, flops_per_sample: float, **scalars: float) -> dict:
        """Close the timing window, print the metrics line; scalars are already-synced floats."""
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        self.eta.step_s = elapsed / max(self._steps, 1)
        sps = self._steps * self.global_batch_size / elapsed
        tflops = sps * flops_per_sample / 1e12 / self.world
        row = {
            "step": step,
            **scalars,
            "samples_per_s": sps,
            "samples_per_s_per_gpu": sps / self.world,
            "tflops_per_gpu": tflops,
            "data_wait_pct": 100.0 * self._data_wait / elapsed,
        }
        if self.peak:
            row["mfu_pct"] = 100.0 * tflops / self.peak
        if self.device.type == "cuda":
            row["mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.reset_window()
        self.emit(row)
        return row

    def emit(self, row: dict) -> None:
        """A row: numbers, and groups of them ({name: number}: an eval's loss by timestep), which go to
        metrics.jsonl and TensorBoard (as group/name) but not to the terminal's line."""
        if not self.enabled:
            return
        say(
            " ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                for k, v in row.items()
                if not isinstance(v, dict)
            )
        )
        if self.bar is not None:
            # the last training loss and, once there is one, the last val loss: an eval's row (no training loss)
            # keeps the training loss shown
            self.postfix |= {k: f"{row[k]:.4f}" for k in ("loss", "val_loss") if k in row}
            self._show()
            self.bar.refresh()

        jsonl = self.jsonl
        if jsonl is None:  # not the main rank
            return

        def write() -> None:
            data = (json.dumps(row) + "\n").encode()
            while data:  # a write the disk cuts short returns less: the next one raises
                data = data[jsonl.write(data) :]

        self._written(write)
        if self.tb is not None:
            for tag, value in tensorboard_scalars(row).items():
                if tag != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(tag, value, row["step"])

    def _written(self, write):
        """A row the run cannot write (a full disk) stops it, naming the file: a lost row is not found later."""
        try:
            return write()
        except OSError as exc:
            raise StorageError(f"writing {self.path} failed ({exc})") from None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


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
