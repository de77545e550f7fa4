"""`python -m flux_train.submit` on a real two-node Slurm (tests/support/slurm_cluster.py), one podman or apptainer
container per node (tests/support/containers.py): a run to the end on both nodes, a requeue on Slurm's USR2 that resumes
exactly where the checkpoint was, a killed worker ending the whole job, each node's container check; and the
plain sbatch script with the project in a virtualenv. Then operations, without containers: a stopped worker
named within the collective timeout, a non-finite step stopping the run there, a campaign of three scored runs,
and the pre-flight refusing a node that lacks the dataset. CPU only: the "GPUs" are gloo worker processes and the
GPU gres files are fake."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from processes import pid_with_env, pids_with_env
from run_outputs import events, metrics
from slurm_cluster import TERMINAL, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "configs/systems/cpu_02x02.yaml"
ENGINES = pytest.mark.parametrize("engine", ["podman", "apptainer"], indirect=True)


def submit(tmp_path: Path, *args: str, env: dict | None = None, config: str = SYSTEM) -> str:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flux_train.cluster.submit",
            "--config",
            config,
            "--nodes",
            "2",
            "--set",
            f"logging.out_dir={tmp_path}/out",
            "--set",
            f"slurm.folder={tmp_path}/submitit/%j",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    job = re.search(r"submitted job (?:array )?(\d+)", out.stdout).group(1)
    first = f"{job}_0" if "job array" in out.stdout else job
    assert f"log folder: {tmp_path}/submitit/{first}" in out.stdout and "tail -F" in out.stdout
    return job


def mllog(tmp_path: Path) -> list[dict]:
    return events(tmp_path / "out")


def node_logs(tmp_path: Path, job: str) -> dict[int, str]:
    folder = tmp_path / "submitit" / job
    return {
        node: "".join(
            (folder / f"{job}_{node}_log.{ext}").read_text(errors="replace")
            for ext in ("out", "err")
            if (folder / f"{job}_{node}_log.{ext}").is_file()
        )
        for node in (0, 1)
    }


def wait_run_start(cluster, job: str, tmp_path: Path) -> None:
    def started() -> bool:
        assert cluster.job(job).get("JobState") not in TERMINAL, node_logs(tmp_path, job)
        return any(e["key"] == "run_start" for e in mllog(tmp_path))

    wait_for(started, 150, "run_start in the MLLOG")


def namespace(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def is_agent(pid: int) -> bool:
    """submitit's entry point in Python (not the engine's client, whose arguments name it too)."""
    try:
        return b"submitit.core._submit" in Path(f"/proc/{pid}/cmdline").read_bytes() and Path(
            f"/proc/{pid}/comm"
        ).read_text().startswith("python")
    except OSError:  # it has just exited
        return False


def assert_one_container_per_node(cluster, job: str) -> None:
    """Each node's agent runs in a mount namespace of its own, neither the machine's nor its slurmd's."""
    agents = [pid for pid in pids_with_env(SLURM_JOB_ID=job) if is_agent(pid)]
    outside = {namespace(pid, "mnt") for pid in [os.getpid(), *(p.pid for p in cluster.procs)]}
    inside = {namespace(pid, "mnt") for pid in agents}
    assert len(agents) == 2 and len(inside) == 2 and not inside & outside, (agents, inside, outside)


def assert_nothing_left(job: str) -> None:
    """No process of the job outlives it: containers, agents and workers are gone."""
    wait_for(lambda: not pids_with_env(SLURM_JOB_ID=job), 60, f"the processes of job {job} to end")


@ENGINES
def test_two_nodes_train_to_the_end(slurm_cluster, engine, tmp_path):
    job = submit(tmp_path, *engine.args(tmp_path), env=engine.env())
    wait_run_start(slurm_cluster, job, tmp_path)
    assert_one_container_per_node(slurm_cluster, job)
    info = slurm_cluster.wait_job(job, timeout=240)
    logs = node_logs(tmp_path, job)
    assert info["JobState"] == "COMPLETED", logs
    assert info["NodeList"] == "n[1-2]"
    # the launcher's rendezvous report: each Slurm node joined as its own group rank, 2 workers each
    for node, ranks in ((0, "[0, 1]"), (1, "[2, 3]")):
        assert f"[launch node {node}/2 n{node + 1}]" in logs[node]
        assert f"group_rank={node}" in logs[node]
        assert "group_world_size=2" in logs[node] and f"global_ranks={ranks}" in logs[node]
        assert "workers finished" in logs[node]
    assert re.search(r"flux-train: flux-debug .* world 4,", logs[0])
    events = mllog(tmp_path)
    assert events[-1]["key"] == "run_stop" and events[-1]["metadata"]["status"] in ("success", "aborted")
    assert [e["key"] for e in events].count("eval_accuracy") >= 1
    assert_nothing_left(job)
    assert not list(ROOT.glob("matplotlib-*"))  # nothing left in the submit directory (matplotlib's fallback)


STEPS, GBS = 30, 4
PREEMPTED_RUN = [
    "--set",
    f"train.global_batch_size={GBS}",
    "--set",
    f"train.max_steps={STEPS}",
    "--set",
    "eval.every_steps=15",
]


@pytest.fixture(scope="module")
def uninterrupted_losses(tmp_path_factory) -> dict[int, float]:
    """The preemption test's run without a preemption: the same 2 ranks, on one node (--local, no container)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "flux_train.cluster.submit",
            "--local",
            "--config",
            SYSTEM,
            "--nodes",
            "1",
            "--gpus-per-node",
            "2",
            *PREEMPTED_RUN,
            "--set",
            f"logging.out_dir={out}",
            "--set",
            f"slurm.folder={out}/sub/%j",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {m["step"]: m["loss"] for m in metrics(out) if "loss" in m}


@ENGINES
def test_preemption_requeues_and_resumes_exactly(slurm_cluster, engine, tmp_path, uninterrupted_losses):
    job = submit(tmp_path, *engine.args(tmp_path), "--gpus-per-node", "1", *PREEMPTED_RUN, env=engine.env())
    wait_run_start(slurm_cluster, job, tmp_path)
    slurm_cluster.run("scancel", "--signal=USR2", job)  # what Slurm sends signal_delay_s before the limit
    info = slurm_cluster.wait_job(job, timeout=300, restarts=1)
    logs = node_logs(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", logs
    assert "flux-train: requeueing job" in logs[0]
    for node in (0, 1):
        assert "got SIGUSR2" in logs[node] and "asked the batch script to requeue the job" in logs[node]
        assert f"job {job}, restart 1:" in logs[node]
    saved = re.search(r"saved checkpoint \S+/step_(\d+)", logs[0])
    resumed = re.search(r"resumed from \S+/step_(\d+) at step (\d+)", logs[0])
    assert saved and resumed, logs[0]
    assert saved.group(1) == resumed.group(1) and 0 < int(resumed.group(2)) < STEPS
    # every step once, with the losses of the same run without the preemption
    losses = [(m["step"], m["loss"]) for m in metrics(tmp_path / "out") if "loss" in m]
    assert [step for step, _ in losses] == list(range(1, STEPS + 1))
    for step, loss in losses:
        assert loss == pytest.approx(uninterrupted_losses[step], rel=1e-6, abs=1e-7), step
    events = mllog(tmp_path)
    keys = [e["key"] for e in events]
    assert keys.count("run_start") == 1  # one run, continued: not started again from step 0
    assert keys[-1] == "run_stop" and events[-1]["metadata"]["samples_count"] == STEPS * GBS
    assert_nothing_left(job)


@ENGINES
def test_dead_worker_ends_the_job_naming_its_rank(slurm_cluster, engine, tmp_path):
    """A worker killed on node 1 ends both nodes quickly, and node 1 names it: rank, host, and its pid as the
    agent sees it (in podman's pid namespace)."""
    job = submit(
        tmp_path,
        *engine.args(tmp_path),
        "--set",
        "train.max_steps=100000",
        "--set",
        "eval.enabled=false",
        env=engine.env(),
    )
    wait_run_start(slurm_cluster, job, tmp_path)
    pid = wait_for(lambda: pid_with_env(TORCHELASTIC_RUN_ID=f"flux-{job}-0", RANK=3), 10, "worker rank 3")
    status = Path(f"/proc/{pid}/status").read_text()
    seen = next(line.split()[-1] for line in status.splitlines() if line.startswith("NSpid:"))
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    info = slurm_cluster.wait_job(job, timeout=60)
    assert time.monotonic() - killed < 45
    logs = node_logs(tmp_path, job)
    assert info["JobState"] == "FAILED", logs
    assert f"worker rank 3 (local rank 1, pid {seen}) on n2 failed: killed by SIGKILL" in logs[1]
    assert_nothing_left(job)


@pytest.mark.parametrize("engine", ["podman"], indirect=True)
def test_each_node_checks_its_container_first(slurm_cluster, engine, tmp_path):
    """An image that is not on the nodes: every node says so, naming itself and the fix, and the job ends."""
    job = submit(
        tmp_path, *engine.args(tmp_path), "--container-image", "localhost/flux-train-ci:nowhere", env=engine.env()
    )
    info = slurm_cluster.wait_job(job, timeout=60)
    logs = node_logs(tmp_path, job)
    assert info["JobState"] == "FAILED", logs
    for node in ("n1", "n2"):  # the check step's output is in the batch script's log: node 0's
        assert (
            f"flux-train: error: node {node}: image localhost/flux-train-ci:nowhere is not in the podman image "
            f"store here: build or load it on every node (podman load -i FILE), or fix container.image"
        ) in logs[0]
    assert "[launch node" not in logs[0] + logs[1]  # no agent started


def test_hostile_values_reach_slurm_whole(slurm_cluster, tmp_path):
    """A job whose #SBATCH values hold quotes, $(...), backticks, ';', '#', '%' and a leading '-', as Slurm's own
    sbatch reads them: each value whole and nothing run, and none of the directives after them dropped (requeue,
    time and nodes sort after the job name and the comment). The job is held: it never starts."""
    canary = tmp_path / "canary"
    evil = f'x\'; touch {canary}; "$(touch {canary})" `touch {canary}` # 100%j ✓'
    additional = json.dumps({"hold": "true", "comment": evil})
    job = submit(
        tmp_path,
        f"--job-name={evil}",
        f"--account=-x$(touch {canary})",
        "--time=7",
        "--set",
        f"slurm.additional={additional}",
    )
    shown = slurm_cluster.run("squeue", "-h", "-j", job, "-o", "%j|%a|%k").stdout.rstrip("\n")
    assert shown == f"{evil}|-x$(touch {canary})|{evil}"
    info = slurm_cluster.job(job)
    assert (info["JobState"], info["Reason"], info["Requeue"]) == ("PENDING", "JobHeldUser", "1")
    assert info["TimeLimit"] == "00:07:00" and info["NumNodes"] == "2-2"
    slurm_cluster.run("scancel", job)
    assert not canary.exists()


NO_PYTHON = {"FLUX_PYTHON": "", "VIRTUAL_ENV": "", "CONDA_PREFIX": ""}  # what the script would pick
DECOY_PYTHON = '#!/bin/sh\necho decoy >> "$(dirname "$0")/called"\nexit 1\n'


@pytest.fixture
def decoy_path(tmp_path) -> str:
    """A PATH whose python3 is not the project's interpreter (it fails, and records that it was called)."""
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "python3").write_text(DECOY_PYTHON)
    (decoy / "python3").chmod(0o755)
    return f"{decoy}:/usr/local/bin:/usr/bin:/bin"


def sbatch(cluster, tmp_path: Path, env: dict) -> tuple[dict, str]:
    out = cluster.run(
        "sbatch",
        "--parsable",
        "--nodes=2",
        "--time=10",
        f"--output={tmp_path}/%j.out",
        "slurm/flux.sbatch",
        "--config",
        SYSTEM,
        "--set",
        "slurm.gpus_per_node=1",
        "--set",
        "train.global_batch_size=4",
        "--set",
        "train.max_steps=4",
        "--set",
        "eval.enabled=false",
        "--set",
        f"logging.out_dir={tmp_path}/out",
        env=env,
    )
    job = out.stdout.strip().split(";")[0]
    info = cluster.wait_job(job, timeout=180)
    return info, (tmp_path / f"{job}.out").read_text()


def test_plain_sbatch_runs_the_virtualenvs_python(slurm_cluster, tmp_path, decoy_path, virtualenv):
    """Submitted with the virtualenv active (VIRTUAL_ENV set) but a PATH that leads elsewhere, as after a
    site's login profile: the job runs the virtualenv's interpreter on both nodes."""
    info, log = sbatch(slurm_cluster, tmp_path, {**NO_PYTHON, "PATH": decoy_path, "VIRTUAL_ENV": str(virtualenv)})
    assert info["JobState"] == "COMPLETED", log
    assert "[launch node 0/2 n1]" in log and "[launch node 1/2 n2]" in log
    assert mllog(tmp_path)[-1]["key"] == "run_stop"
    assert not (Path(decoy_path.split(":")[0]) / "called").exists()


def test_plain_sbatch_without_the_projects_python_says_so(slurm_cluster, tmp_path, decoy_path):
    info, log = sbatch(slurm_cluster, tmp_path, {**NO_PYTHON, "PATH": decoy_path})
    assert info["JobState"] == "FAILED"
    assert (
        "flux-train: error: python3 cannot import torch and flux_train: submit with the virtualenv the project is "
        "installed in active, or set FLUX_PYTHON to its interpreter"
    ) in log


@pytest.fixture(scope="session")
def virtualenv(tmp_path_factory) -> Path:
    """A virtualenv with the project: this interpreter's, or else a new one that sees this interpreter's packages."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix)
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    return venv


# ------------------------------------------------------------------------------------------------ operations


def node_line(logs: dict[int, str], pattern: str) -> str:
    found = [m.group(0) for log in logs.values() for m in re.finditer(pattern, log)]
    assert found, (pattern, logs)
    return found[0]


def test_a_stopped_worker_ends_the_job_naming_its_rank_and_node(slurm_cluster, tmp_path):
    timeout_s = 20
    job = submit(
        tmp_path,
        "--set",
        "train.max_steps=100000",
        "--set",
        "eval.enabled=false",
        "--set",
        f"parallel.timeout_s={timeout_s}",
    )
    wait_run_start(slurm_cluster, job, tmp_path)
    pid = wait_for(lambda: pid_with_env(TORCHELASTIC_RUN_ID=f"flux-{job}-0", RANK=3), 10, "worker rank 3")
    os.kill(pid, signal.SIGSTOP)  # alive, silent, holding every collective
    stopped = time.monotonic()
    try:
        info = slurm_cluster.wait_job(job, timeout=timeout_s + 180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert time.monotonic() - stopped < timeout_s + 180
    logs = node_logs(tmp_path, job)
    assert info["JobState"] == "FAILED", logs
    assert "rank 3 on n2 has been silent" in node_line(logs, r"collective failed on rank \d+ .*"), logs
    assert_nothing_left(job)


def test_a_non_finite_step_stops_the_run_at_that_step_keeping_the_last_checkpoint(slurm_cluster, tmp_path):
    job = submit(
        tmp_path,
        "--set",
        "train.max_steps=20",
        "--set",
        "eval.enabled=false",
        "--set",
        "logging.log_every=1",
        "--set",
        "checkpoint.every_steps=2",
        "--set",
        "train.inject_nan_at_step=5",
    )
    info = slurm_cluster.wait_job(job, timeout=180)
    logs = node_logs(tmp_path, job)
    assert info["JobState"] == "FAILED", logs  # the workers exit with 3: a diverged run is no success
    line = node_line(logs, r"flux-train: stopped: the loss or gradient norm was not finite at step \d+; .*")
    assert "at step 5;" in line and f"{tmp_path}/out/checkpoints/step_00000004" in line, line
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())[-1] == "step_00000004"
    stop = mllog(tmp_path)[-1]
    assert stop["key"] == "run_stop" and stop["metadata"]["status"] == "aborted"


def test_a_campaign_of_three_runs_trains_each_and_is_scored(slurm_cluster, tmp_path):
    """--runs 3: one job array, three seeds, three run folders; the local debug run, which reaches the target in
    about 150 steps, on two nodes in each."""
    job = submit(
        tmp_path,
        "--runs",
        "3",
        "--gpus-per-node",
        "1",
        "--set",
        "train.micro_batch_size=4",
        "--set",
        "logging.progress_bar=false",
        config="configs/debug.yaml",
    )
    for task in range(3):
        info = slurm_cluster.wait_job(f"{job}_{task}", timeout=400)
        assert info["JobState"] == "COMPLETED", node_logs(tmp_path, f"{job}_{task}")
    seeds = [
        yaml.safe_load((tmp_path / "out" / f"run_{i}" / "config.yaml").read_text())["train"]["seed"] for i in range(3)
    ]
    assert seeds[1] == seeds[0] + 1 and seeds[2] == seeds[0] + 2
    done = subprocess.run(
        [sys.executable, "-m", "flux_train.outputs.results", str(tmp_path / "out"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    summary = json.loads(done.stdout)
    assert [r["status"] for r in summary["runs"]] == ["success"] * 3, summary
    assert summary["score"]["minutes"] is not None and summary["score"]["averaged"] == 1, summary  # olympic mean of 3
    assert (tmp_path / "out" / "val_loss.png").is_file()


def test_preflight_names_the_node_without_the_dataset_and_nothing_trains(slurm_cluster, tmp_path):
    data = slurm_cluster.not_on_n2 / tmp_path.name
    subprocess.run(
        [sys.executable, "-m", "dataprep", "fixture", "--out", str(data)], check=True, timeout=120, capture_output=True
    )
    job = submit(tmp_path, "--set", "data.source=energon", "--set", f"data.path={data}")
    info = slurm_cluster.wait_job(job, timeout=120)
    logs = node_logs(tmp_path, job)
    assert info["JobState"] == "FAILED", logs
    line = node_line(logs, r"pre-flight: n2: .*")
    assert f"dataset {data} is not readable here" in line and "--exclude n2" in line, line
    assert "pre-flight: n1" not in logs[0] + logs[1]
    assert "init_start" not in "".join(logs.values()) and not mllog(tmp_path)
