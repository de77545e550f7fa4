"""Performance plumbing: attention backend, regional compile of the DiT blocks, FP8 GEMMs, CUDA graphs.

- `perf.attention`: SDPA backends other than the chosen one are switched off (the cuDNN backend's backward
  failed for this model on the H100/H200 image, so the default is flash).
- `perf.compile=block`: each double/single block is its own torch.compile region (fullgraph), applied before
  FSDP wraps it, so FSDP's all-gathers and the DDP layout's gather waits stay outside the graphs (a region
  per block stack measured 1.02x of this on one H200, and cannot hold those per-block hooks).
- `perf.fp8`: the blocks' token GEMMs (model.is_token_linear) in FP8, with our kernels (flux_train.kernels.fp8)
  or torchao's Float8Linear (`perf.fp8_impl=torchao`).
- `CudaGraph`: a callable captured once and replayed; the trainer captures its whole optimizer step
  (parallel.strategy=ddp, whose weights, gradient buffers and optimizer state never move).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from flux_train.kernels.fp8 import convert_to_fp8, device_e4m3
from flux_train.model import block_stacks, is_token_linear

SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")


def select_attention_backend(name: str) -> None:
    if name == "auto" or not torch.cuda.is_available():
        return
    torch.backends.cuda.enable_flash_sdp(name == "flash")
    torch.backends.cuda.enable_mem_efficient_sdp(name == "efficient")
    torch.backends.cuda.enable_cudnn_sdp(name == "cudnn")
    torch.backends.cuda.enable_math_sdp(name == "math")


def apply_fp8(model: nn.Module, recipe: str, impl: str, device: torch.device) -> nn.Module:
    """FP8 for the blocks' token GEMMs (before compile and sharding); recipe 'none' leaves the model as it is."""
    if recipe == "none":
        return model
    if impl == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        return convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name(recipe),
            module_filter_fn=lambda module, fqn: is_token_linear(fqn, module),
        )
    return convert_to_fp8(model, recipe, device_e4m3(device), is_token_linear)


def compile_blocks(model: nn.Module, mode: str) -> nn.Module:
    """Regional compile: every block its own region (`block`), or nothing (`none`)."""
    if mode == "block":
        for stack in block_stacks(model):
            for i, block in enumerate(stack):
                stack[i] = torch.compile(block, fullgraph=True)
    return model


class CudaGraph:
    """`fn()` captured once -- after `warmup` eager runs on a side stream (compile, autotune, workspaces) -- and
    replayed by each call. `fn` reads its inputs from tensors the caller updates in place; the warm-up runs
    really execute, so capture only where their side effects do not count (before run_start, lr 0)."""

    def __init__(self, fn: Callable[[], Any], warmup: int = 1):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the eager runs' cached blocks back, so the graph's own pool can have them
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog and loader threads keep polling CUDA while this thread captures
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.output = fn()

    def __call__(self) -> Any:
        self.graph.replay()
        return self.output
