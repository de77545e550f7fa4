"""`fixture`: a tiny dataset in the real format (any L, H, W), for tests and the debug run.

Train samples are random (the values the trainer's synthetic source draws for one sample); val sample i
copies the arrays of train sample i mod N under its own key (val keys continue after train), with timestep
i mod 8, so a debug run can show that the trainer overfits. The same samples can instead be written as the
MLCommons Hugging Face (Arrow) input of `convert`, with the empty encodings beside it.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from dataprep.convert import COLUMNS
from dataprep.extras import require
from dataprep.format import EVAL_TIMESTEP_BINS, PARTS, Shape, encode_bf16, tar_sample, write_empty_encodings
from dataprep.prepare import prepare
from dataprep.shards import SplitWriter, plan_shards

MARKER = "fixture.json"


@dataclass(frozen=True)
class FixtureSpec:
    train: int = 16
    val: int = 16
    text_len: int = 16
    height: int = 8
    width: int = 8
    seed: int = 0
    samples_per_shard: int = 8

    @property
    def name(self) -> str:
        return (
            f"train{self.train}-val{self.val}-L{self.text_len}-{self.height}x{self.width}-seed{self.seed}"
            f"-shard{self.samples_per_shard}"
        )


def random_sample(shape: Shape, seed: int) -> dict[str, torch.Tensor]:
    """One sample of random bf16 parts: t5, clip, mean, then logvar around -4 from one generator, as the
    trainer's synthetic source draws them."""
    g = torch.Generator().manual_seed(seed)
    return {
        part: (torch.randn(shape.of(part), generator=g) - (4.0 if part == "logvar" else 0.0)).to(torch.bfloat16)
        for part in PARTS
    }


def fixture_samples(spec: FixtureSpec, split: str) -> Iterator[dict]:
    """Per sample (made one at a time, so any size fits in memory): the source key, the four parts' npy
    bytes, the timestep (val only)."""
    shape = Shape(spec.text_len, spec.height, spec.width)

    def parts(i: int) -> dict:
        return {part: encode_bf16(value) for part, value in random_sample(shape, spec.seed * 100_003 + i).items()}

    if split == "train":
        return ({"key": f"train-{i}", "parts": parts(i), "timestep": None} for i in range(spec.train))
    return (
        {"key": f"val-{i}", "parts": parts(i % spec.train), "timestep": i % EVAL_TIMESTEP_BINS} for i in range(spec.val)
    )


def empty_encodings(spec: FixtureSpec) -> tuple[torch.Tensor, torch.Tensor]:
    empty = random_sample(Shape(spec.text_len, 2, 2), spec.seed + 2)
    return empty["t5"][None], empty["clip"][None]


def write_fixture(root: Path, spec: FixtureSpec) -> Path:
    """Shards, index.txt, empty encodings and energon metadata under root."""
    first_key = 0
    for split, rows in (("train", spec.train), ("val", spec.val)):
        writer = SplitWriter(root, split)
        writer.start(
            {
                "input": "fixture",
                "rows": rows,
                "first_key": first_key,
                "samples_per_shard": spec.samples_per_shard,
                "shape": str(Shape(spec.text_len, spec.height, spec.width)),
            }
        )
        samples = enumerate(fixture_samples(spec, split))
        records = [
            writer.write(
                plan,
                (
                    tar_sample(first_key + r, s["key"], s["parts"], s["timestep"])
                    for r, s in itertools.islice(samples, plan.end - plan.start)
                ),
                [],
            )
            for plan in plan_shards(rows, spec.samples_per_shard)
        ]
        writer.finish(records)
        first_key += rows
    write_empty_encodings(root / "empty_encodings", *empty_encodings(spec))
    prepare(root, workers=1, quiet=True)
    return root


@dataclass(frozen=True)
class FixtureSplit:
    """One split's samples, re-iterable and picklable: datasets pickles what builds a dataset to hash it."""

    spec: FixtureSpec
    split: str

    def __iter__(self) -> Iterator[dict]:
        return fixture_samples(self.spec, self.split)


def save_arrow(path: Path, samples: Iterable[dict], val: bool) -> Path:
    """Samples (a list, or a FixtureSplit) as an MLCommons-style save_to_disk dataset, streamed."""
    require("datasets", "dataprep fixture --arrow (writing the MLCommons Arrow form)")
    from datasets import Dataset, Features, Value

    features = {"__key__": Value("string")} | {column: Value("binary") for column in COLUMNS}
    if val:
        features["timestep"] = Value("int64")

    def rows():
        for s in samples:
            row = {"__key__": s["key"], **{column: s["parts"][part] for column, part in COLUMNS.items()}}
            yield row | ({"timestep": s["timestep"]} if val else {})

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as cache:
        # small writer batches: a full-size sample is 2.1 MiB
        Dataset.from_generator(rows, features=Features(features), cache_dir=cache, writer_batch_size=32).save_to_disk(
            str(path)
        )
    return path


def write_arrow(root: Path, spec: FixtureSpec) -> dict[str, Path]:
    """The fixture as MLCommons distributes its data: root/train and root/val (splits with samples), the input of
    `convert`, and root/empty_encodings, to copy into the converted dataset."""
    sizes = {"train": spec.train, "val": spec.val}
    written = {
        split: save_arrow(Path(root) / split, FixtureSplit(spec, split), split == "val")
        for split, size in sizes.items()
        if size
    }
    write_empty_encodings(Path(root) / "empty_encodings", *empty_encodings(spec))
    return written | {"empty_encodings": Path(root) / "empty_encodings"}


def ensure_fixture(root: Path, train: int, val: int, text_len: int, height: int, width: int, seed: int) -> Path:
    """The fixture dataset for these sizes under root, written once and reused. Written into a temporary
    folder and renamed into place, so concurrent ranks never see half a dataset."""
    spec = FixtureSpec(train, val, text_len, height, width, seed)
    path = Path(root) / spec.name
    if (path / MARKER).is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", dir=path.parent))
    try:
        write_fixture(tmp, spec)
        (tmp / MARKER).write_text(json.dumps(asdict(spec)))
        os.rename(tmp, path)
    except OSError:
        if not (path / MARKER).is_file():  # lost the race to another rank: theirs is complete
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
