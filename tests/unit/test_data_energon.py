"""The energon loaders (flux_train.data.energon) on real datasets written by dataprep: the cooker, the train stream's
order, the val pass's counts, the empty encodings, a dataset unlike the model or damaged. In fresh processes, loader
workers and gloo ranks (exact resume, the val pass's coverage on any number of ranks, two-rank training):
tests/runs/test_data_energon.py."""

import io
import json
import os
import shutil
import tarfile

import numpy as np
import pytest
import torch

from dataprep import digests
from dataprep.fixture import FixtureSpec, fixture_samples, write_fixture
from dataprep.format import (
    METADATA,
    DatasetInfo,
    FormatError,
    Shape,
    encode_bf16,
    load_empty_encodings,
    read_info,
    write_empty_encodings,
    write_info,
)
from flux_train.config import DataConfig, load_config
from flux_train.data.contract import DataError
from flux_train.data.energon import EnergonTrainStream, build_energon, cook, val_counts
from flux_train.private_apis import energon_shard_end

SPEC = FixtureSpec(train=24, val=13, text_len=4, height=2, width=2, seed=3, samples_per_shard=5)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("energon") / "ds", SPEC)


def stream(path, rank=0, world=1, workers=0, seed=7, micro=3):
    d = DataConfig(num_workers=workers, shuffle_buffer_size=10, max_samples_per_sequence=5)
    return EnergonTrainStream(path, rank, world, micro, d, seed)


def fingerprint(batch):
    """Per sample, the first clip value: random, so it identifies the sample."""
    return [round(float(v), 4) for v in batch["clip"][:, 0].float()]


# ------------------------------------------------------------------ cooker


def nvidia_sample(parts, meta, json_as_dict=False):
    """A crude sample as energon hands it over for NVIDIA's layout: keys restart at 0, json bytes (decoder
    off, their choice) or dict (energon's default decoder)."""
    raw = {
        "__key__": "00000000",
        "__shard__": "val/shard_000000.tar",
        "__restore_key__": ("x", 0),
        "__sources__": (),
        "__subflavors__": {},
    }
    raw["json"] = meta if json_as_dict else json.dumps(meta).encode()
    raw.update({f"{p}.bytes": b for p, b in parts.items()})
    return raw


@pytest.mark.parametrize("json_as_dict", [False, True])
def test_cooker_reads_nvidia_layout_bytes_and_json_forms(json_as_dict):
    parts = next(fixture_samples(SPEC, "train"))["parts"]
    cooked = cook(nvidia_sample(parts, {"key": "abc", "timestep": 5}, json_as_dict))
    assert cooked["timestep"].dtype == torch.int64 and int(cooked["timestep"]) == 5
    for part, raw in parts.items():
        assert cooked[part].dtype == torch.bfloat16
        assert encode_bf16(cooked[part]) == raw  # bits unchanged
    assert cooked["__key__"] == "00000000"
    assert "timestep" not in cook(nvidia_sample(parts, {"key": "abc"}, json_as_dict))  # train: no timestep


def test_cooker_names_the_missing_member_and_bad_dtype():
    parts = dict(next(fixture_samples(SPEC, "train"))["parts"])
    del parts["mean"]
    with pytest.raises(DataError, match=r"val/shard_000000.tar: sample 00000000: missing member 00000000.mean.bytes"):
        cook(nvidia_sample(parts, {"key": "k"}))
    buf = io.BytesIO()
    np.save(buf, np.zeros(3, np.float32))
    parts["mean"] = buf.getvalue()
    with pytest.raises(DataError, match="sample 00000000: mean.bytes: dtype float32, expected uint16"):
        cook(nvidia_sample(parts, {"key": "k"}))


# ------------------------------------------------------------------ train stream


def test_same_seed_same_order_other_seed_other_order(dataset):
    a, b, c = stream(dataset), stream(dataset), stream(dataset, seed=8)
    first = [fingerprint(next(a)) for _ in range(8)]
    assert first == [fingerprint(next(b)) for _ in range(8)]
    assert first != [fingerprint(next(c)) for _ in range(8)]
    batch = next(stream(dataset))
    assert set(batch) == {"t5", "clip", "mean", "logvar"}  # the train contract, no timestep
    assert batch["t5"].shape == (3, 4, 4096) and batch["mean"].shape == (3, 16, 2, 2)
    assert all(v.dtype == torch.bfloat16 for v in batch.values())


def test_ranks_read_disjoint_samples(dataset):
    seen = [{v for _ in range(4) for v in fingerprint(next(s))} for s in (stream(dataset, 0, 2), stream(dataset, 1, 2))]
    assert not seen[0] & seen[1]


def test_state_from_another_layout_is_refused(dataset):
    state = stream(dataset, rank=0, world=2).state_dict()
    with pytest.raises(ValueError, match="saved with world_size=2, this run has world_size=1"):
        stream(dataset).load_state_dict(state)
    with pytest.raises(ValueError, match="num_workers=0, this run has num_workers=1"):
        stream(dataset, rank=0, world=2, workers=1).load_state_dict(state)


# ------------------------------------------------------------------ val pass


def test_val_counts_for_the_coco_size():
    # 29,696 COCO samples on 24 ranks x 4 workers do not split evenly; ranks differ by at most the workers
    counts = val_counts(29_696, 24, 4)
    assert sum(counts) == 29_696 and max(counts) - min(counts) <= 4
    assert val_counts(29_696, 8, 4) == [3712] * 8


# ------------------------------------------------------------------ empty encodings


def test_empty_encodings_are_float16_values_converted_not_viewed(tmp_path):
    values = torch.tensor([[0.5, -1.25, 3.0]])
    np.save(tmp_path / "t5_empty.npy", values.numpy().astype(np.float16)[None])
    np.save(tmp_path / "clip_empty.npy", values.numpy().astype(np.float16))
    t5, clip = load_empty_encodings(tmp_path)
    assert t5.dtype == clip.dtype == torch.bfloat16
    assert t5.shape == (1, 1, 3) and clip.float().tolist() == [[0.5, -1.25, 3.0]]
    np.save(tmp_path / "clip_empty.npy", np.zeros((1, 3), np.uint16))
    with pytest.raises(FormatError, match="clip_empty.npy: dtype uint16, expected float16 values"):
        load_empty_encodings(tmp_path)
    with pytest.raises(FormatError, match="missing; write it with `python -m dataprep empty-encodings`"):
        load_empty_encodings(tmp_path / "nowhere")


# ------------------------------------------------------------------ the trainer on it


def energon_config(path, *overrides):
    return load_config("configs/debug.yaml", [f"data.path={path}", *overrides])


def test_dims_mismatch_is_named_in_one_line_before_a_sample_is_read(dataset, tmp_path):
    with pytest.raises(DataError) as bad_model:
        build_energon(energon_config(dataset, "model.joint_attention_dim=3072"), 0, 1)
    assert str(bad_model.value) == (
        f"{dataset / METADATA}: the dataset's samples have t5 [4, 4096], the model takes t5 of width "
        "model.joint_attention_dim 3072; use a model config with flux-schnell's input dims"
    )
    other = tmp_path / "empty16"
    write_empty_encodings(other, torch.zeros(1, 16, 4096), torch.zeros(1, 768))
    with pytest.raises(DataError) as bad_empty:
        build_energon(energon_config(dataset, f"data.empty_encodings={other}"), 0, 1)
    assert str(bad_empty.value) == (
        f"{dataset / METADATA}: the dataset's samples have t5 [4, 4096], the empty encodings in {other} [16, 4096]; "
        "point data.empty_encodings at the ones made for this data"
    )


def test_a_sample_unlike_the_description_is_named_at_the_first_eval(dataset, tmp_path):
    copy = shutil.copytree(dataset, tmp_path / "ds")
    write_info(copy, DatasetInfo(Shape(4, 4, 4), read_info(copy).splits))
    source = build_energon(energon_config(copy), 0, 1)  # the description itself fits the model
    with pytest.raises(DataError) as exc:
        next(source.val())
    assert str(exc.value) == (
        f"val/shard_000000.tar: sample 00000024: t5 [4, 4096], mean [16, 2, 2], but "
        f"{copy / METADATA} says L,H,W 4,4,4; check the dataset with `python -m dataprep "
        f"verify {copy}`"
    )


# ------------------------------------------------------------------ bad shards


def test_a_shard_cut_short_is_named_before_anything_reads_it(dataset, tmp_path):
    copy = shutil.copytree(dataset, tmp_path / "ds")
    shard = copy / "train" / "shard_000001.tar"
    end = energon_shard_end(shard)
    os.truncate(shard, end - 100)
    with pytest.raises(DataError) as exc:
        build_energon(energon_config(copy), 0, 1)
    assert str(exc.value) == (
        f"{shard}: cut short ({end - 100} bytes, its samples end at byte {end} by energon's index); copy or "
        f"convert it again, then check the dataset with `python -m dataprep verify {copy}`"
    )


def test_a_shard_swapped_for_another_of_the_same_size_is_named_before_anything_reads_it(dataset, tmp_path, capsys):
    """Sizes and energon's offsets match (what was checked before); the start of each shard is checked against the
    digest dataprep wrote as it made it. A dataset without digests (made by another tool) loads, said once."""
    copy = shutil.copytree(dataset, tmp_path / "ds")
    first, second = copy / "train" / "shard_000000.tar", copy / "train" / "shard_000001.tar"
    assert first.stat().st_size == second.stat().st_size
    first.rename(copy / "x")
    second.rename(first)
    (copy / "x").rename(second)
    with pytest.raises(DataError) as exc:
        build_energon(energon_config(copy), 0, 1)
    assert str(exc.value) == (
        f"{first}: its first bytes differ from its digest (another shard in its place, or changed); copy or convert "
        f"it again, then check the dataset with `python -m dataprep verify {copy}`"
    )
    for split in ("train", "val"):
        (copy / split / digests.FILE).unlink()
    capsys.readouterr()
    build_energon(energon_config(copy), 0, 1)
    assert capsys.readouterr().out.splitlines() == [
        f"flux-train: note: {copy} has no shard digests in train and val (made by another tool than python -m "
        "dataprep): their contents are not checked"
    ]


def test_a_garbled_tar_header_is_one_line_naming_the_shard(dataset, tmp_path):
    copy = shutil.copytree(dataset, tmp_path / "ds")
    with tarfile.open(copy / "train" / "shard_000002.tar") as tar:
        offset = [m for m in tar][5].offset  # the second sample's first header
    with open(copy / "train" / "shard_000002.tar", "r+b") as f:
        f.seek(offset)
        f.write(os.urandom(512))
    train = stream(copy, micro=4)
    with pytest.raises(DataError) as exc:
        for _ in range(20):
            next(train)
    assert str(exc.value) == (
        f"{copy}: reading the train split failed (ValueError: Unexpected end of tar file: train/shard_000002.tar); "
        f"`python -m dataprep verify {copy}` names every bad shard"
    )


@pytest.mark.parametrize("workers", [0, 1])
def test_a_sample_of_the_wrong_dtype_is_named_once_in_our_words(dataset, tmp_path, capfd, workers):
    """energon printed "Except <our message> in MapDataset.functools.partial(...)" on stdout before our line; now
    nothing but our error, in the loader's process or in its worker."""
    from dataprep.prepare import prepare

    copy = shutil.copytree(dataset, tmp_path / "ds")
    shard = copy / "train" / "shard_000001.tar"
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar]
    bad = next(m for m, _ in members if m.name.endswith(".mean.bytes"))
    as_float32 = io.BytesIO()
    np.save(as_float32, np.zeros((16, 2, 2), np.float32))
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for member, data in members:
            data = as_float32.getvalue() if member is bad else data
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    prepare(copy, workers=1, quiet=True)  # the index of the rewritten shard
    capfd.readouterr()
    train = stream(copy, workers=workers, micro=4)
    with pytest.raises(DataError) as exc:
        for _ in range(20):
            next(train)
    assert str(exc.value) == (
        f"train/shard_000001.tar: sample {bad.name.split('.')[0]}: mean.bytes: dtype float32, expected uint16 "
        "(bf16 bits)"
    )
    printed = capfd.readouterr()
    assert "Except" not in printed.out + printed.err, printed


@pytest.mark.parametrize(
    "damage,message",
    [
        ("empty_encodings/t5_empty.npy", "{copy}/empty_encodings/t5_empty.npy: not a readable .npy file ("),
        (".nv-meta/split.yaml", "{copy}: energon cannot open it (JsonValueError: "),
    ],
)
def test_garbled_metadata_or_empty_encodings_are_one_line_naming_them(dataset, tmp_path, damage, message):
    copy = shutil.copytree(dataset, tmp_path / "ds")
    (copy / damage).write_text("split_parts: 5\n")
    with pytest.raises(DataError) as exc:
        build_energon(energon_config(copy), 0, 1)
    assert str(exc.value).startswith(message.format(copy=copy)), str(exc.value)
    assert "\n" not in str(exc.value)
