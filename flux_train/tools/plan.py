"""`python -m flux_train.plan`: what a run will take before it is spent: memory per GPU and whether it fits,
step time, samples/s, time-to-train to the MLPerf target and checkpoint disk, for one or more node counts.

    python -m flux_train.plan --config configs/systems/H200_01x08.yaml [--nodes 1 2 8 | --nodes 1-8]
        [--set section.key=value] [--gpu H200] [--measured rows.jsonl] [--intra-gbps X] [--inter-gbps X]
        [--rate SAMPLES_S_PER_GPU] [--check] [--json] [--png FILE]

Every number comes from an input printed beside it: flux_train/tools/measured.yaml (figures and bench rows per GPU
kind, each with the command and date that produced it), a bench rows file (--measured, used ahead of the
table), stated figures (the flags: a bandwidth from the pre-flight probe, a published training rate) and the
MLPerf reference convergence points that mlperf-logging ships. A missing input is named, and the times it would
enter are lower bounds.

Per GPU, with P parameters, S GPUs sharing the optimizer state (a node) and R replicas (the nodes):
- memory: ddp holds the weights and a gradient buffer in the compute dtype and 12 P / S bytes of fp32 master
  weights and AdamW moments (flux_train/training/ddp.py); fsdp holds 12 P / S, the fp32 gradient shards between
  micro-batches when accumulating, and two blocks' gathered weights (flux_train/training/fsdp.py). Our FP8
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
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
import yaml

from flux_train import hardware
from flux_train.cli import plan_parser
from flux_train.config import (
    CONFIG_DIR,
    EVAL_SAMPLES,
    Config,
    accumulation_steps,
    eval_interval_steps,
    graph_blocker,
    load_config,
    mesh_shape,
)
from flux_train.errors import UserError, output_file, reports_user_errors, write_output
from flux_train.hardware import Kind, kind_of, named
from flux_train.model.flux import flops_per_sample, param_count, token_linear_param_count
from flux_train.outputs.mllog import BENCHMARK, RULESET, USAGE, rcp_samples
from flux_train.precision_recipes import RECIPES, labelled
from flux_train.private_apis import rcp_batch_sizes
from flux_train.tools.bench_table import fp8_impl_of, precision_of, read_rows
from flux_train.training.checkpoint_size import checkpoint_bytes, checkpoint_disk_gb
from flux_train.training.distributed import reduce_dtype

FIGURES_FILE = Path(__file__).with_name("measured.yaml")
TOKENS = 256  # text tokens and image tokens of a flux1 sample (256x256 images), as the bench measures them
GIB = 2**30
OPTIMIZER_BYTES = 28  # our AdamW kernel's traffic per parameter of the shard: the floor where no time is measured


class PlanError(UserError):
    """A plan that cannot be made (no RCP for the GBS, no GPU kind) or a run that cannot fit its GPUs."""

    label = "plan"


# ---------------------------------------------------------------------------------------------- inputs


class Figures:
    """What is known about one GPU kind: stated figures (flags) first, then the measured figures, then the vendor's
    (flux_train/hardware.py: its memory); bench rows from a --measured file first, then the table's. Activations may
    come from another kind's rows (the same code and model hold the same tensors), labelled so."""

    def __init__(self, kind: str, measured: str | None = None, stated: dict | None = None):
        table = yaml.safe_load(FIGURES_FILE.read_text())
        found = kind_of(kind)
        self.kind = found.name if found else kind
        self.known = found is not None
        self.figures = table.get(self.kind, {}).get("figures", {})
        self.vendor = vendor_figures(found)
        self.stated = {k: v for k, v in (stated or {}).items() if v is not None}
        self.row_sets = [  # this kind's rows, then the other kinds'; stock steps are the table's baselines only
            [(r, f"{FIGURES_FILE.name} {k}, {r['date']}") for k, v in table.items() if (k == self.kind) == mine
             for r in v.get("rows", []) if not (r["mode"] == "step" and r["row"] == "stock")]
            for mine in (True, False)
        ]  # fmt: skip
        if measured:
            self.row_sets.insert(0, self._read(measured))

    def _read(self, path: str) -> list[tuple[dict, str]]:
        rows = []
        for n, row in enumerate(read_rows(path, "--measured"), 1):
            if "error" in row or not (row["row"] == "ours" or "-fp8-" in row["row"]):
                continue  # failed rows, stock diffusers and the ablations measure other code
            if "blocks" not in row or (row["mode"] == "step" and "strategy" not in row):
                raise PlanError(
                    f"--measured {path}: row {n} has no 'blocks' or 'strategy' (written by an older bench): add "
                    '"blocks": [double, single] and, for a step row, "strategy"'
                )
            if not named(self.kind, row.get("device", self.kind)):
                raise PlanError(
                    f"--measured {path}: row {n} was measured on {row['device']}, the plan is for {self.kind}"
                )
            rows.append((row, f"{path} row {n}"))
        return rows

    @property
    def measured(self) -> bool:
        """Whether anything of this kind was measured or stated: a figure not from the vendor's spec, a bench row."""
        return bool(self.stated) or bool(self.figures) or any(self.row_sets[:-1])

    def figure(self, name: str) -> tuple[float, str] | None:
        """(value, where it comes from) of a stated, measured or vendor's figure, or None."""
        if name in self.stated:
            return float(self.stated[name]), f"{self.stated[name]:g}, stated on the command line"
        f = self.figures.get(name)
        if f is None:
            return self.vendor.get(name)
        span = f"{f['value']:g}-{f['high']:g}" if "high" in f else f"{f['value']:g}"
        return float(f["value"]), f"{span} {f['unit']} ({self.kind}, measured {f['date']})"

    def rows(self, mode: str, match, any_kind: bool = False) -> tuple[list[dict], str]:
        """The matching rows of the first row set that has any (this kind's, then with any_kind another's)."""
        for rows in self.row_sets[: None if any_kind else -1]:
            found = [(r, where) for r, where in rows if r["mode"] == mode and match(r)]
            if found:
                return [r for r, _ in found], "; ".join(dict.fromkeys(where for _, where in found))
        return [], ""

    def excluding(self, setup: tuple) -> Figures:
        """These figures without the step rows of one configuration (to check a projection against them)."""
        other = copy.copy(self)
        other.row_sets = [[(r, w) for r, w in rows if step_setup(r) != setup] for rows in self.row_sets]
        return other


def vendor_figures(kind: Kind | None) -> dict[str, tuple[float, str]]:
    """A kind's figures from flux_train/hardware.py, as the plan shows them: (value, where it comes from)."""
    if kind is None:
        return {}
    return {"memory_gib": (kind.memory_gib, f"{kind.memory_gib:g} GiB ({kind.name}, spec: {kind.memory_spec})")}


def step_setup(row: dict) -> tuple | None:
    """What a step row measured, as one key: depth, GPUs, micro-batch, accumulation, layout, activation
    checkpointing, precision, whose FP8, graphs (None: not recorded)."""
    if row["mode"] != "step":
        return None
    return (
        tuple(row["blocks"]), row["world"], row["batch"], row["accum"], row["strategy"], checkpointed(row),
        row["precision"], fp8_impl_of(row), row.get("graphs"),
    )  # fmt: skip


def checkpointed(row: dict) -> bool:
    """Whether a bench row's blocks were checkpointed (rows from before the bench recorded it were not)."""
    return row.get("activation_checkpointing", False)


def row_config(cfg: Config, row: dict) -> Config:
    """The config a bench row measured: the planned model's width at the row's depth, one node of its GPUs, its
    micro-batch, accumulation, layout, activation checkpointing and precision."""
    c = copy.deepcopy(cfg)
    c.model.num_layers, c.model.num_single_layers = row["blocks"]
    c.train.compute_dtype = "bfloat16"
    c.train.micro_batch_size = row["batch"]
    c.train.global_batch_size = row["batch"] * row.get("world", 1) * row.get("accum", 1)
    c.parallel.strategy = row.get("strategy", c.parallel.strategy)
    c.parallel.dp_shard = c.parallel.dp_replicate = -1
    c.parallel.activation_checkpointing = checkpointed(row)
    c.perf = replace(c.perf, fp8=labelled(row["precision"]).name, fp8_impl=fp8_impl_of(row) or c.perf.fp8_impl)
    c.slurm.nodes, c.slurm.gpus_per_node = 1, row.get("world", 1)
    return c


def rcp_points(gbs: int) -> dict:
    """Samples to converge at this GBS in the MLPerf reference runs (mlperf-logging's RCP table): mean, range."""
    samples = rcp_samples(gbs)
    if not samples:
        sizes = ", ".join(map(str, rcp_batch_sizes(USAGE, RULESET, BENCHMARK)))
        raise PlanError(
            f"GBS {gbs} has no reference convergence point: the {BENCHMARK} RCPs ({USAGE} {RULESET}) measured "
            f"samples to converge at GBS {sizes} only, so no time-to-train can be projected for {gbs}; choose one "
            "of them (configs/recipes/gbs<N>.yaml)"
        )
    return {
        "gbs": gbs,
        "rcp": f"{USAGE} {RULESET}",
        "runs": len(samples),
        "mean": statistics.fmean(samples),
        "low": min(samples),
        "high": max(samples),
    }


# ---------------------------------------------------------------------------------------------- the model


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
    with activation checkpointing a block's at a time (the checkpoint drops them with the block's other saved
    tensors, its recompute casts them again). fsdp: none, its backward casts the weights it gathers again (measured
    on four H100, full model, micro-batch 8: counted, the FP8 peak came out 13 % high)."""
    if cfg.parallel.strategy == "fsdp":
        return 0
    return fp8_weight_copies(cfg) / (block_count(cfg) if cfg.parallel.activation_checkpointing else 1)


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
    params, blocks = param_count(cfg.model), block_count(cfg)
    width = getattr(torch, cfg.train.compute_dtype).itemsize
    if cfg.parallel.strategy == "ddp":  # replicated weights and gradient buffer; fp32 master and moments sharded
        state = 2 * width * params + 12 * params / shards
    else:  # fp32 weights and moments sharded; gradient shards kept while accumulating; two blocks gathered
        grads = 4 * params / shards if accumulation_steps(cfg, world) > 1 else 0
        state = 12 * params / shards + grads + 2 * width * params / blocks
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
    stated = figs.figure("rate")
    if stated is not None:  # a stated training rate stands for the whole step
        notes.use("step", stated, "")
        step = mb * accum / stated[0]
        parts = {}
    else:
        parts = step_parts(cfg, figs, notes)
        shards = mesh_shape(cfg.parallel, world, gpus)[1]
        within = "intra" if shards <= gpus else "inter"  # a shard group larger than a node crosses nodes
        parts["exposed_s"], bandwidths = 0.0, []
        if parts["intra_bytes"]:
            bandwidth = notes.use(
                f"{within}-node bandwidth", figs.figure(f"{within}_node_busbw_gbps"), f"pass --{within}-gbps"
            )
            bandwidths.append(bandwidth)
            if bandwidth is not None:
                fraction = exposed_fraction(cfg, figs, bandwidth)
                fraction = notes.use("overlap", fraction, "no step rows of this layout: all of it counted") or 1.0
                parts["exposed_s"] = fraction * parts["intra_bytes"] / (bandwidth * 1e9)
        if parts["inter_bytes"]:
            bandwidth = notes.use(
                "inter-node bandwidth",
                figs.figure("inter_node_busbw_gbps"),
                "pass --inter-gbps: the pre-flight probe's figure",
            )
            bandwidths.append(bandwidth)
            parts["exposed_s"] += parts["inter_bytes"] / (bandwidth * 1e9) if bandwidth else 0.0
        if bandwidths and not any(bandwidths):  # no bandwidth of the traffic known: its time is not 0 but unknown
            parts["exposed_s"] = None
        busy = [parts["compute_s"], parts["buffer_s"], parts["optimizer_s"], parts["exposed_s"]]
        step = sum(x or 0.0 for x in busy) if parts["compute_s"] is not None else None
    out |= {"step": parts, "step_s": step, "samples_s_per_gpu": gbs / world / step if step else None}
    out["step_lower_bound"] = notes.lower_bound  # the eval and checkpoint inputs after this bound time-to-train only
    ceiling = figs.figure("matmul_tflops")
    if step and ceiling:
        out["mfu"] = gbs / world / step * flops_per_sample(cfg.model, TOKENS, TOKENS) / (ceiling[0] * 1e12)
    out["checkpoint"] = checkpoint_plan(cfg, figs, notes, step)
    if rcp is not None and step is not None:
        out["time_to_train"] = time_to_train(cfg, figs, notes, rcp, step, out["checkpoint"])
    warmup = figs.figure("warmup_s")
    out["warmup"] = (
        {"s": warmup[0], "source": warmup[1]}
        if warmup
        else {"steps": cfg.perf.warmup_iters, "s": cfg.perf.warmup_iters * step if step else None,
              "source": f"not measured for {figs.kind}"}
    )  # fmt: skip
    return out | {"sources": notes.sources, "missing": notes.missing, "lower_bound": notes.lower_bound}


def checkpoint_plan(cfg: Config, figs: Figures, notes: Notes, step: float | None) -> dict:
    """Size and disk, and what each save costs the loop: the copy to host memory (async; the first also allocates
    the pinned buffers, and a write slower than the save interval delays the next save), or the write."""
    nodes, world = cfg.slurm.nodes, cfg.slurm.nodes * cfg.slurm.gpus_per_node
    size = checkpoint_bytes(cfg)
    out = {"gb": size / 1e9, "disk_gb": checkpoint_disk_gb(cfg), "every_steps": cfg.checkpoint.every_steps}
    if not cfg.checkpoint.every_steps:
        return out
    write = notes.use("checkpoint write", figs.figure("checkpoint_write_gb_s"), f"not measured for {figs.kind}")
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


# ---------------------------------------------------------------------------------------------- for submit


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


def refusal(cfg: Config, figs: Figures, mem: dict) -> str:
    """Why the job cannot fit its GPUs, and what would, in one line."""
    fix = what_fits(cfg, figs)
    gpus = cfg.slurm.gpus_per_node
    return (
        f"{cfg.parallel.strategy} {precision_of('ours', cfg)} at micro-batch {cfg.train.micro_batch_size} with {gpus} "
        f"GPU(s) per node needs {mem['peak_gib']:.1f} GiB per GPU (model state {mem['state_gib']:.1f} + activations "
        f"{mem['activations_gib'] or 0:.1f}) + {mem['headroom_gib']:g} kept free, an {figs.kind} has "
        f"{mem['capacity_gib']:g} GiB; "
        + (f"what fits: --set {fix}" if fix else "no layout or micro-batch fits: use more GPUs per node")
    )


def submit_line(cfg: Config) -> str:
    """The job's plan in one line, as `submit --dry-run` prints it. Raises PlanError when the job's memory cannot
    fit its GPUs, naming the layout or micro-batch that would."""
    kind = cfg.preflight.gpu_name
    if not kind:
        return "# plan: no GPU kind to plan for (set preflight.gpu_name, e.g. H200)"
    figs = Figures(kind)
    try:
        rcp = rcp_points(cfg.train.global_batch_size)
    except PlanError:
        rcp = None
    p = project(cfg, figs, rcp)
    mem = p["memory"]
    if mem.get("fits") is False:
        raise PlanError(refusal(cfg, figs, mem))
    bound, step_bound = (">= " if p[key] else "" for key in ("lower_bound", "step_lower_bound"))
    fits = (
        f"fits, {mem['peak_gib']:.1f} of {mem['capacity_gib']:g} GiB" if "fits" in mem else f"{mem['peak_gib']:.1f} GiB"
    )
    step = (
        f"step {step_bound}{p['step_s']:.2f} s ({p['samples_s_per_gpu']:.1f} samples/s/GPU)"
        if p["step_s"]
        else f"step: no measured rates for {kind}"
    )
    ttt = p.get("time_to_train")
    ttt = (
        f"time-to-train {bound}{ttt['mean_min']:.0f} min ({ttt['low_min']:.0f}-{ttt['high_min']:.0f}, RCP GBS "
        f"{cfg.train.global_batch_size})"
        if ttt
        else f"time-to-train: {'no RCP for GBS ' + str(cfg.train.global_batch_size) if rcp is None else 'not projected'}"
    )
    ck = p["checkpoint"]
    disk = f"checkpoint disk {ck['disk_gb']:.0f} GB ({cfg.checkpoint.keep} + 1 x {ck['gb']:.0f} GB)"
    return (
        f"# plan ({kind} x {p['gpus']}, {p['layout']}, micro-batch {p['micro_batch']}): {fits}; {step}; {ttt}; {disk}"
    )


# ---------------------------------------------------------------------------------------------- checking


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


def print_check(results: list[dict]) -> None:
    def err(projected, measured):
        return f"{100 * (projected / measured - 1):+.1f} %" if projected and measured else "-"

    print(f"{'blocks':>7s} {'GPUs':>4s} {'micro x acc':>11s} {'layout':28s} {'samples/s/GPU':>24s} {'peak GiB':>24s}")
    print(f"{'':7s} {'':4s} {'':11s} {'':28s} {'measured projected err':>24s} {'measured projected err':>24s}")
    for r in results:
        measured_peak = f"{r['measured_peak_gib']:.1f}" if r["measured_peak_gib"] else "-"
        print(
            f"{'+'.join(map(str, r['blocks'])):>7s} {r['gpus']:4d} {r['micro_batch']:>6d} x {r['accumulation']:<2d} "
            f"{r['layout']:28s} {r['measured_samples_s_per_gpu']:8.2f} {r['projected_samples_s_per_gpu'] or 0:9.2f} "
            f"{err(r['projected_samples_s_per_gpu'], r['measured_samples_s_per_gpu']):>7s} {measured_peak:>8s} "
            f"{r['projected_peak_gib']:9.1f} {err(r['projected_peak_gib'], r['measured_peak_gib']):>7s}"
        )


# ---------------------------------------------------------------------------------------------- output


COLUMNS = (  # header, width
    ("nodes", 5), ("GPUs", 4), ("layout", 18), ("micro x acc", 11), ("GiB/GPU", 7), ("fits", 4), ("compute", 7),
    ("optim", 6), ("comm", 6), ("step s", 8), ("samples/s/GPU", 13), ("MFU %", 5), ("eval %", 6), ("ckpt %", 6),
    ("time-to-train min", 19), ("disk GB", 7),
)  # fmt: skip


def _cells(p: dict) -> list[str]:
    """One table line's cells; '-' where a figure is missing, '>=' on the times that are lower bounds."""

    def num(value, fmt, scale=1.0):
        return format(value * scale, fmt) if value is not None else "-"

    m, s, t, ck = p["memory"], p["step"], p.get("time_to_train", {}), p["checkpoint"]
    bound = ">=" if p["lower_bound"] else ""
    compute = s["compute_s"] + (s["buffer_s"] or 0.0) if s.get("compute_s") is not None else None
    return [
        str(p["nodes"]),
        str(p["gpus"]),
        p["layout"],
        f"{p['micro_batch']} x {p['accumulation']}",
        f"{m['peak_gib']:.1f}",
        {True: "yes", False: "NO"}.get(m.get("fits"), "?"),
        num(compute, ".3f"),
        num(s.get("optimizer_s"), ".3f"),
        num(s.get("exposed_s"), ".3f"),
        (">=" if p["step_lower_bound"] and p["step_s"] is not None else "") + num(p["step_s"], ".3f"),
        num(p["samples_s_per_gpu"], ".2f"),
        num(p.get("mfu"), ".1f", 100),
        num(t.get("eval_share"), ".1f", 100),
        num(t.get("checkpoint_share"), ".2f", 100),
        f"{bound}{t['mean_min']:.0f} ({t['low_min']:.0f}-{t['high_min']:.0f})" if t else "-",
        f"{ck['disk_gb']:.0f}",
    ]


def print_plan(config: str, cfg: Config, figs: Figures, rcp: dict, plans: list[dict], png: str) -> None:
    print(
        f"flux-train plan: {config} on {figs.kind}; {cfg.model.flavor} {param_count(cfg.model) / 1e9:.3f} B parameters; "
        f"GBS {rcp['gbs']}: the RCPs ({rcp['rcp']}, {rcp['runs']} runs) converged in {rcp['mean'] / 1e6:.2f} M "
        f"samples on average ({rcp['low'] / 1e6:.2f}-{rcp['high'] / 1e6:.2f} M)\n"
    )
    print(" ".join(f"{h:{'<' if h == 'layout' else '>'}{w}s}" for h, w in COLUMNS))
    for p in plans:
        if "error" in p:
            print(f"{p['nodes']:>5d} {p['gpus']:>4d} {p['error']}")
            continue
        print(" ".join(f"{c:{'<' if h == 'layout' else '>'}{w}s}" for c, (h, w) in zip(_cells(p), COLUMNS)))
        if p["memory"].get("fits") is False:
            print(f"      does not fit: {refusal(sized(cfg, p['nodes'])[0], figs, p['memory'])}")
    shown = [p for p in plans if "error" not in p]
    if not shown:
        return
    last = shown[-1]
    m, ck, w, s = last["memory"], last["checkpoint"], last["warmup"], last["step"]
    line = (
        f"\nper GPU at {last['nodes']} node(s): model state {m['state_gib']:.1f} GiB + activations "
        f"{m['activations_gib'] or 0:.1f} GiB + {m.get('headroom_gib', 0):g} GiB kept free, of {m['capacity_gib']} GiB"
    )
    if s:
        line += (
            f"; step = compute (with the gradient buffer) + optimizer + the exposed part of "
            f"{s['intra_bytes'] / 1e9:.1f} GB sent within the node and {s['inter_bytes'] / 1e9:.1f} GB across nodes"
        )
    print(line)
    line = f"checkpoints: {ck['gb']:.1f} GB each; keep {cfg.checkpoint.keep} + 1 being written = {ck['disk_gb']:.0f} GB of disk"
    if ck["every_steps"] and ck.get("stall_s") is not None:
        line += f"; a save every {ck['every_steps']} steps holds the loop {ck['stall_s']:.2f} s"
    if "resume_s" in ck:
        line += f"; a resume reads it in {ck['resume_s']:.0f} s"
    print(line)
    if "steps" in w:
        steps = f"({w['s']:.1f} s) " if w["s"] is not None else ""
        warm = f"{w['steps']} step(s) {steps}+ compile and initialisation: {w['source']}"
    else:
        warm = f"{w['s']:.0f} s ({w['source']})"
    print(f"warm-up before run_start (off the clock): {warm}")
    t = last.get("time_to_train")
    if t and t["mean_min"] > cfg.slurm.time_min:
        print(f"longer than slurm.time_min {cfg.slurm.time_min}: the run goes on after requeues (slurm.max_requeue)")
    print("\nsources:")
    for name, text in {k: v for p in shown for k, v in p["sources"].items()}.items():
        print(f"  {name:20s} {text}")
    missing = list(dict.fromkeys(x for p in shown for x in p["missing"]))
    if not figs.measured:
        print(f"missing: {how_to_measure(config, cfg, figs.kind)}")
    elif missing:
        print("missing (times that need them are lower bounds, marked >=):")
        for text in missing:
            print(f"  {text}")
    print(f"plot: {png}")


def how_to_measure(config: str, cfg: Config, kind: str) -> str:
    """What a kind with nothing measured lacks, and the bench commands that measure it on one node."""
    rows = f"{kind}.jsonl"
    return (
        f"nothing is measured on {kind} yet, so no step, time-to-train or checkpoint time: on one {kind} node run "
        f"`python -m flux_train.bench --rows ours --json {rows}` and `torchrun --standalone "
        f"--nproc_per_node={cfg.slurm.gpus_per_node} -m flux_train.bench --mode step --config {config} --rows ours "
        f"--profile --json {rows}`, then plan with --measured {rows} (or add its rows to {FIGURES_FILE.name})"
    )


def plot(plans: list[dict], path: str, title: str) -> None:
    from matplotlib.figure import Figure

    done = [p for p in plans if "time_to_train" in p]
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    nodes = [p["nodes"] for p in done]
    t = [p["time_to_train"] for p in done]
    left.plot(nodes, [x["mean_min"] for x in t], marker="o", label="RCP mean")
    bounds = [(p["nodes"], p["time_to_train"]["mean_min"]) for p in done if p["lower_bound"]]
    if bounds:  # a figure was missing: these times are lower bounds
        left.plot(*zip(*bounds), "o", markerfacecolor="white", color="C0", label="lower bound (a figure missing)")
    left.fill_between(nodes, [x["low_min"] for x in t], [x["high_min"] for x in t], alpha=0.2, label="RCP range")
    left.set(xlabel="nodes", ylabel="time-to-train (minutes)", title=title)
    right.plot(nodes, [p["samples_s_per_gpu"] for p in done], marker="o", label="training step")
    right.plot(nodes, [x["end_to_end_samples_s_per_gpu"] for x in t], marker="o", label="with evals and checkpoints")
    right.set(xlabel="nodes", ylabel="samples/s per GPU", ylim=(0, None))
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    write_output(Path(path), "--png", lambda p: fig.savefig(p, dpi=110, format="png"))


@reports_user_errors
def main(argv=None) -> int:
    args = plan_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    png = args.png or str(Path(cfg.logging.out_dir) / "plan.png")  # beside the run's outputs, not where plan ran
    output_file(Path(png), "--png")
    if args.gpus_per_node:
        cfg.slurm.gpus_per_node = args.gpus_per_node
    kind = args.gpu or cfg.preflight.gpu_name
    table = Path(hardware.__file__).relative_to(CONFIG_DIR.parent)
    kinds = f"the kinds {table} holds: {', '.join(k.name for k in hardware.KINDS)}"
    if not kind:
        raise PlanError(f"name the GPU kind: --gpu KIND or preflight.gpu_name ({kinds})")
    stated = {"intra_node_busbw_gbps": args.intra_gbps, "inter_node_busbw_gbps": args.inter_gbps, "rate": args.rate}
    figs = Figures(kind, args.measured, stated)
    if not figs.known:  # not even its memory: every column would be empty
        given = f"--gpu {kind}" if args.gpu else f"preflight.gpu_name {kind}"
        raise PlanError(f"{given}: no such GPU kind; give one of {kinds} (or add the kind there)")
    if args.check:
        results = check(cfg, figs)
        print(json.dumps(results, indent=1)) if args.json else print_check(results)
        return 0
    rcp = rcp_points(cfg.train.global_batch_size)
    counts = sorted({n for group in args.nodes or [[cfg.slurm.nodes]] for n in group})
    most = cfg.train.global_batch_size // cfg.slurm.gpus_per_node  # one sample per GPU
    if counts[-1] > most:  # what no run can use is not computed (a range of a million once took minutes)
        raise PlanError(
            f"--nodes {counts[-1]}: GBS {cfg.train.global_batch_size} gives {cfg.slurm.gpus_per_node} GPUs per node one "
            f"sample each at {most} nodes; give node counts up to {most}"
        )
    plans = []
    for nodes in counts:
        c, why_not = sized(cfg, nodes)
        gpus = nodes * c.slurm.gpus_per_node
        plans.append({"nodes": nodes, "gpus": gpus, "error": why_not} if why_not else project(c, figs, rcp))
    plot(plans, png, f"{Path(args.config).stem} on {kind}, GBS {rcp['gbs']}")  # first: it can fail
    if args.json:
        print(json.dumps({"config": args.config, "gpu": kind, "rcp": rcp, "plans": plans}, indent=1))
    else:
        print_plan(args.config, cfg, figs, rcp, plans, png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
