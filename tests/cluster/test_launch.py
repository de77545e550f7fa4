"""The per-node agent (flux_train/cluster/launch.py): environment profiles and their precedence, Slurm topology,
the USR2 and TERM relay to workers (also with two signals at once), the preemption exit contract, and a killed
worker or SIGTERM ending a --local run."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from processes import alive, parent, pid_with_env, pids_with_env
from run_outputs import set_flags
from slurm_cluster import wait_for

from flux_train.cluster import launch
from flux_train.config import load_config
from flux_train.outputs import results

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "configs/systems/cpu_02x02.yaml"


def test_profiles_parse_and_leave_nvlink_multicast_alone():
    nvidia, amd = launch.read_profile("nvidia"), launch.read_profile("amd")
    assert nvidia["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert amd["NCCL_IB_GID_INDEX"] == "3" and "HSA_NO_SCRATCH_RECLAIM" in amd
    assert "NCCL_NVLS_ENABLE" not in nvidia and "TORCH_SYMM_MEM_DISABLE_MULTICAST" not in nvidia
    assert launch.read_profile("none") == {}


def test_environment_precedence(tmp_path):
    cfg = load_config(
        SYSTEM,
        [
            "env.profile=nvidia",
            "env.socket_ifname=ib0",
            "env.ib_hca=mlx5_0,mlx5_1",
            "env.vars={NCCL_DEBUG: INFO, NCCL_NVLS_ENABLE: '1'}",
        ],
    )
    wanted = launch.wanted_env(cfg, tmp_path)
    assert wanted["NCCL_DEBUG"] == "INFO"  # env.vars beat the profile file
    assert wanted["NCCL_SOCKET_IFNAME"] == wanted["GLOO_SOCKET_IFNAME"] == "ib0"
    assert wanted["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    assert wanted["TRITON_CACHE_DIR"] == f"{tmp_path}/triton"
    assert wanted["TORCHINDUCTOR_CACHE_DIR"] == f"{tmp_path}/inductor"
    assert wanted["MPLCONFIGDIR"] == f"{tmp_path}/matplotlib"
    # the job's own environment beats everything: the GPU machines need NVLink multicast off
    environ = {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NCCL_DEBUG": "WARN",
        "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_root",
    }  # ... but not over the node's scratch folders
    exported, kept = launch.export_env(wanted, environ)
    assert environ["TORCHINDUCTOR_CACHE_DIR"] == exported["TORCHINDUCTOR_CACHE_DIR"] == f"{tmp_path}/inductor"
    assert environ["NCCL_NVLS_ENABLE"] == "0" and environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert environ["NCCL_DEBUG"] == "WARN" and kept == {"NCCL_NVLS_ENABLE": "0", "NCCL_DEBUG": "WARN"}
    assert exported["NCCL_IB_HCA"] == environ["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"


def test_socket_ifname_auto_is_the_default_route(tmp_path):
    routes = Path("/proc/net/route").read_text().splitlines()[1:]
    default = [line.split()[0] for line in routes if line.split()[1] == "00000000"]
    if not default:
        pytest.skip("this machine has no default route")
    environ: dict[str, str] = {}
    launch.export_env(launch.wanted_env(load_config(SYSTEM, ["env.socket_ifname=auto"]), tmp_path), environ)
    assert environ["NCCL_SOCKET_IFNAME"] == environ["GLOO_SOCKET_IFNAME"] == default[0]


def test_node_from_slurm(monkeypatch):
    for key, value in {
        "SLURM_JOB_ID": "77",
        "SLURM_NODEID": "2",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_JOB_NODELIST": "gpu[08-09],gpu11",
        "SLURM_RESTART_COUNT": "1",
        "SLURM_PROCID": "2",
        "SLURM_NTASKS": "3",
    }.items():
        monkeypatch.setenv(key, value)
    node = launch.Node.detect()
    assert (node.job_id, node.rank, node.count, node.host, node.master, node.restarts) == (
        "77",
        2,
        3,
        "gpu11",
        "gpu08",
        1,
    )
    assert node.port(29500) == 29500
    # derived from the job id: the same on every node, and below the ephemeral ports no connection can hold
    assert node.port(0) == launch.Node.detect().port(0) and 20000 <= node.port(0) < 32768
    local = launch.Node.detect(local=True)
    with socket.socket() as s:  # one node needs no agreed port: any free one
        s.bind(("", local.port(29500)))
    assert local.count == 1


CHILD = """
import signal, sys, time
from pathlib import Path
time.sleep(float(sys.argv[2]))  # a worker still initialising: USR2 would kill it
signal.signal(signal.SIGUSR2, lambda *a: Path(sys.argv[1]).write_text("got USR2"))
time.sleep(10)
"""


def test_relay_waits_until_each_worker_handles_usr2(tmp_path):
    node = launch.Node.detect(local=True)
    children = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / f"w{i}"), str(delay)], start_new_session=True)
        for i, delay in enumerate((0.0, 2.0))
    ]
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        with launch.SignalRelay(node):
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGUSR2)  # what Slurm sends the agent
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not all((tmp_path / f"w{i}").exists() for i in (0, 1)):
                time.sleep(0.1)
        assert all((tmp_path / f"w{i}").read_text() == "got USR2" for i in (0, 1))
        assert all(child.poll() is None for child in children)  # neither was killed by an early USR2
    finally:
        signal.signal(signal.SIGUSR2, previous)
        for child in children:
            child.kill()
            child.wait()


# An agent-like process: rounds of SignalRelay around one long-lived worker that reports each signal it gets.
DOUBLE_SIGNAL_AGENT = r"""
import signal, subprocess, sys
from flux_train.cluster import launch

worker = subprocess.Popen([sys.executable, "-c", sys.argv[2]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          start_new_session=True)
assert worker.stdout.readline() == b"ready\n"
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # between rounds: what the relay puts back
node = launch.Node.detect(local=True)
for _ in range(int(sys.argv[1])):
    with launch.SignalRelay(node):
        print("ready", flush=True)  # the test sends its two signals now
        print(worker.stdout.readline().decode().strip(), flush=True)  # what the worker got
worker.stdin.close()
print(worker.stdout.readline().decode().strip(), flush=True)  # its total
"""
COUNTING_WORKER = r"""
import os, signal, sys
count = 0
def report(signum, frame):
    global count
    count += 1
    os.write(1, f"{signal.Signals(signum).name} {count}\n".encode())
signal.signal(signal.SIGUSR2, report)
signal.signal(signal.SIGTERM, report)
print("ready", flush=True)
sys.stdin.read()  # until the agent closes it
os.write(1, f"total {count}\n".encode())
"""


@pytest.mark.parametrize("signum", [signal.SIGUSR2, signal.SIGTERM])
def test_two_signals_within_a_millisecond_never_hang_or_act_twice(signum):
    """Slurm's signal can reach the agent twice at once (directly and through apptainer's starter). 300 rounds
    of two signals sent back to back: each round the worker gets the signal exactly once and the agent never
    blocks (the handler that set a threading.Event deadlocked within a few rounds)."""
    rounds = 300
    agent = subprocess.Popen(
        [sys.executable, "-c", DOUBLE_SIGNAL_AGENT, str(rounds), COUNTING_WORKER], cwd=ROOT, stdout=subprocess.PIPE
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.decode().strip()) for line in agent.stdout], daemon=True).start()

    def line(k: int) -> str:
        try:
            return lines.get(timeout=10)
        except queue.Empty:
            raise AssertionError(f"the agent hung in round {k}") from None

    gaps = []
    try:
        for k in range(1, rounds + 1):
            assert line(k) == "ready"
            sent = time.perf_counter()
            os.kill(agent.pid, signum)
            os.kill(agent.pid, signum)
            gaps.append(time.perf_counter() - sent)
            assert line(k) == f"{signum.name} {k}"
        assert line(rounds) == f"total {rounds}"  # no round passed its signal on twice
        assert sorted(gaps)[rounds // 2] < 1e-3  # back to back: microseconds apart, unless the test was descheduled
    finally:
        agent.kill()
        agent.wait()


def endless_run(
    tmp_path: Path, module: str, flags: list[str], sets: dict, env: dict | None = None, stderr=subprocess.STDOUT
) -> subprocess.Popen:
    """`python -m MODULE --local --config SYSTEM FLAGS` (the agent, or submit) with two workers training until
    stopped, no evals, into tmp_path/out, `sets` on top; every process of it has FLUX_TEST_MARKER=<tmp_path> in its
    environment."""
    sets = {
        "train.global_batch_size": 4,
        "train.max_steps": 100000,
        "eval.enabled": "false",
        "logging.out_dir": tmp_path / "out",
        **sets,
    }
    return subprocess.Popen(
        [sys.executable, "-m", module, "--local", "--config", SYSTEM, *flags, *set_flags(sets)],
        cwd=ROOT,
        env={**os.environ, "FLUX_TEST_MARKER": str(tmp_path), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def wait_for_run_start(out: Path, timeout: float = 120) -> None:
    """Until MLLOG's run_start is in `out` (the workers train) or `timeout` seconds have passed."""
    mllog = out / "mllog.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (mllog.is_file() and "run_start" in mllog.read_text()):
        time.sleep(0.3)


@pytest.mark.slow
def test_two_sigterms_stop_a_running_agent_once(tmp_path):
    """Slurm's SIGTERM (scancel, the time limit), twice at once, to an agent with two training workers: it
    passes it on once, its workers stop, and it exits with 143 (no traceback, no worker left behind)."""
    agent = endless_run(tmp_path, "flux_train.cluster.launch", [], {"slurm.nodes": 1, "env.local_dir": tmp_path})
    try:
        wait_for_run_start(tmp_path / "out")
        agent.send_signal(signal.SIGTERM)
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=60)
    finally:
        agent.kill()
    assert agent.returncode == 128 + signal.SIGTERM, out
    assert out.count("got SIGTERM (the job is ending): passing it to the workers") == 1, out
    assert "workers stopped on SIGTERM" in out and "Traceback" not in out, out
    assert pid_with_env(FLUX_TEST_MARKER=str(tmp_path)) is None


@pytest.mark.slow
def test_local_run_killed_worker_ends_it_naming_the_rank(tmp_path):
    proc = local_run(tmp_path, {}, {}, stderr=subprocess.STDOUT)
    try:
        wait_for_run_start(tmp_path / "out")
        pid = pid_with_env(FLUX_TEST_MARKER=str(tmp_path), LOCAL_RANK=1)
        assert pid is not None, "worker with local rank 1 not found"
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, out
    assert f"worker rank 1 (local rank 1, pid {pid}) on 127.0.0.1 failed: killed by SIGKILL" in out


def local_run(tmp_path: Path, sets: dict, env: dict, stderr=subprocess.PIPE) -> subprocess.Popen:
    """`submit --local` of one node, an endless_run."""
    return endless_run(
        tmp_path,
        "flux_train.cluster.submit",
        ["--nodes", "1"],
        {"slurm.folder": f"{tmp_path}/sub/%j", **sets},
        env,
        stderr,
    )


def workers_of(tmp_path: Path) -> list[int]:
    return [pid for rank in (0, 1) for pid in pids_with_env(FLUX_TEST_MARKER=tmp_path, LOCAL_RANK=rank)]


SECRETS = {"HF_TOKEN": "hf_s3cr3t", "WANDB_API_KEY": "wandb_s3cr3t", "SITE_AUTH": "site_s3cr3t"}


@pytest.mark.slow
def test_local_run_masks_secrets_and_a_killed_agent_takes_its_workers_along(tmp_path):
    """`submit --local` with secrets in env.vars (one only by env.masked_vars' pattern) and one kept from the
    job's environment: the logs and the run's config.yaml show them masked, the workers' environment holds the
    real values, the config files with the real ones are the owner's only. Then SIGKILL of the agent alone: its
    workers end within seconds (the parent-death signal), and submit says how the agent ended, exit 128 + 9."""
    proc = local_run(
        tmp_path,
        {
            "env.vars": "{HF_TOKEN: %(HF_TOKEN)s, SITE_AUTH: %(SITE_AUTH)s, WANDB_API_KEY: x}" % SECRETS,
            "env.masked_vars": "['*_auth']",
            "env.local_dir": tmp_path / "node",
        },
        {"WANDB_API_KEY": SECRETS["WANDB_API_KEY"]},
    )
    workers: list[int] = []
    try:
        mllog = tmp_path / "out" / "mllog.log"
        wait_for(lambda: mllog.is_file() and "run_start" in mllog.read_text(), 120, "run_start")
        workers = pids_with_env(FLUX_TEST_MARKER=tmp_path, **SECRETS)
        assert len(workers) == 2  # the real values reach both workers
        agent = parent(workers[0])
        assert b"flux_train.cluster.launch" in Path(f"/proc/{agent}/cmdline").read_bytes()
        os.kill(agent, signal.SIGKILL)
        wait_for(lambda: not [pid for pid in workers if alive(pid)], 5, "the workers to end with their agent")
        out, err = proc.communicate(timeout=60)
    finally:
        for pid in [proc.pid, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert (
        err.splitlines()[-1] == f"submit --local: job local-{proc.pid}: the agent (pid {agent}) was killed by SIGKILL"
    )
    assert not [value for value in SECRETS.values() if value in out + err]
    assert "export HF_TOKEN=***" in err and "export SITE_AUTH=***" in err
    assert "kept from the job's environment: WANDB_API_KEY=***" in err
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["env"]["vars"] == {
        "HF_TOKEN": "***",
        "SITE_AUTH": "***",
        "WANDB_API_KEY": "***",
    }
    private = [*(tmp_path / "sub").glob("*/config.yaml"), *(tmp_path / "node").glob("*/config.yaml")]
    assert len(private) == 2 and all(path.stat().st_mode & 0o077 == 0 for path in private)
    assert all(f"local-{proc.pid}" in str(path.parent) for path in private)  # one job id: submit's, the agent's


@pytest.mark.slow
def test_a_killed_submit_local_takes_its_agent_and_workers_along(tmp_path):
    """SIGKILL of `submit --local` alone, as soon as its workers run: the agent gets SIGTERM (the parent-death
    signal), passes it on, and nothing of the run is left."""
    proc = local_run(tmp_path, {}, {})
    run: list[int] = []
    try:
        wait_for(lambda: len(workers_of(tmp_path)) == 2, 120, "two workers")
        run = [pid for pid in pids_with_env(FLUX_TEST_MARKER=tmp_path) if pid != proc.pid]  # the agent and workers
        proc.kill()
        wait_for(lambda: not [pid for pid in run if alive(pid)], 10, "the agent and workers to end with submit")
    finally:
        for pid in [proc.pid, *run]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()
    assert len(run) == 3


@pytest.mark.slow
def test_ctrl_c_stops_the_agent_with_one_line(tmp_path):
    """SIGINT (Ctrl-C) to the agent: the launcher stops the workers, and the agent says so in one line of its own
    (no traceback; the workers' KeyboardInterrupt is theirs, prefixed with their rank), exit 128 + 2."""
    agent = subprocess.Popen(
        [sys.executable, "-m", "flux_train.cluster.launch", "--local", "--config", SYSTEM, "--set", "slurm.nodes=1"]
        + set_flags({"train.max_steps": 100000, "eval.enabled": "false", "logging.out_dir": tmp_path / "out"}),
        cwd=ROOT,
        env={**os.environ, "FLUX_TEST_MARKER": str(tmp_path)},
        stderr=subprocess.PIPE,
        text=True,
    )
    workers: list[int] = []
    try:
        workers = wait_for(lambda: len(workers_of(tmp_path)) == 2 and workers_of(tmp_path), 120, "two workers")
        agent.send_signal(signal.SIGINT)
        _, err = agent.communicate(timeout=60)
    finally:
        for pid in [agent.pid, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    own = [line for line in err.splitlines() if not line.startswith("[rank")]
    assert agent.returncode == 128 + signal.SIGINT and own[-1] == "launch: stopped by SIGINT; the workers were stopped"
    assert not [line for line in own if "Traceback" in line] and not [pid for pid in workers if alive(pid)]


def test_runtime_tunables_report_each_step_and_never_fail(tmp_path):
    for path, value in (("proc/sys/vm/drop_caches", "0"), ("proc/sys/kernel/numa_balancing", "1")):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(value)
    env = {**os.environ, "FLUX_TUNABLES_ROOT": str(tmp_path), "PATH": "/usr/bin:/bin"}  # no cpupower here
    done = subprocess.run(["bash", str(launch.TUNABLES)], env=env, capture_output=True, text=True, timeout=30)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 8
    assert "ok       drop the page cache (vm.drop_caches=3)" in lines and "ok       kernel.numa_balancing=0" in lines
    assert (tmp_path / "proc/sys/vm/drop_caches").read_text().strip() == "3"
    assert (tmp_path / "proc/sys/kernel/numa_balancing").read_text().strip() == "0"
    assert "skipped  CPU frequency governor performance: cpupower not found" in lines
    assert any(line.startswith("skipped  transparent hugepages enabled=always: ") for line in lines)


def test_failure_names_rank_host_cause_and_stderr_tail(tmp_path, monkeypatch):
    """A worker that raises: the agent's message names its rank, host, exit code and ends with its traceback."""
    cfg = load_config(
        SYSTEM, ["slurm.nodes=1", "slurm.gpus_per_node=1", "train.global_batch_size=2", f"env.local_dir={tmp_path}"]
    )
    monkeypatch.setattr(launch, "worker_args", lambda config_file: ["-c", "raise SystemExit('boom: bad shard')"])
    for key in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(key, raising=False)  # the agent exports them: restored after the test
    previous = signal.getsignal(signal.SIGUSR2)
    with pytest.raises(launch.WorkerFailure) as failure:
        launch.run_node(cfg, local=True)
    signal.signal(signal.SIGUSR2, previous)
    message = str(failure.value)
    assert message.startswith("worker rank 0 (local rank 0, pid ") and " on 127.0.0.1 failed: exit code 1" in message
    assert message.splitlines()[-1].strip().endswith("boom: bad shard")


def test_the_agent_says_the_rendezvous_in_one_line_and_leaves_no_node_local_folder(tmp_path):
    """torch-elastic's log of a node, a dozen INFO lines (the rendezvous report, "starting workers", "waiting for
    other agents"), becomes the agent's one line of the rendezvous; the node-local folder (caches, worker logs, the
    job's config) goes with the run: `submit --local` and the tests left flux-train-local-* folders in /tmp. The
    agent runs as its command does, its workers replaced by `python -c pass`."""
    code = (
        "import sys; from flux_train.cluster import launch\n"
        "launch.worker_args = lambda config_file: ['-c', 'pass']\n"
        "sys.exit(launch.main(sys.argv[1:]))"
    )
    args = ["--local", "--config", SYSTEM, "--set", "slurm.nodes=1", "--set", f"env.local_dir={tmp_path}"]
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    err = done.stderr.splitlines()
    assert [line for line in err if not line.startswith("[launch node 0/1 127.0.0.1] ")] == [], err
    assert "[launch node 0/1 127.0.0.1] rendezvous: group_rank=0 group_world_size=1 global_ranks=[0, 1]" in err
    assert list(tmp_path.iterdir()) == []


def test_workers_that_saved_and_stopped_requeue_the_job_only_when_asked_and_allowed(tmp_path, monkeypatch):
    """The flag the batch script turns into `scontrol requeue` is created only where the script set one up and
    slurm.max_requeue allows another requeue; otherwise the node says it was preempted."""
    from dataclasses import replace

    from flux_train.training.preemption import REQUEUE_FLAG_ENV

    cfg = load_config(SYSTEM, ["slurm.max_requeue=2"])
    node = launch.Node("42", 0, 1, "127.0.0.1", "127.0.0.1", restarts=1)
    flag = tmp_path / "requeue.flag"
    monkeypatch.delenv(REQUEUE_FLAG_ENV, raising=False)
    assert launch.request_requeue(cfg, node) is launch.NodeStatus.PREEMPTED
    monkeypatch.setenv(REQUEUE_FLAG_ENV, str(flag))
    assert launch.request_requeue(cfg, replace(node, restarts=2)) is launch.NodeStatus.PREEMPTED
    assert not flag.exists()
    assert launch.request_requeue(cfg, node) is launch.NodeStatus.REQUEUED and flag.exists()


@pytest.mark.parametrize("status,code", [("FINISHED", 0), ("REQUEUED", 0), ("PREEMPTED", 0), ("TERMINATED", 143)])
def test_the_agents_exit_code_says_only_whether_sigterm_stopped_it(monkeypatch, status, code):
    monkeypatch.setattr(launch, "run_node", lambda cfg, local: launch.NodeStatus[status])
    assert launch.main(["--config", SYSTEM]) == code


@pytest.mark.slow
def test_local_launcher_run_with_evals_on_the_energon_fixture_passes_the_checker_structure(tmp_path):
    """Issue 7's short run on the CPU: the --local launcher path, 2 workers, 50 steps, evals on the energon
    fixture's val set; the official checker finds the log's structure complete (only the convergence test on
    eval_accuracy may fail: 50 steps do not reach 0.586)."""
    out = tmp_path / "out"
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
            "--set",
            "data.source=energon",
            "--set",
            "data.path=null",
            "--set",
            "data.num_workers=0",
            "--set",
            f"data.fixture_dir={tmp_path}/fixture",
            "--set",
            "train.global_batch_size=4",
            "--set",
            "train.max_steps=50",
            "--set",
            "eval.every_steps=25",
            "--set",
            f"logging.out_dir={out}",
            "--set",
            f"slurm.folder={tmp_path}/sub/%j",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = results.read_events(out / "mllog.log")
    assert [e["metadata"]["samples_count"] for e in events if e["key"] == "eval_accuracy"] == [100, 200]
    assert events[-1]["key"] == "run_stop" and events[-1]["metadata"]["samples_count"] == 200
    assert results.check_compliance(out / "mllog.log").failed_keys in ([], ["eval_accuracy"])


def test_the_worker_leaves_with_the_trainers_exit_code():
    """The worker skips the interpreter's teardown (os._exit) but keeps train.main's code: 0, or 2 for a bad input."""
    run = [sys.executable, "-m", "flux_train.cluster.worker", "--config", "configs/debug.yaml"]
    ok = subprocess.run([*run, "--print-config"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "flavor: flux-debug" in ok.stdout
    bad = subprocess.run([*run, "--set", "train.lr=abc"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip() == "config error: train.lr: expected a number, got str 'abc'"


@pytest.mark.slow
def test_a_local_run_says_its_job_where_its_outputs_are_and_why_it_ended(tmp_path):
    """`submit --local` to the step cap: one job id throughout, the run folder named at the end, and the trainer's
    last line says why the run ended `aborted`."""
    proc = local_run(tmp_path, {"train.max_steps": 2}, {})
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "finished at step 2, the step cap train.max_steps 2, before an eval reached the target" in out + err
    assert (
        out.splitlines()[-1]
        == f"submit --local: job local-{proc.pid} ended; the run's outputs are in {tmp_path / 'out'}"
    )
