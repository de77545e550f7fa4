"""Per-node agent: one per node (one Slurm task per node), inside the container when there is one.

    python -m flux_train.cluster.launch --config CONFIG [--set section.key=value ...] [--local]

flux_train.cluster.submit runs the same agent through submitit (NodeAgent); slurm/flux.sbatch runs this command.
In order: export the environment profile (slurm/env/<profile>.env, socket interface, IB HCAs, env.vars;
a variable already set in the job's environment is kept), point the compile caches at node-local disk,
optionally run slurm/runtime_tunables.sh, then start one worker per GPU with torch's elastic launcher
(static rendezvous on the job's first host: Slurm's node N is group rank N) running
`python -m flux_train.cluster.worker` (the trainer). A failed worker ends this node with its rank, host and cause
in the log; srun's --kill-on-bad-exit then ends the other nodes.

Preemption and time limits (the contract: flux_train.training.preemption): Slurm's warning signal reaches this agent,
which passes it on to its workers; they save a checkpoint and exit with preemption.EXIT_CODE; the agent then
creates the flag file that the batch script's teardown turns into `scontrol requeue` on the host. SIGTERM
(scancel, the end of the time limit) goes on to the workers as well, and the agent exits with 143.
"""

from __future__ import annotations

import enum
import logging
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable

from flux_train.cli import launch_parser
from flux_train.config import Config, ConfigError, checkpoint_dir, load_config, validate
from flux_train.errors import reports_user_errors
from flux_train.masking import mask_env
from flux_train.training.preemption import EXIT_CODE as PREEMPTED_EXIT_CODE
from flux_train.training.preemption import REQUEUE_FLAG_ENV, SIGNAL

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "slurm" / "env"
TUNABLES = REPO / "slurm" / "runtime_tunables.sh"
IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
LOCAL_JOB_ID_ENV = "FLUX_LOCAL_JOB_ID"
# scratch folders that belong to this node: a value inherited from the submitting shell (a login node's path,
# or the /tmp default torch writes into its own process's environment) is replaced; env.vars can still set them
NODE_LOCAL_VARS = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "MPLCONFIGDIR")
# the agent's pid, in its workers' environment: each worker ends when the agent does (flux_train.cluster.worker)
AGENT_PID_ENV = "FLUX_AGENT_PID"
VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class WorkerFailure(RuntimeError):
    """A worker died; the message names its rank, host and cause."""


class NodeStatus(str, enum.Enum):
    """How a node's workers ended without failing: what run_node returns (and a submitit job's result)."""

    FINISHED = "finished"  # every worker exited 0
    REQUEUED = "requeued"  # saved a checkpoint on Slurm's warning signal; the batch script requeues the job
    PREEMPTED = "preempted"  # saved a checkpoint and stopped, with no requeue: the same command continues it
    TERMINATED = "terminated"  # stopped by SIGTERM (scancel, the time limit)


@dataclass(frozen=True)
class Node:
    """Where this agent runs in the job."""

    job_id: str
    rank: int  # Slurm's node id
    count: int
    host: str  # this node's Slurm name; it must resolve on every node
    master: str  # the job's first host: it runs the rendezvous store
    restarts: int  # SLURM_RESTART_COUNT: how often the job was requeued

    @classmethod
    def detect(cls, local: bool = False) -> "Node":
        if local or "SLURM_JOB_ID" not in os.environ:
            # submit --local names the job (its folder has the id); an agent started by hand names its own
            return cls(os.environ.get(LOCAL_JOB_ID_ENV, f"local-{os.getpid()}"), 0, 1, "127.0.0.1", "127.0.0.1", 0)
        # submitit expands SLURM_JOB_NODELIST itself: no scontrol needed inside a container
        from submitit.slurm.slurm import SlurmJobEnvironment

        env = SlurmJobEnvironment()
        hosts = env.hostnames
        return cls(
            env.job_id,
            env.node,
            env.num_nodes,
            hosts[env.node],
            hosts[0],
            int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        )

    def port(self, configured: int) -> int:
        if self.count == 1:
            return free_port()  # no other node needs to know it
        # 0: the same port on every node, different across jobs, below Linux's ephemeral ports (32768-60999),
        # where no outgoing connection can hold it
        return configured or random.Random(self.job_id).randint(20000, 32767)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def log(node: Node, message: str) -> None:
    print(f"[launch node {node.rank}/{node.count} {node.host}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------
# environment


def read_profile(name: str) -> dict[str, str]:
    """slurm/env/<name>.env: NAME=VALUE lines, # comments; values are taken literally."""
    if name == "none":
        return {}
    path = PROFILES / f"{name}.env"
    out = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.isidentifier():
            raise ConfigError(f"{path}:{number}: expected NAME=VALUE, got {line!r}")
        out[key] = value
    return out


def check_variable_names(names, key: str) -> None:
    """Refuse what cannot be one environment variable's name (`A=B` would set A; the environment refuses it)."""
    for name in names:
        if not VARIABLE_NAME.fullmatch(name):
            raise ConfigError(
                f"{key}: {name!r} is not a variable name (letters, digits and '_', not starting with a digit); "
                "rename or remove it"
            )


def env_vars(cfg: Config) -> dict[str, str]:
    """env.vars, checked: names an environment can hold, values without a NUL character."""
    check_variable_names(cfg.env.vars, "env.vars")
    for name, value in cfg.env.vars.items():
        if "\0" in value:
            raise ConfigError(f"env.vars.{name}: a NUL character cannot be in an environment variable; remove it")
    return cfg.env.vars


def wanted_env(cfg: Config, local_dir: Path) -> dict[str, str]:
    """What the config asks for, later entries winning: profile, interface/HCAs, caches, env.vars."""
    e = cfg.env
    wanted = read_profile(e.profile)
    if e.socket_ifname:
        wanted.update(dict.fromkeys(IFNAME_VARS, e.socket_ifname))
    if e.ib_hca:
        wanted["NCCL_IB_HCA"] = e.ib_hca
    # compile caches on a shared filesystem are slow and racy across nodes
    wanted["TRITON_CACHE_DIR"] = str(local_dir / "triton")
    wanted["TORCHINDUCTOR_CACHE_DIR"] = str(local_dir / "inductor")
    # matplotlib (the run report) falls back to a temporary folder in the working directory, the submit
    # directory, when $HOME and /tmp are read-only, as in a container
    wanted["MPLCONFIGDIR"] = str(local_dir / "matplotlib")
    wanted.update(env_vars(cfg))
    return wanted


def default_route_ifname() -> str:
    for line in Path("/proc/net/route").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) > 1 and fields[1] == "00000000":
            return fields[0]
    raise ConfigError("env.socket_ifname=auto: this node has no default route; name the interface instead")


def export_env(wanted: dict[str, str], environ=os.environ) -> tuple[dict[str, str], dict[str, str]]:
    """Export each variable the job's environment does not already set (node-local scratch folders always);
    returns (exported, kept)."""
    exported, kept = {}, {}
    for key, value in wanted.items():
        if key in environ and key not in NODE_LOCAL_VARS:
            kept[key] = environ[key]
            continue
        if key in IFNAME_VARS and value == "auto":
            value = default_route_ifname()
        environ[key] = exported[key] = value
    return exported, kept


def run_tunables(node: Node) -> None:
    """Optional host tuning; each step reports itself and none of them stops the job."""
    result = subprocess.run(["bash", str(TUNABLES)], capture_output=True, text=True)
    for line in (result.stdout + result.stderr).splitlines():
        log(node, f"runtime_tunables: {line}")
    if result.returncode:
        log(node, f"runtime_tunables.sh exited with {result.returncode}; continuing")


def write_job_config(cfg: Config, path: Path) -> None:
    """The resolved config for an agent or its workers to read, with its real values (env.vars may hold
    secrets): readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file written before keeps its mode through O_CREAT
    with open(fd, "w") as out:
        out.write(cfg.to_yaml())


def local_dir_for(cfg: Config, node: Node) -> Path:
    base = cfg.env.local_dir or os.environ.get("TMPDIR") or "/tmp"
    return Path(base) / f"flux-train-{node.job_id}-node{node.rank}"


# ---------------------------------------------------------------------------------------------------
# Slurm's warning signal


def _children(parent: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                pids.append(int(entry))
    return pids


def _catches(pid: int, signum: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(mask, 16) >> (signum - 1) & 1)


class SignalRelay:
    """Passes Slurm's USR2 and TERM on to this node's workers (each in its own session, so Slurm's signal
    misses them), once per worker and signal, including workers started after the signal came.

    No Python code runs in signal context: CPython's C-level handler writes the signal's number to a
    wake-up pipe (signal.set_wakeup_fd), in whichever thread the kernel interrupts, and this object's thread
    reads the pipe and does the rest. So a second signal arriving during the first (Slurm's signal can come
    twice, directly and through the container's starter) cannot block, and the main thread may be stuck
    anywhere. USR2 goes only to workers that have installed their handler (before that it would kill them);
    TERM goes to every worker, and the elastic agent then sees them stop. On exit the previous handlers come
    back, except USR2's, which is ignored from then on: a late USR2 must not reach submitit's handler and
    requeue a finished job."""

    SIGNALS = (SIGNAL, signal.SIGTERM)

    def __init__(self, node: Node):
        self.node = node
        self.received: set[int] = set()  # read by the main thread once the workers are gone
        # the handlers signal.signal gives back: a function, SIG_DFL or SIG_IGN, or None (one not set from Python)
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        self._thread = threading.Thread(target=self._relay, daemon=True)

    def __enter__(self) -> "SignalRelay":
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._thread.start()
        self._previous_wakeup = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        for signum in self.SIGNALS:
            # replaces submitit's USR2 handler, which would requeue at once instead of waiting for the checkpoint
            self._previous[signum] = signal.signal(signum, _wake_only)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_IGN if signum == SIGNAL else previous)
        signal.set_wakeup_fd(self._previous_wakeup)
        os.close(self._write)  # the thread reads end-of-file and stops
        self._thread.join()
        os.close(self._read)

    def _relay(self) -> None:
        sent: dict[int, set[int]] = {}  # signal -> the workers it went to
        while True:
            if select.select([self._read], [], [], 0.2 if sent else None)[0]:
                data = os.read(self._read, 64)
                if not data:
                    return
                for signum in data:
                    if signum not in self.SIGNALS:  # the wake-up pipe gets every signal with a Python handler
                        continue
                    name = signal.Signals(signum).name
                    if signum in sent:
                        log(self.node, f"got {name} again: already passing it to the workers")
                        continue
                    log(self.node, f"got {name} ({WHY[signum]}): passing it to the workers")
                    sent[signum] = set()
                    self.received.add(signum)
            for signum, pids in sent.items():
                for pid in _children(os.getpid()):
                    if pid not in pids and (signum != SIGNAL or _catches(pid, signum)):
                        try:
                            os.kill(pid, signum)
                        except ProcessLookupError:
                            continue
                        pids.add(pid)


def _wake_only(signum, frame) -> None:
    """A Python-level handler, so that CPython's own handler runs and writes to the wake-up pipe."""


WHY = {SIGNAL: "preemption or time limit", signal.SIGTERM: "the job is ending"}


# ---------------------------------------------------------------------------------------------------
# workers


def launch_config(cfg: Config, node: Node, worker_logs: Path):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=node.count,
        max_nodes=node.count,
        nproc_per_node=cfg.slurm.gpus_per_node,
        run_id=f"flux-{node.job_id}-{node.restarts}",
        role="flux",
        # Slurm fixes the nodes and their order: node N is group rank N, and the first node's agent hosts the
        # store (the workers' too). Unlike c10d's dynamic rendezvous, nothing polls the store while the
        # workers run, so a node whose workers stop later does not fail when the first node's agent is gone.
        rdzv_backend="static",
        rdzv_endpoint=f"{node.master}:{node.port(cfg.env.master_port)}",
        rdzv_configs={"rank": node.rank},
        max_restarts=0,  # fail fast: recovery is Slurm's requeue plus the checkpoint, not an in-job restart
        signals_to_handle="SIGINT,SIGHUP,SIGQUIT",  # not SIGTERM: SignalRelay passes it on
        logs_specs=DefaultLogsSpecs(log_dir=str(worker_logs), tee=Std.ALL),
        log_line_prefix_template="[rank${rank}]:",
    )


def worker_args(config_file: Path) -> list[str]:
    return ["-u", "-m", "flux_train.cluster.worker", "--config", str(config_file)]


def describe_failure(err, host: str, worker_logs: Path) -> str:
    """ChildFailedError -> one line per failed worker (the first to fail first) and its stderr tail."""
    first_rank = err.get_first_failure()[0]
    lines = []
    for rank, failure in sorted(err.failures.items(), key=lambda item: item[0] != first_rank):
        cause = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        lines.append(
            f"worker rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) on {host} failed: {cause}"
        )
        # the launcher's layout: <log_dir>/<run id>_<random>/attempt_<n>/<local rank>/stderr.log
        for stderr in worker_logs.glob(f"*/attempt_*/{failure.local_rank}/stderr.log"):
            lines += ["    " + line for line in stderr.read_text(errors="replace").splitlines()[-15:]]
    return "\n".join(lines)


def stopped_for_requeue(err) -> bool:
    """Workers that saved a checkpoint exit with PREEMPTED_EXIT_CODE; the launcher may SIGTERM the slower
    ones of the node as soon as the first has exited (the save itself is collective and complete)."""
    codes = {failure.exitcode for failure in err.failures.values()}
    return PREEMPTED_EXIT_CODE in codes and codes <= {PREEMPTED_EXIT_CODE, -signal.SIGTERM}


def request_requeue(cfg: Config, node: Node) -> NodeStatus:
    resume = cfg.checkpoint.resume
    if resume == "none":
        after = "checkpoint.resume=none: the next start begins again at step 0"
    elif resume == "auto":
        after = f"the next start resumes from the latest checkpoint in {checkpoint_dir(cfg)}"
    else:
        after = f"the next start resumes from {resume} (checkpoint.resume)"
    flag = os.environ.get(REQUEUE_FLAG_ENV)
    if not flag:
        log(
            node,
            f"workers saved a checkpoint and stopped; no requeue hook (${REQUEUE_FLAG_ENV} is unset: not "
            f"started by flux_train.cluster.submit or slurm/flux.sbatch): run the same command again; {after}",
        )
        return NodeStatus.PREEMPTED
    if node.restarts >= cfg.slurm.max_requeue:
        log(
            node,
            f"workers saved a checkpoint and stopped; not requeueing: the job was already requeued "
            f"{node.restarts} times (slurm.max_requeue={cfg.slurm.max_requeue})",
        )
        return NodeStatus.PREEMPTED
    Path(flag).touch()
    log(node, f"workers saved a checkpoint and stopped; asked the batch script to requeue the job; {after}")
    return NodeStatus.REQUEUED


class ElasticLog(logging.Filter):
    """torch-elastic's log of this node in the agent's words: its rendezvous report (a dozen INFO lines) as one line,
    its other INFO lines and the warnings that repeat the agent's own line (a signal passed on) dropped, any other
    warning or error kept."""

    REPEATS = ("Received %s death signal, shutting down workers", "Sending process %s closing signal %s")

    def __init__(self, node: Node):
        super().__init__()
        self.node = node

    def filter(self, record: logging.LogRecord) -> bool:
        result = record.args if isinstance(record.args, dict) else {}
        if "global_ranks" in result:  # "Rendezvous complete for workers. Result: ..." (flux_train/private_apis.py)
            keys = ("group_rank", "group_world_size", "global_ranks")
            log(self.node, "rendezvous: " + " ".join(f"{key}={result[key]}" for key in keys))
            return False
        return record.levelno > logging.INFO and record.msg not in self.REPEATS


ELASTIC_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")


def run_node(cfg: Config, local: bool = False) -> NodeStatus:
    """The whole per-node path; raises WorkerFailure when a worker failed. The node-local folder goes at the end
    (compile caches, worker logs, the job's config with its secrets), but for a requeue: the job comes back to it."""
    node = Node.detect(local)
    nproc = cfg.slurm.gpus_per_node
    validate(cfg, world_size=node.count * nproc, gpus_per_node=nproc)
    local_dir = local_dir_for(cfg, node)
    try:
        local_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"env.local_dir: cannot create {local_dir} on this node ({exc.strerror}); set env.local_dir (or $TMPDIR) "
            "to a writable node-local folder"
        ) from None
    status = None
    try:
        status = run_workers(cfg, node, local_dir)
        return status
    finally:
        if status is not NodeStatus.REQUEUED:
            shutil.rmtree(local_dir, ignore_errors=True)


def run_workers(cfg: Config, node: Node, local_dir: Path) -> NodeStatus:
    """This node's environment, then its workers, to their end."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    nproc = cfg.slurm.gpus_per_node
    restart = f", restart {node.restarts}" if node.restarts else ""
    log(
        node,
        f"job {node.job_id}{restart}: {nproc} workers per node x {node.count} nodes, rendezvous at "
        f"{node.master}, node-local dir {local_dir}",
    )
    exported, kept = export_env(wanted_env(cfg, local_dir))
    for key, value in mask_env(exported, cfg.env.masked_vars).items():
        log(node, f"export {key}={value}")
    for key, value in mask_env(kept, cfg.env.masked_vars).items():
        log(node, f"kept from the job's environment: {key}={value}")
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    if cfg.env.runtime_tunables:
        run_tunables(node)
    config_file = local_dir / "config.yaml"
    write_job_config(cfg, config_file)
    for logger in map(logging.getLogger, ELASTIC_LOGGERS):
        logger.setLevel(logging.INFO)  # the rendezvous report is at INFO
        for earlier in [f for f in logger.filters if isinstance(f, ElasticLog)]:  # an earlier node in this process
            logger.removeFilter(earlier)
        logger.addFilter(ElasticLog(node))
    worker_logs = local_dir / f"workers-{os.getpid()}"  # this start's own: a requeued job starts again
    with SignalRelay(node) as relay:
        try:
            elastic_launch(launch_config(cfg, node, worker_logs), sys.executable)(*worker_args(config_file))
        except ChildFailedError as err:
            if stopped_for_requeue(err):
                return request_requeue(cfg, node)
            if signal.SIGTERM in relay.received:
                log(node, "workers stopped on SIGTERM")
                return NodeStatus.TERMINATED
            message = describe_failure(err, node.host, worker_logs)
            log(node, message)
            raise WorkerFailure(message) from None
    log(node, "workers finished")
    return NodeStatus.FINISHED


class NodeAgent:
    """What submitit runs on each node. The resolved config travels in the job's pickle, so a requeued job
    runs exactly what was submitted."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def __call__(self) -> NodeStatus:
        return run_node(self.cfg)


@reports_user_errors
def main(argv=None) -> int:
    args = launch_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)  # a bad config is answered before torch loads
    from torch.distributed.elastic.multiprocessing import SignalException

    try:
        status = run_node(cfg, args.local)
    except WorkerFailure:
        return 1  # already logged
    except SignalException as exc:  # Ctrl-C, SIGHUP or SIGQUIT: the launcher has stopped the workers
        print(f"launch: stopped by {exc.sigval.name}; the workers were stopped", file=sys.stderr)
        return 128 + exc.sigval
    return 128 + signal.SIGTERM if status is NodeStatus.TERMINATED else 0


if __name__ == "__main__":
    sys.exit(main())
