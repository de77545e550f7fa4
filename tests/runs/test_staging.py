"""docs/operating.md, "What flux-train writes and removes", walked command by command: a file or folder of the user's
is planted at every name a command stages under, or staged under before (`<out>.partial`, `*.partial`, `*.tmp`,
`step_XXXXXXXX.tmp`), and the command then either does its work beside it or refuses in one line naming it; the
user's files are as they were in every case. export stands for `sample --exported` too (one function writes both);
bench's saves need a GPU."""

import hashlib
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from run_outputs import events, set_flags, train_command

from dataprep.__main__ import main as dataprep
from dataprep.fixture import FixtureSpec, write_arrow
from flux_train.tools.export import main as export
from flux_train.training import train

ROOT = Path(__file__).resolve().parents[2]
MINE = "the user's own\n"


def plant(*paths: Path, folders: bool = False) -> None:
    """A file of the user's at each path, or (folders) a folder holding one."""
    for path in paths:
        target = path / "notes.txt" if folders else path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(MINE)


def files(folder: Path) -> dict[str, str]:
    """Every file under `folder` by content (the .lock files, rewritten at every start, aside)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def kept(before: dict[str, str], folder: Path) -> bool:
    """Whether the files of `before` are all there with the same content."""
    now = files(folder)
    return all(now.get(name) == digest for name, digest in before.items())


RUN = {"data.source": "synthetic", "eval.enabled": "false", "train.max_steps": 6, "checkpoint.every_steps": 2}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A debug run (in-process, on the synthetic set) stopped by a non-finite loss at step 3, found at step 4's
    sync: its checkpoint of step 2 is the newest, and the same command without the NaN resumes from it."""
    out = tmp_path_factory.mktemp("run")
    flags = set_flags({**RUN, "logging.out_dir": out, "train.inject_nan_at_step": 3})
    assert train.main(["--config", "configs/debug.yaml", *flags]) == 3
    return out


def test_export_writes_beside_the_users_staging_names_and_a_full_disk_leaves_nothing(run, tmp_path, capsys):
    """`export --out mine` beside the user's `mine.partial/` (with a file in it, which was removed) and
    `notes.partial`; then a full disk (a file size limit under the weights' size) in a real export process: one
    line, exit 74, its staging removed, the user's files as they were."""
    plant(tmp_path / "mine.partial", folders=True)
    plant(tmp_path / "notes.partial")
    before = files(tmp_path)
    argv = ["export", "--config", "configs/debug.yaml", "--checkpoint", str(run / "checkpoints")]
    assert export([*argv, "--out", str(tmp_path / "mine")]) == 0, capsys.readouterr().err
    assert kept(before, tmp_path) and (tmp_path / "mine" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "mine.partial", "notes.partial"]

    def full_disk() -> None:  # the weights are 3 MB
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    before = files(tmp_path)
    command = [sys.executable, "-m", "flux_train.checkpoint", *argv, "--out", str(tmp_path / "full")]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300, preexec_fn=full_disk)
    assert proc.returncode == 74 and proc.stderr.strip().splitlines() == [
        f"fatal: writing the export --out {tmp_path / 'full'} failed (SafetensorError: Error while serializing: I/O "
        "error: File too large (os error 27))"
    ], proc.stderr[-3000:]
    assert files(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "mine",
        "mine.partial",
        "notes.partial",
    ]


def test_dataprep_leaves_the_users_partial_files_and_refuses_to_adopt_a_shard_name(tmp_path, capsys):
    """convert into a folder holding the user's `notes.partial` files where dataprep stages (the split folders, its
    bookkeeping), which a rerun removed: converted beside them, twice (the second run resumes, finding every shard
    done). A file of the user's at a shard's staging name in a folder no conversion has started is refused."""
    inputs = write_arrow(tmp_path / "arrow", FixtureSpec(train=6, val=3, text_len=4, height=2, width=2))
    out = tmp_path / "ds"
    plant(out / "notes.partial", out / "train" / "notes.partial", out / ".dataprep" / "train" / "notes.partial")
    before = files(out)
    argv = ["convert", "--train", str(inputs["train"]), "--val", str(inputs["val"]), "--shape", "4,2,2"]
    argv += ["--samples-per-shard", "4", "--workers", "1"]
    for _ in range(2):
        assert dataprep([*argv, "--out", str(out)]) == 0
        assert kept(before, out) and (out / "train" / "shard_000001.tar").is_file()

    fresh = tmp_path / "fresh"
    plant(fresh / "train" / "shard_000000.tar.partial")
    before = files(fresh)
    capsys.readouterr()
    assert dataprep([*argv, "--out", str(fresh)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {fresh / 'train' / 'shard_000000.tar.partial'}: a file of that name is there, not written by this "
        "conversion; move it away and rerun"
    )
    assert kept(before, fresh)


def test_the_trainer_leaves_the_users_files_at_its_staging_names(run, tmp_path):
    """A run resumed in a folder holding the user's files at the names the trainer staged under
    (`mllog.log.tmp`, `metrics.jsonl.tmp`, `heartbeats/rank_00000.tmp`: written and renamed over the real file) and a
    folder of the user's at a checkpoint's staging name (`step_00000004.tmp/`, removed at the start): refused in
    one line before init_start, naming it; moved away, the run resumes and finishes beside the rest."""
    out = shutil.copytree(run, tmp_path / "run")
    foreign = out / "checkpoints" / "step_00000004.tmp"
    plant(out / "mllog.log.tmp", out / "metrics.jsonl.tmp", out / "heartbeats" / "rank_00000.tmp")
    plant(foreign, folders=True)
    before = files(out)
    command = train_command(out, *set_flags(RUN))
    refused = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"config error: {foreign} was not made by a save of flux-train (no .flux-train-staging in it), and a save of "
        "that step would need its name: move it out of checkpoint.dir"
    ], refused.stderr[-3000:]
    assert files(out) == before
    shutil.move(foreign, tmp_path / "moved")
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0 and "resumed from" in done.stdout, done.stderr[-3000:]
    planted = ("mllog.log.tmp", "metrics.jsonl.tmp", "heartbeats/rank_00000.tmp")
    assert kept({name: before[name] for name in planted}, out)
    assert (out / "checkpoints" / "step_00000006" / "progress.pt").is_file()
    assert [e["key"] for e in events(out)].count("run_start") == 1


def test_a_lock_file_of_the_users_is_refused_not_overwritten(tmp_path):
    """`.lock` is the one fixed name every writing command takes in its folder (rewritten at every start with its
    holder's line): a file of that name holding anything else is the user's, and stays."""
    from dataprep.folder_lock import FolderLockError, lock_folder

    plant(tmp_path / ".lock")
    with pytest.raises(FolderLockError) as refused:
        lock_folder(tmp_path, "--out")
    assert (
        str(refused.value) == f"--out {tmp_path}: {tmp_path / '.lock'} is not a lock file of this tool's; move it away"
    )
    assert (tmp_path / ".lock").read_text() == MINE
    (tmp_path / ".lock").write_text("")  # made, then cut before its holder's line: ours
    with lock_folder(tmp_path, "--out"):
        assert (tmp_path / ".lock").read_text().startswith("host ")
