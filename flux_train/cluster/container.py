"""What puts each node's agent in its container: the engine's command line (pyxis, apptainer, docker, podman)
with its mounts, GPU passthrough and ulimits, and a check that runs on every node before the container
starts and names the node and the fix when something the container needs is missing there."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass

from flux_train.cluster.launch import check_variable_names
from flux_train.config import Config, ConfigError
from flux_train.training.preemption import REQUEUE_FLAG_ENV

# docker/podman start from the image's environment: what the agent needs from Slurm's and the site's
PASSTHROUGH = (
    "SLURM_JOB_ID",
    "SLURM_JOB_NUM_NODES",
    "SLURM_JOB_NODELIST",
    "SLURM_NODEID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURMD_NODENAME",
    "SLURM_NTASKS",
    "SLURM_RESTART_COUNT",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SUBMITIT_EXECUTOR",
    "SUBMITIT_PREEMPT_SIGNAL",
    REQUEUE_FLAG_ENV,
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
)
# docker/podman --ulimit; container.ulimits adds to or replaces these ("" drops one). Unlimited locked
# memory is what pinned host buffers and RDMA need.
DEFAULT_ULIMITS = {"memlock": "-1:-1"}
ULIMIT_NAMES = (
    "core",
    "cpu",
    "data",
    "fsize",
    "locks",
    "memlock",
    "msgqueue",
    "nice",
    "nofile",
    "nproc",
    "rss",
    "rtprio",
    "rttime",
    "sigpending",
    "stack",
)
# what the trial start on each node imports: the image's interpreter must reach both
TRIAL_IMPORT = "import flux_train, submitit"


@dataclass(frozen=True)
class Mount:
    src: str
    dst: str
    mode: str  # rw | ro

    def spec(self) -> str:
        return f"{self.src}:{self.dst}" + (":ro" if self.mode == "ro" else "")


def parse_mount(text: str) -> Mount:
    parts = text.split(":")
    if "," in text or not parts[0] or len(parts) > 3 or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        raise ConfigError(f"container mount {text!r}: expected SRC, SRC:DST or SRC:DST:ro (paths without ',' or ':')")
    src = os.path.abspath(os.path.expanduser(parts[0]))
    dst = parts[1] if len(parts) > 1 and parts[1] else src
    if not dst.startswith("/"):
        raise ConfigError(f"container mount {text!r}: the destination must be an absolute path")
    return Mount(src, dst, parts[2] if len(parts) == 3 else "rw")


def folder_root(folder: str) -> str:
    """submitit's folder without its per-job part: what every node must see."""
    return os.path.abspath(folder.split("%j")[0] or ".")


def mounts(cfg: Config) -> list[Mount]:
    """The submit directory (the default workdir) and submitit's folder at the same paths, then the config's."""
    configured = [parse_mount(m) for m in cfg.container.mounts]
    auto: list[Mount] = []
    for path in ([] if cfg.container.workdir else [os.getcwd()]) + [folder_root(cfg.slurm.folder)]:
        same_path = [m.src for m in auto + configured if m.src == m.dst]
        if not any(path == src or path.startswith(src.rstrip("/") + "/") for src in same_path):
            auto.append(Mount(path, path, "rw"))
    return auto + configured


def ulimits(cfg: Config) -> dict[str, str]:
    """DEFAULT_ULIMITS with container.ulimits on top, checked: NAME -> SOFT[:HARD], -1 for unlimited."""
    out = {**DEFAULT_ULIMITS, **cfg.container.ulimits}
    for name, value in out.items():
        numbers = value.split(":")
        if name not in ULIMIT_NAMES:
            raise ConfigError(f"container.ulimits.{name}: unknown limit; accepted: {', '.join(ULIMIT_NAMES)}")
        if value and (len(numbers) > 2 or not all(n.lstrip("-").isdigit() for n in numbers)):
            raise ConfigError(
                f"container.ulimits.{name}={value!r}: expected SOFT or SOFT:HARD in whole numbers "
                f"(-1: unlimited), or '' for the engine's own limit"
            )
    return {name: value for name, value in out.items() if value}


def gpu_args(cfg: Config) -> list[str]:
    """GPU passthrough: container.gpu_args, or what env.profile needs with this engine."""
    engine, profile = cfg.container.runtime, cfg.env.profile
    if cfg.container.gpu_args is not None:
        return list(cfg.container.gpu_args)
    if engine == "apptainer":
        return {"nvidia": ["--nv"], "amd": ["--rocm"]}.get(profile, [])
    if profile == "nvidia":
        return ["--gpus=all"] if engine == "docker" else ["--device=nvidia.com/gpu=all"]  # podman: CDI
    if profile == "amd":
        return ["--device=/dev/kfd", "--device=/dev/dri", "--group-add=video", "--security-opt=seccomp=unconfined"]
    return []


def command(cfg: Config) -> tuple[list[str], list[str]]:
    """(srun options, argv before the Python command) that put each node's agent in the container."""
    c = cfg.container
    if c.runtime == "none":
        return [], [sys.executable]
    assert c.image is not None  # submit.resolve_config refuses a runtime without an image before this
    if c.image.startswith("-"):  # docker, podman and apptainer take the image as a word of its own
        raise ConfigError(f"container.image {c.image!r}: starts with '-', so {c.runtime} would read it as an option")
    check_variable_names(c.env, "container.env")
    binds = mounts(cfg)
    workdir = c.workdir or os.getcwd()
    try:
        python = shlex.split(c.python)
    except ValueError as exc:
        raise ConfigError(f"container.python {c.python!r}: {exc} (it is split like a shell command line)") from None
    if c.runtime == "pyxis":
        # only the srun step is containerised: the batch script and its requeue teardown stay on the host
        return [
            f"--container-image={c.image}",
            "--container-mounts=" + ",".join(m.spec() for m in binds),
            f"--container-workdir={workdir}",
            *c.extra_args,
        ], python
    if c.runtime == "apptainer":
        return [], [
            "apptainer",
            "exec",
            *gpu_args(cfg),
            "--bind=" + ",".join(m.spec() for m in binds),
            f"--pwd={workdir}",
            *c.extra_args,
            c.image,
            *python,
        ]
    infiniband = ["--device=/dev/infiniband", "--cap-add=IPC_LOCK"] if cfg.env.ib_hca else []
    names = dict.fromkeys([*PASSTHROUGH, *c.env])
    return [], [
        c.runtime,
        "run",
        "--rm",
        "--init",
        "--network=host",
        "--ipc=host",
        *[f"--ulimit={name}={value}" for name, value in ulimits(cfg).items()],
        *gpu_args(cfg),
        *infiniband,
        *[f"--volume={m.spec()}" for m in binds],
        f"--workdir={workdir}",
        *[f"--env={name}" for name in names],
        *c.extra_args,
        c.image,
        *python,
    ]


# bash, run on each node before the agent's container starts; arguments: engine, image, mount sources...,
# "--", then the trial command. Only "$@" and fixed text reach the shell: nothing from the config is parsed.
# (No single quotes in it: the batch script carries it as one quoted word.)
NODE_CHECK = r"""
node=${SLURMD_NODENAME:-$(hostname)}
fail() { echo "flux-train: error: node $node: $*" >&2; exit 1; }
last() { tail -n 1 <<<"$1"; }
engine=$1 image=$2
shift 2
command -v "$engine" >/dev/null \
  || fail "$engine is not installed here (not on PATH): install it on every node, or choose another container.runtime"
while [ "$1" != -- ]; do
  [ -e "$1" ] || fail "mount source $1 does not exist here:" \
    "create it on every node (a shared filesystem), or fix container.mounts"
  shift
done
shift
if [ "$engine" = apptainer ]; then
  [[ $image == *://* || -r $image ]] || fail "image $image is missing or unreadable here:" \
    "copy it to every node (a shared filesystem), or fix container.image"
else
  out=$("$engine" version 2>&1) \
    || fail "$engine does not work here ($(last "$out")): start its service, or choose another container.runtime"
  "$engine" image inspect "$image" >/dev/null 2>&1 || fail "image $image is not in the $engine image store here:" \
    "build or load it on every node ($engine load -i FILE), or fix container.image"
fi
out=$("$@" 2>&1) && exit 0
rlimits=(cpu fsize data stack core rss nproc nofile memlock as locks sigpending msgqueue nice rtprio rttime)
if [[ $out =~ rlimit\ type\ ([0-9]+) ]]; then limit=${rlimits[${BASH_REMATCH[1]}]}
elif [[ $out =~ RLIMIT_([A-Z]+) ]]; then limit=${BASH_REMATCH[1],,}
fi
[ -z "${limit:-}" ] || fail "$engine cannot set the $limit limit here (higher than this node lets it):" \
  "set container.ulimits.$limit lower, e.g. --set container.ulimits.$limit=N:N"
fail "the container does not start ($(last "$out")): check container.image, container.python and container.extra_args"
"""


def node_check(cfg: Config) -> list[str] | None:
    """argv of the per-node check (bash NODE_CHECK: the engine, the image, the mount sources, then a trial start
    that imports the project with the container's Python); None where there is nothing to check here (no
    container, or pyxis, which reports its own errors)."""
    c = cfg.container
    if c.runtime in ("none", "pyxis"):
        return None
    _, argv = command(cfg)
    assert c.image is not None  # submit.resolve_config refuses a runtime without an image
    return [
        "bash",
        "-c",
        NODE_CHECK,
        "flux-train-check",
        c.runtime,
        c.image,
        *dict.fromkeys(m.src for m in mounts(cfg)),
        "--",
        *argv,
        "-c",
        TRIAL_IMPORT,
    ]
