"""The sections a Slurm job reads around the run: the pre-flight checks, the allocation, the container and the
nodes' environment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from flux_train.config.setting import POSITIVE, at_least, setting, within
from flux_train.container_engines import EngineName


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
        at_least(0),
    )
    min_bus_bandwidth_gbps: float = setting(
        0.0, "the least all-reduce bus bandwidth over all ranks, GB/s (0: any)", at_least(0)
    )
    probe_mb: int = setting(256, "the size of the bandwidth probe's all-reduce, MB", POSITIVE)


@dataclass
class SlurmConfig:
    nodes: int = setting(1, "nodes of the job (--nodes)", at_least(1))
    gpus_per_node: int = setting(
        8, "GPUs per node = workers per node (CPU worker processes on a CPU-only run)", at_least(1)
    )
    cpus_per_task: int = setting(0, "CPUs of each node's task; 0: Slurm's default", at_least(0))
    mem_gb: int = setting(0, "memory per node; 0: all of the node's memory (--mem=0)", at_least(0))
    partition: Optional[str] = setting(None, "Slurm partition (--partition); unset: the cluster's default")
    account: Optional[str] = setting(None, "Slurm account (--account); unset: the user's default")
    qos: Optional[str] = setting(None, "Slurm QOS (--qos); unset: the default")
    time_min: int = setting(240, "the job's time limit in minutes (--time)", at_least(1))
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
        10, "the job requeues itself at most this many times (preemptions and time limits alike)", at_least(0)
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
    runtime: EngineName = setting(
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
        29500, "c10d rendezvous port on the job's first host; 0 = derived from the job id", within(0, 65535)
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
