"""The rules a config must keep beyond each key's own range (validate: cross-field checks, the batch split over the
ranks, the mesh, CUDA graphs), and the values that follow from a config (the mesh shape, accumulation, eval
cadence, checkpoint folder)."""

from __future__ import annotations

import math
from pathlib import Path

from flux_train.config.keys import keys
from flux_train.config.sections import Config, ParallelConfig, TrainConfig
from flux_train.config.setting import ConfigError
from flux_train.precision_recipes import RECIPES


def validate(cfg: Config, world_size: int | None = None, gpus_per_node: int | None = None) -> Config:
    """Ranges, empty strings and cross-field checks; world_size adds the batch divisibility check once known, and
    gpus_per_node (a Slurm job's) lets its message name the node counts that divide the batch."""
    t, m = cfg.train, cfg.model

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    for key in keys():
        section, name = key.name.split(".")
        value = getattr(getattr(cfg, section), name)
        if isinstance(value, str):
            need(bool(value.strip()) or key.may_be_empty, f"{key.name}: empty; give a value, or null to leave it unset")
            # a newline or NUL in a path splits every message naming it and fails deep in the OS calls
            need(value.isprintable(), f"{key.name}: {value!r} holds a control character (a newline, a tab, NUL, ...)")
        if key.accepts and value is not None:  # None: an optional setting left unset
            accepted, ok = key.accepts
            need(ok(value), f"{key.name}: must be {accepted}, got {value}")
    need(m.num_layers + m.num_single_layers > 0, "model: num_layers + num_single_layers must be >= 1")
    need(
        all(d > 0 and d % 2 == 0 for d in m.axes_dims_rope),
        f"model.axes_dims_rope: every axis must be a positive even number (rotary pairs), got {m.axes_dims_rope}",
    )
    need(
        Path(cfg.logging.mllog_file).name == cfg.logging.mllog_file and cfg.logging.mllog_file not in (".", ".."),
        f"logging.mllog_file: a file name in logging.out_dir, not a path, got {cfg.logging.mllog_file!r}",
    )
    need(
        sum(m.axes_dims_rope) == m.attention_head_dim,
        f"model.axes_dims_rope: must sum to attention_head_dim {m.attention_head_dim}, got {m.axes_dims_rope}",
    )
    need(m.in_channels % 4 == 0, f"model.in_channels: must be 4 x latent channels (2x2 patches), got {m.in_channels}")
    blocker = graph_blocker(cfg) if cfg.perf.cuda_graphs is True else None
    need(blocker is None, blocker or "")
    need(
        cfg.data.synthetic_val_samples <= cfg.data.synthetic_train_samples,
        f"data.synthetic_val_samples {cfg.data.synthetic_val_samples} > data.synthetic_train_samples "
        f"{cfg.data.synthetic_train_samples}: the synthetic val set is a subset of the train set",
    )
    impls = RECIPES[cfg.perf.fp8].impls
    need(
        cfg.perf.fp8_impl in impls,
        f"perf.fp8={cfg.perf.fp8}: perf.fp8_impl={cfg.perf.fp8_impl} has no such recipe; set perf.fp8_impl="
        + " or ".join(impls),
    )
    need(
        not cfg.eval.sample_prompts or bool(cfg.eval.sample_weights),
        "eval.sample_prompts needs eval.sample_weights: a local FLUX.1-schnell folder with vae/ and the text encoders",
    )
    if world_size is not None and t.global_batch_size % (t.micro_batch_size * world_size):
        raise ConfigError(_batch_split(t, world_size, gpus_per_node))
    return cfg


def _batch_split(t: TrainConfig, world_size: int, gpus_per_node: int | None) -> str:
    """Why the global batch does not split over the ranks, and what would split it."""
    per_step = t.micro_batch_size * world_size
    why = (
        f"train.global_batch_size {t.global_batch_size} is not divisible by train.micro_batch_size "
        f"{t.micro_batch_size} x data-parallel size {world_size} = {per_step}"
    )
    if gpus_per_node is None:  # the ranks are given (torchrun): the batch settings are what can change
        return f"{why}; set train.global_batch_size to a multiple of {per_step} or change train.micro_batch_size"
    per_node = t.micro_batch_size * gpus_per_node
    steps = t.global_batch_size // per_node if t.global_batch_size % per_node == 0 else 0
    nodes = [str(n) for n in range(1, steps + 1) if steps % n == 0]
    if not nodes:
        return (
            f"{why}; no node count splits it at micro-batch {t.micro_batch_size} with {gpus_per_node} GPUs per "
            "node: change train.micro_batch_size or slurm.gpus_per_node"
        )
    return (
        f"{why}; the node counts that split it at micro-batch {t.micro_batch_size} with {gpus_per_node} GPUs per "
        f"node: {', '.join(nodes)} (--nodes, slurm.nodes); or change train.micro_batch_size"
    )


def mesh_shape(pcfg: ParallelConfig, world: int, local_world: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard); defaults shard within a node and replicate across nodes."""
    for key, value in (("dp_shard", pcfg.dp_shard), ("dp_replicate", pcfg.dp_replicate)):
        if value > 0 and world % value:
            raise ConfigError(
                f"parallel.{key}={value} does not divide the {world} ranks of this run; choose a "
                f"divisor of {world} or -1 (shard within a node, replicate across nodes)"
            )
    shard = (
        pcfg.dp_shard
        if pcfg.dp_shard > 0
        else (world // pcfg.dp_replicate if pcfg.dp_replicate > 0 else min(local_world, world))
    )
    replicate = pcfg.dp_replicate if pcfg.dp_replicate > 0 else world // shard
    if shard * replicate != world:
        raise ConfigError(
            f"parallel.dp_replicate {replicate} x parallel.dp_shard {shard} != the {world} ranks of "
            "this run; set one of them to -1"
        )
    return replicate, shard


def graph_blocker(cfg: Config, device_type: str | None = None) -> str | None:
    """Why the step cannot be captured as a CUDA graph (the fix in one line), or None; `device_type` also checks the
    device (None: not known yet). The rule perf.cuda_graphs=true is refused by and auto is decided on."""
    if cfg.parallel.strategy != "ddp":
        return (
            "perf.cuda_graphs: FSDP2 gathers weights into fresh buffers every step, which a CUDA graph cannot "
            "replay; set parallel.strategy=ddp (weights and gradient buffers stay in place)"
        )
    if cfg.train.inject_nan_at_step:
        return (
            "train.inject_nan_at_step: a captured step replays without the hook; set perf.cuda_graphs=false to test it"
        )
    if cfg.perf.warmup_iters < 1:
        return "perf.cuda_graphs: graphs are captured during the warm-up before run_start; set perf.warmup_iters >= 1"
    if device_type is not None and device_type != "cuda":
        return "perf.cuda_graphs needs a GPU; set perf.cuda_graphs=false on the CPU"
    return None


def graphs_on(cfg: Config, device_type: str) -> bool:
    """Whether the step runs as a CUDA graph: perf.cuda_graphs=true, or auto wherever the step can be captured
    (graph_blocker). Measured at 6 + 12 blocks, micro-batch 8 since graphed ddp steps defer their updates: never
    slower than eager (bf16 1.02x at one H100 and at two H200, FP8 1.02x at two H200), and with FP8, whose casts
    can make the step wait on the host, up to 1.45x (docs/performance.md)."""
    if cfg.perf.cuda_graphs != "auto":
        return cfg.perf.cuda_graphs
    return graph_blocker(cfg, device_type) is None


def checkpoint_dir(cfg: Config) -> Path:
    """The run's checkpoint folder: checkpoint.dir, by default <logging.out_dir>/checkpoints."""
    return Path(cfg.checkpoint.dir or Path(cfg.logging.out_dir) / "checkpoints")


def accumulation_steps(cfg: Config, world_size: int) -> int:
    """Micro-batches per rank per optimizer step (validate() checks the division is exact)."""
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * world_size)


def eval_interval_steps(cfg: Config) -> int:
    """Steps between evaluations: ceil(262144 / GBS) unless a debug cadence is set."""
    if cfg.eval.every_steps:
        return cfg.eval.every_steps
    return math.ceil(cfg.eval.every_samples / cfg.train.global_batch_size)
