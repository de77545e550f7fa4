"""What a crashed, crowded or failing run leaves behind, on one real training killed mid-run and copies of its folder:
a second run in a folder in use is refused naming the holder; the resumed run's records hold each step and eval
once and pass the official checker; a full disk ends in one line naming the file and the last good checkpoint;
resume skips unreadable checkpoints and refuses another model or layout before init_start; planted links, an
export over a file and a mistyped log value end in one line. Each refusal: exit status, one stderr line, and the
folder as it was."""

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from run_outputs import column, events, losses, metrics, set_flags, train_command
from run_outputs import train as run_train

from flux_train.config import load_config
from flux_train.outputs import results
from flux_train.tools.export import main as export_main
from flux_train.tools.export import read_weights
from flux_train.training import checkpoint, checkpoint_size, run_folder, train

pytestmark = pytest.mark.slow  # the module fixture trains

# latent_scale 0.02 brings the debug model under the 0.586 target within ~20 steps of the synthetic set
RUN = {
    "data.source": "synthetic",
    "train.latent_scale": 0.02,
    "eval.every_steps": 2,  # = the logging and checkpoint cadence: a stop signal always lands on an eval step
    "logging.log_every": 2,
    "checkpoint.every_steps": 2,
    "checkpoint.keep": 5,
    "train.max_steps": 60,
}


def flags(**changes) -> list[str]:
    return set_flags({**RUN, **{k.replace("__", "."): v for k, v in changes.items()}})


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` by content (what 'nothing lost or overwritten' compares), but the lock file, which
    each start rewrites with its own name."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.name != ".lock"
    }


def newest(out: Path) -> Path:
    return checkpoint.list_checkpoints(out / "checkpoints")[-1]


def started_until(out: Path, step: int) -> subprocess.Popen:
    """The run (never reaching the target) started in the background, once it has logged `step`."""
    proc = subprocess.Popen(train_command(out, *flags(eval__target=0)), stdout=subprocess.DEVNULL, text=True)
    deadline = time.time() + 300
    while max(losses(out), default=0) < step and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    return proc


def refused(*commands: list[str]) -> list[subprocess.CompletedProcess]:
    """Commands run side by side, to their end (each is refused within its start-up)."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    outputs = [p.communicate(timeout=300) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *output) for p, output in zip(procs, outputs)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run preempted (SIGUSR2, at an eval step) and requeued, then killed (SIGKILL) a few steps on; while it was held, a second run in its folder and one saving into its checkpoint folder; a copy of the
    folder as the kill left it; and the same command again, resumed to the target."""
    root = tmp_path_factory.mktemp("runs")
    out = root / "run"
    preempted = started_until(out, 4)
    preempted.send_signal(signal.SIGUSR2)
    assert preempted.wait(timeout=300) == 75
    first = started_until(out, max(losses(out)) + 4)
    first.send_signal(signal.SIGSTOP)  # held where it is (its locks with it) while the others are tried
    second, sharing = refused(
        train_command(out, *flags()), train_command(root / "other", *flags(checkpoint__dir=out / "checkpoints"))
    )
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    crashed = shutil.copytree(out, root / "crashed", symlinks=True)
    resumed = run_train(out, *flags(), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return SimpleNamespace(
        root=root, out=out, first=first, second=second, sharing=sharing, crashed=crashed, resumed=resumed
    )


def copy_of(runs, tmp_path, name="run") -> Path:
    return shutil.copytree(runs.crashed, tmp_path / name, symlinks=True)


# ------------------------------------------------------------------ one run per folder


@pytest.mark.parametrize(
    "who,key,folder", [("second", "logging.out_dir", ""), ("sharing", "checkpoint.dir", "checkpoints")]
)
def test_a_second_run_in_a_folder_in_use_is_refused_naming_the_holder(runs, who, key, folder):
    proc = getattr(runs, who)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"config error: {key} {runs.out / folder} is in use by host ")
    assert lines[0].endswith(f"; wait for it to end, or choose another {key}") and f" pid {runs.first.pid} " in lines[0]
    # the first run's log is intact: its run_start (the second neither removed nor rewrote the file) is still there
    first_start = [e for e in events(runs.crashed) if e["key"] == "run_start"]
    assert [e for e in events(runs.out) if e["key"] == "run_start"] == first_start and len(first_start) == 1


# ------------------------------------------------------------------ records after a crash


def test_after_a_crash_the_resumed_records_hold_each_step_and_eval_once_in_order(runs):
    assert "resumed from" in runs.resumed.stdout  # the dead holder's lock did not keep it out
    last = max(losses(runs.out))
    assert [r["step"] for r in metrics(runs.out) if "loss" in r] == list(range(2, last + 1, 2))
    # the eval of the step preempted too (it runs before the save), and none twice
    assert [r["step"] for r in metrics(runs.out) if "val_loss" in r] == list(range(2, last + 1, 2))
    assert column(runs.out, "val_loss")[-1] <= 0.586 < column(runs.out, "val_loss")[0]
    keys = [e["key"] for e in events(runs.out)]
    evals = [e["metadata"]["samples_count"] for e in events(runs.out) if e["key"] == "eval_accuracy"]
    assert evals == [8 * step for step in range(2, last + 1, 2)]
    for key in ("init_start", "init_stop", "run_start", "run_stop"):
        assert keys.count(key) == 1, key
    blocks = [k for k in keys if k in ("block_start", "block_stop")]
    assert blocks == ["block_start", "block_stop"] * (len(blocks) // 2)  # no block opened twice


def test_the_official_checker_and_results_accept_the_resumed_log(runs, capsys):
    log = runs.out / "mllog.log"
    proc = subprocess.run(
        [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training", "--ruleset", "6.0.0", log],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=runs.root,
    )
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert results.main([str(runs.out), "--out", str(runs.root)]) == 0
    assert "1/1 logs pass" in capsys.readouterr().out


# ------------------------------------------------------------------ a full disk


def limited(limit_bytes: int):
    """The full disk's stand-in: no file of the process may grow past `limit_bytes` (RLIMIT_FSIZE; Python ignores
    SIGXFSZ, so the write fails with EFBIG, as a write to a full disk fails with ENOSPC)."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return apply


def run_limited(out: Path, limit_bytes: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_command(out, *args), capture_output=True, text=True, timeout=300, preexec_fn=limited(limit_bytes)
    )


def test_a_full_disk_at_a_save_ends_in_one_line_and_the_report_only_warns(runs, tmp_path):
    """40 KB per file: the logs fit, report.png (~80 KB) does not (a warning, training goes on), the checkpoint's
    shard (~10 MB) does not (the run ends naming it and the last good checkpoint, its partial save removed)."""
    out = copy_of(runs, tmp_path)
    good = newest(out)
    before = [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")]
    (out / "checkpoints" / "step_99999999.tmp").mkdir()  # an interrupted save's leftover: removed at the start
    proc = run_limited(out, 40_000, *flags(eval__target=0))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 74, proc.stderr[-3000:]
    assert lines[:-1] and all(
        line.startswith(f"flux-train: warning: could not write {out / 'report.png'} (") for line in lines[:-1]
    ), lines
    failed = out / "checkpoints" / f"step_{int(good.name[5:]) + 2:08d}"
    assert lines[-1].startswith(f"fatal: writing checkpoint {failed} failed (")
    assert lines[-1].endswith(f"; the last good checkpoint is {good} (checkpoint.resume=auto picks it up)")
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == before
    assert not list((out / "checkpoints").glob("*.tmp"))


def test_a_full_log_disk_ends_in_one_line_and_the_next_start_resumes_past_it_and_a_cut_checkpoint(runs, tmp_path):
    """The log's own size (and a bit) as the limit: the resumed run rewrites the records the crash cut away, then an
    MLLOG line fails half-written. Freed, the next start skips the newest checkpoint (its shard cut short here) with one
    warning, resumes from the one before, cuts the half line away and goes on with every record once."""
    out = copy_of(runs, tmp_path)
    found = checkpoint.list_checkpoints(out / "checkpoints")
    good = found[-1]
    log = out / "mllog.log"
    proc = run_limited(out, log.stat().st_size + 100, *flags(checkpoint__every_steps=0, eval__target=0))
    fatal = [line for line in proc.stderr.splitlines() if not line.startswith("flux-train: warning: could not write")]
    assert proc.returncode == 74 and fatal == [
        f"fatal: writing {log} failed ([Errno 27] File too large); the last good checkpoint is {good} "
        "(checkpoint.resume=auto picks it up)"
    ], proc.stderr[-3000:]
    assert not log.read_text().endswith("\n")  # the line the disk cut

    size = (good / "__0_0.distcp").stat().st_size
    os.truncate(good / "__0_0.distcp", size // 2)
    proc = run_train(out, *flags(eval__target=0, train__max_steps=int(good.name[5:]) + 2), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"flux-train: warning: skipped checkpoint {good}: __0_0.distcp is cut short ({size // 2} of {size} bytes)"
    ]
    assert f"resumed from {found[-2]} at step" in proc.stdout
    last = max(losses(out))
    assert [r["step"] for r in metrics(out) if "loss" in r] == list(range(2, last + 1, 2))
    evals = [e["metadata"]["samples_count"] for e in events(out) if e["key"] == "eval_accuracy"]
    assert evals == [8 * step for step in range(2, last + 1, 2)]
    assert all(line.startswith(":::MLLOG {") and line.endswith("}") for line in log.read_text().splitlines())


def in_a_small_tmpfs(folder: Path, size: int, command: list[str]) -> list[str]:
    """`command` in a mount namespace of its own where `folder` is a tmpfs of `size` bytes: a real full disk (ENOSPC),
    gone with the process. A user namespace makes root unneeded where the kernel allows them."""
    mount = 'mount -t tmpfs -o size="$1" tmpfs "$0" && shift && exec "$@"'
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount, str(folder), str(size), *command]


def test_a_full_disk_at_a_save_says_so_naming_the_folder_and_the_last_good_checkpoint(tmp_path):
    """Checkpoints on a tmpfs with room for one and a half: the save at step 4 runs out of room (torch's writer calls
    that "unexpected pos"; the line says the disk is full)."""
    folder = tmp_path / "small"
    folder.mkdir()
    probe = subprocess.run(in_a_small_tmpfs(folder, 1 << 20, ["true"]), capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"no tmpfs in a mount namespace here: {probe.stderr.strip()}")
    ckpt = folder / "checkpoints"
    run = {"data.source": "synthetic", "eval.enabled": "false", "logging.log_every": 2, "checkpoint.every_steps": 2}
    run |= {"train.max_steps": 6, "checkpoint.dir": ckpt}
    cfg = load_config("configs/debug.yaml", [f"{k}={v}" for k, v in run.items()])
    command = train_command(tmp_path / "run", *set_flags(run))
    proc = subprocess.run(
        in_a_small_tmpfs(folder, int(1.5 * checkpoint_size.checkpoint_bytes(cfg)), command),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 74 and proc.stderr.strip().splitlines() == [
        f"fatal: writing checkpoint {ckpt / 'step_00000004'} failed (the disk is full: no space left in {ckpt}; "
        f"make room there); the last good checkpoint is {ckpt / 'step_00000002'} (checkpoint.resume=auto picks it "
        "up)"
    ], proc.stderr[-3000:]


# ------------------------------------------------------------------ checkpoints


def corrupt(path: Path, how: str) -> str:
    """Damage checkpoint `path` as a crash, a full disk or a cut copy would; returns the reason resume gives."""
    if how == "shard cut short":
        shard = path / "__0_0.distcp"
        size = shard.stat().st_size
        os.truncate(shard, 1000)
        return f"__0_0.distcp is cut short (1000 of {size} bytes)"
    if how == "no loader state":
        (path / "loader_rank0.pt").unlink()
        return "the loader state of rank 0 is missing or unreadable (No such file or directory: "
    if how == "empty progress":
        (path / "progress.pt").write_bytes(b"")
        return "progress.pt is unreadable ("
    if how == "garbled progress":
        (path / "progress.pt").write_bytes(os.urandom(64))
        return "progress.pt is unreadable ("
    (path / ".metadata").unlink()
    return "its DCP metadata (.metadata) is missing or unreadable ("


@pytest.mark.parametrize(
    "how", ["shard cut short", "no loader state", "empty progress", "garbled progress", "no metadata"]
)
def test_resume_skips_an_unreadable_checkpoint_naming_why_and_ignores_tmp_leftovers(runs, tmp_path, capsys, how):
    out = copy_of(runs, tmp_path)
    found = checkpoint.list_checkpoints(out / "checkpoints")
    (out / "checkpoints" / "step_99999999.tmp").mkdir()  # an interrupted save of a later step
    reason = corrupt(found[-1], how)
    cfg = load_config("configs/debug.yaml", [f"logging.out_dir={out}", *[f"{k}={v}" for k, v in RUN.items()]])
    assert checkpoint.resolve_resume(cfg, 1) == found[-2]
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"flux-train: warning: skipped checkpoint {found[-1]}: {reason}") and "\n" not in line


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.num_layers=3", "holds another model: 'double_blocks.2."),
        ("train.global_batch_size=16", "was saved with train.global_batch_size 8, this run has 16"),
        ("parallel.strategy=ddp", "was saved with parallel.strategy fsdp, this run has ddp"),
        ("data.source=energon", "was saved with data.source synthetic, this run has energon"),
    ],
)
def test_a_checkpoint_of_another_model_or_layout_is_refused_before_init_start(
    runs, tmp_path, capsys, override, message
):
    out = copy_of(runs, tmp_path)
    before = snapshot(out)
    rc = train.main(["--config", "configs/debug.yaml", *flags(), "--set", f"logging.out_dir={out}", "--set", override])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith(f"checkpoint error: checkpoint {newest(out)} {message}"), err
    assert err.endswith("resume with the run's own settings, or start this one in a new logging.out_dir")
    assert "\n" not in err and snapshot(out) == before


def test_a_checkpoint_of_another_world_size_is_refused_once_for_two_ranks(runs, tmp_path):
    """Two ranks on one host: rank 0 holds the folder's lock (rank 1 takes none, so neither refuses the other),
    finds the mismatch, and says it once; rank 1 exits without a word."""
    out = copy_of(runs, tmp_path)
    before = snapshot(out)
    proc = run_train(out, *flags(train__micro_batch_size=4), nproc=2, timeout=300)
    expected = (
        f"checkpoint error: checkpoint {newest(out)} was saved with world size (nodes x GPUs per node) 1, this run "
        "has 2: resume with the run's own settings, or start this one in a new logging.out_dir"
    )
    assert proc.returncode != 0 and proc.stderr.count("checkpoint error:") == 1, proc.stderr[-3000:]
    assert expected in proc.stderr.splitlines()
    assert snapshot(out) == before


# ------------------------------------------------------------------ planted links, export, results


def contents(path: Path):
    """A file's bytes, or a folder's files by name, lock files included."""
    return {p.name: p.read_bytes() for p in path.iterdir()} if path.is_dir() else path.read_bytes()


@pytest.mark.parametrize("name", ["metrics.jsonl", "heartbeats/rank_00000", "checkpoints"])
def test_a_symbolic_link_in_the_run_folder_is_refused_not_written_through(runs, tmp_path, capsys, name):
    out = copy_of(runs, tmp_path)
    link, victim = out / name, tmp_path / "victim"
    if link.is_dir():
        victim.mkdir()
        (victim / "mine.txt").write_text("not yours\n")
        shutil.rmtree(link)
    else:
        victim.write_text("not yours\n")
        link.unlink()
    link.symlink_to(victim)
    before = snapshot(out), contents(victim)
    rc = train.main(["--config", "configs/debug.yaml", *flags(), "--set", f"logging.out_dir={out}"])
    assert rc == 2 and capsys.readouterr().err.strip() == (
        f"config error: {link} is a symbolic link (to {victim}); the run does not write through links in its "
        "folder: remove it (checkpoint.dir puts checkpoints elsewhere)"
    )
    assert (snapshot(out), contents(victim)) == before


def test_export_onto_an_existing_file_or_folder_is_refused_in_one_line(runs, tmp_path, capsys):
    for existing in (tmp_path / "model.safetensors", tmp_path / "folder"):
        if existing.suffix:
            existing.write_text("keep me")
        else:
            existing.mkdir()
            (existing / "notes.txt").write_text("keep me")
        before = snapshot(tmp_path)
        argv = ["export", "--config", "configs/debug.yaml", "--checkpoint", str(runs.crashed / "checkpoints")]
        assert export_main([*argv, "--out", str(existing)]) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: --out {existing} exists; give a new folder to write the export into (nothing is overwritten)"
        )
        assert snapshot(tmp_path) == before


def mistype_value(record: dict) -> None:
    record["value"] = "0.57x"


def mistype_count(record: dict) -> None:
    record["metadata"]["samples_count"] = "24"


def mistype_time(record: dict) -> None:
    record["time_ms"] = None


@pytest.mark.parametrize(
    "key,edit,problem",
    [
        ("eval_accuracy", mistype_value, "value '0.57x' is not a number"),
        ("eval_accuracy", mistype_count, "samples_count '24' is not a count"),
        ("run_start", mistype_time, "time_ms None is not a number"),
    ],
)
def test_results_on_a_mistyped_log_value_is_one_line(runs, tmp_path, capsys, key, edit, problem):
    records = events(runs.out)
    at = next(i for i, record in enumerate(records) if record["key"] == key)
    edit(records[at])
    log = tmp_path / "mllog.log"
    log.write_text("".join(f":::MLLOG {json.dumps(record)}\n" for record in records))
    assert results.main([str(log), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: no readable MLLOG in {log} (MLLOG record {at + 1} ({key}): {problem})"), err
    assert "\n" not in err


def test_a_run_folder_that_cannot_be_created_is_one_line(tmp_path, capsys):
    """logging.out_dir under a regular file (as a read-only mount would, for any user, root included)."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = train.main(["--config", "configs/debug.yaml", *flags(), "--set", f"logging.out_dir={blocker / 'run'}"])
    assert rc == 2 and capsys.readouterr().err.strip() == (
        f"config error: logging.out_dir {blocker / 'run'}: cannot write there (Not a directory: {blocker / 'run'})"
    )
    assert blocker.read_text() == "x"


def test_a_finished_run_is_not_started_again_even_without_checkpoints(runs, tmp_path, capsys):
    out = shutil.copytree(runs.out, tmp_path / "run", symlinks=True)
    shutil.rmtree(out / "checkpoints")  # a run that saved none: its log would have been replaced
    before = snapshot(out)
    assert train.main(["--config", "configs/debug.yaml", *flags(), "--set", f"logging.out_dir={out}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"config error: {out} holds a finished run (run_stop in mllog.log); choose a new logging.out_dir, or set "
        "checkpoint.resume=none to start over in this one"
    )
    assert snapshot(out) == before


def test_a_run_stopped_by_a_non_finite_loss_resumes_and_a_finished_one_does_not():
    def stop(status: str, samples: int) -> list[dict]:
        return [{"key": "run_stop", "metadata": {"status": status, "samples_count": samples}}]

    assert not run_folder.finished(stop("aborted", 48), 32, 480)  # diverged after the checkpoint at 32 samples
    assert run_folder.finished(stop("aborted", 48), None, 480)  # no checkpoint to resume from
    assert run_folder.finished(stop("aborted", 32), 32, 480)  # stopped at the checkpoint itself
    assert run_folder.finished(stop("aborted", 480), 32, 480)  # the step cap
    assert run_folder.finished(stop("success", 48), 32, 480)


def test_a_log_named_as_another_run_file_is_refused_before_the_folder_is_made(tmp_path, capsys):
    """logging.mllog_file=.lock: a fresh run would delete the lock file, and a second run lock a new one."""
    out = tmp_path / "run"
    rc = train.main(
        [
            "--config",
            "configs/debug.yaml",
            *flags(),
            "--set",
            f"logging.out_dir={out}",
            "--set",
            "logging.mllog_file=.lock",
        ]
    )
    assert rc == 2 and capsys.readouterr().err == (
        "config error: logging.mllog_file: .lock is another file of the run folder; name the log mllog.log\n"
    )
    assert not out.exists()


def test_a_checkpoint_past_a_lowered_step_cap_is_refused_before_init_start(runs, tmp_path, capsys):
    """train.max_steps lowered below the newest checkpoint's step: refused naming both (it used to run nothing and
    end 'aborted' with exit 0), nothing in the folder changed."""
    out = copy_of(runs, tmp_path)
    at = checkpoint.read_progress(newest(out)).step
    before = snapshot(out)
    assert (
        train.main(
            ["--config", "configs/debug.yaml", *flags(train__max_steps=at - 1), "--set", f"logging.out_dir={out}"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"is at step {at}, past train.max_steps {at - 1}" in err, err
    assert snapshot(out) == before  # mllog.log included: no init_start was written


def test_a_run_whose_teardown_hangs_is_ended_naming_the_rank_and_where_it_waits(tmp_path):
    """A graphed run at two GPUs once finished its steps and then never exited: destroying the NCCL communicator
    waited on a captured graph. Whatever hangs there, the product ends the process within
    parallel.exit_timeout_s. The hang is planted where that one was, in the process group's teardown (shutdown
    replaced by a long sleep in the child: a CPU host has no NCCL to hang)."""
    script = (
        "import sys, time\n"
        "from flux_train.training import train\n"
        "train.shutdown = lambda: time.sleep(300)\n"
        "sys.exit(train.main(sys.argv[1:]))\n"
    )
    out = tmp_path / "run"
    args = train_command(out, *flags(train__max_steps=2, parallel__exit_timeout_s=2))[3:]  # past -m ...train
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=240)
    ended = time.time()
    assert proc.returncode == 6, proc.stderr[-2000:]
    assert "finished at step 2, the step cap" in proc.stdout
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("flux-train: rank 0"))
    assert "the run ended (status aborted) but the process had not exited 2 s later" in line
    assert "it waits in <lambda>" in line and "called from main" in line and "exit 6" in line
    # every thread's stack follows the line, the hung frame in it
    assert proc.stderr.index("(most recent call first)") > proc.stderr.index(line)
    assert 'File "<string>", line 3 in <lambda>' in proc.stderr
    run_stop = next(e for e in events(out) if e["key"] == "run_stop")
    assert 2 <= ended - run_stop["time_ms"] / 1000 < 2 + 10  # parallel.exit_timeout_s after the run ended


def test_an_error_before_a_teardown_that_hangs_is_said_before_the_deadline_ends_it(tmp_path):
    """A run stopped by a bad input once printed only the deadline's line when its teardown then hung: the error's own
    line, what the user has to fix, came after the teardown, which never ended. The bad input is real (a data.path
    that does not exist, found after the process group is up); the hang is planted as above. A fault that is no bad
    input (planted here: a bug's exception, whose traceback would come after the teardown) is named in the deadline's
    line."""
    hang = "import sys, time\nfrom flux_train.training import train\ntrain.shutdown = lambda: time.sleep(300)\n"
    bug = "train.Trainer.run = lambda self: 1 / 0\n"
    out, nowhere = tmp_path / "run", tmp_path / "nowhere"
    lines = []
    for script, args in [
        (hang, flags(data__source="energon", data__path=nowhere, parallel__exit_timeout_s=2)),
        (hang + bug, flags(parallel__exit_timeout_s=2, checkpoint__resume="none")),
    ]:
        command = [
            sys.executable,
            "-c",
            script + "sys.exit(train.main(sys.argv[1:]))\n",
            *train_command(out, *args)[3:],
        ]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 6, proc.stderr[-2000:]
        lines.append(proc.stderr.splitlines())
    (error, ended, *_), (bug_ended, *_) = lines
    assert error == (
        f"config error: data.path {nowhere} does not exist here; point it at the prepared dataset (python -m dataprep) "
        "or use data.source=synthetic"
    )
    assert ended.startswith("flux-train: rank 0 on ") and "the run ended (stopped by an error) but" in ended
    assert "the run ended (stopped by ZeroDivisionError: division by zero) but" in bug_ended


def test_a_final_checkpoint_cut_by_a_kill_is_completed_by_the_same_command_without_a_second_run_stop(tmp_path):
    """The final save follows run_stop (off the clock); SIGKILL during it (planted where its shards are written and
    progress.pt is not, the deterministic moment of a kill mid-save) left step_00000006.tmp, and the same command
    again was refused as a finished run, the last step's weights lost. Now it trains steps 5-6 again from the
    checkpoint of step 4 and saves them: the weights of an uninterrupted run, its records untouched (one run_stop),
    and only then is the run finished."""
    cut = (
        "import os, signal, sys\n"
        "from flux_train.training import checkpoint, train\n"
        "complete = checkpoint.Checkpointer._complete\n"
        "def cut(self, tmp, final, progress):\n"
        "    if progress['step'] == 6:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    complete(self, tmp, final, progress)\n"
        "checkpoint.Checkpointer._complete = cut\n"
        "sys.exit(train.main(sys.argv[1:]))\n"
    )
    args = flags(train__max_steps=6, checkpoint__every_steps=4, eval__target=0)
    whole, out = tmp_path / "whole", tmp_path / "run"
    assert run_train(whole, *args, timeout=300).returncode == 0
    killed = subprocess.run([sys.executable, "-c", cut, *train_command(out, *args)[3:]], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (out / "checkpoints" / "step_00000006.tmp").is_dir() and newest(out).name == "step_00000004"
    records = snapshot(out)
    completed = run_train(out, *args, timeout=300)
    final = out / "checkpoints" / "step_00000006"
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert f"completed the final checkpoint {final} of the finished run (steps 5-6 again)" in completed.stdout
    assert {k: v for k, v in snapshot(out).items() if not k.startswith(("checkpoints/", "heartbeats/"))} == {
        k: v for k, v in records.items() if not k.startswith(("checkpoints/", "heartbeats/"))
    }  # mllog.log (one run_stop) and metrics.jsonl as the run left them
    assert [e["key"] for e in events(out)].count("run_stop") == 1
    assert newest(out) == final and not list((out / "checkpoints").glob("*.tmp"))
    cfg = load_config(out / "config.yaml")
    mine, reference = read_weights(cfg, final), read_weights(cfg, whole / "checkpoints" / "step_00000006")
    assert mine.keys() == reference.keys() and all(torch.equal(mine[k], reference[k]) for k in mine)
    again = run_train(out, *args, timeout=300)
    assert again.returncode == 2 and "holds a finished run" in again.stderr
