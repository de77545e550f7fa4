"""`fixture`: a tiny dataset in the real format (any L, H, W), for tests and the debug run.

Train samples are random (flux_train's synthetic set); val sample i copies the arrays of train sample
i mod N under its own key (val keys continue after train), with timestep i mod 8, so a debug run can
show that the trainer overfits. The same samples can instead be written as the MLCommons Hugging Face
(Arrow) input of `convert`.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dataprep.format import CLIP_DIM, T5_DIM, Shape, encode_bf16, tar_sample, write_empty_encodings
from dataprep.prepare import prepare
from dataprep.shards import SplitWriter, plan_shards
from flux_train.data import PARTS, synthetic_samples
from flux_train.flow import EVAL_TIMESTEP_BINS

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
        return (f"train{self.train}-val{self.val}-L{self.text_len}-{self.height}x{self.width}-seed{self.seed}"
                f"-shard{self.samples_per_shard}")


def fixture_rows(spec: FixtureSpec) -> dict[str, list[dict]]:
    """{"train": [...], "val": [...]}: per sample the source key, the four parts' npy bytes, the timestep."""
    data = synthetic_samples(spec.train, spec.text_len, spec.height, spec.width, T5_DIM, CLIP_DIM, spec.seed)
    encoded = [{part: encode_bf16(data[part][i]) for part in PARTS} for i in range(spec.train)]
    train = [{"key": f"train-{i}", "parts": encoded[i], "timestep": None} for i in range(spec.train)]
    val = [{"key": f"val-{i}", "parts": encoded[i % spec.train], "timestep": i % EVAL_TIMESTEP_BINS}
           for i in range(spec.val)]
    return {"train": train, "val": val}


def empty_encodings(spec: FixtureSpec) -> tuple[torch.Tensor, torch.Tensor]:
    empty = synthetic_samples(1, spec.text_len, 2, 2, T5_DIM, CLIP_DIM, spec.seed + 2)
    return empty["t5"], empty["clip"]


def write_fixture(root: Path, spec: FixtureSpec, rows: dict | None = None) -> Path:
    """Shards, index.txt, empty encodings and energon metadata under root (rows: fixture_rows(spec))."""
    rows = rows or fixture_rows(spec)
    first_key = 0
    for split in ("train", "val"):
        writer = SplitWriter(root, split)
        writer.start({"input": "fixture", "rows": len(rows[split]), "first_key": first_key,
                      "samples_per_shard": spec.samples_per_shard, "shape": str(Shape(spec.text_len, spec.height,
                                                                                          spec.width))})
        records = []
        for plan in plan_shards(len(rows[split]), spec.samples_per_shard):
            samples = (tar_sample(first_key + r, rows[split][r]["key"], rows[split][r]["parts"],
                                  rows[split][r]["timestep"]) for r in range(plan.start, plan.end))
            records.append(writer.write(plan, samples, []))
        writer.finish(records)
        first_key += len(rows[split])
    write_empty_encodings(root / "empty_encodings", *empty_encodings(spec))
    prepare(root, workers=1, quiet=True)
    return root


def save_arrow(path: Path, samples: list[dict], val: bool) -> Path:
    """Samples (as fixture_rows gives them) as an MLCommons-style save_to_disk dataset."""
    from datasets import Dataset, Features, Value

    columns: dict = {"__key__": [s["key"] for s in samples]}
    features = {"__key__": Value("string")}
    for column, part in (("t5_encodings", "t5"), ("clip_encodings", "clip"), ("mean", "mean"), ("logvar", "logvar")):
        columns[column] = [s["parts"][part] for s in samples]
        features[column] = Value("binary")
    if val:
        columns["timestep"] = [s["timestep"] for s in samples]
        features["timestep"] = Value("int64")
    Dataset.from_dict(columns, features=Features(features)).save_to_disk(str(path))
    return path


def write_arrow(root: Path, spec: FixtureSpec) -> dict[str, Path]:
    """The fixture as the input of `convert`: root/train and root/val."""
    return {split: save_arrow(Path(root) / split, samples, split == "val")
            for split, samples in fixture_rows(spec).items()}


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
        (tmp / MARKER).write_text(str(asdict(spec)))
        os.rename(tmp, path)
    except OSError:
        if not (path / MARKER).is_file():  # lost the race to another rank: theirs is complete
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
