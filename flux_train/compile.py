"""Performance plumbing: attention backend, regional compile of the DiT blocks, CUDA graph capture.

- `perf.attention`: SDPA backends other than the chosen one are switched off (the cuDNN backend's backward
  failed for this model on the H100/H200 image, so the default is flash).
- `perf.compile=block`: each double/single block is its own torch.compile region (fullgraph), applied before
  FSDP wraps it, so FSDP's all-gathers stay outside the graphs. `stack`: each block stack's loop is one region
  (only without FSDP: the per-block FSDP hooks cannot live inside one graph).
- `GraphedStep`: a whole forward+backward captured once and replayed, for static inputs and parameters
  (one process, no FSDP: FSDP2 allocates its unsharded parameters and collective buffers per step).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from flux_train.layers import run_stack
from flux_train.model import block_stacks

SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")


def select_attention_backend(name: str) -> None:
    if name == "auto" or not torch.cuda.is_available():
        return
    if name not in SDPA_BACKENDS:
        raise ValueError(f"perf.attention: {name!r}; expected auto or one of {', '.join(SDPA_BACKENDS)}")
    torch.backends.cuda.enable_flash_sdp(name == "flash")
    torch.backends.cuda.enable_mem_efficient_sdp(name == "efficient")
    torch.backends.cuda.enable_cudnn_sdp(name == "cudnn")
    torch.backends.cuda.enable_math_sdp(name == "math")


def block_wrapper(mode: str) -> Callable[[nn.Module], nn.Module] | None:
    """The per-block hook for parallel.parallelize: compiles each block when mode == 'block'."""
    if mode == "block":
        return lambda block: torch.compile(block, fullgraph=True)
    if mode == "stack":
        raise ValueError("perf.compile=stack compiles whole block stacks and cannot hold FSDP's per-block hooks; "
                         "use perf.compile=block for training")
    return None


def compile_unsharded(model: nn.Module, mode: str) -> nn.Module:
    """Regional compile of a model that FSDP does not wrap (one-GPU forward/backward benchmarks)."""
    if mode == "block":
        for stack in block_stacks(model):
            for i, block in enumerate(stack):
                stack[i] = torch.compile(block, fullgraph=True)
    elif mode == "stack":
        model.run_double_stack = torch.compile(run_stack, fullgraph=True)
        model.run_single_stack = torch.compile(run_stack, fullgraph=True)
    return model


class GraphedStep:
    """Capture `fn()` (forward + backward into .grad) on a side stream after warm-up; `__call__` replays it.
    Inputs must be updated in place between replays; each replay writes fresh gradients into .grad."""

    def __init__(self, fn: Callable[[], torch.Tensor], params: list[torch.Tensor], warmup: int = 3):
        self.params = params
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        for p in params:  # backward allocates .grad inside the capture: replays overwrite the same buffers
            p.grad = None
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = fn()

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.loss
