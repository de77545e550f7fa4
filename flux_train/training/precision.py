"""The run's precision, one component the trainer and the bench drive without knowing which recipe runs
(`perf.fp8`, `perf.fp8_impl`; the recipes' table: flux_train/precision_recipes.py), after torchtitan's model
converters. In the order a run calls it:

- `convert(model)`: before activation checkpointing, compile and the layout (perf.prepare_model): the blocks'
  token Linears (model.is_token_linear) become FP8 ones, ours (flux_train/kernels/fp8.py) or torchao's;
- `attach(model)`: once the layout has put the weights on the device: our FP8 layers' scale buffers;
- `after_step()`: after each optimizer step, device work only (it runs inside a captured step): delayed scaling
  turns the step's maxima into the next step's scales;
- `reset()`: after the warm-up's steps on synthetic tensors: no history, no overflow counted;
- `state_dict()` / `load_state_dict()`: the checkpoint's `precision` part; a state this precision cannot take
  (another recipe's, another set of layers or history length) raises errors.StateMisfit saying so;
- `metrics()` and `warning(step)`, at logging boundaries (a host sync): numbers for metrics.jsonl
  (`fp8_overflows`), and one line, once, when FP8 values keep saturating under delayed scaling
  (docs/operating.md, "Operating a run").
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
from torch import nn

from flux_train.config import PerfConfig
from flux_train.errors import StateMisfit
from flux_train.kernels.fp8 import FP8Scaling, convert_to_fp8, device_e4m3
from flux_train.model.flux import canonical_name, is_token_linear
from flux_train.precision_recipes import RECIPES, Recipe

OPERANDS = ("x", "W", "dY")  # the order of FP8Scaling's maxima per layer


class Precision(Protocol):
    recipe: Recipe

    def convert(self, model: nn.Module) -> nn.Module:
        """Before compile and the layout (meta or real weights); returns the model, converted in place."""
        ...

    def attach(self, model: nn.Module) -> None:
        """After the layout: what the converted layers need on the device."""
        ...

    def after_step(self) -> None:
        """After each optimizer step: device work only, no host sync."""
        ...

    def reset(self) -> None:
        """After the warm-up: what the synthetic steps left behind is forgotten."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None:
        """Raises StateMisfit, changing nothing, on a state of another recipe or model."""
        ...

    def metrics(self) -> dict[str, float]:
        """Numbers for the metrics line (reads the device)."""
        ...

    def warning(self, step: int) -> str | None:
        """A line about a problem that persists, or None; at logging boundaries (reads the device)."""
        ...


class NoFP8:
    """perf.fp8=none: the model computes in train.compute_dtype. Also the base of the recipes that keep nothing
    between steps: every call a no-op, no state, nothing to report."""

    recipe = RECIPES["none"]

    def convert(self, model: nn.Module) -> nn.Module:
        return model

    def attach(self, model: nn.Module) -> None:
        pass

    def after_step(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict:
            raise StateMisfit(f"it holds FP8 amax histories (delayed scaling), perf.fp8={self.recipe.name} keeps none")

    def metrics(self) -> dict[str, float]:
        return {}

    def warning(self, step: int) -> str | None:
        return None


class TorchaoFP8(NoFP8):
    """perf.fp8_impl=torchao: torchao's Float8Linear, current scaling (its own casts; no state). Off a GPU, its
    emulation (a dequantised matmul, as ours: torch's CPU FP8 GEMM took 2 s a step of the debug model)."""

    def __init__(self, recipe: Recipe, device: torch.device):
        self.recipe, self.device = recipe, device

    def convert(self, model: nn.Module) -> nn.Module:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(self.recipe.name)
        return convert_to_float8_training(
            model,
            config=dataclasses.replace(config, emulate=self.device.type != "cuda"),
            module_filter_fn=lambda module, fqn: is_token_linear(fqn, module),
        )


class OurFP8(NoFP8):
    """Our FP8 layers (flux_train/kernels/fp8.py) with current scaling, per tensor or per row: no state."""

    def __init__(self, recipe: Recipe, device: torch.device, history: int = 16, gelu_in_cast: bool = False):
        self.recipe, self.device, self.history, self.gelu_in_cast = recipe, device, history, gelu_in_cast

    def convert(self, model: nn.Module) -> nn.Module:
        dtype = device_e4m3(self.device)
        return convert_to_fp8(model, self.recipe.name, dtype, is_token_linear, self.history, self.gelu_in_cast)

    def attach(self, model: nn.Module) -> None:
        FP8Scaling.of(model, self.device)  # the layers' scale buffers; current scaling has no scaling to drive


class DelayedFP8(OurFP8):
    """Our FP8 layers with delayed scaling: the scales of each step come from the amax history of the last
    `history` steps (kernels.fp8.FP8Scaling), which checkpoints carry, so a resume continues exactly."""

    scaling: FP8Scaling  # made by attach
    names: list[str]  # its layers', as the model names them

    def __init__(self, recipe: Recipe, device: torch.device, history: int, margin: int, gelu_in_cast: bool):
        super().__init__(recipe, device, history, gelu_in_cast)
        self.margin = margin
        self.mark: tuple[int, torch.Tensor] | None = None  # (step, saturations by pair) where warning's window starts
        self.warned = False

    def attach(self, model: nn.Module) -> None:
        scaling = FP8Scaling.of(model, self.device, self.margin)
        assert scaling is not None  # convert made every token Linear a delayed one
        names = {id(module): canonical_name(fqn) for fqn, module in model.named_modules()}
        self.scaling, self.names = scaling, [names[id(layer)] for layer in scaling.layers]

    def after_step(self) -> None:
        self.scaling.update()

    def reset(self) -> None:
        self.scaling.reset()
        self.mark = None

    def state_dict(self) -> dict:
        return {"recipe": self.recipe.name, **self.scaling.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if "history" not in state_dict:
            raise StateMisfit(f"it holds no amax history (saved without perf.fp8={self.recipe.name})")
        try:
            self.scaling.load_state_dict(state_dict)  # a state without a recipe: progress.pt's "fp8", always delayed
        except ValueError as exc:
            raise StateMisfit(str(exc)) from None
        self.mark = None

    def metrics(self) -> dict[str, float]:
        return {"fp8_overflows": int(self.scaling.overflows)}

    def warning(self, step: int) -> str | None:
        """Once a run: the (layer, operand) pairs whose values saturated beyond e4m3's rounding (FP8Scaling's
        `saturations`) in at least a quarter of the steps of a window of `history` steps or more. The first window
        starts at the first call once the histories have filled (the first `history` steps, which overflow most)."""
        if self.warned or step < self.history:
            return None
        counts = self.scaling.saturations.to("cpu", copy=True)  # a copy on the CPU too: the count goes on
        if self.mark is None:
            self.mark = (step, counts)
            return None
        start, before = self.mark
        if step - start < self.history:
            return None
        self.mark = (step, counts)
        persistent = ((counts - before) * 4 >= step - start).nonzero().tolist()
        if not persistent:
            return None
        self.warned = True
        named = ", ".join(f"{self.names[i]} {OPERANDS[j]}" for i, j in persistent[:3])
        more = f" and {len(persistent) - 3} more" if len(persistent) > 3 else ""
        return (
            f"FP8 delayed scaling: the values of {len(persistent)} of {counts.numel()} (layer, operand) pairs "
            f"saturated in at least a quarter of steps {start + 1}-{step} ({named}{more}): their maxima outgrow "
            f"the amax history; perf.fp8_margin={self.margin + 1} doubles the headroom"
        )


def precision_for(perf: PerfConfig, device: torch.device) -> Precision:
    """The precision `perf` asks for, on `device` (whose e4m3 format our FP8 layers take)."""
    recipe = RECIPES[perf.fp8]
    if not recipe.fp8:
        return NoFP8()
    if perf.fp8_impl == "torchao":
        return TorchaoFP8(recipe, device)
    if recipe.history:
        return DelayedFP8(recipe, device, perf.fp8_amax_history, perf.fp8_margin, perf.fp8_gelu_in_cast)
    return OurFP8(recipe, device)
