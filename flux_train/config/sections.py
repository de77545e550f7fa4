"""The sections a training run reads (model, data, train, eval, parallel, perf, checkpoint, logging) and `Config`,
the whole of a config: those and the job's sections (job_sections.py), one attribute per section."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import yaml

from flux_train.config.job_sections import ContainerConfig, EnvConfig, PreflightConfig, SlurmConfig
from flux_train.config.setting import (
    AUTO_OR_POSITIVE,
    BELOW_ONE,
    PATCHABLE,
    POSITIVE,
    RULES,
    at_least,
    setting,
    within,
)

# Fixed by the MLPerf flux1 rules and reference (docs/benchmark.md).
EVAL_EVERY_SAMPLES = 262_144
TARGET_VAL_LOSS = 0.586
TRAIN_SAMPLES = 1_099_776
EVAL_SAMPLES = 29_696


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
    num_layers: int = setting(19, "double-stream (text and image) blocks", at_least(0))
    num_single_layers: int = setting(38, "single-stream blocks, after the double-stream ones", at_least(0))
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
        at_least(0),
    )
    shuffle_buffer_size: int = setting(100, "energon: per-worker shuffle buffer in samples (0 = none)", at_least(0))
    max_samples_per_sequence: int = setting(
        100,
        "energon: samples read in a row from one shard slice before moving to another (0 = no limit)",
        at_least(0),
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
        1600, "linear warm-up: the learning rate is lr x (step + 1) / warmup_steps before this step", at_least(0)
    )
    max_steps: int = setting(
        30_000, "step cap: a run that reaches it without reaching eval.target ends aborted", POSITIVE
    )
    seed: int = setting(
        1234,
        "the run's seed (MLLOG's seed): the initial weights, the data order and every random draw (seeded from it, the "
        "step and the micro-batch); run i of a campaign (submit --runs) takes seed + i",
        within(0, 2**32 - 1),
    )
    caption_dropout_prob: float = setting(
        0.1,
        "per-sample probability of swapping both text encodings for the empty string's (the reference's: 0.1)",
        within(0, 1),
    )
    adam_beta1: float = setting(0.9, f"AdamW's beta1 ({RULES})", BELOW_ONE)
    adam_beta2: float = setting(0.95, f"AdamW's beta2 ({RULES})", BELOW_ONE)
    adam_eps: float = setting(1.0e-8, f"AdamW's epsilon ({RULES})", POSITIVE)
    weight_decay: float = setting(0.1, f"AdamW's weight decay ({RULES})", at_least(0))
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
        0, "a test hook for the non-finite guard: the loss of this step (1-based) becomes NaN; 0 = never", at_least(0)
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
        0, "debug runs may evaluate on a step cadence instead; 0 = derive from every_samples", at_least(0)
    )
    target: float = setting(
        TARGET_VAL_LOSS, "the run ends with success at the first eval whose val loss is <= this", at_least(0)
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
        within(10, 7 * 24 * 3600),  # a week is longer than any job
    )
    exit_timeout_s: int = setting(
        60,
        "a rank whose run has ended but whose process has not exited after this long (a hung teardown: NCCL's "
        "communicator destruction, a stuck thread) is ended, naming the rank and where it waits (exit 6)",
        within(1, 3600),
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
    fp8_amax_history: int = setting(16, "delayed scaling: steps of amax history a scale is taken from", within(1, 1024))
    fp8_margin: int = setting(0, "delayed scaling: 2^margin of headroom above the amax", within(0, 8))
    fp8_gelu_in_cast: bool = setting(
        True,
        "delayed scaling: the MLPs' GELU applied by the FP8 cast of the next Linear's input as it reads, instead "
        "of a bf16 GELU written first (the whole model's forward + backward 1.8 % faster on an H200; "
        "docs/performance.md)",
    )
    warmup_iters: int = setting(
        0,
        "training steps run on synthetic batches before run_start (compile, graphs), weights restored after",
        at_least(0),
    )
    warmup_latent_size: int = setting(
        32,
        "the warm-up batches' latent side; it should match the data's (32 for 256x256 images) so compile does not "
        "run again",
        PATCHABLE,
    )


@dataclass
class CheckpointConfig:
    dir: Optional[str] = setting(None, "the checkpoint folder; default <logging.out_dir>/checkpoints")
    every_steps: int = setting(0, "a checkpoint every this many steps; 0: none on a cadence", at_least(0))
    keep: int = setting(2, "the newest checkpoints kept; older ones are removed", at_least(1))
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
