"""A real two-node Slurm on loopback for the launcher tests: slurmctld and two slurmd daemons as nodes n1 and
n2 on 127.0.0.1, auth/none, 4 fake GPUs (gres files) per node, and the fast requeue settings. What node n2
cannot see: `cluster.not_on_n2`, a folder that n2's daemon (and so every job process on n2) sees empty, as a
node that lacks a mount would (a tmpfs over it in n2's mount namespace). Where slurmctld
is not installed the tests skip, except in CI (.ci/run installs Debian's packages), where they fail.

The machine is left as it was found, also when the run is interrupted: the daemons see an /etc/hosts where
n1 and n2 resolve through a bind mount in their own mount namespace (the machine's file is never written),
they die with the test process (PR_SET_PDEATHSIG), and SIGTERM, like Ctrl-C, ends the session through the
fixture's teardown, which cancels the jobs, waits for their processes, and stops the daemons and anything of the
jobs that outlived them by pid."""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from processes import parent, pids_with_env

NODES = ("n1", "n2")
HOSTS = Path("/etc/hosts")
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what}: not reached within {timeout:.0f} s")


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []
        self.not_on_n2 = root / "not-on-n2"

    def _write_config(self) -> None:
        r, host = self.root, socket.gethostname().split(".")[0]
        for name in ("state", "log", *[f"spool/slurmd-{n}" for n in NODES]):
            (r / name).mkdir(parents=True, exist_ok=True)
        for g in range(4):
            (r / f"fakegpu{g}").touch()  # without device files slurmd reports 0 GPUs and the node is invalid
        (r / "gres.conf").write_text(f"Name=gpu File={r}/fakegpu[0-3]\n")
        lines = [
            "ClusterName=fluxtest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/none",
            "CredType=cred/none",
            # cred_expire and the 1 s scheduler intervals make a requeued job start again in ~15 s, not ~136 s
            "AuthInfo=cred_expire=10",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1,sched_interval=1",
            "MpiDefault=none",
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            "ReturnToService=2",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmdSpoolDir={r}/spool/slurmd-%n",
            f"StateSaveLocation={r}/state",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "KillWait=5",
            "SlurmdParameters=config_overrides",
            "GresTypes=gpu",
        ]
        lines += [
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs=16 "
            f"RealMemory=64000 Gres=gpu:4 State=UNKNOWN"
            for n in NODES
        ]
        lines.append(f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _daemon(self, *argv: str, log: str, hide: Path | None = None) -> None:
        # in a private mount namespace with our hosts file over /etc/hosts (and an empty tmpfs over `hide`);
        # killed when the test process dies
        hosts = self.root / "hosts"
        hosts.write_text(HOSTS.read_text().rstrip("\n") + f"\n127.0.0.1 {' '.join(NODES)}\n")
        hiding = f"mount -t tmpfs none {shlex.quote(str(hide))} && " if hide else ""
        wrapped = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "bash",
            "-c",
            f'mount --bind "$0" /etc/hosts && {hiding}exec "$@"',
            str(hosts),
            *argv,
        ]
        with open(self.root / "log" / log, "w") as out:
            self.procs.append(
                subprocess.Popen(
                    wrapped, stdout=out, stderr=subprocess.STDOUT, env=self.env, preexec_fn=_die_with_parent
                )
            )

    def start(self) -> None:
        self._write_config()
        self._daemon("slurmctld", "-D", "-f", str(self.conf), log="slurmctld.out")
        wait_for(lambda: self.run("scontrol", "ping", check=False).returncode == 0, 20, "slurmctld ping")
        self.not_on_n2.mkdir()
        for n in NODES:
            self._daemon(
                "slurmd",
                "-D",
                "-N",
                n,
                "-f",
                str(self.conf),
                log=f"slurmd-{n}.out",
                hide=self.not_on_n2 if n == "n2" else None,
            )
        wait_for(
            lambda: self.run("sinfo", "-h", "-o", "%D", "-t", "idle").stdout.strip() == str(len(NODES)),
            30,
            "both nodes idle",
        )

    def job_processes(self) -> list[int]:
        """What runs for this cluster's jobs (slurmstepd, the job's own processes): all have our SLURM_CONF, and
        neither are the daemons nor their own helpers (slurmctld's slurmscriptd)."""
        daemons = {os.getpid(), *(proc.pid for proc in self.procs)}
        return [
            pid for pid in pids_with_env(SLURM_CONF=str(self.conf)) if pid not in daemons and parent(pid) not in daemons
        ]

    def stop(self) -> None:
        jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if jobs:
            self.run("scancel", *jobs, check=False)
        try:  # a slurmstepd reports to the daemons before it exits: stopping them first would strand it
            wait_for(
                lambda: (
                    not self.run("squeue", "-h", "-o", "%i", check=False).stdout.split() and not self.job_processes()
                ),
                60,
                "the jobs' processes to end",
            )
        except TimeoutError:
            pass
        for proc in reversed(self.procs):  # the slurmd daemons, then slurmctld, by pid
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in self.job_processes():  # whatever still outlived them, by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def run(self, *argv: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            argv, env={**self.env, **(env or {})}, capture_output=True, text=True, check=check, timeout=30
        )

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (finished jobs stay visible for MinJobAge, 300 s)."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait_job(self, job_id: str, timeout: float, restarts: int = 0) -> dict[str, str]:
        """Until the job ends (after at least `restarts` requeues); returns its last `scontrol` record."""

        def ended():
            info = self.job(job_id)
            done = info.get("JobState") in TERMINAL and int(info.get("Restarts", 0)) >= restarts
            return info if done else None

        return wait_for(ended, timeout, f"job {job_id} end", interval=1.0)


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # pytest then runs the fixtures' teardown, as on Ctrl-C


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    if shutil.which("slurmctld") is None:
        if os.environ.get("CI"):
            pytest.fail("slurmctld is not installed; .ci/run installs Debian's slurmctld, slurmd and slurm-client")
        pytest.skip("Slurm is not installed (apt-get install slurmctld slurmd slurm-client)")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    saved_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)  # for submit subprocesses and submitit's sbatch calls
    saved_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, saved_term)
        if saved_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved_conf
