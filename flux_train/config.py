"""Typed configuration: dataclass sections, YAML files with `defaults:` composition, `--set` overrides.

A config file is YAML with optional `defaults: [other.yaml, model/flux-debug.yaml, ...]` (paths relative
to the file, then to the `configs/` folder). Defaults merge in order, the file's own keys last, then
`--set section.key=value` overrides (values parsed as YAML). Every key is checked against the dataclasses
below: unknown keys, wrong types and impossible values raise ConfigError naming the key path.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import yaml

from flux_train.errors import UserError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

# Fixed by the MLPerf flux1 rules and reference (docs/benchmark.md).
EVAL_EVERY_SAMPLES = 262_144
TARGET_VAL_LOSS = 0.586
TRAIN_SAMPLES = 1_099_776
EVAL_SAMPLES = 29_696
IMAGE_SIZE = 256  # the task's images: 256x256 (32x32 latents)


class ConfigError(UserError, ValueError):
    """A bad configuration value; the message names the key path and what is accepted."""

    label = "config error"


@dataclass
class ModelConfig:
    flavor: str = "flux-schnell"
    in_channels: int = 64
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    axes_dims_rope: list[int] = field(default_factory=lambda: [16, 56, 56])
    # start from these weights instead of the reference init: a local diffusers FluxTransformer2DModel folder
    # (or a FLUX.1 pipeline folder with transformer/) or a black-forest-labs .safetensors file
    init_from: Optional[str] = None


@dataclass
class DataConfig:
    # energon: the dataset of docs/data-format.md (written by `python -m dataprep`); synthetic: an in-memory random set
    source: Literal["synthetic", "energon"] = "synthetic"
    # energon dataset root (the folder holding .nv-meta/, train/, val/, empty_encodings/); unset: a tiny fixture
    # dataset is written to fixture_dir and used (debug runs only)
    path: Optional[str] = None
    # empty-string encodings for caption dropout; default <path>/empty_encodings
    empty_encodings: Optional[str] = None
    # energon loader worker processes per rank; the train order (and resuming it) depends on it and the world size
    num_workers: int = 2
    # energon: per-worker shuffle buffer in samples (0 = none); samples read in a row from one shard slice
    # before moving to another (0 = no limit)
    shuffle_buffer_size: int = 100
    max_samples_per_sequence: int = 100
    # sizes of the synthetic set, and of the fixture written when source=energon and path is unset
    synthetic_train_samples: int = 64
    synthetic_val_samples: int = 32
    synthetic_text_len: int = 16
    synthetic_latent_size: int = 8
    # where that fixture goes; default <logging.out_dir>/fixture
    fixture_dir: Optional[str] = None


@dataclass
class TrainConfig:
    global_batch_size: int = 512
    micro_batch_size: int = 16
    lr: float = 2.0e-4
    warmup_steps: int = 1600
    max_steps: int = 30_000
    seed: int = 1234
    caption_dropout_prob: float = 0.1
    # fixed by the rules; configurable only so tests and ablations can move them
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1.0e-8
    weight_decay: float = 0.1
    grad_clip_norm: float = 1.0
    latent_shift: float = 0.1159
    latent_scale: float = 0.3611
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # a test hook for the non-finite guard: the loss of this step (1-based) becomes NaN; 0 = never
    inject_nan_at_step: int = 0


@dataclass
class EvalConfig:
    every_samples: int = EVAL_EVERY_SAMPLES
    # debug runs may evaluate on a step cadence instead; 0 = derive from every_samples
    every_steps: int = 0
    target: float = TARGET_VAL_LOSS
    batch_size: int = 16
    enabled: bool = True
    # a file of prompts (one a line): after each eval's MLLOG events rank 0 writes <out_dir>/samples/step_N.png, one
    # 256x256 image per prompt (flux_train/tools/sample.py; the last eval's after run_stop). Off by default: the grids of
    # the other evals take time between run_start and run_stop. Needs sample_weights: a local FLUX.1-schnell folder
    # (vae/, text_encoder/, tokenizer/, text_encoder_2/, tokenizer_2/)
    sample_prompts: Optional[str] = None
    sample_weights: Optional[str] = None


@dataclass
class ParallelConfig:
    # fsdp: weights, gradients and optimizer state sharded (FSDP2), weights gathered every micro-batch: fits
    # 80 GB GPUs. ddp: bf16 weights and gradients replicated, fp32 master weights and AdamW state sharded over
    # dp_shard; one reduce-scatter and one all-gather per optimizer step (needs ~4 bytes per parameter plus
    # 12/dp_shard: 141 GB and larger GPUs; python -m flux_train.plan says what fits)
    strategy: Literal["fsdp", "ddp"] = "fsdp"
    # gradient reduction dtype; fsdp: of the reduce-scatter (auto: float32, as the reference); ddp: of the
    # cross-node all-reduce, the reduce-scatter within a node summing the compute dtype (auto: the compute
    # dtype, as the MLPerf submissions; docs/benchmark.md "Gradient reduction precision")
    reduce_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # -1: all ranks of a node shard, nodes replicate (HSDP); 1 replicate = plain FSDP over all ranks
    dp_shard: int = -1
    dp_replicate: int = -1
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    # a collective that has not completed after this long ends the run, naming the ranks that did not arrive;
    # it must cover the longest stretch one rank can spend away from the others (a checkpoint save, an eval)
    timeout_s: int = 300
    # a rank whose run has ended but whose process has not exited after this long (a hung teardown: NCCL's
    # communicator destruction, a stuck thread) is ended, naming the rank and where it waits (exit 6)
    exit_timeout_s: int = 60


@dataclass
class PerfConfig:
    compile: Literal["none", "block"] = "none"
    # the whole optimizer step (micro-batches, reduction, AdamW, all-gathers) as one CUDA graph (ddp only);
    # auto: on where it can capture and pays (ddp on a GPU with FP8; `graphs_on`), off elsewhere
    cuda_graphs: Literal["auto", True, False] = "auto"
    rmsnorm: Literal["auto", "triton", "torch"] = "auto"
    # auto: in bf16 the backend measured fastest here, checked against flash (flux_train/training/perf.py); in fp32 torch's
    attention: Literal["flash", "efficient", "cudnn", "math", "auto"] = "auto"
    # delayed: one scale per tensor from an amax history (ours only); tensorwise: from the current amax;
    # rowwise: one scale per row (flux_train/kernels/fp8.py)
    fp8: Literal["none", "delayed", "tensorwise", "rowwise"] = "none"
    # ours: flux_train.kernels.fp8; torchao: torchao.float8's Float8Linear (needs torchao installed)
    fp8_impl: Literal["ours", "torchao"] = "ours"
    # delayed scaling: steps of amax history a scale is taken from, and 2^margin of headroom above it
    fp8_amax_history: int = 16
    fp8_margin: int = 0
    # training steps run on synthetic batches before run_start (compile, graphs), weights restored after;
    # their latent side should match the data's (32 for 256x256 images) so compile does not run again
    warmup_iters: int = 0
    warmup_latent_size: int = 32


@dataclass
class PreflightConfig:
    # per-node checks and an all-reduce bandwidth probe before init_start (flux_train/training/preflight.py); the
    # submitter turns it on for Slurm runs
    enabled: bool = False
    gpu_name: str = ""  # a substring every GPU's name must contain, e.g. H200; empty: any
    # in the checkpoint and log folders; unset (null): what the plan says the checkpoints need,
    # checkpoint.keep + 1 checkpoints of this model and layout (flux_train.training.checkpoint.checkpoint_disk_gb)
    min_free_disk_gb: Optional[float] = None
    min_bus_bandwidth_gbps: float = 0.0  # all-reduce bus bandwidth over all ranks
    probe_mb: int = 256


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    every_steps: int = 0
    keep: int = 2
    resume: str = "auto"  # auto | none | <path>
    # write checkpoints in the background: a save costs training only the copy to host memory
    async_save: bool = False
    # save the state a run ends with (an eval at the target, or train.max_steps), after run_stop: what export, samples
    # and a longer run start from; false: none (a diverged run never saves its non-finite state)
    final: bool = True


@dataclass
class LoggingConfig:
    out_dir: str = "runs/flux"
    log_every: int = 10
    progress_bar: bool = True
    tensorboard: bool = False
    mllog_file: str = "mllog.log"
    # MLLOG lines also on stdout (the system configs set it: the MLPerf recipes print them in the job log)
    mllog_stdout: bool = False
    submission_org: str = "flux-train"
    submission_platform: str = "unknown"
    submission_division: Literal["closed", "open"] = "closed"
    submission_status: str = "onprem"
    submission_poc_name: str = ""
    submission_poc_email: str = ""


@dataclass
class SlurmConfig:
    nodes: int = 1
    # GPUs per node = workers per node (CPU worker processes on a CPU-only run)
    gpus_per_node: int = 8
    cpus_per_task: int = 0  # 0: Slurm's default
    mem_gb: int = 0  # 0: all of the node's memory (--mem=0)
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time_min: int = 240
    job_name: str = "flux-train"
    # submitit's folder (pickles, per-node logs); %j is the job id; must be visible from every node
    folder: str = "runs/submitit/%j"
    # Slurm sends USR2 this long before the time limit: logging.log_every steps (workers act at the next logging
    # step) + a checkpoint save + slack (flux_train/training/preemption.py)
    signal_delay_s: int = 120
    # the job requeues itself at most this many times (preemptions and time limits alike)
    max_requeue: int = 10
    exclusive: bool = True
    # nodes Slurm must not use, in Slurm's hostlist syntax (n[3,7]): the pre-flight names the ones that fail
    exclude: str = ""
    # extra `#SBATCH --key=value` lines (value true = a bare flag)
    additional: dict[str, str] = field(default_factory=dict)


@dataclass
class ContainerConfig:
    runtime: Literal["none", "pyxis", "apptainer", "docker", "podman"] = "none"
    # pyxis: a registry image or a squashfs path starting with / or ./; apptainer: a .sif; docker/podman: a tag
    image: Optional[str] = None
    # "SRC", "SRC:DST" or "SRC:DST:ro"; the submit directory and submitit's folder are added automatically
    mounts: list[str] = field(default_factory=list)
    # working directory inside the container; default: the submit directory, mounted at the same path
    workdir: Optional[str] = None
    # the image's Python; /usr/bin/env resolves it inside the image (pyxis checks the path on the host first)
    python: str = "/usr/bin/env python3"
    # docker/podman only (pyxis and apptainer pass the whole environment): extra variable names to pass in
    env: list[str] = field(default_factory=list)
    # docker/podman only (apptainer and pyxis keep the node's limits): NAME: SOFT[:HARD] (-1: unlimited) on top
    # of memlock: -1:-1; an engine without CAP_SYS_RESOURCE cannot go above the node's hard limits
    ulimits: dict[str, str] = field(default_factory=dict)
    # GPU passthrough options; null: from env.profile (nvidia: docker --gpus=all, podman CDI
    # --device=nvidia.com/gpu=all, apptainer --nv; amd: /dev/kfd and /dev/dri, apptainer --rocm); [] for none
    gpu_args: Optional[list[str]] = None
    extra_args: list[str] = field(default_factory=list)


@dataclass
class EnvConfig:
    # slurm/env/<profile>.env: NCCL (nvidia) or RCCL/HSA (amd) defaults; variables already set in the job win
    profile: Literal["none", "nvidia", "amd"] = "none"
    # NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME; "auto" = the interface of the default route
    socket_ifname: Optional[str] = None
    ib_hca: Optional[str] = None  # NCCL_IB_HCA
    # c10d rendezvous port on the job's first host; 0 = derived from the job id
    master_port: int = 29500
    # node-local scratch for compile caches and worker logs; default $TMPDIR or /tmp
    local_dir: Optional[str] = None
    runtime_tunables: bool = False  # run slurm/runtime_tunables.sh once per node before the workers
    vars: dict[str, str] = field(default_factory=dict)
    # more variable names (fnmatch patterns, any case) whose values are masked in logs, --dry-run and the run's
    # config.yaml, on top of *TOKEN*, *KEY*, *SECRET*, *PASSWORD*, *PASSWD*, *CREDENTIAL* (flux_train/masking.py)
    masked_vars: list[str] = field(default_factory=list)


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
        quote = text.lstrip()[:1]
        if quote in ("'", '"'):  # YAML reads it as a quoted string: taken verbatim, the stray quote would stay in
            raise ConfigError(
                f"--set {assignment!r}: the value starts with {quote} but is not a quoted string (a quote left "
                "open?); close the quote, or leave the quotes out (the shell's quotes around the whole --set suffice)"
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
    if dataclasses.is_dataclass(tp):
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


def _at_least(low: float) -> tuple[str, Callable[[Any], bool]]:
    return f">= {low}", lambda v: v >= low


def _within(low: float, high: float) -> tuple[str, Callable[[Any], bool]]:
    return f"in [{low}, {high}]", lambda v: low <= v <= high


POSITIVE = ("> 0", lambda v: v > 0)
BELOW_ONE = ("in [0, 1)", lambda v: 0 <= v < 1)  # an AdamW beta of 1 divides by zero in its bias correction
AUTO_OR_POSITIVE = ("-1 (auto) or >= 1", lambda v: v == -1 or v >= 1)

# what each number accepts (0 where the key's comment gives it a meaning: off, unset, none)
RANGES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "model.num_layers": _at_least(0),
    "model.num_single_layers": _at_least(0),
    "model.attention_head_dim": POSITIVE,
    "model.num_attention_heads": POSITIVE,
    "model.joint_attention_dim": POSITIVE,
    "model.pooled_projection_dim": POSITIVE,
    "model.in_channels": POSITIVE,
    "data.num_workers": _at_least(0),
    "data.shuffle_buffer_size": _at_least(0),
    "data.max_samples_per_sequence": _at_least(0),
    "data.synthetic_train_samples": POSITIVE,
    "data.synthetic_val_samples": POSITIVE,
    "data.synthetic_text_len": POSITIVE,
    "train.global_batch_size": POSITIVE,
    "train.micro_batch_size": POSITIVE,
    "train.lr": POSITIVE,
    "train.warmup_steps": _at_least(0),
    "train.max_steps": POSITIVE,
    "train.seed": _within(0, 2**32 - 1),
    "train.caption_dropout_prob": _within(0, 1),
    "train.adam_beta1": BELOW_ONE,
    "train.adam_beta2": BELOW_ONE,
    "train.adam_eps": POSITIVE,
    "train.weight_decay": _at_least(0),
    "train.grad_clip_norm": POSITIVE,
    "train.latent_scale": POSITIVE,
    "train.inject_nan_at_step": _at_least(0),
    "eval.every_samples": POSITIVE,
    "eval.every_steps": _at_least(0),
    "eval.target": _at_least(0),
    "eval.batch_size": POSITIVE,
    "parallel.dp_shard": AUTO_OR_POSITIVE,
    "parallel.dp_replicate": AUTO_OR_POSITIVE,
    "parallel.timeout_s": _within(10, 7 * 24 * 3600),  # seconds; a week is longer than any job
    "parallel.exit_timeout_s": _within(1, 3600),
    "perf.warmup_iters": _at_least(0),
    "perf.fp8_amax_history": _within(1, 1024),  # steps
    "perf.fp8_margin": _within(0, 8),  # powers of two of headroom
    "preflight.min_free_disk_gb": _at_least(0),
    "preflight.min_bus_bandwidth_gbps": _at_least(0),
    "preflight.probe_mb": POSITIVE,
    "checkpoint.every_steps": _at_least(0),
    "checkpoint.keep": _at_least(1),
    "logging.log_every": POSITIVE,
    "slurm.nodes": _at_least(1),
    "slurm.gpus_per_node": _at_least(1),
    "slurm.cpus_per_task": _at_least(0),
    "slurm.mem_gb": _at_least(0),
    "slurm.time_min": _at_least(1),
    "slurm.signal_delay_s": POSITIVE,
    "slurm.max_requeue": _at_least(0),
    "env.master_port": _within(0, 65535),
}

# strings an empty value means something for; any other key given one (what an unset shell variable gives:
# --set data.path=$DATA) is refused rather than read as unset (null unsets a key)
MAY_BE_EMPTY = {"preflight.gpu_name", "slurm.exclude", "logging.submission_poc_name", "logging.submission_poc_email"}


def _values(cfg: Config) -> dict[str, Any]:
    """section.key -> value, for every key of every section."""
    return {
        f"{section.name}.{f.name}": getattr(getattr(cfg, section.name), f.name)
        for section in dataclasses.fields(cfg)
        for f in dataclasses.fields(getattr(cfg, section.name))
    }


def validate(cfg: Config, world_size: int | None = None, gpus_per_node: int | None = None) -> Config:
    """Ranges, empty strings and cross-field checks; world_size adds the batch divisibility check once known, and
    gpus_per_node (a Slurm job's) lets its message name the node counts that divide the batch."""
    t, m = cfg.train, cfg.model

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    values = _values(cfg)
    for key, value in values.items():
        if not isinstance(value, str):
            continue
        need(value.strip() or key in MAY_BE_EMPTY, f"{key}: empty; give a value, or null to leave it unset")
        # a newline or NUL in a path splits every message naming it and fails deep in the OS calls
        need(value.isprintable(), f"{key}: {value!r} holds a control character (a newline, a tab, NUL, ...)")
    for key, (accepted, ok) in RANGES.items():  # None: an optional setting left unset
        need(values[key] is None or ok(values[key]), f"{key}: must be {accepted}, got {values[key]}")
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
    p = cfg.parallel
    need(
        cfg.perf.cuda_graphs is not True or p.strategy == "ddp",
        "perf.cuda_graphs: FSDP2 gathers weights into fresh buffers every step, which a CUDA graph cannot "
        "replay; set parallel.strategy=ddp (weights and gradient buffers stay in place)",
    )
    need(
        not (cfg.perf.cuda_graphs is True and t.inject_nan_at_step),
        "train.inject_nan_at_step: a captured step replays without the hook; set perf.cuda_graphs=false to test it",
    )
    need(
        cfg.perf.cuda_graphs is not True or cfg.perf.warmup_iters >= 1,
        "perf.cuda_graphs: graphs are captured during the warm-up before run_start; set perf.warmup_iters >= 1",
    )
    need(
        cfg.data.synthetic_val_samples <= cfg.data.synthetic_train_samples,
        f"data.synthetic_val_samples {cfg.data.synthetic_val_samples} > data.synthetic_train_samples "
        f"{cfg.data.synthetic_train_samples}: the synthetic val set is a subset of the train set",
    )
    need(
        cfg.perf.fp8 != "delayed" or cfg.perf.fp8_impl == "ours",
        "perf.fp8=delayed: torchao's Float8Linear has no delayed scaling; set perf.fp8_impl=ours",
    )
    for key in ("perf.warmup_latent_size", "data.synthetic_latent_size"):
        need(
            values[key] > 0 and values[key] % 2 == 0,
            f"{key}: must be a positive even number (2x2 patches), got {values[key]}",
        )
    need(
        not cfg.eval.sample_prompts or cfg.eval.sample_weights,
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


def graphs_on(cfg: Config, device_type: str) -> bool:
    """Whether the step runs as a CUDA graph: perf.cuda_graphs=true, or auto where the step can be captured (the
    ddp layout, whose buffers stay in place, on a GPU, with a warm-up to capture in, no NaN-injection hook) and
    where it was measured to pay: with FP8, whose casts make the step wait on the host (6 + 12 blocks, micro-batch
    8: the step 1.45x at one rank, 1.17x at two), not in bf16 (0.97x and 0.99x there; docs/performance.md)."""
    if cfg.perf.cuda_graphs != "auto":
        return cfg.perf.cuda_graphs
    return (
        cfg.parallel.strategy == "ddp"
        and device_type == "cuda"
        and cfg.perf.fp8 != "none"
        and cfg.perf.warmup_iters >= 1
        and not cfg.train.inject_nan_at_step
    )


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
