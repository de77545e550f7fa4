"""`convert` + `prepare` on real HF-arrow inputs: byte-identical round trip in the on-disk layout, crash and
rerun, and bad input (hard stop naming file and row, or --skip-bad counted and listed)."""

import contextlib
import hashlib
import io
import json
import os
import resource
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from megatron.energon import WorkerConfig, get_loader, get_val_dataset
from processes import alive, children, maps
from slurm_cluster import wait_for

from dataprep.__main__ import main
from dataprep.convert import convert
from dataprep.fixture import FixtureSpec, fixture_samples, save_arrow, write_arrow
from dataprep.format import DataprepError, Shape, decode_bf16, encode_bf16
from dataprep.prepare import prepare
from flux_train.data.energon import FluxTaskEncoder

ROOT = Path(__file__).resolve().parents[2]
SPEC = FixtureSpec(train=11, val=6, text_len=4, height=2, width=2, seed=5)
SHAPE = Shape(4, 2, 2)


def members(tar):
    with tarfile.open(tar) as t:
        return {m.name: t.extractfile(m).read() for m in t}


def energon_samples(root, split):
    worker_config = WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = get_val_dataset(
        root, split_part=split, worker_config=worker_config, batch_size=None, task_encoder=FluxTaskEncoder()
    )
    return list(get_loader(ds))


@pytest.mark.slow
def test_round_trip_arrow_convert_prepare_energon_is_byte_identical(tmp_path):
    inputs = write_arrow(tmp_path / "arrow", SPEC)
    out = tmp_path / "ds"
    rc = main(
        [
            "convert",
            "--train",
            str(inputs["train"]),
            "--val",
            str(inputs["val"]),
            "--out",
            str(out),
            "--shape",
            str(SHAPE),
            "--samples-per-shard",
            "4",
            "--workers",
            "2",
        ]
    )
    assert rc == 0
    prepare(out, workers=1)
    rows = {split: list(fixture_samples(SPEC, split)) for split in ("train", "val")}

    # the layout: shards of 4, index.txt, members KEY.json/.t5/.clip/.mean/.logvar.bytes, keys unique across splits
    assert (out / "train" / "index.txt").read_text().split() == [f"shard_{i:06d}.tar" for i in range(3)]
    assert (out / "val" / "index.txt").read_text().split() == [f"shard_{i:06d}.tar" for i in range(2)]
    first_key = {"train": 0, "val": SPEC.train}
    for split in ("train", "val"):
        tars = {}
        for name in (out / split / "index.txt").read_text().split():
            tars.update(members(out / split / name))
        assert len(tars) == 5 * len(rows[split])
        for i, row in enumerate(rows[split]):
            key = f"{first_key[split] + i:08d}"
            meta = {"key": row["key"]} | ({"timestep": row["timestep"]} if split == "val" else {})
            assert tars[f"{key}.json"] == json.dumps(meta).encode()
            for part, raw in row["parts"].items():
                assert tars[f"{key}.{part}.bytes"] == raw  # the npy bytes unchanged
    assert yaml.safe_load((out / ".nv-meta" / "dataset.yaml").read_text()) == {
        "__module__": "megatron.energon",
        "__class__": "CrudeWebdataset",
    }
    split_parts = yaml.safe_load((out / ".nv-meta" / "split.yaml").read_text())["split_parts"]
    assert split_parts["train"] == ["train/shard_{000000..000002}.tar"]
    assert split_parts["val"] == ["val/shard_{000000..000001}.tar"]

    # energon reads back the same keys and arrays
    for split in ("train", "val"):
        samples = energon_samples(out, split)
        assert [s["__key__"] for s in samples] == [f"{first_key[split] + i:08d}" for i in range(len(rows[split]))]
        for sample, row in zip(samples, rows[split]):
            for part, raw in row["parts"].items():
                assert torch.equal(sample[part].view(torch.int16), decode_bf16(raw).view(torch.int16))
            if split == "val":
                assert int(sample["timestep"]) == row["timestep"]


def digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.tar"))}


@pytest.mark.slow
def test_killed_convert_reruns_to_the_same_shards_without_partial_files(tmp_path):
    spec = FixtureSpec(train=40, val=0, text_len=256, height=2, width=2, samples_per_shard=2)
    inputs = write_arrow(tmp_path / "arrow", spec)
    args = [
        sys.executable,
        "-m",
        "dataprep",
        "convert",
        "--train",
        str(inputs["train"]),
        "--shape",
        "256,2,2",
        "--samples-per-shard",
        "2",
        "--workers",
        "1",
    ]
    reference = tmp_path / "reference"
    subprocess.run([*args, "--out", str(reference)], check=True, capture_output=True, cwd=ROOT, timeout=600)

    out = tmp_path / "out"
    proc = subprocess.Popen(
        [*args, "--out", str(out)],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    records = out / ".dataprep" / "train"
    deadline = time.time() + 300
    while len(list(records.glob("shard_*.tar.json"))) < 3 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the converter and its worker, mid-run
    proc.wait()
    finished = len(list(records.glob("shard_*.tar.json")))
    assert proc.returncode == -signal.SIGKILL and 3 <= finished < 20, (proc.returncode, finished)
    (out / "train" / "shard_000019.tar.partial").write_bytes(b"half a shard")  # as a crash mid-write leaves it

    rerun = subprocess.run([*args, "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"{finished} already finished" in rerun.stdout
    assert not list(out.rglob("*.partial"))
    assert digests(out / "train") == digests(reference / "train") and len(digests(reference / "train")) == 20
    assert (out / "train" / "index.txt").read_text() == (reference / "train" / "index.txt").read_text()


@pytest.mark.slow
def test_a_killed_worker_is_one_line_naming_its_shard_and_the_rerun_finishes(tmp_path):
    """SIGKILL to the pool's worker in the middle of a shard, as the out-of-memory killer sends it: convert ends in
    one line naming that shard, exit 1 (it was BrokenProcessPool's traceback), and the same command again finishes."""
    spec = FixtureSpec(train=40, val=0, text_len=256, height=2, width=2, samples_per_shard=2)
    inputs = write_arrow(tmp_path / "arrow", spec)
    out = tmp_path / "out"
    args = [sys.executable, "-m", "dataprep", "convert", "--train", str(inputs["train"]), "--shape", "256,2,2"]
    args += ["--samples-per-shard", "2", "--workers", "1", "--out", str(out)]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    frozen: list = []

    def writing_a_shard() -> bool:  # the worker stopped while a shard of its is partial, or let go on a little
        worker = next((pid for pid in children(proc.pid) if str(inputs["train"]) in maps(pid)), None)
        if worker is None:
            return False
        os.kill(worker, signal.SIGSTOP)
        frozen[:] = [worker, *(out / "train").glob("*.partial")]
        if len(frozen) > 1:
            return True
        os.kill(worker, signal.SIGCONT)
        return False

    try:
        wait_for(writing_a_shard, 120, "the worker in the middle of a shard", interval=0.002)
        worker, partial = frozen[:2]
        os.kill(worker, signal.SIGKILL)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    shard = f"train/{partial.name.removesuffix('.partial')}"
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert err.splitlines()[-1] == (
        f"error: a convert worker was killed (or crashed) while writing {shard}; the out-of-memory killer is the "
        "usual cause (dmesg names it): lower --workers, then run the same command again (finished shards are kept)"
    )
    rerun = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert rerun.returncode == 0 and " already finished" in rerun.stdout, rerun.stderr[-3000:]
    assert len(digests(out / "train")) == 20 and not list(out.rglob("*.partial"))


def bad_input(tmp_path, mutate, val=False):
    samples = list(fixture_samples(SPEC, "val" if val else "train"))
    mutate(samples)
    return save_arrow(tmp_path / "bad", samples, val)


def wrong_shape(samples):
    buf = io.BytesIO()
    np.save(buf, np.zeros((5, 4096), np.uint16))
    samples[7]["parts"]["t5"] = buf.getvalue()


def duplicate_key(samples):
    samples[9]["key"] = samples[2]["key"]


def test_bad_sample_stops_with_file_row_and_problem_and_leaves_no_partial_shard(tmp_path):
    path = bad_input(tmp_path, wrong_shape)
    with pytest.raises(
        DataprepError,
        match=rf"{path}: row 7 \(__key__ 'train-7'\): t5: shape \[5, 4096\], "
        r"expected \[4, 4096\]; fix the input or pass --skip-bad",
    ):
        convert(tmp_path / "out", path, None, 4, SHAPE, 1, skip_bad=False)
    assert not list((tmp_path / "out").rglob("*.partial"))
    assert not (tmp_path / "out" / "train" / "shard_000001.tar").exists()  # the shard holding row 7
    assert not (tmp_path / "out" / "train" / "index.txt").exists()


def test_duplicate_keys_and_missing_columns_stop_before_writing(tmp_path):
    path = bad_input(tmp_path, duplicate_key)
    with pytest.raises(DataprepError, match=rf"{path}: row 9: duplicate __key__ 'train-2' \(first at row 2\)"):
        convert(tmp_path / "out", path, None, 4, SHAPE, 1, skip_bad=False)
    with pytest.raises(DataprepError, match=r"missing column\(s\) \['timestep'\]"):
        convert(tmp_path / "out2", None, path, 4, SHAPE, 1, skip_bad=False)  # val needs timesteps
    with pytest.raises(DataprepError, match="not a Hugging Face save_to_disk dataset"):
        convert(tmp_path / "out3", tmp_path / "nowhere", None, 4, SHAPE, 1, skip_bad=False)


def test_skip_bad_counts_and_lists_the_skipped_samples(tmp_path, capsys):
    def both(samples):
        wrong_shape(samples)
        duplicate_key(samples)

    path = bad_input(tmp_path, both)
    out = tmp_path / "out"
    assert (
        main(
            [
                "convert",
                "--train",
                str(path),
                "--out",
                str(out),
                "--shape",
                str(SHAPE),
                "--samples-per-shard",
                "4",
                "--workers",
                "1",
                "--skip-bad",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "skipped inputs  2" in printed and "row 7 'train-7': t5: shape [5, 4096]" in printed
    listed = (out / ".dataprep" / "train" / "skipped.tsv").read_text().splitlines()
    assert [line.split("\t")[:2] for line in listed[1:]] == [["7", "train-7"], ["9", "train-2"]]
    prepare(out, workers=1, quiet=True)
    keys = [s["__key__"] for s in energon_samples(out, "train")]
    assert keys == [f"{i:08d}" for i in range(SPEC.train) if i not in (7, 9)]


def nvidia_layout(out, val_first_key):
    """Shards as NVIDIA's to_webdataset.py writes them (tarfile defaults, json first, its json bytes)."""
    rows = {split: list(fixture_samples(SPEC, split)) for split in ("train", "val")}
    for split, first in (("train", 0), ("val", val_first_key)):
        (out / split).mkdir(parents=True)
        with tarfile.open(out / split / "shard_000000.tar", "w") as tar:
            for i, row in enumerate(rows[split]):
                meta = {"key": row["key"]} | ({"timestep": row["timestep"]} if split == "val" else {})
                for ext, data in [("json", json.dumps(meta).encode())] + [
                    (f"{p}.bytes", row["parts"][p]) for p in ("t5", "clip", "mean", "logvar")
                ]:
                    info = tarfile.TarInfo(f"{first + i:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return rows


def test_prepare_refuses_nvidia_duplicate_keys_with_guidance_and_reads_their_tars(tmp_path):
    """NVIDIA's writer restarts keys at 0 in val/: energon >= 7.3 calls sys.exit on that, we raise. With unique
    keys, their tar layout prepares and loads like ours."""
    nvidia_layout(tmp_path / "restarting", val_first_key=0)
    with pytest.raises(DataprepError, match="sample keys repeat across shards.*restarts keys at 00000000 in val"):
        prepare(tmp_path / "restarting", workers=1, quiet=True)
    rows = nvidia_layout(tmp_path / "unique", val_first_key=SPEC.train)
    prepare(tmp_path / "unique", workers=1, quiet=True)
    for split in ("train", "val"):
        samples = energon_samples(tmp_path / "unique", split)
        assert len(samples) == len(rows[split])
        for sample, row in zip(samples, rows[split]):
            assert encode_bf16(sample["t5"]) == row["parts"]["t5"]
            assert int(sample.get("timestep", -1)) == (row["timestep"] if split == "val" else -1)


def test_a_second_writer_of_an_output_folder_is_refused_naming_the_holder(tmp_path):
    """This process holds --out's lock, as a running convert does: another convert into it stops before writing
    anything (two converts writing one folder at once left shards of zeros)."""
    import socket

    from dataprep.folder_lock import lock_folder

    out = tmp_path / "out"
    command = [sys.executable, "-m", "dataprep", "convert", "--train", str(tmp_path / "in"), "--out", str(out)]
    with lock_folder(out, "--out"):
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert line.startswith(f"error: --out {out} is in use by host {socket.gethostname()} pid {os.getpid()} since ")
    assert line.endswith("; wait for it to end, or choose another --out") and "\n" not in line
    assert not out.exists()  # the refused convert wrote nothing; the holder's lock went with it, and the folder it made


def test_a_lock_let_go_is_never_taken_on_the_file_its_holder_removed(tmp_path, monkeypatch):
    """Letting go removes the lock file (a failed start leaves no folder holding only `.lock`). A process that had
    opened it just before holds a removed file once it locks it: it must take the one at the path instead, or two
    processes would both hold "the" lock."""
    from dataprep import folder_lock

    out = tmp_path / "out"
    held = folder_lock.lock_folder(out, "--out")
    stale = open(out / folder_lock.LOCK_FILE, "r+")  # opened before the holder let go
    held.release()
    assert not out.exists()  # the lock made the folder, and nothing else was written there
    opened = iter([stale])
    real = folder_lock._open
    monkeypatch.setattr(folder_lock, "_open", lambda path, setting: next(opened, None) or real(path, setting))
    with folder_lock.lock_folder(out, "--out") as lock:
        assert stale.closed and os.path.samefile(f"/proc/self/fd/{lock.handle.fileno()}", out / ".lock")


def test_a_full_disk_while_writing_a_shard_is_one_line_exit_74_and_the_rerun_finishes(tmp_path):
    """A file size limit under a shard's size (RLIMIT_FSIZE: the write fails with EFBIG, as one to a full disk fails
    with ENOSPC; the pool's worker inherits it): convert stops in one line naming the shard, with exit 74 as
    docs/operating.md's exit codes say (it was 2, a bad input's), and leaves no partial file; with room again, the
    same command finishes."""
    inputs = write_arrow(tmp_path / "arrow", FixtureSpec(train=4, val=0, text_len=256, height=2, width=2))
    out = tmp_path / "out"
    args = [sys.executable, "-m", "dataprep", "convert", "--train", str(inputs["train"]), "--shape", "256,2,2"]
    args += ["--samples-per-shard", "2", "--workers", "1", "--out", str(out)]

    def limited() -> None:  # a shard of two samples is 4 MiB
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    full = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600, preexec_fn=limited)
    assert full.returncode == 74 and "Traceback" not in full.stderr, full.stderr[-3000:]
    assert full.stderr.strip().splitlines()[-1] == (  # below the progress bar
        f"error: {out / 'train' / 'shard_000000.tar'}: writing it failed (File too large); make room and rerun the "
        "same command (finished shards are kept)"
    )
    assert not list(out.rglob("*.partial")) and not list(out.rglob("*.tar"))
    rerun = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (out / "train" / "index.txt").read_text().split() == ["shard_000000.tar", "shard_000001.tar"]


def test_killed_convert_takes_its_pool_along(tmp_path):
    """SIGKILL of convert alone (not its process group) while its spawned pool converts: the workers end too (the
    parent-death signal) instead of waiting on their queues forever with the input mapped."""
    inputs = write_arrow(tmp_path / "arrow", FixtureSpec(train=24, val=0, text_len=256, height=2, width=2))
    args = ["--train", str(inputs["train"]), "--shape", "256,2,2", "--samples-per-shard", "2", "--workers", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataprep", "convert", *args, "--out", str(tmp_path / "out")],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pool: list[int] = []

    def converting() -> bool:  # a worker has mapped the input: it is past its start-up
        pool[:] = children(proc.pid)
        return any(str(inputs["train"]) in maps(pid) for pid in pool)

    try:
        wait_for(converting, 60, "a pool worker reading the input")
        proc.kill()
        assert proc.wait() == -signal.SIGKILL  # killed mid-run, not finished
        wait_for(lambda: not [pid for pid in pool if alive(pid)], 5, "the pool to end with convert")
    finally:
        for pid in [proc.pid, *pool]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
