"""`verify`: open the dataset through energon and check everything a training run relies on.

Checks: `.nv-meta/dataset.yaml` is CrudeWebdataset and split.yaml has train and val; the dataset describes
itself (format.METADATA, written by `prepare`) and `--shape`, if given, agrees with it; every tar reads to
its end (no truncation); index.txt matches the shards; every sample has all parts with the dtype uint16 (bf16
bits), the dataset's shape and no NaN/Inf, and val samples a timestep 0..7; keys are unique; the counts are
the recorded ones; every byte of each shard matches the digest dataprep wrote when it made it (dataprep.digests;
data made by another tool has none, and says so); the empty encodings exist with matching shapes. Prints counts per split and per timestep;
any defect makes the command exit non-zero with the defect named.
"""

from __future__ import annotations

import tarfile
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import yaml
from megatron.energon import (
    Cooker,
    CrudeSample,
    DefaultTaskEncoder,
    WorkerConfig,
    basic_sample_keys,
    get_loader,
    get_val_dataset,
)
from megatron.energon.errors import reraise_exception

from dataprep import digests, progress
from dataprep.format import (
    CLIP_DIM,
    EMPTY_CLIP,
    EMPTY_T5,
    METADATA,
    PARTS,
    T5_DIM,
    DataprepError,
    DatasetInfo,
    FormatError,
    Shape,
    check_sample,
    read_info,
    sample_meta,
    sample_where,
)
from dataprep.prepare import DATASET_YAML, SPLITS
from dataprep.shards import INDEX

# energon's loader always asks for page-locked memory; on a host without a GPU torch warns that there is none
warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator is found")


@dataclass
class SampleChecker:
    """Cooker that checks a crude sample in the loader's workers and returns only a small report."""

    shape: Optional[Shape]  # None: the shape is unknown and not checked
    val: bool
    __stateless__ = True  # what energon's @stateless sets: a pure function of the sample

    def __call__(self, sample: dict) -> CrudeSample:
        try:
            meta = sample_meta(sample)
            problems = []
        except ValueError as exc:
            meta, problems = {}, [f"json: {exc}"]
        if "json" not in sample:
            problems.append("json: missing")
        parts = {part: sample.get(f"{part}.bytes") for part in PARTS}
        problems += check_sample(meta.get("key", "?"), parts, meta.get("timestep"), self.val, self.shape)
        return CrudeSample(
            **basic_sample_keys(sample), problems=problems, timestep=meta.get("timestep"), where=sample_where(sample)
        )


class CheckEncoder(DefaultTaskEncoder):
    decoder = None

    def __init__(self, checker: SampleChecker):
        super().__init__()
        # energon's Cooker bounds the cook's result to Sample, yet runs one that gives a CrudeSample (a dict) as well
        self.cookers = [Cooker(checker)]  # pyright: ignore[reportArgumentType] - the Sample bound, above


@dataclass
class Report:
    defects: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)  # split -> samples
    timesteps: dict = field(default_factory=dict)  # split -> Counter
    digested: dict = field(default_factory=dict)  # split -> shards whose every byte was checked, None: no digests

    def defect(self, message: str) -> None:
        self.defects.append(message)


def check_metadata(root: Path, report: Report) -> list[str]:
    """Structure checks; returns the splits that energon can open."""
    meta = root / ".nv-meta"
    dataset_yaml = meta / "dataset.yaml"
    if not dataset_yaml.is_file():
        report.defect(f"{dataset_yaml}: missing; run `python -m dataprep prepare {root}`")
        return []
    if yaml.safe_load(dataset_yaml.read_text()) != DATASET_YAML:
        report.defect(f"{dataset_yaml}: expected {DATASET_YAML}, found {dataset_yaml.read_text().strip()!r}")
    split_yaml = meta / "split.yaml"
    parts = (yaml.safe_load(split_yaml.read_text()) or {}).get("split_parts", {}) if split_yaml.is_file() else {}
    for split in SPLITS:
        if not parts.get(split):
            report.defect(f"{split_yaml}: no '{split}' split part")
    return [s for s in SPLITS if parts.get(s)]


def dataset_info(root: Path, asserted: Optional[Shape], report: Report) -> Optional[DatasetInfo]:
    """What the dataset says it is; `--shape` (asserted) must agree with it."""
    try:
        info = read_info(root)
    except FormatError as exc:
        report.defect(str(exc))
        return None
    if info is None:
        report.defect(
            f"{root / METADATA}: missing, so the sample shape is unknown; run `python -m dataprep prepare "
            f"{root}` (it records the shape and counts)"
        )
    elif asserted is not None and asserted != info.shape:
        report.defect(f"{root / METADATA}: the dataset's samples are L,H,W {info.shape}, --shape expects {asserted}")
    return info


def check_tars(root: Path, split: str, report: Report) -> None:
    """Each tar reads to its end; index.txt names exactly the shards."""
    folder = root / split
    tars = sorted(folder.glob("*.tar"))
    index = folder / INDEX
    if not index.is_file():
        report.defect(f"{index}: missing")
    elif sorted(line.strip() for line in index.read_text().splitlines() if line.strip()) != [t.name for t in tars]:
        report.defect(f"{index}: does not list exactly the {len(tars)} .tar files of {folder}")
    for tar in tars:
        try:
            # tarfile stops quietly at a cut header, so check that the last member's data and the end-of-archive
            # marker (two zero blocks) fit in the file
            with tarfile.open(tar) as t:
                end = max((m.offset_data + m.size for m in t), default=0)
            need = -(-end // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE + 2 * tarfile.BLOCKSIZE
            if need > tar.stat().st_size:
                raise tarfile.ReadError(
                    f"member data and end marker need {need} bytes, the file has {tar.stat().st_size}"
                )
        except (tarfile.TarError, OSError) as exc:
            report.defect(f"{tar}: truncated or corrupt tar ({exc})")


def check_digests(root: Path, split: str, workers: int, report: Report) -> None:
    """Every byte of each shard against the digest dataprep wrote as it made it (none: made by another tool)."""
    folder = root / split
    try:
        entries = digests.read(folder)
    except ValueError as exc:
        report.defect(str(exc))
        return
    names = sorted(p.name for p in folder.glob("*.tar"))
    report.digested[split] = None if entries is None else len(names)
    if entries is not None:
        report.defects.extend(digests.check(folder, names, entries, rng=None, threads=workers))


def check_samples(
    root: Path, split: str, shape: Optional[Shape], recorded: Optional[int], workers: int, report: Report
) -> None:
    """Every sample of the split against `shape`; `recorded` is the sample count the metadata gives."""
    worker_config = WorkerConfig(rank=0, world_size=1, num_workers=workers, global_error_handler=reraise_exception)
    dataset = get_val_dataset(
        root,
        split_part=split,
        worker_config=worker_config,
        batch_size=None,  # pyright: ignore[reportArgumentType] - typed int; build_batch takes None: no batching
        task_encoder=CheckEncoder(SampleChecker(shape, split == "val")),
    )
    keys, timesteps = set(), Counter()
    try:
        for sample in progress.bar(len(dataset), f"verify {split}", iterable=get_loader(dataset)):
            if sample["__key__"] in keys:
                report.defect(f"{sample['where']}: duplicate key")
            keys.add(sample["__key__"])
            if "." in sample["__key__"]:
                report.defect(f"{sample['where']}: key contains a dot")
            report.defects.extend(f"{sample['where']}: {p}" for p in sample["problems"])
            timesteps[sample["timestep"]] += 1
    except Exception as exc:  # noqa: BLE001 - energon reports unreadable shards with many exception types
        report.defect(
            f"{root / split}: reading through energon failed after {len(keys)} samples: {type(exc).__name__}: {exc}"
        )
    if len(keys) != len(dataset):
        report.defect(f"{root / split}: energon's index has {len(dataset)} samples, {len(keys)} were read")
    if recorded is not None and recorded != len(keys):
        report.defect(
            f"{root / METADATA}: records {recorded} {split} samples, {len(keys)} were read; rerun "
            f"`python -m dataprep prepare {root}`"
        )
    report.counts[split] = len(keys)
    report.timesteps[split] = timesteps


def check_empty(root: Path, shape: Optional[Shape], report: Report) -> None:
    """The empty encodings: float16 [1, L, 4096] (any L when the shape is unknown) and [1, 768]."""
    for name, expected in ((EMPTY_T5, [1, shape.text_len if shape else "L", T5_DIM]), (EMPTY_CLIP, [1, CLIP_DIM])):
        file = root / "empty_encodings" / name
        if not file.is_file():
            report.defect(
                f"{file}: missing; copy MLCommons' empty_encodings/ there (`dataprep fixture --arrow` writes one "
                "beside its splits), or write it with `python -m dataprep empty-encodings` from the T5 and CLIP weights"
            )
            continue
        array = np.load(file, allow_pickle=False)
        fits = array.ndim == len(expected) and all(e in ("L", n) for n, e in zip(array.shape, expected))
        if array.dtype != np.float16 or not fits:
            report.defect(f"{file}: {array.dtype} {list(array.shape)}, expected float16 {list(expected)}")


def verify(root: Path, asserted: Optional[Shape], workers: int) -> Report:
    """Check the dataset at root; `asserted` (--shape) is the shape the caller expects, if any."""
    root = Path(root)
    if not root.is_dir():
        raise DataprepError(f"{root}: no such folder; give the dataset root (holding .nv-meta/, train/, val/)")
    report = Report()
    splits = check_metadata(root, report)
    info = dataset_info(root, asserted, report)
    shape = info.shape if info else asserted
    for split in splits:
        check_tars(root, split, report)
        check_digests(root, split, workers, report)
        check_samples(root, split, shape, info.splits.get(split, {}).get("samples") if info else None, workers, report)
    check_empty(root, shape, report)
    rows = [
        (
            "sample shape",
            f"L,H,W {shape} ({'recorded in the dataset' if info else 'from --shape'})"
            if shape
            else "unknown (not checked)",
        )
    ]
    rows += [(split, f"{n} samples") for split, n in report.counts.items()]
    rows += [
        (f"{split} digests", f"{n} shards, every byte checked" if n is not None else "none (made by another tool)")
        for split, n in report.digested.items()
    ]
    if report.timesteps.get("val"):
        rows.append(
            (
                "val per timestep",
                ", ".join(f"{k}: {n}" for k, n in sorted(report.timesteps["val"].items(), key=lambda kv: str(kv[0]))),
            )
        )
    rows.append(("defects", f"{len(report.defects)}\n" + progress.listed(report.defects) if report.defects else "none"))
    progress.summary(f"verify {root}", rows)
    return report
