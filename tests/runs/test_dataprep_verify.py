"""`verify` passes a clean dataset with its counts and fails on each planted defect, naming it; the dataset
describes itself (shape and counts, written by `prepare`) and verify checks the samples against that."""

import io
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
from shell import python_on_path

from dataprep import digests
from dataprep.__main__ import main
from dataprep.fixture import FixtureSpec, write_fixture
from dataprep.format import METADATA, DatasetInfo, Shape, read_info, write_info
from dataprep.prepare import prepare

ROOT = Path(__file__).resolve().parents[2]
SPEC = FixtureSpec(train=10, val=9, text_len=4, height=2, width=2, samples_per_shard=5)
SHAPE = "4,2,2"


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("verify") / "clean", SPEC)


@pytest.fixture
def dataset(clean, tmp_path):
    return shutil.copytree(clean, tmp_path / "ds")


def verify(root, capsys):
    rc = main(["verify", str(root), "--shape", SHAPE, "--workers", "0"])
    return rc, capsys.readouterr().out


def rewrite(tar_path, drop=(), replace=None):
    """Rewrite a shard without some members / with other bytes for some, then re-index the dataset."""
    with tarfile.open(tar_path) as t:
        members = [(m, t.extractfile(m).read()) for m in t]
    with tarfile.open(tar_path, "w") as t:
        for member, data in members:
            if member.name in drop:
                continue
            data = (replace or {}).get(member.name, data)
            member.size = len(data)
            t.addfile(member, io.BytesIO(data))


def test_clean_dataset_passes_with_counts_per_split_and_timestep(clean, capsys):
    rc, out = verify(clean, capsys)
    assert rc == 0, out
    assert "train             10 samples" in out and "val               9 samples" in out
    assert "val per timestep  0: 2, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1" in out
    assert "train digests     2 shards, every byte checked" in out and "val digests       2 shards" in out
    assert "defects           none" in out


def test_truncated_tar_is_named(dataset, capsys):
    shard = dataset / "train" / "shard_000001.tar"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a copy cut mid-sample
    rc, out = verify(dataset, capsys)
    assert rc == 1
    assert f"{shard}: truncated or corrupt tar" in out


def test_a_swapped_or_changed_shard_is_named_by_its_digest_and_data_without_digests_passes(dataset, capsys):
    """Two shards of the same size swapped, and a byte changed past a shard's start: their lengths, offsets and
    samples are fine, their content is not what dataprep wrote. Without digests (data made by another tool) verify
    says so and checks the rest."""
    first, second = dataset / "train" / "shard_000000.tar", dataset / "train" / "shard_000001.tar"
    assert first.stat().st_size == second.stat().st_size
    first.rename(dataset / "x")
    second.rename(first)
    (dataset / "x").rename(second)
    val = dataset / "val" / "shard_000001.tar"
    data = val.read_bytes()
    at = data.rindex(b'"key": "val-8"') + len(b'"key": "val-')  # the last sample's source key, past the head
    assert at > digests.HEAD_BYTES
    val.write_bytes(data[:at] + b"9" + data[at + 1 :])  # still a readable sample
    rc, out = verify(dataset, capsys)
    assert rc == 1
    swapped = "its first bytes differ from its digest (another shard in its place, or changed)"
    assert f"{first}: {swapped}" in out and f"{second}: {swapped}" in out
    assert f"{val}: bytes 0-{val.stat().st_size} differ from its digest (changed)" in out
    assert "defects           3\n" in out
    for split in ("train", "val"):
        (dataset / split / digests.FILE).unlink()
    rc, out = verify(dataset, capsys)
    assert rc == 0 and "train digests     none (made by another tool)" in out, out


def test_wrong_shape_is_named(dataset, capsys):
    buf = io.BytesIO()
    np.save(buf, np.zeros((3, 4096), np.uint16))
    rewrite(dataset / "val" / "shard_000000.tar", replace={"00000012.t5.bytes": buf.getvalue()})
    prepare(dataset, workers=1, quiet=True)
    rc, out = verify(dataset, capsys)
    assert rc == 1
    assert "val/shard_000000.tar: sample 00000012: t5: shape [3, 4096], expected [4, 4096]" in out


def test_missing_member_is_named(dataset, capsys):
    rewrite(dataset / "train" / "shard_000000.tar", drop={"00000003.logvar.bytes"})
    prepare(dataset, workers=1, quiet=True)
    rc, out = verify(dataset, capsys)
    assert rc == 1
    assert "train/shard_000000.tar: sample 00000003: logvar: missing or empty" in out


def test_missing_empty_encodings_and_metadata_are_named(dataset, capsys):
    (dataset / "empty_encodings" / "clip_empty.npy").unlink()
    rc, out = verify(dataset, capsys)
    assert rc == 1 and "empty_encodings/clip_empty.npy: missing" in out
    (dataset / ".nv-meta" / "dataset.yaml").unlink()
    rc, out = verify(dataset, capsys)
    assert rc == 1 and ".nv-meta/dataset.yaml: missing; run `python -m dataprep prepare" in out


def test_fixture_then_verify_with_no_flags_passes(tmp_path, capsys):
    assert main(["fixture", "--out", str(tmp_path / "ds"), "--train", "6", "--val", "5"]) == 0
    rc = main(["verify", str(tmp_path / "ds"), "--workers", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "sample shape      L,H,W 16,8,8 (recorded in the dataset)" in out
    info = read_info(tmp_path / "ds")
    assert info == DatasetInfo(
        Shape(16, 8, 8), {"train": {"shards": 1, "samples": 6}, "val": {"shards": 1, "samples": 5}}
    )


def test_samples_unlike_the_recorded_shape_fail_naming_the_sample(tmp_path, capsys):
    root = write_fixture(tmp_path / "full", FixtureSpec(train=2, val=1, text_len=256, height=32, width=32))
    write_info(root, DatasetInfo(Shape(16, 8, 8), read_info(root).splits))  # metadata says 16,8,8
    rc = main(["verify", str(root), "--workers", "0"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "train/shard_000000.tar: sample 00000001: t5: shape [256, 4096], expected [16, 4096]" in out
    assert "val/shard_000000.tar: sample 00000002: mean: shape [16, 32, 32], expected [16, 8, 8]" in out


def test_shape_flag_asserts_the_recorded_shape(clean, capsys):
    rc = main(["verify", str(clean), "--shape", "256,32,32", "--workers", "0"])
    out = capsys.readouterr().out
    assert rc == 1
    assert f"{clean / METADATA}: the dataset's samples are L,H,W 4,2,2, --shape expects 256,32,32" in out
    assert "t5: shape" not in out  # the samples are what the dataset says they are


def test_missing_description_and_stale_counts_are_named(dataset, capsys):
    info = read_info(dataset)
    write_info(dataset, DatasetInfo(info.shape, {**info.splits, "val": {"shards": 2, "samples": 8}}))
    rc, out = verify(dataset, capsys)
    assert rc == 1 and f"{dataset / METADATA}: records 8 val samples, 9 were read; rerun" in out
    (dataset / METADATA).unlink()
    rc = main(["verify", str(dataset), "--workers", "0"])
    out = capsys.readouterr().out
    assert (
        rc == 1
        and f"{dataset / METADATA}: missing, so the sample shape is unknown; run `python -m dataprep prepare {dataset}`"
        in out
    )


@pytest.mark.slow
def test_the_documented_arrow_fixture_path_ends_green_showing_only_our_lines(tmp_path):
    """docs/data.md's MLCommons path on the --arrow fixture (fixture, convert, copy the empty encodings, prepare,
    verify), as written there: verify finds no defect (nothing wrote the empty encodings, and nothing could without
    the T5 and CLIP weights); and what the commands print is ours, without datasets' progress bars or energon's
    "Saving info ... Collapsing split parts" inside prepare's bar."""
    text = (ROOT / "docs" / "data.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "fixture --arrow" in b)
    done = subprocess.run(
        ["bash", "-euc", block],
        cwd=tmp_path,
        env=python_on_path(tmp_path / "bin") | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^  defects +none$", done.stdout, re.M), done.stdout
    printed = done.stdout + done.stderr
    for noise in ("Saving info", "Collapsing split parts", "Generating train split", "Saving the dataset"):
        assert noise not in printed, printed
