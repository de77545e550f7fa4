"""The planner's model of a run: memory per GPU, the parts of a step, time-to-train and checkpoint costs, from the
figures of flux_train/tools/plan_figures.py; the layout and micro-batch that fit; each measured step row against its
projection from the others (`check`).

Per GPU, with P parameters, S GPUs sharing the optimizer state (a node) and R replicas (the nodes):
- memory: ddp holds the weights and a gradient buffer in the compute dtype and 12 P / S bytes of fp32 master
  weights and AdamW moments (flux_train/training/ddp.py); fsdp holds 12 P / S, the fp32 gradient shards between
  micro-batches when accumulating (and with activation checkpointing, whose peak comes late in the backward), and
  its largest block four times: gathered, the next one prefetched, and in backward the block's unsharded gradient
  twice (flux_train/training/fsdp.py). Our FP8
  (perf.fp8 delayed or tensorwise) under ddp keeps one byte per FP8 parameter from forward to backward (the
  transposed e4m3 weights; with activation checkpointing a block's at a time); under fsdp none (the backward casts
  the weights it gathers again). Activations: micro-batch x blocks x the figure per sample and block of one-GPU
  forward+backward rows (their peak less the weights and e4m3 copies; rows whose peak is the weights and their
  gradients are left out). With activation checkpointing (parallel.activation_checkpointing) each block keeps
  only its input between forward and backward (text + image tokens x hidden width in the compute dtype: 3.0 MiB
  per sample for flux-schnell), and one block at a time holds its activations (the figure per sample and block)
  while it is recomputed and its backward runs.
- step: compute (samples x FLOPs per sample at the forward+backward FLOP rate measured nearest that batch; with
  activation checkpointing x 4/3: every block's forward again, a third of forward + backward as flops_per_sample
  counts them) + optimizer (ms per 1e9 parameters of the shard) + the exposed part of the traffic within the node
  (bytes per step by layout over the bus bandwidth, times the fraction left exposed in the step rows of this kind,
  layout and, where there are any, precision) + the all-reduce across nodes (exposed: it runs after backward).
- time-to-train: the RCP's samples to converge for the GBS as steps, an eval every ceil(262144 / GBS) steps at
  the measured eval rate, and the checkpoint stalls. The warm-up before run_start is off the clock.
"""

from __future__ import annotations

import copy
import math
import statistics

import torch

from flux_train.config import (
    EVAL_SAMPLES,
    Config,
    accumulation_steps,
    eval_interval_steps,
    graph_blocker,
    mesh_shape,
)
from flux_train.model.flux import flops_per_sample, largest_block_param_count, param_count, token_linear_param_count
from flux_train.precision_recipes import RECIPES
from flux_train.tools.bench_table import fp8_impl_of, precision_of
from flux_train.tools.plan_figures import Figures, row_config, step_setup
from flux_train.training.checkpoint_size import checkpoint_bytes, checkpoint_disk_gb
from flux_train.training.distributed import reduce_dtype

TOKENS = 256  # text tokens and image tokens of a flux1 sample (256x256 images), as the bench measures them
GIB = 2**30
OPTIMIZER_BYTES = 28  # our AdamW kernel's traffic per parameter of the shard: the floor where no time is measured


class Notes:
    """Where each input of a projection came from, and which inputs are missing."""

    def __init__(self):
        self.sources: dict[str, str] = {}
        self.missing: list[str] = []
        self.lower_bound = False  # a time input is missing: the times are lower bounds

    def use(self, name: str, found: tuple[float, str] | None, lacking: str, timing: bool = True) -> float | None:
        if found is None:
            self.missing.append(f"{name} ({lacking})")
            self.lower_bound |= timing
            return None
        self.sources[name] = found[1]
        return found[0]


def nearest_batch(rows: list[dict], batch: int) -> int:
    """The rows' batch nearest `batch` by ratio (a tie: the larger)."""
    return min({r["batch"] for r in rows}, key=lambda b: (abs(math.log(b / batch)), -b))


def same_precision(cfg: Config):
    """A row filter: rows measured at cfg's precision (FP8: with the same implementation)."""
    precision = precision_of("ours", cfg)
    return lambda r: r["precision"] == precision and fp8_impl_of(r) in (None, cfg.perf.fp8_impl)


def block_count(cfg: Config) -> int:
    return cfg.model.num_layers + cfg.model.num_single_layers


def fp8_weight_copies(cfg: Config) -> int:
    """Bytes of every FP8 Linear's transposed e4m3 weight (one byte per parameter): what our tensorwise FP8 recipes
    save for the backward, whatever the batch, unless the backward casts the weight again (FP8Linear.recast_weight).
    A one-GPU forward+backward row holds them all."""
    if cfg.perf.fp8_impl in RECIPES[cfg.perf.fp8].e4m3_weights:
        return token_linear_param_count(cfg.model)
    return 0


def fp8_weight_bytes(cfg: Config) -> float:
    """The e4m3 weights our FP8 holds from the forward to the backward, beside the activations. ddp: all of them
    (measured on two H200, full model, micro-batch 4: fitted per sample instead, the FP8 peak came out 3.8 % low);
    fsdp: none, its backward casts the weights it gathers again (measured on four H100, full model, micro-batch 8:
    counted, the FP8 peak came out 13 % high). With activation checkpointing, either layout: a block's at a time (the
    checkpoint drops them with the block's other saved tensors; its recompute casts them again and keeps them for
    that block's backward)."""
    if cfg.parallel.activation_checkpointing:
        return fp8_weight_copies(cfg) / block_count(cfg)
    return 0 if cfg.parallel.strategy == "fsdp" else fp8_weight_copies(cfg)


def block_input(cfg: Config) -> tuple[float, str]:
    """(GiB per sample, what it is) a checkpointed block keeps from its forward to its backward: its input, the
    hidden states of the text and image tokens in the compute dtype (the conditioning vector and RoPE tables are
    every block's)."""
    hidden = cfg.model.num_attention_heads * cfg.model.attention_head_dim
    width = getattr(torch, cfg.train.compute_dtype).itemsize
    gib = 2 * TOKENS * hidden * width / GIB
    return gib, (
        f"activation checkpointing: each block keeps its input, {gib * 1024:.1f} MiB per sample ({2 * TOKENS} "
        f"tokens x {hidden} x {width} bytes), and one block its activations at a time"
    )


def activations_gib(cfg: Config, per_block: float, notes: Notes) -> float:
    """Activations per GPU from the GiB per sample and block a forward+backward keeps: every block's; with
    activation checkpointing (flux_train.training.perf.checkpoint_blocks) every block's input, and one block's
    activations while it is recomputed and its backward runs."""
    blocks, batch = block_count(cfg), cfg.train.micro_batch_size
    if not cfg.parallel.activation_checkpointing:
        return batch * blocks * per_block
    kept = notes.use("AC memory", block_input(cfg), "", False) or 0.0
    return batch * (blocks * kept + per_block)


def activation_figure(cfg: Config, figs: Figures) -> tuple[float, str] | None:
    """GiB per sample and block: one-GPU forward+backward rows' peak less their bf16 weights (and e4m3 copies)."""
    precision, same = precision_of("ours", cfg), same_precision(cfg)

    def activation_bound(r: dict) -> bool:
        # not a peak of the weights and their whole gradient at the end of the backward (every batch-4 row on
        # H100 and H200, bf16 and FP8 alike), which says nothing of the activations
        return r["peak_gib"] > 1.02 * 4 * param_count(row_config(cfg, r).model) / GIB

    rows, where = figs.rows("fwdbwd", lambda r: same(r) and "peak_gib" in r and activation_bound(r), any_kind=True)
    if not rows:
        return None
    per = []
    for r in rows:
        rcfg = row_config(cfg, r)
        fixed = 2 * param_count(rcfg.model) + fp8_weight_copies(rcfg)
        per.append((r["peak_gib"] - fixed / GIB) / (r["batch"] * sum(r["blocks"])))
    mean = statistics.fmean(per)
    return mean, f"{mean:.4f} GiB per sample and block, {len(per)} {precision} fwdbwd row(s) ({where})"


def memory(cfg: Config, figs: Figures, notes: Notes) -> dict:
    """Peak memory per GPU by layout, and whether it fits with the headroom kept free."""
    world = cfg.slurm.nodes * cfg.slurm.gpus_per_node
    shards = mesh_shape(cfg.parallel, world, cfg.slurm.gpus_per_node)[1]
    params = param_count(cfg.model)
    width = getattr(torch, cfg.train.compute_dtype).itemsize
    if cfg.parallel.strategy == "ddp":  # replicated weights and gradient buffer; fp32 master and moments sharded
        state = 2 * width * params + 12 * params / shards
    else:  # fp32 weights and moments sharded; the fp32 gradient shards while accumulating, and with checkpointing
        # always: its peak comes late in the backward, the shards written (on two H200, 6 + 12 blocks, FP8 at
        # 128 x 1, left out: 19.5 % low). The largest block four times in the compute dtype: gathered, with the next
        # one prefetched, and in backward its unsharded gradient, autograd's and packed for the reduce-scatter
        # (counted as two average blocks, the checkpointed rows at 32 x 4 came out 1.3-2.6 GiB low)
        late = accumulation_steps(cfg, world) > 1 or cfg.parallel.activation_checkpointing
        grads = 4 * params / shards if late else 0
        state = 12 * params / shards + grads + 4 * width * largest_block_param_count(cfg.model)
    state += fp8_weight_bytes(cfg)  # held from the forward to the backward, like state
    per_block = notes.use("activations", activation_figure(cfg, figs), "no forward+backward row with a peak", False)
    out = {"state_gib": state / GIB, "activations_gib": None, "peak_gib": state / GIB, "capacity_gib": None}
    if per_block is not None:
        out["activations_gib"] = activations_gib(cfg, per_block, notes)
        out["peak_gib"] += out["activations_gib"]
    capacity = notes.use("memory", figs.figure("memory_gib"), f"no figure for {figs.kind}", False)
    headroom = notes.use("headroom", figs.figure("headroom_gib"), "none measured: nothing kept free", False) or 0.0
    if capacity is not None:
        out |= {"capacity_gib": capacity, "headroom_gib": headroom, "fits": out["peak_gib"] + headroom <= capacity}
    return out


def traffic(cfg: Config, params: int, shards: int, replicas: int, accum: int) -> tuple[float, float]:
    """Bytes each GPU sends per optimizer step (ring collectives) within its shard group and across replicas."""
    width = getattr(torch, cfg.train.compute_dtype).itemsize
    ring = (shards - 1) / shards
    across = 2 * (replicas - 1) / replicas  # all-reduce
    if cfg.parallel.strategy == "ddp":  # gradients reduce-scattered and weights all-gathered once per step
        return ring * 2 * width * params, across * width * params / shards
    reduced = reduce_dtype(cfg.parallel, getattr(torch, cfg.train.compute_dtype)).itemsize
    gathers = 2 if cfg.parallel.reshard_after_forward else 1  # for forward, and again for backward
    return accum * ring * (gathers * width + reduced) * params, across * reduced * params / shards


def recompute_share(cfg: Config, notes: Notes) -> float:
    """What activation checkpointing adds to a step's FLOPs: every block's forward again, a third of forward +
    backward (flops_per_sample counts the backward as twice the forward: its dX and dW GEMMs)."""
    if not cfg.parallel.activation_checkpointing:
        return 0.0
    text = "activation checkpointing: every block's forward again, +1/3 of the forward+backward FLOPs"
    return notes.use("AC recompute", (1 / 3, text), "", False) or 0.0


def step_parts(cfg: Config, figs: Figures, notes: Notes) -> dict:
    """Compute, gradient-buffer and optimizer seconds (None where a figure is missing) and the bytes each GPU sends
    within its shard group and across replicas, of one optimizer step."""
    world = cfg.slurm.nodes * cfg.slurm.gpus_per_node
    replicas, shards = mesh_shape(cfg.parallel, world, cfg.slurm.gpus_per_node)
    accum, params = accumulation_steps(cfg, world), param_count(cfg.model)
    precision, batch = precision_of("ours", cfg), cfg.train.micro_batch_size
    same = same_precision(cfg)
    rows, _ = figs.rows("fwdbwd", same)
    rate = None
    if rows:  # FLOP/s at the measured batch nearest this micro-batch, so that it carries over to another depth
        nearest = nearest_batch(rows, batch)
        at, where = figs.rows("fwdbwd", lambda r: same(r) and r["batch"] == nearest)
        flops = [r.get("flops_per_sample") or flops_per_sample(row_config(cfg, r).model, TOKENS, TOKENS) for r in at]
        rate = statistics.fmean(r["samples_s_per_gpu"] * f for r, f in zip(at, flops))
        text = (
            f"{statistics.fmean(r['samples_s_per_gpu'] for r in at):.2f} samples/s at batch {nearest}, {len(at)} row(s)"
        )
        rate = (rate, f"{precision} fwdbwd {text} ({where})")
    rate = notes.use("compute", rate, f"no {precision} forward+backward row for {figs.kind}")
    copy_rate = figs.figure("copy_tb_s")
    per_billion = figs.figure(f"optimizer_ms_per_billion_{cfg.parallel.strategy}")
    if per_billion is None and copy_rate is not None:  # the kernel's bytes at the copy rate: a floor
        per_billion = OPTIMIZER_BYTES / copy_rate[0], f"{OPTIMIZER_BYTES} B per parameter at {copy_rate[1]} (a floor)"
    ms = notes.use("optimizer", per_billion, f"no optimizer time or copy rate for {figs.kind}")
    flops = flops_per_sample(cfg.model, TOKENS, TOKENS) * (1 + recompute_share(cfg, notes))
    out = {
        "compute_s": accum * batch * flops / rate if rate else None,
        "buffer_s": 0.0,
        "optimizer_s": ms * params / shards / 1e12 if ms is not None else None,
    }
    if cfg.parallel.strategy == "ddp":  # each micro-batch's gradients copied (the first) or added into the buffer
        width = getattr(torch, cfg.train.compute_dtype).itemsize
        copy_rate = notes.use("copy rate (grads)", copy_rate, f"no copy rate for {figs.kind}")
        out["buffer_s"] = (2 + 3 * (accum - 1)) * width * params / (copy_rate * 1e12) if copy_rate else None
    out["intra_bytes"], out["inter_bytes"] = traffic(cfg, params, shards, replicas, accum)
    return out


def exposed_fraction(cfg: Config, figs: Figures, bandwidth: float) -> tuple[float, str] | None:
    """The share of the within-node traffic the step rows of this layout leave exposed: (step - compute - buffer -
    optimizer) / traffic time, averaged over the rows with more than one GPU, those of this precision where there
    are any: what hides it is the compute beside it, which the precision changes (on four H100 under fsdp, FP8
    left all of it exposed, bf16 0.7-0.8)."""

    def layout(r: dict) -> bool:
        return r["strategy"] == cfg.parallel.strategy and r["world"] > 1

    same = same_precision(cfg)
    rows, where = figs.rows("step", lambda r: layout(r) and same(r))
    which = f" in {precision_of('ours', cfg)}"
    if not rows:
        which, (rows, where) = "", figs.rows("step", layout)
    fractions = []
    for r in rows:
        parts = step_parts(row_config(cfg, r), figs, Notes())
        busy = [parts["compute_s"], parts["buffer_s"], parts["optimizer_s"]]
        if None not in busy:
            step = r["batch"] * r["accum"] / r["samples_s_per_gpu"]
            exposed = (step - sum(busy)) / (parts["intra_bytes"] / (bandwidth * 1e9))
            fractions.append(min(max(exposed, 0.0), 1.0))
    if not fractions:
        return None
    mean = statistics.fmean(fractions)
    return mean, f"{mean:.2f} of it exposed, {len(fractions)} {cfg.parallel.strategy} step row(s){which} ({where})"


def project(cfg: Config, figs: Figures, rcp: dict | None) -> dict:
    """The plan of one run size (cfg.slurm.nodes x gpus_per_node)."""
    notes = Notes()
    nodes, gpus = cfg.slurm.nodes, cfg.slurm.gpus_per_node
    world = nodes * gpus
    accum, gbs, mb = accumulation_steps(cfg, world), cfg.train.global_batch_size, cfg.train.micro_batch_size
    out = {
        "nodes": nodes,
        "gpus": world,
        "layout": f"{cfg.parallel.strategy} {precision_of('ours', cfg)}"
        + (" (torchao)" if cfg.perf.fp8 != "none" and cfg.perf.fp8_impl == "torchao" else "")
        + (" + AC" if cfg.parallel.activation_checkpointing else ""),
        "micro_batch": mb,
        "accumulation": accum,
        "params": param_count(cfg.model),
        "memory": memory(cfg, figs, notes),
    }
    parts, step = step_time(cfg, figs, notes)
    out |= {"step": parts, "step_s": step, "samples_s_per_gpu": gbs / world / step if step else None}
    out["step_lower_bound"] = notes.lower_bound  # the eval and checkpoint inputs after this bound time-to-train only
    ceiling = figs.figure("matmul_tflops")
    if step and ceiling:
        out["mfu"] = gbs / world / step * flops_per_sample(cfg.model, TOKENS, TOKENS) / (ceiling[0] * 1e12)
    out["checkpoint"] = checkpoint_plan(cfg, figs, notes, step)
    if rcp is not None and step is not None:
        out["time_to_train"] = time_to_train(cfg, figs, notes, rcp, step, out["checkpoint"])
    out["warmup"] = warmup(cfg, figs, step)
    return out | {"sources": notes.sources, "missing": notes.missing, "lower_bound": notes.lower_bound}


def step_time(cfg: Config, figs: Figures, notes: Notes) -> tuple[dict, float | None]:
    """The parts of one optimizer step (step_parts and the traffic's exposed seconds) and its seconds (None: no
    compute rate); a stated training rate stands for the whole step."""
    stated = figs.figure("rate")
    if stated is not None:
        notes.use("step", stated, "")
        world = cfg.slurm.nodes * cfg.slurm.gpus_per_node
        return {}, cfg.train.micro_batch_size * accumulation_steps(cfg, world) / stated[0]
    parts = step_parts(cfg, figs, notes)
    parts["exposed_s"] = exposed_seconds(cfg, figs, notes, parts)
    busy = [parts["compute_s"], parts["buffer_s"], parts["optimizer_s"], parts["exposed_s"]]
    return parts, sum(x or 0.0 for x in busy) if parts["compute_s"] is not None else None


def exposed_seconds(cfg: Config, figs: Figures, notes: Notes, parts: dict) -> float | None:
    """The seconds of a step's traffic the compute beside it does not hide: within the shard group the measured
    fraction of it (exposed_fraction), across replicas all of it; None where no bandwidth of the traffic is known
    (its time is not 0 but unknown)."""
    gpus = cfg.slurm.gpus_per_node
    shards = mesh_shape(cfg.parallel, cfg.slurm.nodes * gpus, gpus)[1]
    within = "intra" if shards <= gpus else "inter"  # a shard group larger than a node crosses nodes
    exposed, bandwidths = 0.0, []
    if parts["intra_bytes"]:
        bandwidth = notes.use(
            f"{within}-node bandwidth", figs.figure(f"{within}_node_busbw_gbps"), f"pass --{within}-gbps"
        )
        bandwidths.append(bandwidth)
        if bandwidth is not None:
            fraction = exposed_fraction(cfg, figs, bandwidth)
            fraction = notes.use("overlap", fraction, "no step rows of this layout: all of it counted") or 1.0
            exposed = fraction * parts["intra_bytes"] / (bandwidth * 1e9)
    if parts["inter_bytes"]:
        bandwidth = notes.use(
            "inter-node bandwidth",
            figs.figure("inter_node_busbw_gbps"),
            "pass --inter-gbps: the pre-flight probe's figure",
        )
        bandwidths.append(bandwidth)
        exposed += parts["inter_bytes"] / (bandwidth * 1e9) if bandwidth else 0.0
    return None if bandwidths and not any(bandwidths) else exposed


def warmup(cfg: Config, figs: Figures, step: float | None) -> dict:
    """The warm-up before run_start: measured, or perf.warmup_iters steps (and compile and initialisation)."""
    found = figs.figure("warmup_s")
    if found:
        return {"s": found[0], "source": found[1]}
    steps = cfg.perf.warmup_iters
    return {"steps": steps, "s": steps * step if step else None, "source": f"not measured for {figs.kind}"}


def checkpoint_plan(cfg: Config, figs: Figures, notes: Notes, step: float | None) -> dict:
    """Size and disk, and what each save costs the loop: the copy to host memory (async; the first also allocates
    the pinned buffers, and a write slower than the save interval delays the next save), or the write."""
    nodes, world = cfg.slurm.nodes, cfg.slurm.nodes * cfg.slurm.gpus_per_node
    size = checkpoint_bytes(cfg)
    out = {"gb": size / 1e9, "disk_gb": checkpoint_disk_gb(cfg), "every_steps": cfg.checkpoint.every_steps}
    if not cfg.checkpoint.every_steps:
        return out
    write = notes.use("checkpoint write", figs.figure("checkpoint_write_gb_s"), f"not measured for {figs.kind}")
    if write is not None:  # a run's last save (at Slurm's warning signal, or the final one) is written at once
        out["last_save_s"] = size / nodes / (write * 1e9)
    read = figs.figure("checkpoint_read_gb_s")
    if read is not None:  # every node reads the weights and all optimizer shards (the node's GPUs hold them all)
        out["resume_s"] = size / (read[0] * 1e9)
    if cfg.checkpoint.async_save:
        shards = mesh_shape(cfg.parallel, world, cfg.slurm.gpus_per_node)[1]
        staged = size - 12 * param_count(cfg.model) * (
            1 - 1 / shards
        )  # this GPU's part: weights and its optimizer shard
        stage = notes.use("async staging", figs.figure("async_stage_gb_s"), f"not measured for {figs.kind}")
        first = figs.figure("async_first_save_gb_s")
        if stage is not None:
            late = size / nodes / (write * 1e9) - cfg.checkpoint.every_steps * step if write and step else 0.0
            out["stall_s"] = staged / (stage * 1e9) + max(late, 0.0)
            out["first_extra_s"] = staged / (first[0] * 1e9) - staged / (stage * 1e9) if first else 0.0
    elif write is not None:
        out["stall_s"] = size / nodes / (write * 1e9)
    return out


def time_to_train(cfg: Config, figs: Figures, notes: Notes, rcp: dict, step: float, ckpt: dict) -> dict:
    """Minutes from run_start to the converging eval at the RCP's mean and range of samples to converge."""
    world = cfg.slurm.nodes * cfg.slurm.gpus_per_node
    precision, same_rows = precision_of("ours", cfg), same_precision(cfg)
    rows, where = figs.rows("step", lambda r: same_rows(r) and "eval_samples_s_per_gpu" in r)
    same = [r for r in rows if r["strategy"] == cfg.parallel.strategy] or rows
    # an eval is one forward per sample: a row of another depth carries over at its FLOP rate
    flops = flops_per_sample(cfg.model, TOKENS, TOKENS)
    scaled = [
        r["eval_samples_s_per_gpu"] * flops_per_sample(row_config(cfg, r).model, TOKENS, TOKENS) / flops for r in same
    ]
    found = None
    if same:
        mean = statistics.fmean(scaled)
        found = mean, f"{mean:.1f} samples/s/GPU, {len(same)} {precision} step row(s) at their FLOP rate ({where})"
    rate = notes.use("eval", found, f"no eval rate for {figs.kind}")
    eval_s = EVAL_SAMPLES / (rate * world) if rate else 0.0
    stall = ckpt.get("stall_s", 0.0)
    out = {"eval_s": eval_s if rate else None, "checkpoint_stall_s": ckpt.get("stall_s")}
    for key in ("mean", "low", "high"):
        steps = rcp[key] / cfg.train.global_batch_size
        saves = steps // ckpt["every_steps"] if ckpt["every_steps"] else 0
        evals = steps / eval_interval_steps(cfg)
        seconds = steps * step + evals * eval_s + saves * stall + (ckpt.get("first_extra_s", 0.0) if saves else 0.0)
        out[f"{key}_min"] = seconds / 60
        if key == "mean":
            out["eval_share"] = evals * eval_s / seconds if rate else None
            out["checkpoint_share"] = saves * stall / seconds if "stall_s" in ckpt or not saves else None
            out["end_to_end_samples_s_per_gpu"] = rcp[key] / seconds / world
    return out


def sized(cfg: Config, nodes: int) -> tuple[Config, str | None]:
    """The config at this node count, its micro-batch lowered to a divisor where GBS no longer splits into it;
    (the config as given, why not) when the GBS does not split over the GPUs at all."""
    world, mb = nodes * cfg.slurm.gpus_per_node, cfg.train.micro_batch_size
    per_gpu, rest = divmod(cfg.train.global_batch_size, world)
    if rest or not per_gpu:  # before the copy: a range holds many such counts
        return cfg, f"GBS {cfg.train.global_batch_size} does not split over {world} GPUs"
    c = copy.deepcopy(cfg)
    c.slurm.nodes = nodes
    c.train.micro_batch_size = max(d for d in range(1, mb + 1) if per_gpu % d == 0)
    return c, None


def what_fits(cfg: Config, figs: Figures) -> str | None:
    """The layout and micro-batch nearest the config's that fit its GPUs, as --set assignments."""
    world = cfg.slurm.nodes * cfg.slurm.gpus_per_node
    per_gpu = cfg.train.global_batch_size // world
    for strategy in dict.fromkeys((cfg.parallel.strategy, "ddp", "fsdp")):
        for mb in sorted((d for d in range(1, cfg.train.micro_batch_size + 1) if per_gpu % d == 0), reverse=True):
            c = copy.deepcopy(cfg)
            c.parallel.strategy, c.train.micro_batch_size = strategy, mb
            found = memory(c, figs, Notes())
            if found.get("fits"):
                changes = [f"train.micro_batch_size={mb}"] if mb != cfg.train.micro_batch_size else []
                if strategy != cfg.parallel.strategy:
                    changes.insert(0, f"parallel.strategy={strategy}")
                    changes += ["perf.cuda_graphs=false"] if cfg.perf.cuda_graphs is True and graph_blocker(c) else []
                return f"{' '.join(changes)} ({found['peak_gib']:.1f} GiB)"
    return None


def check(cfg: Config, figs: Figures) -> list[dict]:
    """Every step row of this kind against its projection from the other configurations' rows."""
    rows, _ = figs.rows("step", lambda r: True)
    out = []
    for setup in dict.fromkeys(s for s in map(step_setup, rows) if s is not None):
        same = [r for r in rows if step_setup(r) == setup]
        c = row_config(cfg, same[0])
        p = project(c, figs.excluding(setup), None)
        peaks = [r["peak_gib"] for r in same if "peak_gib" in r]
        out.append(
            {
                "blocks": same[0]["blocks"],
                "gpus": same[0]["world"],
                "micro_batch": same[0]["batch"],
                "accumulation": same[0]["accum"],
                "layout": p["layout"] + {None: "", True: ", graphs", False: ", eager"}[same[0].get("graphs")],
                "rows": len(same),
                "measured_samples_s_per_gpu": statistics.fmean(r["samples_s_per_gpu"] for r in same),
                "projected_samples_s_per_gpu": p["samples_s_per_gpu"],
                "step_lower_bound": p["step_lower_bound"],
                "measured_peak_gib": max(peaks) if peaks else None,
                "projected_peak_gib": p["memory"]["peak_gib"],
                "missing": p["missing"],
            }
        )
    return out
