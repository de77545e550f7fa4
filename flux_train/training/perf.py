"""Performance plumbing: attention backend, regional compile of the DiT blocks, FP8 GEMMs, CUDA graphs.

- `perf.attention`: SDPA backends other than the chosen one are switched off. `auto` takes, in bf16, the
  backend measured fastest on the platform (`preferred_attention`) once a forward and backward of it on the
  flux attention shape matched flash's; a failure falls back to flash and says why. In fp32 (no flash
  kernel) `auto` leaves the choice to torch.
- `perf.compile=block`: each double/single block is its own torch.compile region (fullgraph), applied before
  FSDP wraps it, so FSDP's all-gathers and the DDP layout's gather waits stay outside the graphs (a region
  per block stack measured 1.02x of this on one H200, and cannot hold those per-block hooks).
- `prepare_model`: the order the three apply in (the precision's conversion, FP8 with `perf.fp8`:
  flux_train.training.precision; compile; activation checkpointing), for every caller.
- `CudaGraph`: a callable captured once and replayed; `GraphedStep`: the trainer's whole optimizer step as one
  (parallel.strategy=ddp, whose weights, gradient buffers and optimizer state never move), fed from static buffers.
"""

from __future__ import annotations

import typing
import warnings
from typing import Any, Callable

import torch
from torch import nn

from flux_train.config import PerfConfig
from flux_train.data.contract import DataError
from flux_train.hardware import device_arch, of_arch
from flux_train.model.flux import block_stacks
from flux_train.training.precision import Precision


def preferred_attention(device: torch.device) -> str:
    """The SDPA backend measured fastest for Flux's attention (24 heads x 512 tokens x 128, bf16) on this GPU's
    architecture (flux_train/hardware.py); flash, which every platform has, where the table holds none of it."""
    kind = of_arch(device_arch(device))
    return kind.attention if kind else "flash"


def attention_problem(name: str, device: torch.device) -> str | None:
    """Why backend `name` cannot train Flux's attention here (its error, or output/gradients off flash's by more
    than bf16 rounding), or None: one forward and backward at the model's shape and strides, against flash."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    g = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(3, 2, 512, 24, 128, device=device, generator=g, dtype=torch.bfloat16)
    dout = torch.randn(2, 24, 512, 128, device=device, generator=g, dtype=torch.bfloat16)
    results = {}
    for backend in ("flash", name):
        q, k, v = (t.detach().requires_grad_() for t in qkv)
        try:
            with sdpa_kernel(backends[backend]):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                )
                out.backward(dout)
        except RuntimeError as exc:
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"
        grads = [t.grad for t in (q, k, v)]
        assert all(g is not None for g in grads)  # backward reached every input
        results[backend] = [out.float(), *(g.float() for g in grads if g is not None)]
    for what, a, b in zip(("output", "dq", "dk", "dv"), results[name], results["flash"]):
        err = ((a - b).norm() / b.norm()).item()
        if not err < 2e-2:  # bf16 rounding of both is ~4e-3
            return f"its {what} differs from flash's by {err:.1%}"
    return None


def torch_default_attention() -> str:
    """Every SDPA backend on: torch picks per call (what stock code gets)."""
    for enable in (
        torch.backends.cuda.enable_flash_sdp,
        torch.backends.cuda.enable_mem_efficient_sdp,
        torch.backends.cuda.enable_cudnn_sdp,
        torch.backends.cuda.enable_math_sdp,
    ):
        enable(True)
    _compile_caches_follow("torch")
    return "torch's choice"


def select_attention_backend(name: str, dtype: torch.dtype = torch.bfloat16, device: torch.device | None = None) -> str:
    """Switch on one SDPA backend (`perf.attention`) and return its name; `auto`: see the module docstring."""
    if not torch.cuda.is_available():
        return "torch's choice"
    device = device or torch.device("cuda", torch.cuda.current_device())
    if name == "auto":
        if dtype != torch.bfloat16:
            return torch_default_attention()
        name = preferred_attention(device)
        problem = attention_problem(name, device) if name != "flash" else None
        if problem:
            warnings.warn(
                f"perf.attention=auto: {name} attention failed its check here ({problem}); using flash", stacklevel=2
            )
            name = "flash"
    torch.backends.cuda.enable_flash_sdp(name == "flash")
    torch.backends.cuda.enable_mem_efficient_sdp(name == "efficient")
    torch.backends.cuda.enable_cudnn_sdp(name == "cudnn")
    torch.backends.cuda.enable_math_sdp(name == "math")
    return _compile_caches_follow(name)


def _compile_caches_follow(backend: str) -> str:
    """The SDPA backend is chosen when torch.compile traces a block, and the compile caches on disk do not key on
    the switches above: a block compiled under one backend was replayed under another (measured on an H200: a run
    asking for cuDNN ran flash from the cache). The backend joins the cache key."""
    torch.compiler.config.cache_key_tag = f"flux-train-sdpa-{backend}"
    return backend


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Activation checkpointing per block (after compile, before sharding): backward recomputes each block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for stack in block_stacks(model):
        for i, block in enumerate(stack):
            stack[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    return model


def prepare_model(
    model: nn.Module, perf: PerfConfig, activation_checkpointing: bool, precision: Precision
) -> nn.Module:
    """The one assembly of the model's speed features, in the order they compose: the precision's layers (FP8
    Linears, which compile then traces), each block its own compile region, activation checkpointing around each
    compiled block. Before the layout shards or gathers it; the trainer and the bench's rows both take it from here.
    The checkpoint runs outside the compiled region, so everything the compiled block saves is dropped and
    recomputed: inside it, the partitioner keeps what ops that mutate (our FP8 casts raise their amax) produce
    instead of recomputing it (measured on 4 H100, the full model under fsdp at micro-batch 32: bf16 53.6 GiB peak,
    FP8 out of memory)."""
    precision.convert(model)
    compile_blocks(model, perf.compile)
    return checkpoint_blocks(model) if activation_checkpointing else model


def compile_blocks(model: nn.Module, mode: str) -> nn.Module:
    """Regional compile: every block its own region (`block`), or nothing (`none`)."""
    if mode == "block":
        for stack in block_stacks(model):
            for i, block in enumerate(stack):
                stack[i] = typing.cast(nn.Module, torch.compile(block, fullgraph=True))  # an OptimizedModule
    return model


class CudaGraph:
    """`fn()` captured once -- after `warmup` eager runs on a side stream (compile, autotune, workspaces) -- and
    replayed by each call. `fn` reads its inputs from tensors the caller updates in place; the warm-up runs
    really execute, so capture only where their side effects do not count (before run_start, lr 0).

    `release()`, if given, drops what the warm-up runs left alive that the capture allocates again (e.g.
    parameters' .grad): the capture takes its memory from the graph's own pool, so a tensor held from the eager
    runs would be held twice (measured on an H100: full flux-schnell FP8 at batch 8 ran out of memory graphed,
    53 GiB eager). `close()` destroys the graph: NCCL counts every graph that captured one of its collectives and
    waits for them all to go before a communicator can be destroyed (a run whose graph outlives its process
    group never exits)."""

    def __init__(self, fn: Callable[[], Any], warmup: int = 1, release: Callable[[], None] | None = None):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
            if release is not None:
                release()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the eager runs' cached blocks back, so the graph's own pool can have them
        self.graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog and loader threads keep polling CUDA while this thread captures
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.output = fn()

    def __call__(self) -> Any:
        if self.graph is None:
            raise RuntimeError("this CUDA graph was closed")
        self.graph.replay()
        return self.output

    def close(self) -> None:
        if self.graph is not None:
            torch.cuda.synchronize()
            self.graph.reset()
            self.graph, self.output = None, None


class GraphedStep:
    """perf.cuda_graphs: an optimizer step as one CUDA graph (every micro-batch's forward and backward, the gradient
    reduction, clipping, AdamW, the weight all-gathers) with no host work between kernels. `body(static)` runs the
    step on a list of (inputs, target) micro-batches; it is captured at the first call -- in the warm-up, at lr 0,
    where the capture's eager run and the replay change no weight -- on copies of that call's micro-batches, and
    each later call copies its micro-batches into those static buffers and replays it."""

    def __init__(self, body: Callable[[list[tuple[dict, torch.Tensor]]], tuple[torch.Tensor, torch.Tensor]]):
        self.body = body
        self.graph: CudaGraph | None = None
        self.static: list[tuple[dict, torch.Tensor]] = []

    def __call__(self, staged: list[tuple[dict, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graph is None:
            self.static = [({k: v.clone() for k, v in inputs.items()}, target.clone()) for inputs, target in staged]
            self.graph = CudaGraph(lambda: self.body(self.static))
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
        loss_sum, grad_norm = self.graph()
        return loss_sum.clone(), grad_norm.clone()

    def close(self) -> None:
        """Destroy the graph and its static buffers (before the process group: CudaGraph.close)."""
        if self.graph is not None:
            self.graph.close()
        self.graph, self.static = None, []
