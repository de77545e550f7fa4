"""Throughput benchmark against the stock diffusers baseline, measured in the same process.

    python -m flux_train.bench --config configs/bench.yaml [--set k=v] [--ablate] [--json out.json]
    torchrun --nproc_per_node=4 -m flux_train.bench --config configs/bench.yaml --mode step

`--mode fwdbwd` (one GPU): forward + backward of the full model with bf16 parameters and no optimizer, the
way ../shared/bench/baseline_diffusers.py measures stock diffusers (eager and regional compile); ours adds
the fused forwards, the Triton RMSNorm, regional compile and CUDA graph replay; `--ablate` adds one row per
technique switched off.
`--mode step` (any number of GPUs): a whole training step — FSDP2, AdamW, clipping — of our trainer against
stock diffusers assembled the usual way (per-block compile + fully_shard, fused AdamW); `--accum N` times
ours with N micro-batches per optimizer step, as the GBS recipes run it (no stock row: it has no accumulation).
Every row reports samples/s per GPU, TFLOP/s, MFU against a bf16 matmul ceiling measured in the same run,
and peak memory; ratios are against the stock regional-compile row.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from flux_train import flow
from flux_train.compile import GraphedStep, compile_unsharded, select_attention_backend
from flux_train.config import Config, load_config
from flux_train.model import block_stacks, build_model, flops_per_sample, init_weights


def matmul_ceiling(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * iters / (time.perf_counter() - t0) / 1e12


def synthetic_inputs(cfg: Config, batch: int, text_len: int, latent: int, device) -> tuple[dict, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    m = cfg.model
    tokens = (latent // 2) ** 2
    kw = dict(hidden_states=torch.randn(batch, tokens, m.in_channels, device=device, generator=g),
              encoder_hidden_states=torch.randn(batch, text_len, m.joint_attention_dim, device=device, generator=g),
              pooled_projections=torch.randn(batch, m.pooled_projection_dim, device=device, generator=g),
              timestep=torch.rand(batch, device=device, generator=g),
              img_ids=flow.image_ids(latent, latent, device), txt_ids=flow.text_ids(text_len, device))
    kw = {k: v.to(torch.bfloat16) if k in ("hidden_states", "encoder_hidden_states", "pooled_projections") else v
          for k, v in kw.items()}
    return kw, torch.randn(batch, tokens, m.in_channels, device=device, generator=g)


def timed(step, steps: int, warmup: int = 3) -> tuple[float, float]:
    """(median seconds per step, warm-up seconds) with CUDA events."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2], warm


# ------------------------------------------------------------------------------------ one GPU, fwd + bwd

def stock_flux(cfg: Config, device: str):
    """Stock diffusers FluxTransformer2DModel with the config's dimensions (its own forwards and init)."""
    from diffusers import FluxTransformer2DModel

    m = cfg.model
    with torch.device(device):
        return FluxTransformer2DModel(
            patch_size=1, in_channels=m.in_channels, num_layers=m.num_layers, num_single_layers=m.num_single_layers,
            attention_head_dim=m.attention_head_dim, num_attention_heads=m.num_attention_heads,
            joint_attention_dim=m.joint_attention_dim, pooled_projection_dim=m.pooled_projection_dim,
            guidance_embeds=False, axes_dims_rope=tuple(m.axes_dims_rope))


def stock_model(cfg: Config, regional: bool):
    model = stock_flux(cfg, "cuda").to(torch.bfloat16)
    if regional:
        model.compile_repeated_blocks(fullgraph=True)
    return lambda **kw: model(**kw, return_dict=False)[0], model


def our_model(cfg: Config, rmsnorm: str, compile_mode: str, fp8: str):
    model = build_model(cfg.model, rmsnorm_impl=rmsnorm, fp8=fp8)
    model.to_empty(device="cuda")
    init_weights(model, seed=0)
    with torch.no_grad():  # leave the zero init so no branch is trivially zero
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.to(torch.bfloat16)
    compile_unsharded(model, compile_mode)
    return model, model


def fwdbwd_row(name: str, forward, module, kw, target, steps: int, graphs: bool, flops: float, batch: int) -> dict:
    params = [p for p in module.parameters()]

    def step():
        for p in params:
            p.grad = None
        loss = flow.mse_loss(forward(**kw), target)
        loss.backward()
        return loss.detach()

    torch.cuda.reset_peak_memory_stats()
    try:
        run = GraphedStep(step, params) if graphs else step
        seconds, warm = timed(run, steps)
    except torch.OutOfMemoryError:
        return {"row": name, "error": "OOM"}
    sps = batch / seconds
    return {"row": name, "batch": batch, "ms": round(seconds * 1000, 1), "samples_s_per_gpu": round(sps, 2),
            "tflops": round(sps * flops / 1e12, 1), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
            "warm_s": round(warm, 1)}


# attention first: flash kernels carry cutlass in their template names
KERNEL_KINDS = (("attention", ("flash", "fmha")), ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas")),
                ("nccl", ("nccl",)), ("triton fused", ("triton",)))


def profile_step(forward, module, kw, target, steps: int = 3) -> None:
    """Where the GPU time of a forward+backward goes: shares per kernel kind and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    params = list(module.parameters())

    def step():
        for p in params:
            p.grad = None
        flow.mse_loss(forward(**kw), target).backward()

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) or 1.0
    shares = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for e in events:
        kind = next((k for k, keys in KERNEL_KINDS if any(s in e.key.lower() for s in keys)), "other")
        shares[kind] += e.self_device_time_total
    print("PROFILE kernel time per step (ms): " + ", ".join(
        f"{k} {v / 1000 / steps:.1f} ({100 * v / total:.0f}%)" for k, v in shares.items()), flush=True)
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:15]:
        print(f"PROFILE {e.self_device_time_total / 1000 / steps:8.2f} ms x{e.count // steps:<4d} {e.key[:110]}")


def run_fwdbwd(cfg: Config, args) -> list[dict]:
    kw, target = synthetic_inputs(cfg, args.batch, args.text_len, args.latent, "cuda")
    flops = flops_per_sample(cfg.model, args.text_len, (args.latent // 2) ** 2)
    p = cfg.perf
    stock = [("stock diffusers eager", "stock", False, None),
             ("stock diffusers regional compile", "stock", True, None)]
    variants = ([] if args.only_ours else stock) + [("flux-train", "ours", p.cuda_graphs, p)]
    variants += [(f"flux-train + FP8 {recipe}", "ours", p.cuda_graphs, replace(p, fp8=recipe))
                 for recipe in filter(None, args.fp8.split(","))]
    if args.ablate:
        variants += [("  - CUDA graphs", "ours", False, p),
                     ("  - compile (eager)", "ours", False, replace(p, compile="none")),
                     ("  - Triton RMSNorm (torch)", "ours", p.cuda_graphs, replace(p, rmsnorm="torch")),
                     ("  compile per stack", "ours", p.cuda_graphs, replace(p, compile="stack"))]
    rows = []
    for name, kind, flag, perf in variants:
        if kind == "stock":
            forward, module = stock_model(cfg, regional=flag)
            graphs = False
        else:
            forward, module = our_model(cfg, perf.rmsnorm, perf.compile, perf.fp8)
            graphs = flag
        row = fwdbwd_row(name, forward, module, kw, target, args.steps, graphs, flops, args.batch)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.profile and name == "flux-train":
            profile_step(forward, module, kw, target)
        del forward, module
        gc.collect()
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------ training step (FSDP)

def run_step(cfg: Config, args) -> list[dict]:
    """Our Trainer's step vs stock diffusers + FSDP2, both with AdamW and clipping, at the config's batch."""
    from flux_train.train import Trainer

    world = int(os.environ.get("WORLD_SIZE", 1))
    cfg.data.source = "synthetic"
    cfg.data.synthetic_text_len, cfg.data.synthetic_latent_size = args.text_len, args.latent
    cfg.data.synthetic_train_samples = cfg.data.synthetic_val_samples = max(cfg.train.micro_batch_size * 2, 8)
    cfg.train.global_batch_size = cfg.train.micro_batch_size * world * args.accum
    cfg.logging.out_dir = args.out_dir
    cfg.perf.cuda_graphs = False  # FSDP steps are not captured (flux_train.compile)
    flops = flops_per_sample(cfg.model, args.text_len, (args.latent // 2) ** 2)
    # the stock step has no accumulation: it is compared at accumulation 1 only
    rows = [] if args.only_ours or args.accum > 1 else [stock_fsdp_step(cfg, args, flops)]
    if rows and dist.get_rank() == 0:
        print(json.dumps(rows[0]), flush=True)
    gc.collect()  # the stock model and optimizer went out of scope with stock_fsdp_step
    torch.cuda.empty_cache()
    trainer = Trainer(cfg)
    torch.cuda.reset_peak_memory_stats()
    seconds, warm = timed(lambda: trainer.train_step(), args.steps)
    sps = cfg.train.micro_batch_size * args.accum / seconds
    name = "flux-train step" + (f" + FP8 {cfg.perf.fp8}" if cfg.perf.fp8 != "none" else "") + (
        f" (accumulation {args.accum})" if args.accum > 1 else "")
    rows.append({"row": name, "world": world, "batch": cfg.train.micro_batch_size,
                 "ms": round(seconds * 1000, 1), "samples_s_per_gpu": round(sps, 2),
                 "tflops": round(sps * flops / 1e12, 1),
                 "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1), "warm_s": round(warm, 1)})
    if trainer.dist.is_main:
        print(json.dumps(rows[-1]), flush=True)
    return rows


def stock_fsdp_step(cfg: Config, args, flops: float) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        dist.init_process_group("nccl")
    model = stock_flux(cfg, "meta")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for stack in block_stacks(model):
        for i, block in enumerate(stack):
            stack[i] = torch.compile(block, fullgraph=True)
            fully_shard(stack[i], mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    kw, target = synthetic_inputs(cfg, cfg.train.micro_batch_size, args.text_len, args.latent, "cuda")

    def step():
        loss = flow.mse_loss(model(**kw, return_dict=False)[0], target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    seconds, warm = timed(step, args.steps)
    sps = cfg.train.micro_batch_size / seconds
    row = {"row": "stock diffusers FSDP2 step (per-block compile)", "world": dist.get_world_size(),
           "batch": cfg.train.micro_batch_size, "ms": round(seconds * 1000, 1), "samples_s_per_gpu": round(sps, 2),
           "tflops": round(sps * flops / 1e12, 1), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
           "warm_s": round(warm, 1)}
    return row


def print_table(rows: list[dict], ceiling: float) -> None:
    # the reference row: stock regional compile (fwdbwd) or stock FSDP2 with per-block compile (step)
    base = next((r for r in rows if r["row"].startswith("stock") and ("regional" in r["row"] or "FSDP2" in r["row"])),
                None)
    print(f"\nbf16 matmul ceiling {ceiling:.0f} TFLOP/s\n")
    print(f"{'row':46s} {'samples/s/GPU':>13s} {'TFLOP/s':>8s} {'MFU %':>6s} {'peak GiB':>8s} {'vs stock':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['row']:46s} {r['error']}")
            continue
        ratio = r["samples_s_per_gpu"] / base["samples_s_per_gpu"] if base and "error" not in base else float("nan")
        print(f"{r['row']:46s} {r['samples_s_per_gpu']:13.2f} {r['tflops']:8.1f} {100 * r['tflops'] / ceiling:6.1f} "
              f"{r['peak_gib']:8.1f} {ratio:8.2f}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flux_train.bench", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/bench.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--mode", choices=("fwdbwd", "step"), default=None,
                   help="default: fwdbwd on one GPU, step under torchrun")
    p.add_argument("--batch", type=int, default=16, help="fwdbwd batch (step mode uses train.micro_batch_size)")
    p.add_argument("--text-len", type=int, default=256)
    p.add_argument("--latent", type=int, default=32, help="latent side (32 = 256x256 images)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--accum", type=int, default=1,
                   help="step mode: micro-batches per optimizer step (gradients reduced and AdamW run once per step)")
    p.add_argument("--ablate", action="store_true", help="one row per technique switched off")
    p.add_argument("--only-ours", action="store_true", help="skip the stock rows")
    p.add_argument("--fp8", default="", help="extra rows with these FP8 recipes, e.g. rowwise,tensorwise")
    p.add_argument("--profile", action="store_true", help="kernel-time breakdown of our step")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--out-dir", default="runs/bench")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m flux_train.bench needs a GPU", file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.overrides)
    torch.backends.cuda.matmul.allow_tf32 = True
    select_attention_backend(cfg.perf.attention)
    mode = args.mode or ("step" if "WORLD_SIZE" in os.environ else "fwdbwd")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # each rank measures its own GPU's ceiling
    ceiling = matmul_ceiling()
    rows = run_fwdbwd(cfg, args) if mode == "fwdbwd" else run_step(cfg, args)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        print_table(rows, ceiling)
        result = {"device": torch.cuda.get_device_name(), "mode": mode, "ceiling_tflops": ceiling, "rows": rows,
                  "flops_per_sample": flops_per_sample(cfg.model, args.text_len, (args.latent // 2) ** 2)}
        print("SUMMARY " + json.dumps(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
