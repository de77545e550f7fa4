"""What a run draws for people after its evals: the run report (report.png from metrics.jsonl) and, with
eval.sample_prompts, a grid of samples per eval (rank 0). Pictures are best effort: any error in drawing or writing
one (a full disk, the GPU out of memory) is a warning, and training goes on.

The grids come from diffusers' FluxPipeline (flux_train.tools.sample.Sampler), which nothing in training imports:
the trainer is handed a way to build a sampler by the modules that start it (the train command, the cluster
worker), since tools sit above training."""

from __future__ import annotations

import gc
import sys
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import torch
from torch import nn

from flux_train.config import Config
from flux_train.outputs.report import REPORT_FILE, write_report
from flux_train.training.checkpoint import brief

if TYPE_CHECKING:
    from PIL import Image


class GridSampler(Protocol):
    """flux_train.tools.sample.Sampler, as the trainer uses it."""

    def grid(self, state: dict[str, torch.Tensor]) -> Image.Image: ...


# builds the run's sampler from its config, device and dtype (flux_train.tools.sample.Sampler.for_run)
SamplerFactory = Callable[[Config, torch.device, torch.dtype], GridSampler]


def best_effort(path: Path, write: Callable[[], object]) -> bool:
    """Pictures for people (the report, sample grids): any error in drawing or writing one is a warning, training
    goes on. (Only this rank draws: no collective is left waiting on it.)"""
    try:
        write()
        return True
    except Exception as exc:  # noqa: BLE001 - a picture never ends a run; KeyboardInterrupt still does
        print(
            f"flux-train: warning: could not write {path} ({brief(exc)}); training goes on",
            file=sys.stderr,
            flush=True,
        )
        return False


def release_device_memory() -> None:
    """Give what a finished or failed drawing held back to the device (a failed one's tensors live on in reference
    cycles until collected), so that training finds the memory it had."""
    gc.collect()
    torch.cuda.empty_cache()  # a no-op where CUDA was never initialised


def gathered_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the full weights of a training layout's model on rank 0's CPU (an empty dict on the others)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return typing.cast(dict[str, torch.Tensor], state)  # a model's state: tensors


class Pictures:
    """The run's pictures. `samples`: evals are followed by grids (every rank takes part in gathering the
    weights); `sampler` draws them on rank 0 (None on the other ranks)."""

    def __init__(
        self,
        *,
        out_dir: Path,
        global_batch_size: int,
        target: float,
        model: nn.Module,
        is_main: bool,
        samples: bool,
        sampler: GridSampler | None,
    ):
        self.out_dir, self.global_batch_size, self.target = out_dir, global_batch_size, target
        self.model, self.is_main, self.samples, self.sampler = model, is_main, samples, sampler
        if sampler is not None:
            release_device_memory()  # the text encoders that made it ran once (T5: 9.5 GB in bf16) and are gone

    def after_eval(self, step: int) -> None:
        """After an eval's MLLOG events and metrics row: the report and, with samples, the grid of `step`."""
        self.report()
        if not self.samples:
            return
        weights = gathered_weights(self.model)  # collective: the full weights on rank 0
        sampler = self.sampler
        if sampler is None:
            return
        path = self.out_dir / "samples" / f"step_{step:08d}.png"

        def draw() -> None:
            path.parent.mkdir(exist_ok=True)
            sampler.grid(weights).save(path)

        if best_effort(path, draw):
            print(f"flux-train: samples of step {step}: {path}", flush=True)
        release_device_memory()

    def report(self) -> None:
        """The run's report.png from metrics.jsonl (rank 0)."""
        if self.is_main:
            best_effort(
                self.out_dir / REPORT_FILE, lambda: write_report(self.out_dir, self.global_batch_size, self.target)
            )
