"""Throughput benchmark against stock diffusers, measured side by side on the same GPUs.

    python -m flux_train.bench --mode fwdbwd --rows stock,ours,ours-fp8-tensorwise --json rows.jsonl
    torchrun --nproc_per_node=2 -m flux_train.bench --mode step --rows stock,ours --profile --json rows.jsonl
    python -m flux_train.bench --table rows.jsonl

`--mode fwdbwd` (one GPU): forward + backward of the model with bf16 weights and no optimizer, at `--batch`.
Rows: `stock-eager` / `stock` (diffusers FluxTransformer2DModel, eager / its regional compile), `ours` (the
config's perf settings), `ours-fp8-<recipe>`, `torchao-fp8-<recipe>` (torchao's Float8Linear on our model),
and ablations `ours-no-graphs`, `ours-no-compile`, `ours-torch-rmsnorm`.
`--mode step` (any number of GPUs, under torchrun): a whole training step at train.micro_batch_size per GPU.
Rows: `stock` (diffusers + FSDP2 per block, per-block compile, fused AdamW, clipping: what a user would
assemble; with parallel.activation_checkpointing, in this mode and in fwdbwd, diffusers' own gradient
checkpointing of every block) and `ours` (our Trainer's own step with the config as given: strategy, FP8, graphs,
`--accum`);
`--profile` adds where the step's GPU time goes; the row also carries the eval rate (the trainer's evaluate
path, val samples/s per GPU). Timed steps are steady ones: with FP8 delayed scaling, the steps until every amax
history holds a maximum run first and are reported apart (`fp8_startup`).

Every row is one JSON line appended to `--json`; `--table FILE` prints them all: samples/s per GPU, TFLOP/s,
MFU against the bf16 matmul ceiling measured in the same process, peak memory, the ratio to the stock row of
the same mode and batch, and for step rows the step efficiency = step samples/s / one-GPU forward+backward
samples/s of the same precision and micro-batch (an `ours` fwdbwd row in the same file). Run the rows of one
comparison in one GPU session: the stock rows move several per cent from one machine to the next.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from flux_train.cli import BENCH_ROWS, bench_parser
from flux_train.config import Config, PerfConfig, graphs_on, load_config
from flux_train.data.sources import synthetic_samples
from flux_train.errors import UserError, reports_user_errors, write_output
from flux_train.model import flow
from flux_train.model.diffusers_adapter import diffusers_config, diffusers_inputs
from flux_train.model.flux import (
    MLP,
    SingleStreamBlock,
    build_model,
    flops_per_sample,
    init_weights,
    is_token_linear,
)
from flux_train.precision_recipes import RECIPES, fp8_row
from flux_train.tools.bench_table import kernel_breakdown, precision_of, print_table, read_rows
from flux_train.training.distributed import is_out_of_memory
from flux_train.training.perf import CudaGraph, prepare_model, select_attention_backend, torch_default_attention
from flux_train.training.precision import DelayedFP8, NoFP8, precision_for


def matmul_ceiling(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        _ = a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        _ = a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def synthetic_inputs(cfg: Config, batch: int, text_len: int, latent: int) -> tuple[dict, torch.Tensor]:
    """Our model's kwargs and a target on the GPU, from a synthetic batch through the trainer's own path."""
    m = cfg.model
    samples = synthetic_samples(batch, text_len, latent, latent, m.joint_attention_dim, m.pooled_projection_dim, 0)
    samples = {k: v.cuda() for k, v in samples.items()}
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs, target = flow.build_inputs(
        samples,
        torch.rand(batch, device="cuda", generator=g),
        g,
        cfg.train.latent_shift,
        cfg.train.latent_scale,
        torch.bfloat16,
    )
    return inputs.as_kwargs(), target


def timed(step, steps: int, warmup: int = 3) -> tuple[float, float]:
    """(seconds per step, warm-up seconds): `steps` steps back to back between two synchronisations, as a
    training loop runs them (the host queues the next step while the GPU works on this one)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    if dist.is_initialized():
        dist.barrier()
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps, warm


def warmup_steps(args) -> int:
    """Untimed steps before a step row's timed ones (compile, autotune, the allocator's pools), and profiled ones:
    three micro-batches' worth, however many micro-batches a step holds."""
    return -(-3 // args.accum)


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


# ------------------------------------------------------------------------------------ GPU time by kind


def profile_breakdown(run, steps: int = 3, top: int = 25) -> tuple[dict, list, list]:
    """`run` profiled for `steps` calls: its CUDA kernels' time by kind, the top kernels and the idle gaps by what
    ended them (bench_table.kernel_breakdown)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1000 / steps
    events = prof.events()
    assert events is not None  # the stopped profile's events, parsed on this first read: never None here
    kernels = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
    ]
    return kernel_breakdown(kernels, wall_ms, steps, top)


# ------------------------------------------------------------------------------------ one GPU, fwd + bwd


def stock_flux(cfg: Config, device: str):
    """diffusers' FluxTransformer2DModel at the config's sizes; with parallel.activation_checkpointing, diffusers' own
    gradient checkpointing of every block: what a user of the stock model turns on to fit a larger micro-batch, so
    that rows of ours with checkpointing have a stock row to compare with on the same terms."""
    from diffusers import FluxTransformer2DModel

    with torch.device(device):
        model = FluxTransformer2DModel(**diffusers_config(cfg.model))
    if cfg.parallel.activation_checkpointing:
        model.enable_gradient_checkpointing()
    return model


def row_perf(cfg: Config, row: str) -> PerfConfig:
    """The perf settings one of our fwdbwd rows runs with: the config's, with the row's FP8 recipe or ablation, and
    CUDA graphs where the trainer would capture its step with that recipe (config.graphs_on)."""
    perf, fp8 = cfg.perf, fp8_row(row)
    if fp8 is not None:
        perf = replace(perf, fp8_impl=fp8[0], fp8=fp8[1].name)
    return replace(
        perf,
        cuda_graphs=graphs_on(replace(cfg, perf=perf), "cuda") and row != "ours-no-graphs",
        compile="none" if row == "ours-no-compile" else perf.compile,
        rmsnorm="torch" if row == "ours-torch-rmsnorm" else perf.rmsnorm,
    )


def fwdbwd_model(cfg: Config, row: str):
    """(forward(kw) -> output, module, use CUDA graphs, its precision) for a fwdbwd row: ours as the trainer
    assembles it (perf.prepare_model), graphed where the trainer's step would be (config.graphs_on)."""
    if row.startswith("stock"):
        # diffusers decorates ModelMixin.to with functools.wraps(nn.Module.to): typeshed's _Wrapped binds no self
        model = stock_flux(cfg, "cuda").to(torch.bfloat16)  # pyright: ignore[reportArgumentType] - wraps, above
        if row == "stock":
            model.compile_repeated_blocks(fullgraph=True)
        return lambda kw: model(**diffusers_inputs(kw))[0], model, False, NoFP8()
    perf = row_perf(cfg, row)
    model = build_model(cfg.model, perf.rmsnorm)
    model.to_empty(device="cuda")
    init_weights(model, seed=0)
    with torch.no_grad():  # leave the zero init so no branch is trivially zero
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.to(torch.bfloat16)
    precision = precision_for(perf, torch.device("cuda"))
    prepare_model(model, perf, cfg.parallel.activation_checkpointing, precision)
    precision.attach(model)
    return lambda kw: model(**kw), model, perf.cuda_graphs, precision


def row_attention(cfg: Config, row: str) -> str:
    """The SDPA backend a row runs with: torch's own choice for stock code, perf.attention for ours."""
    return torch_default_attention() if row.startswith("stock") else select_attention_backend(cfg.perf.attention)


def run_fwdbwd(cfg: Config, args, row: str) -> dict:
    attention = row_attention(cfg, row)
    kw, target = synthetic_inputs(cfg, args.batch, args.text_len, args.latent)
    forward, module, graphs, precision = fwdbwd_model(cfg, row)
    params = list(module.parameters())

    def step():
        for p in params:
            p.grad = None
        loss = flow.mse_loss(forward(kw), target)
        loss.backward()
        precision.after_step()  # what a training step adds: FP8 delayed scaling's next scales
        return loss.detach()

    def release():  # the warm-up's gradients: the capture allocates its own
        for p in params:
            p.grad = None

    torch.cuda.reset_peak_memory_stats()
    run = CudaGraph(step, warmup=2, release=release) if graphs else step
    seconds, warm = timed(run, args.steps)
    result = {
        "mode": "fwdbwd",
        "row": row,
        "batch": args.batch,
        "precision": precision_of(row, cfg),
        "attention": attention,
        "ms": round(seconds * 1000, 1),
        "samples_s_per_gpu": round(args.batch / seconds, 2),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "warm_s": round(warm, 1),
        "graphs": graphs,
        "activation_checkpointing": cfg.parallel.activation_checkpointing,
    }
    if precision.recipe.fp8:
        result["fp8_impl"] = row_perf(cfg, row).fp8_impl
    if args.profile:
        result["profile"], result["top_kernels"], result["idle_gaps"] = profile_breakdown(run)
    if graphs:
        run.close()
    return result


# ------------------------------------------------------------------------------------ FP8 casts alone


def tokens_of(fqn: str, batch: int, text_len: int, image_tokens: int) -> int:
    """The tokens in the batch a block's module at `fqn` takes: the text stream's, the image stream's, or both
    (the single blocks)."""
    return batch * (text_len if ".txt_" in fqn else image_tokens if ".img_" in fqn else text_len + image_tokens)


def token_gemm_operands(cfg: Config, batch: int, text_len: int, image_tokens: int) -> dict[tuple[int, int], int]:
    """{(rows, cols): count} of every operand one forward+backward casts to FP8: x [M,K], W [N,K] and dY [M,N]
    of each of the blocks' token Linears (model.is_token_linear), M their tokens in the batch."""
    model = build_model(cfg.model)
    shapes: dict[tuple[int, int], int] = {}
    for fqn, module in model.named_modules():
        if not is_token_linear(fqn, module):
            continue
        tokens = tokens_of(fqn, batch, text_len, image_tokens)
        assert isinstance(module, torch.nn.Linear)  # as is_token_linear's modules are
        n, k = module.weight.shape
        for shape in ((tokens, k), (n, k), (tokens, n)):
            shapes[shape] = shapes.get(shape, 0) + 1
    return shapes


def gelu_cast_inputs(cfg: Config, batch: int, text_len: int, image_tokens: int) -> dict[tuple, int]:
    """{(rows, head columns, tail columns, the tail's row stride, the Linear's outputs): count} of every input one
    forward casts with its GELU applied as the cast reads (model.flux.gelu_linear): each MLP's output projection
    (no head), each single block's linear2 (head: the attention's output; tail: a column slice of linear1's
    output)."""
    inputs: dict[tuple, int] = {}
    for fqn, module in build_model(cfg.model).named_modules():
        m = tokens_of(fqn, batch, text_len, image_tokens)
        if isinstance(module, MLP):
            out = module[2]
            key = (m, 0, out.in_features, out.in_features, out.out_features)
        elif isinstance(module, SingleStreamBlock):
            head, lin2 = module.hidden, module.linear2
            key = (m, head, lin2.in_features - head, module.linear1.out_features, lin2.out_features)
        else:
            continue
        inputs[key] = inputs.get(key, 0) + 1
    return inputs


def gelu_cast_seconds(m: int, head: int, tail: int, stride: int, n: int, fp8: torch.dtype) -> tuple[float, float]:
    """GPU seconds of the cast of [head | gelu(tail)] ([m, head] and a column slice of an [m, stride] tensor, as
    linear1's output leaves a single block's MLP input) and of its Linear's weight [n, head + tail], with delayed
    scaling: (the GELU applied by the cast as it reads, the GELU and the join written in bf16 by Inductor first as
    the unfused path does)."""
    from flux_train.kernels.fp8_cast import cast_transpose_pair, gelu_tanh_joined

    x = torch.randn(m, head, device="cuda").bfloat16()
    t = torch.randn(m, stride, device="cuda").bfloat16()[:, -tail:]
    w = torch.randn(n, head + tail, device="cuda").bfloat16()
    scales, amax = torch.full((2,), 1e-2, device="cuda"), torch.zeros(2, device="cuda")
    joined = torch.compile(gelu_tanh_joined)
    fused = cuda_seconds(lambda: cast_transpose_pair(x, w, scales, amax, fp8, gelu_tail=t), iters=5, graphed=False)
    apart = cuda_seconds(lambda: cast_transpose_pair(joined(x, t), w, scales, amax, fp8), iters=5, graphed=False)
    return fused, apart


def copy_rate() -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read and written (the bandwidth a cast can reach)."""
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / cuda_seconds(lambda: y.copy_(x), graphed=False)


def cuda_seconds(fn, iters: int = 20, graphed: bool = True) -> float:
    """GPU seconds per call of `fn`: its calls replayed from a CUDA graph (no host launch time between them), or
    launched (a copy of a GiB is not launch-bound; captured, it ran at 2.8 of the 4.3 TB/s on an H200)."""
    if not graphed:
        return timed_events(lambda: [fn() for _ in range(iters)]) / iters
    graph = CudaGraph(lambda: [fn() for _ in range(iters)], warmup=2)
    return timed_events(graph) / iters


def timed_events(run) -> float:
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000


def run_casts(cfg: Config, args, row: str) -> dict:
    """The FP8 cast kernel (kernels/fp8_cast.py) at every operand shape of one forward+backward at --batch: ms
    per step against its byte floor at this GPU's copy rate. Delayed scaling moves 4 bytes per element (read bf16,
    write both e4m3 layouts); current scaling (tensorwise) 6 (one more read for the amax)."""
    from flux_train.kernels.fp8 import device_e4m3
    from flux_train.kernels.fp8_cast import cast_transpose

    fp8, found = device_e4m3(torch.device("cuda")), fp8_row(row)
    delayed = found is not None and found[1].history
    rate = copy_rate()
    shapes = token_gemm_operands(cfg, args.batch, args.text_len, (args.latent // 2) ** 2)
    per_shape, total, floor = [], 0.0, 0.0
    for (m, k), count in sorted(shapes.items()):
        x = torch.randn(m, k, device="cuda").bfloat16()
        scale = torch.full((), 1e-2 if delayed else 0.0, device="cuda")
        amax = torch.zeros(1, device="cuda")
        seconds = cuda_seconds(lambda x=x, scale=scale, amax=amax: cast_transpose(x, scale, amax, fp8))
        moved = (4 if delayed else 6) * m * k
        per_shape.append([m, k, count, round(seconds * 1e6, 1), round(moved / seconds / 1e9)])
        total += seconds * count
        floor += moved / rate * count
    result = {
        "mode": "casts",
        "row": row,
        "batch": args.batch,
        "ms": round(total * 1000, 2),
        "floor_ms": round(floor * 1000, 2),
        "copy_tb_s": round(rate / 1e12, 2),
        "shapes": per_shape,
    }
    if delayed:  # the inputs whose GELU the cast applies: in the cast, or written apart first
        inputs = gelu_cast_inputs(cfg, args.batch, args.text_len, (args.latent // 2) ** 2)
        result["gelu"] = [
            [m, head, tail, count, *(round(s * 1e6, 1) for s in gelu_cast_seconds(m, head, tail, stride, n, fp8))]
            for (m, head, tail, stride, n), count in inputs.items()
        ]
    return result


# ------------------------------------------------------------------------------------ collectives


def layout_messages(cfg: Config) -> list[tuple[str, int, torch.dtype]]:
    """(what, elements, dtype) of the messages the layouts send within a node: FSDP gathers one block's weights in
    the compute dtype and reduce-scatters its gradients in the reduction dtype (bf16 or fp32), a double or single
    block at a time."""
    model = build_model(cfg.model)
    sizes = {
        "double block": sum(p.numel() for p in model.double_blocks[0].parameters()),
        "single block": sum(p.numel() for p in model.single_blocks[0].parameters()),
    }
    return [(f"{what}, {str(dtype).removeprefix('torch.')}", n, dtype) for what, n in sizes.items()
            for dtype in (torch.bfloat16, torch.float32)]  # fmt: skip


def collective_seconds(row: str, n: int, dtype: torch.dtype, world: int) -> float:
    """Seconds of one `row` collective of n elements (the gathered or the reduced size) over every rank."""
    full = torch.empty(n, dtype=dtype, device="cuda")
    shard = torch.empty(n // world, dtype=dtype, device="cuda")

    def op():
        if row == "all-gather":
            dist.all_gather_into_tensor(full, shard)
        else:
            dist.reduce_scatter_tensor(shard, full)

    for _ in range(3):
        op()
    dist.barrier()
    return timed_events(lambda: [op() for _ in range(10)]) / 10


def run_collectives(cfg: Config, args, row: str) -> dict:
    """Bus bandwidth (NCCL's definition: bytes x (n - 1) / n per second) of `row` over every rank, at each layout
    message size: the figure the planner divides a layout's traffic by."""
    world = dist.get_world_size()
    sizes = []
    for what, n, dtype in layout_messages(cfg):
        n -= n % world
        seconds = collective_seconds(row, n, dtype, world)
        nbytes = n * dtype.itemsize
        busbw = nbytes * (world - 1) / world / seconds / 1e9
        sizes.append([what, round(nbytes / 1e6), round(seconds * 1000, 3), round(busbw, 1)])
    return {
        "mode": "collectives",
        "row": row,
        "world": world,
        "batch": 0,
        "sizes": sizes,
        "busbw_gbps": round(statistics.fmean(s[3] for s in sizes), 1),
    }


# ------------------------------------------------------------------------------------ training step


def row_batch(cfg: Config, args) -> int:
    """The batch a row is labelled by: a step row's micro-batch (train.micro_batch_size), else --batch."""
    return cfg.train.micro_batch_size if args.mode == "step" else args.batch


def run_step(cfg: Config, args, row: str) -> dict:
    started = time.perf_counter()
    world = dist.get_world_size()
    mb = row_batch(cfg, args)
    base = {"mode": "step", "row": row, "world": world, "batch": mb, "accum": args.accum}
    base["attention"] = row_attention(cfg, row)  # the trainer selects perf.attention again, the same way
    if row == "stock":
        seconds, warm, profile = stock_fsdp_step(cfg, args)
        checkpointed = cfg.parallel.activation_checkpointing
        base |= {
            "precision": "bf16",
            "activation_checkpointing": checkpointed,
            "label": "stock diffusers + FSDP2 (per-block compile, fused AdamW"
            + (", diffusers' gradient checkpointing)" if checkpointed else ")"),
        }
    else:
        seconds, warm, profile, measured = trainer_step(cfg, args)
        base |= {
            "precision": precision_of("ours", cfg),
            **({"fp8_impl": cfg.perf.fp8_impl} if RECIPES[cfg.perf.fp8].fp8 else {}),
            "strategy": cfg.parallel.strategy,
            "activation_checkpointing": cfg.parallel.activation_checkpointing,
            **measured,
            "label": (
                f"ours {cfg.parallel.strategy}"
                + (" + graphs" if measured["graphs"] else "")
                + (" + checkpointing" if cfg.parallel.activation_checkpointing else "")
                + (f", accumulation {args.accum}" if args.accum > 1 else "")
            ),
        }
    base |= {
        "ms": round(seconds * 1000, 1),
        "samples_s_per_gpu": round(mb * args.accum / seconds, 2),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        # the allocator's own peak, and how often it had to free its cache and retry (each a device sync)
        "reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 1),
        "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
        "warm_s": round(warm, 1),
        "row_s": round(time.perf_counter() - started),  # the whole row: what a device call must leave it
    }
    if profile:
        base["profile"], base["top_kernels"], base["idle_gaps"] = profile
    return base


def trainer_overrides(cfg: Config, args) -> list[str]:
    """The bench's settings for the trainer, as --set overrides on top of the user's (validated again with them):
    synthetic data of the bench's shapes, the global batch of one step at --accum, no checkpoints or resume."""
    world, mb = dist.get_world_size(), cfg.train.micro_batch_size
    samples = max(mb * 2, cfg.eval.batch_size * world * 4)
    return [
        "data.source=synthetic",
        f"data.synthetic_text_len={args.text_len}",
        f"data.synthetic_latent_size={args.latent}",
        f"perf.warmup_latent_size={args.latent}",
        f"data.synthetic_train_samples={samples}",
        f"data.synthetic_val_samples={samples}",
        f"train.global_batch_size={mb * world * args.accum}",
        f"logging.out_dir={args.out_dir}",
        "checkpoint.resume=none",
        "checkpoint.every_steps=0",
    ]


def trainer_step(cfg: Config, args) -> tuple[float, float, tuple | None, dict]:
    """(seconds per step, warm-up seconds, profile, the row's other figures: eval samples/s per GPU, whether the
    step ran as a CUDA graph, and with FP8 delayed scaling its start-up)."""
    from flux_train.tools.sample import Sampler
    from flux_train.training.train import Trainer

    started = time.perf_counter()
    trainer = Trainer(load_config(args.config, args.overrides + trainer_overrides(cfg, args)), Sampler.for_run)
    torch.cuda.reset_peak_memory_stats()
    trainer.warm_up(max(trainer.cfg.perf.warmup_iters, 1))  # compile and, with perf.cuda_graphs, capture
    measured: dict = {"start_s": round(time.perf_counter() - started)}  # the model built, compiled, warmed up
    startup = settle_fp8(trainer) if isinstance(trainer.precision, DelayedFP8) else None
    seconds, warm = timed(trainer.train_step, args.steps, warmup_steps(args))
    measured["graphs"] = trainer.graphed is not None
    if startup is not None:  # what the steps before every history was full took beyond steady steps
        steps, startup_s = startup
        measured["fp8_startup"] = {"steps": steps, "extra_s": round(startup_s - steps * seconds, 2)}
    profile = profile_breakdown(trainer.train_step, warmup_steps(args)) if args.profile else None
    e0 = time.perf_counter()
    trainer.evaluator.loss(0)  # warm: eval shapes compile once
    torch.cuda.synchronize()
    e1 = time.perf_counter()
    count = trainer.evaluator.loss(0).count
    eval_rate = count / (time.perf_counter() - e1) / dist.get_world_size()
    measured["eval_s"] = round(time.perf_counter() - e0)  # both passes, the compile included
    if args.checkpoint:
        print("CHECKPOINT " + json.dumps(checkpoint_timings(trainer, args, seconds)), flush=True)
    measured["eval_samples_s_per_gpu"] = round(eval_rate, 1)
    trainer.close()  # its graph before the process group (Trainer.close)
    return seconds, warm, profile, measured


def settle_fp8(trainer, limit: int = 20) -> tuple[int, float]:
    """(steps, seconds): training steps until every delayed FP8 operand of `trainer` (one with FP8 delayed scaling)
    has a maximum in its history, so that the timed steps are steady ones. Until then an operand is read twice
    (its amax first: kernels/fp8_cast.py), on the first steps of a run and on those of each gradient the
    zero-initialised gates hold at zero."""
    scaling = cast(DelayedFP8, trainer.precision).scaling
    steps, t0 = 0, time.perf_counter()
    # without_history reads the device: the check after the last step waits for it
    while scaling.without_history() and steps < limit:
        trainer.train_step()
        steps += 1
    return steps, time.perf_counter() - t0


def checkpoint_timings(trainer, args, step_seconds: float) -> dict:
    """Seconds to save (blocking, and async: until training resumes, then until written), to load, and the step
    time while an async save is being written, for this trainer's full state. Each figure is printed on rank 0
    as it is measured (`CHECKPOINT key value`), so a run cut short by a time limit still reports what it got;
    the GB/s rates carry the figures over to a larger model on the same disk."""

    from flux_train.training import checkpoint

    out: dict = {"step_ms": round(step_seconds * 1000, 1)}

    def report(key, value):
        out[key] = value
        if dist.get_rank() == 0:
            print(f"CHECKPOINT {key} {value}", flush=True)

    def clock(fn):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        dist.barrier()
        return result, round(time.perf_counter() - t0, 2)

    root, parts = own_folder(Path(args.checkpoint)), trainer.parts
    blocking = checkpoint.Checkpointer(root / "sync", keep=1)
    path, save_s = clock(lambda: blocking.save(1, parts))
    size_gb = round(checkpoint.folder_bytes(path) / 1e9, 1)
    report("checkpoint_gb", size_gb)
    report("save_s", save_s)
    report("write_gb_per_s", round(size_gb / max(save_s, 1e-3), 2))
    _, load_s = clock(lambda: checkpoint.load(path, parts))
    report("load_s", load_s)
    report("read_gb_per_s", round(size_gb / max(load_s, 1e-3), 2))
    shutil_rmtree(root / "sync")
    background = checkpoint.Checkpointer(root / "async", keep=1, async_save=True)
    _, first_s = clock(lambda: background.save(1, parts))
    report("async_blocking_first_s", first_s)  # with the host buffers' allocation (pinned on a GPU host)
    in_flight, _ = timed(trainer.train_step, args.steps, warmup=0)
    report("step_ms_while_writing", round(in_flight * 1000, 1))
    _, async_finish_s = clock(background.wait)
    report("async_wait_after_steps_s", async_finish_s)
    _, again_s = clock(lambda: background.save(2, parts))
    report("async_blocking_s", again_s)  # every later save: the buffers are reused
    background.close()
    shutil_rmtree(root)
    return out


def own_folder(parent: Path) -> Path:
    """A new folder in --checkpoint for the bench's saves, the same on every rank: what it removes is its own, never
    a folder of the user's there."""
    from dataprep.staging import staging_folder

    made: list = [None]
    if dist.get_rank() == 0:
        parent.mkdir(parents=True, exist_ok=True)
        made[0] = staging_folder(parent / "bench")
    dist.broadcast_object_list(made, src=0)
    return made[0]


def shutil_rmtree(path) -> None:
    """Remove a checkpoint folder once (rank 0) and wait for it."""
    import shutil

    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def stock_fsdp_step(cfg: Config, args) -> tuple[float, float, tuple | None]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = stock_flux(cfg, "meta")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for stack in (model.transformer_blocks, model.single_transformer_blocks):
        for i, block in enumerate(stack):
            stack[i] = cast(torch.nn.Module, torch.compile(block, fullgraph=True))  # a Module compiles to a Module
            fully_shard(stack[i], mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    kw, target = synthetic_inputs(cfg, cfg.train.micro_batch_size, args.text_len, args.latent)
    kw = diffusers_inputs(kw)

    def step():
        for _ in range(args.accum):  # FSDP2's default: each micro-batch's gradients reduce-scattered and summed
            loss = flow.mse_loss(model(**kw)[0], target) / args.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    seconds, warm = timed(step, args.steps, warmup_steps(args))
    return seconds, warm, profile_breakdown(step, warmup_steps(args)) if args.profile else None


# ------------------------------------------------------------------------------------ the table


@reports_user_errors
def main(argv=None) -> int:
    args = bench_parser().parse_args(argv)
    if args.table:
        print_table(read_rows(args.table))
        return 0
    cfg = load_config(args.config, args.overrides)
    known = BENCH_ROWS[args.mode]
    rows = (args.rows or (",".join(known) if args.mode == "casts" else "stock,ours")).split(",")
    unknown = [r for r in rows if r not in known]
    if unknown:
        raise UserError(f"--rows: unknown row '{unknown[0]}' for --mode {args.mode}; choose from {', '.join(known)}")
    if not torch.cuda.is_available():
        raise UserError("python -m flux_train.bench measures GPUs and none is visible here (--table FILE needs none)")
    if args.mode in ("fwdbwd", "casts") and len(rows) > 1 and not args.same_process:  # each row in its own process
        return run_rows_apart(rows, sys.argv[1:] if argv is None else list(argv))
    return measure(cfg, args, rows)


def run_rows_apart(rows: list[str], argv: list[str]) -> int:
    """Each row in its own process, one after another: a row gets the whole GPU (no memory or compile state of
    the rows before it), and a row whose process dies -- an illegal memory access leaves the CUDA context
    unusable, a crash takes the process -- leaves the others to measure."""
    failed = []
    for row in rows:
        proc = subprocess.run([sys.executable, "-m", "flux_train.bench", *argv, "--rows", row])
        if proc.returncode < 0:  # killed: it could not say why itself
            print(f"ROW FAILED {row}: its process died of signal {-proc.returncode}", flush=True)
        if proc.returncode:
            failed.append(row)
    if failed:
        print(f"bench: {len(failed)} of {len(rows)} rows failed ({', '.join(failed)}); the others are measured")
    return 1 if failed else 0


def measure(cfg: Config, args, rows: list[str]) -> int:
    """The rows in this process (every rank of a step row under torchrun)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.mode in ("step", "collectives") and not dist.is_initialized():
        dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # each rank measures its own GPU
    ceiling = matmul_ceiling()
    device = torch.cuda.get_device_name()  # asked now: after an illegal memory access no CUDA call answers
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    flops = flops_per_sample(cfg.model, args.text_len, (args.latent // 2) ** 2)
    failed = []
    for row in rows:
        error = None
        try:
            run = {"fwdbwd": run_fwdbwd, "step": run_step, "casts": run_casts, "collectives": run_collectives}
            result = run[args.mode](load_config(args.config, args.overrides), args, row)
        except Exception as exc:  # noqa: BLE001 - every failure of a row becomes its one line
            error = exc
            result = {"mode": args.mode, "row": row, "batch": row_batch(cfg, args), "error": row_error(exc)}
            print(f"ROW FAILED {row}: {result['error']}", flush=True)
            failed.append(row)
        result |= {
            "blocks": [cfg.model.num_layers, cfg.model.num_single_layers],  # the depth, for the planner
            "device": device,
            "ceiling_tflops": round(ceiling, 1),
            "flops_per_sample": flops,
        }
        if rank0:
            print("ROW " + json.dumps(result), flush=True)
            if args.json:
                write_output(Path(args.json), "--json", functools.partial(append_row, row=result))
        if error is not None and (dist.is_initialized() or not usable_after(error)):
            # the other ranks wait in a collective (torchrun ends them), or this process's CUDA context is lost
            os._exit(1)
        free_memory()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if failed else 0


def append_row(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def row_error(exc: BaseException) -> str:
    """What stopped a row, in one line: out of memory with the sizes, an illegal memory access, a compile
    failure, or the exception's type and first words."""
    text = " ".join(str(exc).split())
    if is_out_of_memory(exc):
        sizes = ". ".join(text.split(". ")[:3])  # torch's: what it tried to allocate, the total, what was free
        peak = (
            f" (torch's peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)" if torch.cuda.is_available() else ""
        )
        return f"out of memory{peak}: {sizes[:300]}"
    if "illegal memory access" in text or "illegal address" in text:
        return f"illegal memory access: a kernel touched memory outside its tensors ({text[:200]})"
    if type(exc).__module__.startswith(("torch._dynamo", "torch._inductor")):
        return f"compile failed ({type(exc).__name__}): {text[:240]}"
    return f"{type(exc).__name__}: {text[:240]}"


def usable_after(exc: BaseException) -> bool:
    """Whether this process can measure another row: not after a CUDA error other than out of memory (the
    context is lost: every later call fails the same way)."""
    text = str(exc)
    return is_out_of_memory(exc) or not ("CUDA error" in text or "CUDA driver error" in text)


if __name__ == "__main__":
    sys.exit(main())
