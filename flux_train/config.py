"""Typed configuration: dataclass sections, YAML files with `defaults:` composition, `--set` overrides.

A config file is YAML with optional `defaults: [other.yaml, model/flux-debug.yaml, ...]` (paths relative
to the file, then to the `configs/` folder). Defaults merge in order, the file's own keys last, then
`--set section.key=value` overrides (values parsed as YAML). Every key is checked against the dataclasses
below: unknown keys, wrong types and impossible values raise ConfigError naming the key path. Each key's field
carries its help and the values it accepts (`setting`): validate checks them, and docs/config.md and
`--help-config` show them.
"""

from __future__ import annotations

import argparse
import collections.abc
import copy
import dataclasses
import json
import math
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import yaml

from flux_train.errors import UserError
from flux_train.precision_recipes import RECIPES

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

# Fixed by the MLPerf flux1 rules and reference (docs/benchmark.md).
EVAL_EVERY_SAMPLES = 262_144
TARGET_VAL_LOSS = 0.586
TRAIN_SAMPLES = 1_099_776
EVAL_SAMPLES = 29_696


class ConfigError(UserError, ValueError):
    """A bad configuration value; the message names the key path and what is accepted."""

    label = "config error"


# what a number accepts: (the text messages and docs show, the check); 0 is accepted where the key's help gives it
# a meaning (off, unset, none)
Accepts = tuple[str, Callable[[Any], bool]]


def _at_least(low: float) -> Accepts:
    return f">= {low}", lambda v: v >= low


def _within(low: float, high: float) -> Accepts:
    return f"in [{low}, {high}]", lambda v: low <= v <= high


POSITIVE = ("> 0", lambda v: v > 0)
BELOW_ONE = ("in [0, 1)", lambda v: 0 <= v < 1)  # an AdamW beta of 1 divides by zero in its bias correction
AUTO_OR_POSITIVE = ("-1 (auto) or >= 1", lambda v: v == -1 or v >= 1)
PATCHABLE = ("a positive even number (2x2 patches)", lambda v: v > 0 and v % 2 == 0)
RULES = "fixed by the rules; configurable only so tests and ablations can move it"


def setting(default: Any, help: str, accepts: Accepts | None = None, may_be_empty: bool = False) -> Any:
    """A config key's field: its default, what it does (`help`), the values validate accepts (`accepts`; an optional
    key's null is always accepted) and, for a string, whether empty means something (`may_be_empty`; any other key
    given an empty string, what an unset shell variable gives in --set data.path=$DATA, is refused rather than read
    as unset, since null unsets a key)."""
    metadata = {"help": help, "accepts": accepts, "may_be_empty": may_be_empty}
    if isinstance(default, (list, dict)):  # mutable: every config gets its own copy
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelConfig:
    flavor: str = setting(
        "flux-schnell",
        "the model's name: printed at the start, checked against a checkpoint's on resume and export; flux-schnell's "
        "runs get the MLPerf reference's convergence points in the progress bar. The shapes are the keys below",
    )
    in_channels: int = setting(
        64, "input and output channels per token: 4 x the VAE's latent channels (2x2 patches)", POSITIVE
    )
    num_layers: int = setting(19, "double-stream (text and image) blocks", _at_least(0))
    num_single_layers: int = setting(38, "single-stream blocks, after the double-stream ones", _at_least(0))
    attention_head_dim: int = setting(128, "width of one attention head; the hidden size is heads x this", POSITIVE)
    num_attention_heads: int = setting(24, "attention heads per block", POSITIVE)
    joint_attention_dim: int = setting(4096, "width of the T5 text encodings the model reads", POSITIVE)
    pooled_projection_dim: int = setting(768, "width of the pooled CLIP encoding the model reads", POSITIVE)
    axes_dims_rope: list[int] = setting(
        [16, 56, 56],
        "rotary embedding dimensions per position-id axis (one that is 0 for every token, the patch row, the patch "
        "column): each even, summing to attention_head_dim",
    )
    init_from: Optional[str] = setting(
        None,
        "start from these weights instead of the reference init: a local diffusers FluxTransformer2DModel folder "
        "(or a FLUX.1 pipeline folder with transformer/) or a black-forest-labs .safetensors file",
    )


@dataclass
class DataConfig:
    source: Literal["synthetic", "energon"] = setting(
        "synthetic",
        "energon: the dataset of docs/data-format.md (written by `python -m dataprep`); synthetic: an in-memory "
        "random set",
    )
    path: Optional[str] = setting(
        None,
        "energon dataset root (the folder holding .nv-meta/, train/, val/, empty_encodings/); unset: a tiny fixture "
        "dataset is written to fixture_dir and used (debug runs only)",
    )
    empty_encodings: Optional[str] = setting(
        None, "empty-string encodings for caption dropout; default <path>/empty_encodings"
    )
    num_workers: int = setting(
        2,
        "energon loader worker processes per rank; the train order (and resuming it) depends on it and the world size",
        _at_least(0),
    )
    shuffle_buffer_size: int = setting(100, "energon: per-worker shuffle buffer in samples (0 = none)", _at_least(0))
    max_samples_per_sequence: int = setting(
        100,
        "energon: samples read in a row from one shard slice before moving to another (0 = no limit)",
        _at_least(0),
    )
    synthetic_train_samples: int = setting(
        64,
        "train samples of the synthetic set, and of the fixture written when source=energon and path is unset",
        POSITIVE,
    )
    synthetic_val_samples: int = setting(
        32, "val samples of that set or fixture (the synthetic set's are its first train samples)", POSITIVE
    )
    synthetic_text_len: int = setting(16, "text tokens per sample of that set or fixture", POSITIVE)
    synthetic_latent_size: int = setting(8, "latent side of that set or fixture (32 for 256x256 images)", PATCHABLE)
    fixture_dir: Optional[str] = setting(None, "where that fixture goes; default <logging.out_dir>/fixture")


@dataclass
class TrainConfig:
    global_batch_size: int = setting(
        512,
        "samples per optimizer step over all ranks; gradient accumulation = it / (micro_batch_size x ranks), which "
        "must divide exactly. configs/recipes/ holds the reference's (GBS, lr, warm-up) points",
        POSITIVE,
    )
    micro_batch_size: int = setting(16, "samples per rank per forward and backward", POSITIVE)
    lr: float = setting(2.0e-4, "the learning rate after the warm-up (constant after it)", POSITIVE)
    warmup_steps: int = setting(
        1600, "linear warm-up: the learning rate is lr x (step + 1) / warmup_steps before this step", _at_least(0)
    )
    max_steps: int = setting(
        30_000, "step cap: a run that reaches it without reaching eval.target ends aborted", POSITIVE
    )
    seed: int = setting(
        1234,
        "the run's seed (MLLOG's seed): the initial weights, the data order and every random draw (seeded from it, the "
        "step and the micro-batch); run i of a campaign (submit --runs) takes seed + i",
        _within(0, 2**32 - 1),
    )
    caption_dropout_prob: float = setting(
        0.1,
        "per-sample probability of swapping both text encodings for the empty string's (the reference's: 0.1)",
        _within(0, 1),
    )
    adam_beta1: float = setting(0.9, f"AdamW's beta1 ({RULES})", BELOW_ONE)
    adam_beta2: float = setting(0.95, f"AdamW's beta2 ({RULES})", BELOW_ONE)
    adam_eps: float = setting(1.0e-8, f"AdamW's epsilon ({RULES})", POSITIVE)
    weight_decay: float = setting(0.1, f"AdamW's weight decay ({RULES})", _at_least(0))
    grad_clip_norm: float = setting(
        1.0,
        f"gradients are clipped to this global norm ({RULES})",
        POSITIVE,
    )
    latent_shift: float = setting(
        0.1159,
        f"the VAE latents enter the model as (z - latent_shift) x latent_scale, the Flux VAE's factors ({RULES})",
    )
    latent_scale: float = setting(0.3611, f"the scale in latent_shift's formula, the Flux VAE's ({RULES})", POSITIVE)
    compute_dtype: Literal["bfloat16", "float32"] = setting(
        "bfloat16", "the dtype of the forward and backward; master weights and optimizer state are float32"
    )
    device: Literal["auto", "cpu", "cuda"] = setting(
        "auto", "where to train; auto: the GPU when one is visible, else the CPU"
    )
    inject_nan_at_step: int = setting(
        0, "a test hook for the non-finite guard: the loss of this step (1-based) becomes NaN; 0 = never", _at_least(0)
    )


@dataclass
class EvalConfig:
    every_samples: int = setting(
        EVAL_EVERY_SAMPLES,
        "an eval every ceil(every_samples / train.global_batch_size) steps (MLLOG's evaluation_frequency; the rules' "
        "262144)",
        POSITIVE,
    )
    every_steps: int = setting(
        0, "debug runs may evaluate on a step cadence instead; 0 = derive from every_samples", _at_least(0)
    )
    target: float = setting(
        TARGET_VAL_LOSS, "the run ends with success at the first eval whose val loss is <= this", _at_least(0)
    )
    batch_size: int = setting(16, "val samples per rank per forward", POSITIVE)
    enabled: bool = setting(True, "false: no evals, so the run ends at train.max_steps")
    sample_prompts: Optional[str] = setting(
        None,
        "a file of prompts (one a line): after each eval's MLLOG events rank 0 writes <out_dir>/samples/step_N.png, "
        "one 256x256 image per prompt (flux_train/tools/sample.py; the last eval's after run_stop). Off by "
        "default: the grids of the other evals take time between run_start and run_stop. Needs sample_weights",
    )
    sample_weights: Optional[str] = setting(
        None,
        "for sample_prompts: a local FLUX.1-schnell folder (vae/, text_encoder/, tokenizer/, text_encoder_2/, "
        "tokenizer_2/)",
    )


@dataclass
class ParallelConfig:
    strategy: Literal["fsdp", "ddp"] = setting(
        "fsdp",
        "fsdp: weights, gradients and optimizer state sharded (FSDP2), weights gathered every micro-batch: fits 80 GB "
        "GPUs. ddp: bf16 weights and gradients replicated, fp32 master weights and AdamW state sharded over "
        "dp_shard; one reduce-scatter and one all-gather per optimizer step (needs ~4 bytes per parameter plus "
        "12/dp_shard: 141 GB and larger GPUs; python -m flux_train.plan says what fits)",
    )
    reduce_dtype: Literal["auto", "float32", "bfloat16"] = setting(
        "auto",
        "gradient reduction dtype; fsdp: of the reduce-scatter (auto: float32, as the reference); ddp: of the "
        "cross-node all-reduce (float32: each shard summed in an fp32 buffer, rounded back once), the reduce-scatter "
        "within a node summing the compute dtype (auto: the compute dtype, as the MLPerf submissions; "
        'docs/benchmark.md "Gradient reduction precision")',
    )
    dp_shard: int = setting(
        -1,
        "ranks that shard the state (fsdp: weights, gradients, optimizer; ddp: the optimizer's); -1: all ranks / "
        "dp_replicate where that is set, else the ranks of a node (nodes replicate: HSDP)",
        AUTO_OR_POSITIVE,
    )
    dp_replicate: int = setting(
        -1, "replicas of the sharded state; -1: all ranks / dp_shard; 1 = plain FSDP over all ranks", AUTO_OR_POSITIVE
    )
    reshard_after_forward: bool = setting(
        True,
        "fsdp: free each block's gathered weights after its forward and gather them again for the backward (false: "
        "keep them, more memory, one all-gather less)",
    )
    activation_checkpointing: bool = setting(
        False, "recompute each block's forward in the backward instead of keeping its activations"
    )
    backend: Literal["auto", "nccl", "gloo"] = setting(
        "auto", "torch.distributed's backend; auto: nccl on GPUs (RCCL on AMD), gloo on the CPU"
    )
    timeout_s: int = setting(
        300,
        "a collective that has not completed after this long ends the run, naming the ranks that did not arrive; it "
        "must cover the longest stretch one rank can spend away from the others (a checkpoint save, an eval)",
        _within(10, 7 * 24 * 3600),  # a week is longer than any job
    )
    exit_timeout_s: int = setting(
        60,
        "a rank whose run has ended but whose process has not exited after this long (a hung teardown: NCCL's "
        "communicator destruction, a stuck thread) is ended, naming the rank and where it waits (exit 6)",
        _within(1, 3600),
    )


@dataclass
class PerfConfig:
    compile: Literal["none", "block"] = setting(
        "none", "block: each double/single block is its own torch.compile region (flux_train/training/perf.py)"
    )
    cuda_graphs: Literal["auto", True, False] = setting(
        "auto",
        "the whole optimizer step (micro-batches, reduction, AdamW, all-gathers) as one CUDA graph (ddp only); auto: "
        "on wherever it can capture (ddp on a GPU, a warm-up to capture in; `graphs_on`), off elsewhere",
    )
    rmsnorm: Literal["auto", "triton", "torch"] = setting(
        "auto", "the Q/K RMSNorms' kernel; auto: ours in Triton on a GPU, torch's elsewhere"
    )
    attention: Literal["flash", "efficient", "cudnn", "math", "auto"] = setting(
        "auto",
        "the SDPA backend; auto: in bf16 the backend measured fastest here (cuDNN on Hopper, else flash), checked "
        "against flash (flux_train/training/perf.py); in fp32 torch's choice",
    )
    fp8: Literal["none", "delayed", "tensorwise", "rowwise"] = setting(
        "none",
        "FP8 GEMMs for the blocks' token Linears; delayed: one scale per tensor from an amax history (ours only); "
        "tensorwise: from the current amax; rowwise: one scale per row (flux_train/kernels/fp8.py)",
    )
    fp8_impl: Literal["ours", "torchao"] = setting(
        "ours",
        "ours: flux_train.kernels.fp8; torchao: torchao.float8's Float8Linear (needs torchao installed)",
    )
    fp8_amax_history: int = setting(
        16, "delayed scaling: steps of amax history a scale is taken from", _within(1, 1024)
    )
    fp8_margin: int = setting(0, "delayed scaling: 2^margin of headroom above the amax", _within(0, 8))
    warmup_iters: int = setting(
        0,
        "training steps run on synthetic batches before run_start (compile, graphs), weights restored after",
        _at_least(0),
    )
    warmup_latent_size: int = setting(
        32,
        "the warm-up batches' latent side; it should match the data's (32 for 256x256 images) so compile does not "
        "run again",
        PATCHABLE,
    )


@dataclass
class PreflightConfig:
    enabled: bool = setting(
        False,
        "per-node checks and an all-reduce bandwidth probe before init_start (flux_train/training/preflight.py); the "
        "submitter turns it on for Slurm runs",
    )
    gpu_name: str = setting("", "a word every GPU's name holds, e.g. H200 (not GH200); empty: any", may_be_empty=True)
    min_free_disk_gb: Optional[float] = setting(
        None,
        "free disk needed in the checkpoint and log folders; unset (null): what the plan says the checkpoints need, "
        "checkpoint.keep + 1 checkpoints of this model and layout (flux_train.training.checkpoint_size.checkpoint_disk_gb)",
        _at_least(0),
    )
    min_bus_bandwidth_gbps: float = setting(
        0.0, "the least all-reduce bus bandwidth over all ranks, GB/s (0: any)", _at_least(0)
    )
    probe_mb: int = setting(256, "the size of the bandwidth probe's all-reduce, MB", POSITIVE)


@dataclass
class CheckpointConfig:
    dir: Optional[str] = setting(None, "the checkpoint folder; default <logging.out_dir>/checkpoints")
    every_steps: int = setting(0, "a checkpoint every this many steps; 0: none on a cadence", _at_least(0))
    keep: int = setting(2, "the newest checkpoints kept; older ones are removed", _at_least(1))
    resume: str = setting(
        "auto",
        "auto: the newest checkpoint in dir that reads back whole; none: start over; else a step_XXXXXXXX folder",
    )
    async_save: bool = setting(
        False, "write checkpoints in the background: a save costs training only the copy to host memory"
    )
    final: bool = setting(
        True,
        "save the state a run ends with (an eval at the target, or train.max_steps), after run_stop: what export, "
        "samples and a longer run start from; false: none (a diverged run never saves its non-finite state)",
    )


@dataclass
class LoggingConfig:
    out_dir: str = setting(
        "runs/flux",
        "the run folder: mllog.log, metrics.jsonl, config.yaml, report.png, samples, by default the checkpoints",
    )
    log_every: int = setting(
        10,
        "steps between metrics lines (and host syncs: the non-finite check, stop votes, the preemption signal)",
        POSITIVE,
    )
    progress_bar: bool = setting(True, "a progress bar on stderr, when it is a terminal")
    tensorboard: bool = setting(False, "also write the metrics to <out_dir>/tensorboard (needs tensorboard installed)")
    mllog_file: str = setting("mllog.log", "the MLPerf log's file name in out_dir")
    mllog_stdout: bool = setting(
        False,
        "MLLOG lines also on stdout (the system configs set it: the MLPerf recipes print them in the job log)",
    )
    submission_org: str = setting("flux-train", "MLLOG's submission_org")
    submission_platform: str = setting("unknown", "MLLOG's submission_platform: the system's name")
    submission_division: Literal["closed", "open"] = setting("closed", "MLLOG's submission_division")
    submission_status: str = setting("onprem", "MLLOG's submission_status")
    submission_poc_name: str = setting("", "MLLOG's submission_poc_name", may_be_empty=True)
    submission_poc_email: str = setting("", "MLLOG's submission_poc_email", may_be_empty=True)


@dataclass
class SlurmConfig:
    nodes: int = setting(1, "nodes of the job (--nodes)", _at_least(1))
    gpus_per_node: int = setting(
        8, "GPUs per node = workers per node (CPU worker processes on a CPU-only run)", _at_least(1)
    )
    cpus_per_task: int = setting(0, "CPUs of each node's task; 0: Slurm's default", _at_least(0))
    mem_gb: int = setting(0, "memory per node; 0: all of the node's memory (--mem=0)", _at_least(0))
    partition: Optional[str] = setting(None, "Slurm partition (--partition); unset: the cluster's default")
    account: Optional[str] = setting(None, "Slurm account (--account); unset: the user's default")
    qos: Optional[str] = setting(None, "Slurm QOS (--qos); unset: the default")
    time_min: int = setting(240, "the job's time limit in minutes (--time)", _at_least(1))
    job_name: str = setting("flux-train", "the job's name (--job-name)")
    folder: str = setting(
        "runs/submitit/%j",
        "submitit's folder (pickles, per-node logs); %j is the job id; must be visible from every node",
    )
    signal_delay_s: int = setting(
        120,
        "Slurm sends USR2 this long before the time limit: logging.log_every steps (workers act at the next logging "
        "step) + a checkpoint save + slack (flux_train/training/preemption.py)",
        POSITIVE,
    )
    max_requeue: int = setting(
        10, "the job requeues itself at most this many times (preemptions and time limits alike)", _at_least(0)
    )
    exclusive: bool = setting(True, "whole nodes (--exclusive)")
    exclude: str = setting(
        "",
        "nodes Slurm must not use, in Slurm's hostlist syntax (n[3,7]): the pre-flight names the ones that fail",
        may_be_empty=True,
    )
    additional: dict[str, str] = setting({}, "extra `#SBATCH --key=value` lines (value true = a bare flag)")


@dataclass
class ContainerConfig:
    runtime: Literal["none", "pyxis", "apptainer", "docker", "podman"] = setting(
        "none", "the container each node's agent runs in; none: the submit host's Python on each node"
    )
    image: Optional[str] = setting(
        None,
        "pyxis: a registry image or a squashfs path starting with / or ./; apptainer: a .sif; docker/podman: a tag",
    )
    mounts: list[str] = setting(
        [], '"SRC", "SRC:DST" or "SRC:DST:ro"; the submit directory and submitit\'s folder are added automatically'
    )
    workdir: Optional[str] = setting(
        None, "working directory inside the container; default: the submit directory, mounted at the same path"
    )
    python: str = setting(
        "/usr/bin/env python3",
        "the image's Python; /usr/bin/env resolves it inside the image (pyxis checks the path on the host first)",
    )
    env: list[str] = setting(
        [],
        "docker/podman only (pyxis and apptainer pass the whole environment): extra variable names to pass in",
    )
    ulimits: dict[str, str] = setting(
        {},
        "docker/podman only (apptainer and pyxis keep the node's limits): NAME: SOFT[:HARD] (-1: unlimited) on top of "
        "memlock: -1:-1; an engine without CAP_SYS_RESOURCE cannot go above the node's hard limits",
    )
    gpu_args: Optional[list[str]] = setting(
        None,
        "GPU passthrough options; null: from env.profile (nvidia: docker --gpus=all, podman CDI "
        "--device=nvidia.com/gpu=all, apptainer --nv; amd: /dev/kfd and /dev/dri, apptainer --rocm); [] for none",
    )
    extra_args: list[str] = setting(
        [], "more options for the engine's run command (apptainer exec, docker/podman run) or, with pyxis, srun"
    )


@dataclass
class EnvConfig:
    profile: Literal["none", "nvidia", "amd"] = setting(
        "none",
        "slurm/env/<profile>.env: NCCL (nvidia) or RCCL/HSA (amd) defaults; variables already set in the job win",
    )
    socket_ifname: Optional[str] = setting(
        None, 'NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME; "auto" = the interface of the default route'
    )
    ib_hca: Optional[str] = setting(None, "NCCL_IB_HCA")
    master_port: int = setting(
        29500, "c10d rendezvous port on the job's first host; 0 = derived from the job id", _within(0, 65535)
    )
    local_dir: Optional[str] = setting(
        None, "node-local scratch for compile caches and worker logs; default $TMPDIR or /tmp"
    )
    runtime_tunables: bool = setting(False, "run slurm/runtime_tunables.sh once per node before the workers")
    vars: dict[str, str] = setting(
        {}, "more environment variables for each node's agent and workers, over the profile's; the job's own win"
    )
    masked_vars: list[str] = setting(
        [],
        "more variable names (fnmatch patterns, any case) whose values are masked in logs, --dry-run and the run's "
        "config.yaml, on top of *TOKEN*, *KEY*, *SECRET*, *PASSWORD*, *PASSWD*, *CREDENTIAL* (flux_train/masking.py)",
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    container: ContainerConfig = field(default_factory=ContainerConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The config as the YAML a run archives and --print-config shows (lists on one line); load_config reads
        it back to the same config."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)


# ---------------------------------------------------------------------------------------------
# YAML composition


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _resolve(ref: str, parent: Path) -> Path:
    name = ref if ref.endswith((".yaml", ".yml")) else ref + ".yaml"
    for candidate in (parent / name, CONFIG_DIR / name):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"defaults: cannot find '{ref}' (looked in {parent} and {CONFIG_DIR})")


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without anchors and aliases: a config has no use for them, and nested aliases (a "billion laughs" of a
    few hundred bytes) expand to more values than memory holds. A key given twice in one mapping is refused too:
    YAML keeps the last silently, and the one a user edited may be the other."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise ConfigError(f"line {mark.line + 1}: an alias (*name); write the value out instead")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, collections.abc.Hashable):
                break  # SafeLoader's own error names it
            if key in seen:
                raise ConfigError(
                    f"line {key_node.start_mark.line + 1}: key {key!r} given twice in one mapping (first on line "
                    f"{seen[key]}); keep one"
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def parse_yaml(text: str):
    """A config text or a --set value: plain YAML, aliases refused."""
    return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass


def load_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """Read a config file with its `defaults:` chain merged in; returns a plain nested dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config file not found: {path}; pass --config an existing YAML file (the shipped ones are in {CONFIG_DIR})"
        )
    resolved = path.resolve()
    if resolved in _seen:
        raise ConfigError(f"defaults: cycle through {path}")
    try:
        raw = parse_yaml(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    defaults = raw.pop("defaults", []) or []
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) and d.strip() for d in defaults):
        raise ConfigError(
            f"{path}: defaults: expected a list of config names, e.g. [model/flux-debug], got {defaults!r}"
        )
    merged: dict = {}
    for ref in defaults:
        merged = _deep_merge(merged, load_yaml(_resolve(ref, path.parent), _seen + (resolved,)))
    return _deep_merge(merged, raw)


def apply_override(tree: dict, assignment: str) -> dict:
    """Apply one `section.key=value` (value parsed as YAML) to a nested dict."""
    if "=" not in assignment:
        raise ConfigError(f"--set '{assignment}': expected section.key=value")
    dotted, _, text = assignment.partition("=")
    keys = dotted.strip().split(".")
    if len(keys) < 2 or not all(keys):
        raise ConfigError(f"--set '{assignment}': expected section.key=value")
    try:
        value = parse_yaml(text) if text.strip() else ""
    except yaml.YAMLError:
        opening = text.lstrip()[:1]
        if opening in ("'", '"'):  # YAML reads it as a quoted string: taken verbatim, the stray quote would stay in
            raise ConfigError(
                f"--set {assignment!r}: the value starts with {opening} but is not a quoted string (a quote left "
                "open?); close the quote, or leave the quotes out (the shell's quotes around the whole --set suffice)"
            ) from None
        if opening in ("[", "{"):  # YAML reads it as a list or a mapping: taken verbatim, a typo would become a value
            kind = "list" if opening == "[" else "mapping"
            raise ConfigError(
                f"--set {assignment!r}: the value starts with {opening} but is not a YAML {kind} (a bracket left "
                f"open?); close it, or quote the whole value to mean the text: --set '{dotted}=\"{text}\"'"
            ) from None
        value = text
    except ConfigError as exc:
        raise ConfigError(f"--set '{assignment}': {exc}") from None
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set '{assignment}': '{key}' is not a section")
    node[keys[-1]] = value
    return tree


# ---------------------------------------------------------------------------------------------
# typed conversion


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is typing.Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, dict):
        return repr(tp).replace("typing.", "")
    if tp is type(None):  # an optional key's unset value, as YAML writes it
        return "null"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], path)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: {value!r} is not accepted; expected {_type_name(tp)}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        return [_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        return {str(k): _convert(v, args[1], f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 5e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {type(value).__name__} {value!r}")
        try:
            value = float(value)
        except OverflowError:  # an integer beyond any float
            value = math.inf
        if not math.isfinite(value):  # .nan, .inf, or 1e309 (read as a string, then overflowing)
            raise ConfigError(f"{path}: expected a finite number, got {value}")
        return value
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{path}: expected a string, got {type(value).__name__} {value!r}")
        return str(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    raise ConfigError(f"{path}: unsupported type {tp}")


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(str(k) for k in set(data) - set(names))  # str: YAML keys may be numbers
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"unknown key '{where}{unknown[0]}'; accepted keys here: {', '.join(names)}")
    kwargs = {k: _convert(v, hints[k], f"{path}.{k}" if path else k) for k, v in data.items()}
    return cls(**kwargs)


@dataclass(frozen=True)
class Key:
    """One config key, as its field declares it (`setting`)."""

    name: str  # section.key
    type: Any
    default: Any
    help: str
    accepts: Accepts | None
    may_be_empty: bool

    def accepted(self) -> str:
        """Its type, and its range where it has one."""
        return f"{_type_name(self.type)}, {self.accepts[0]}" if self.accepts else _type_name(self.type)

    def default_text(self) -> str:
        """The default as a YAML value (JSON is YAML: null, true, "text", [16, 56, 56])."""
        return json.dumps(self.default)


def keys() -> list[Key]:
    """Every key, in the order of the sections and their fields."""
    found = []
    for section, cls in typing.get_type_hints(Config).items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            found.append(Key(f"{section}.{f.name}", hints[f.name], default, **f.metadata))
    return found


def keys_help() -> str:
    """Every key, what it takes, its default and what it does (`--help-config`; docs/config.md is the same table)."""
    lines = [
        "Every config key: what it takes, its default (the files in configs/ set others) and what it does. Set one in",
        "a config file's section or with --set SECTION.KEY=VALUE (a YAML value). The same table: docs/config.md.",
    ]
    section = None
    for key in keys():
        if key.name.split(".")[0] != section:
            section = key.name.split(".")[0]
            lines.append("")
        lines.append(f"{key.name}  {key.accepted()}  (default {key.default_text()})")
        lines += textwrap.wrap(
            key.help,
            116,
            initial_indent="    ",
            subsequent_indent="    ",
            break_on_hyphens=False,
            break_long_words=False,
        )
    return "\n".join(lines)


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


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    tree = load_yaml(path) if path is not None else {}
    for assignment in overrides:
        tree = apply_override(tree, assignment)
    return validate(_build(Config, tree, ""))


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


# ---------------------------------------------------------------------------------------------
# the flags of every command that reads a config


def add_overrides(parser: argparse.ArgumentParser) -> None:
    """`--set SECTION.KEY=VALUE` (repeatable) into `overrides`, and `--help-config` listing the keys, as every
    command that reads a config takes them."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        type=assignment,
        metavar="SECTION.KEY=VALUE",
        help="override one config value; repeatable (the keys: --help-config)",
    )
    parser.add_argument(
        "--help-config",
        action=PrintConfigKeys,
        help="print every config key with its type, default and help, and exit",
    )


class PrintConfigKeys(argparse.Action):
    """`--help-config`: answered during parsing, as --help is, before the command's other flags are checked."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(keys_help())
        parser.exit()


def assignment(text: str) -> str:
    """argparse type of --set: KEY=VALUE in one word. `--set train.lr 0.5` would otherwise end in argparse's
    "unrecognized arguments: 0.5", which does not say what the form is."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not SECTION.KEY=VALUE: give the key and its value as one word, e.g. --set {text}=VALUE"
        )
    return text
