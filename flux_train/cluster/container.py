"""What puts each node's agent in its container: the config's container settings resolved and checked (mounts,
ulimits, the variables passed in) for the engine `container.runtime` names (flux_train/container_engines.py), which
makes the command line, and a check that runs on every node before the container starts and names the node and the
fix when something the container needs is missing there."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass

from flux_train.cluster.launch import check_variable_names
from flux_train.config import Config, ConfigError, ContainerConfig
from flux_train.container_engines import ENGINES, Engine, Launch
from flux_train.training.preemption import REQUEUE_FLAG_ENV

# an engine that starts from the image's environment is given these names (Launch.env): what the agent needs from
# Slurm's and the site's
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
# an engine's ulimits (Launch.ulimits); container.ulimits adds to or replaces these ("" drops one). Unlimited locked
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


def engine_of(c: ContainerConfig) -> Engine:
    """The engine container.runtime names: everything about it is asked of it."""
    return ENGINES[c.runtime]


def gpu_args(cfg: Config) -> list[str]:
    """GPU passthrough: container.gpu_args, or what env.profile needs with this engine."""
    if cfg.container.gpu_args is not None:
        return list(cfg.container.gpu_args)
    return engine_of(cfg.container).gpu_args(cfg.env.profile)


def command(cfg: Config) -> tuple[list[str], list[str]]:
    """(srun options, argv before the Python command) that put each node's agent in its engine's container."""
    c, engine = cfg.container, engine_of(cfg.container)
    if not engine.needs_image:  # no container: the submit host's Python, none of the container settings read
        return [], [sys.executable]
    assert c.image is not None  # submit.resolve_config refuses a runtime without an image before this
    if c.image.startswith("-"):  # the engines take the image as a word of its own
        raise ConfigError(f"container.image {c.image!r}: starts with '-', so {c.runtime} would read it as an option")
    check_variable_names(c.env, "container.env")
    binds = tuple(m.spec() for m in mounts(cfg))
    try:
        python = tuple(shlex.split(c.python))
    except ValueError as exc:
        raise ConfigError(f"container.python {c.python!r}: {exc} (it is split like a shell command line)") from None
    launch = Launch(
        image=c.image,
        binds=binds,
        workdir=c.workdir or os.getcwd(),
        python=python,
        gpu_args=tuple(gpu_args(cfg)),
        env=tuple(dict.fromkeys([*PASSTHROUGH, *c.env])),
        ulimits=ulimits(cfg),
        infiniband=bool(cfg.env.ib_hca),
        extra_args=tuple(c.extra_args),
    )
    return engine.srun_options(launch), engine.argv(launch)


# bash, run on each node before the agent's container starts, around the engine's own lines (Engine.image_check);
# arguments: engine, image, mount sources..., "--", then the trial command. Only "$@" and fixed text reach the shell:
# nothing from the config is parsed. (No single quotes in it: the batch script carries it as one quoted word.)
CHECK_ENGINE_AND_MOUNTS = r"""
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
"""
TRIAL_START = r"""out=$("$@" 2>&1) && exit 0
rlimits=(cpu fsize data stack core rss nproc nofile memlock as locks sigpending msgqueue nice rtprio rttime)
if [[ $out =~ rlimit\ type\ ([0-9]+) ]]; then limit=${rlimits[${BASH_REMATCH[1]}]}
elif [[ $out =~ RLIMIT_([A-Z]+) ]]; then limit=${BASH_REMATCH[1],,}
fi
[ -z "${limit:-}" ] || fail "$engine cannot set the $limit limit here (higher than this node lets it):" \
  "set container.ulimits.$limit lower, e.g. --set container.ulimits.$limit=N:N"
fail "the container does not start ($(last "$out")): check container.image, container.python and container.extra_args"
"""


def node_check_script(image_check: str) -> str:
    """The bash of the per-node check with an engine's own lines."""
    return CHECK_ENGINE_AND_MOUNTS + image_check + TRIAL_START


def node_check(cfg: Config) -> list[str] | None:
    """argv of the per-node check (bash: the engine, the mount sources, the engine's own check of the image, then a
    trial start that imports the project with the container's Python); None where the engine has none (no
    container, or an engine that reports its own errors)."""
    c, engine = cfg.container, engine_of(cfg.container)
    if engine.image_check is None:
        return None
    _, argv = command(cfg)
    assert c.image is not None  # submit.resolve_config refuses a runtime without an image
    return [
        "bash",
        "-c",
        node_check_script(engine.image_check),
        "flux-train-check",
        engine.name,
        c.image,
        *dict.fromkeys(m.src for m in mounts(cfg)),
        "--",
        *argv,
        "-c",
        TRIAL_IMPORT,
    ]
