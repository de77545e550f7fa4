"""`python -m flux_train.submit` on a real two-node Slurm (tests/slurm_cluster.py): a run to the end on both
nodes, a requeue on Slurm's USR2 that resumes from the checkpoint, a killed worker ending the whole job (through
the docker runtime with a fake engine), and the plain sbatch script. CPU only: the "GPUs" are gloo worker
processes and the GPU gres files are fake."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flux_train import results
from processes import pid_with_env
from slurm_cluster import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "configs/systems/cpu_02x02.yaml"


def submit(tmp_path: Path, *args: str, env: dict | None = None) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "flux_train.submit", "--config", SYSTEM, "--nodes", "2",
         "--set", f"logging.out_dir={tmp_path}/out", "--set", f"slurm.folder={tmp_path}/submitit/%j", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    job = re.search(r"submitted job (\d+)", out.stdout).group(1)
    assert f"log folder: {tmp_path}/submitit/{job}" in out.stdout and "tail -F" in out.stdout
    return job


def mllog(tmp_path: Path) -> list[dict]:
    try:
        return results.read_events(tmp_path / "out" / "mllog.log")
    except results.UnreadableLog:  # not written yet
        return []


def node_logs(tmp_path: Path, job: str) -> dict[int, str]:
    folder = tmp_path / "submitit" / job
    return {node: "".join((folder / f"{job}_{node}_log.{ext}").read_text(errors="replace")
                          for ext in ("out", "err") if (folder / f"{job}_{node}_log.{ext}").is_file())
            for node in (0, 1)}


def wait_run_start(tmp_path: Path) -> None:
    wait_for(lambda: any(e["key"] == "run_start" for e in mllog(tmp_path)), 150, "run_start in the MLLOG")


def test_two_nodes_train_to_the_end(slurm_cluster, tmp_path):
    job = submit(tmp_path, "--runtime", "none")
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


def test_preemption_requeues_and_resumes(slurm_cluster, tmp_path):
    steps, gbs = 30, 4
    job = submit(tmp_path, "--runtime", "none", "--gpus-per-node", "1", "--set", f"train.global_batch_size={gbs}",
                 "--set", f"train.max_steps={steps}", "--set", "eval.every_steps=15")
    wait_run_start(tmp_path)
    slurm_cluster.run("scancel", "--signal=USR2", job)  # what Slurm sends signal_delay_s before the limit
    info = slurm_cluster.wait_job(job, timeout=300, restarts=1)
    logs = node_logs(tmp_path, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", logs
    assert "flux-train: requeueing job" in logs[0]
    for node in (0, 1):
        assert "got USR2" in logs[node] and "asked the batch script to requeue the job" in logs[node]
        assert f"job {job}, restart 1:" in logs[node]
    saved = re.search(r"saved checkpoint \S+/step_(\d+)", logs[0])
    resumed = re.search(r"resumed from \S+/step_(\d+) at step (\d+)", logs[0])
    assert saved and resumed, logs[0]
    assert saved.group(1) == resumed.group(1) and 0 < int(resumed.group(2)) < steps
    events = mllog(tmp_path)
    keys = [e["key"] for e in events]
    assert keys.count("run_start") == 1  # one run, continued: not started again from step 0
    assert keys[-1] == "run_stop" and events[-1]["metadata"]["samples_count"] == steps * gbs


# No container engine can run here: this stand-in for `docker run` runs the command directly, with only the
# variables named by --env=NAME (plus a bare PATH and HOME, like an image's) and in --workdir, as docker would.
FAKE_DOCKER = """
import json, os, sys
args = sys.argv[1:]
assert args[0] == "run", args
i = 1
while args[i].startswith("--"):
    i += 1
options, command = args[1:i], args[i + 1:]
with open(os.environ["FAKE_DOCKER_RECORD"], "a") as record:
    record.write(json.dumps(args) + "\\n")
env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root"}
env.update({o[6:]: os.environ[o[6:]] for o in options if o.startswith("--env=") and o[6:] in os.environ})
os.chdir(next(o[10:] for o in options if o.startswith("--workdir=")))
os.execve(command[0], command, env)
"""


def test_dead_worker_ends_the_job_naming_its_rank(slurm_cluster, tmp_path):
    """Through the docker runtime (a fake engine, above): the agent gets all it needs from the variables
    passed by name, and a worker killed on node 1 ends both nodes quickly."""
    bin_dir, record = tmp_path / "bin", tmp_path / "docker.jsonl"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f"#!{sys.executable}" + FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DOCKER_RECORD": str(record)}
    job = submit(tmp_path, "--runtime", "docker", "--container-image", "flux-train:test",
                 "--set", f"container.python={sys.executable}", "--set", "container.env=[FAKE_DOCKER_RECORD]",
                 "--set", "train.max_steps=100000", "--set", "eval.enabled=false", env=env)
    wait_run_start(tmp_path)
    assert len(record.read_text().splitlines()) == 2  # one container per node
    pid = wait_for(lambda: pid_with_env(TORCHELASTIC_RUN_ID=f"flux-{job}", RANK=3), 10, "worker rank 3")
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    info = slurm_cluster.wait_job(job, timeout=60)
    assert time.monotonic() - killed < 45
    logs = node_logs(tmp_path, job)
    assert info["JobState"] == "FAILED", logs
    assert "worker rank 3 (local rank 1, pid %d) on n2 failed: killed by SIGKILL" % pid in logs[1]


def test_plain_sbatch_script(slurm_cluster, tmp_path):
    out = slurm_cluster.run(
        "sbatch", "--parsable", "--nodes=2", "--time=10", f"--output={tmp_path}/%j.out", "slurm/flux.sbatch",
        "--config", SYSTEM, "--set", "slurm.gpus_per_node=1", "--set", "train.global_batch_size=4",
        "--set", "train.max_steps=4", "--set", "eval.enabled=false", "--set", f"logging.out_dir={tmp_path}/out")
    job = out.stdout.strip().split(";")[0]
    info = slurm_cluster.wait_job(job, timeout=180)
    log = (tmp_path / f"{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", log
    assert "[launch node 0/2 n1]" in log and "[launch node 1/2 n2]" in log
    assert mllog(tmp_path)[-1]["key"] == "run_stop"
