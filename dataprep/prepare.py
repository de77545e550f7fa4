"""`prepare`: energon metadata for the shards, through energon's own API, without prompts, and the dataset's
description of itself.

Writes `.nv-meta/` (index.sqlite, .info.json, split.yaml with split parts train: train/.*, val: val/.*)
and `dataset.yaml` = CrudeWebdataset (the data is cooked by flux_train.data.energon.cook), as `energon prepare
--split-parts 'train:train/.*' --split-parts 'val:val/.*' --sample-type CrudeWebdataset` would; then
`.nv-meta/flux_dataset.yaml` (format.METADATA): the sample shape, read from the first sample of each split,
and the samples and shards per split.
"""

from __future__ import annotations

import contextlib
import io
import json
import tarfile
from pathlib import Path

import yaml

from dataprep import progress
from dataprep.format import EMPTY_CLIP, EMPTY_T5, METADATA, DataprepError, DatasetInfo, Shape, shape_of, write_info
from dataprep.shards import INDEX, SHARD_PARTIAL

SPLITS = ("train", "val")
DATASET_YAML = {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}


def split_shards(root: Path, split: str) -> list[str]:
    """The split's tar files relative to root, in index.txt order when there is one."""
    folder = root / split
    if not folder.is_dir():
        return []
    partial = sorted(p.name for p in folder.iterdir() if SHARD_PARTIAL.match(p.name))
    if partial:
        raise DataprepError(
            f"{folder}: unfinished shards {partial}; rerun the convert/encode command to finish them before prepare"
        )
    on_disk = sorted(p.name for p in folder.glob("*.tar"))
    index = folder / INDEX
    if index.is_file():
        listed = [line.strip() for line in index.read_text().splitlines() if line.strip()]
        if sorted(listed) != on_disk:
            raise DataprepError(
                f"{index} lists {len(listed)} shards but {folder} holds {len(on_disk)} .tar files "
                f"(missing: {sorted(set(listed) - set(on_disk))[:5]}, unlisted: "
                f"{sorted(set(on_disk) - set(listed))[:5]}); finish or redo the conversion"
            )
        on_disk = listed
    return [f"{split}/{name}" for name in on_disk]


def first_sample_shape(root: Path, tar: str) -> Shape:
    """L,H,W of the first sample of a shard, read from the start of the tar."""
    parts, key = {}, None
    with tarfile.open(root / tar, "r|") as stream:
        for member in stream:
            stem, _, ext = member.name.partition(".")
            if key is not None and stem != key:
                break
            key = stem
            data = stream.extractfile(member) if ext in ("t5.bytes", "mean.bytes") else None
            if data is not None:  # None: not a regular file
                parts[ext.split(".")[0]] = data.read()
    if len(parts) != 2:
        raise DataprepError(
            f"{root / tar}: the first sample ({key}) has no t5.bytes or mean.bytes member; check the "
            f"shards with `python -m dataprep verify {root}`"
        )
    try:
        return shape_of(parts)
    except ValueError as exc:
        raise DataprepError(
            f"{root / tar}: sample {key}: t5/mean are not [L, 4096] / [16, H, W] arrays ({exc})"
        ) from None


def describe(root: Path, tars: list[str], counts: dict) -> DatasetInfo:
    """The shape every split's first sample has (one per dataset) and the counts per split."""
    firsts = {split: next(t for t in tars if t.startswith(split + "/")) for split in counts if counts[split]["shards"]}
    shapes = {split: first_sample_shape(root, tar) for split, tar in firsts.items()}
    if len(set(shapes.values())) > 1:
        raise DataprepError(
            f"{root}: the splits hold samples of different shapes (L,H,W: "
            f"{', '.join(f'{firsts[s]}: {shape}' for s, shape in shapes.items())}); one dataset "
            f"holds one shape: rewrite the odd split"
        )
    return DatasetInfo(next(iter(shapes.values())), counts)


def prepare(root: Path, workers: int = 8, quiet: bool = False) -> dict:
    """Index the shards and describe the dataset (METADATA); returns {split: {"shards": n, "samples": n}}."""
    from megatron.energon.flavors.webdataset import BaseWebdatasetFactory

    root = Path(root)
    tars = [t for split in SPLITS for t in split_shards(root, split)]
    if not tars:
        raise DataprepError(f"{root}: no train/*.tar or val/*.tar shards; convert or encode first")

    def progress_fn(items, length=None):
        return items if quiet else iter(progress.bar(length, "prepare (index shards)", unit="shard", iterable=items))

    said = io.StringIO()
    try:
        # energon prints its steps to stdout ("Saving info to ...", "Collapsing split parts... Done"), into our bar:
        # kept for its refusal below. Its return type differs between versions (7.1: a tuple, 7.4: a set) and
        # nothing is needed from it
        with contextlib.redirect_stdout(said):
            BaseWebdatasetFactory.prepare_dataset(
                root,
                tars,
                split_parts_patterns=[(s, f"{s}/.*") for s in SPLITS],
                shuffle_seed=None,
                workers=max(1, workers),
                progress_fn=progress_fn,
            )
    except SystemExit:  # energon >= 7.3 exits on duplicate keys, even from the API
        example = next((line for line in said.getvalue().splitlines() if "duplicate key:" in line), "no example")
        raise DataprepError(
            f"{root}: energon refused the dataset because sample keys repeat across shards ({example.strip()}). "
            f"NVIDIA's to_webdataset.py restarts keys at 00000000 in val/; reconvert with `python -m dataprep "
            f"convert`, whose keys are unique across train and val"
        ) from None
    (root / ".nv-meta" / "dataset.yaml").write_text(yaml.safe_dump(DATASET_YAML, sort_keys=False))
    counts = json.loads((root / ".nv-meta" / ".info.json").read_text())["shard_counts"]
    result = {
        s: {
            "shards": sum(1 for t in counts if t.startswith(s + "/")),
            "samples": sum(n for t, n in counts.items() if t.startswith(s + "/")),
        }
        for s in SPLITS
    }
    info = describe(root, tars, result)
    write_info(root, info)
    if not quiet:
        empty = root / "empty_encodings"
        has_empty = (empty / EMPTY_T5).is_file() and (empty / EMPTY_CLIP).is_file()
        progress.summary(
            "prepare",
            [
                ("dataset", f"{root} (CrudeWebdataset)"),
                *[(s, f"{c['shards']} shards, {c['samples']} samples") for s, c in result.items()],
                ("sample shape", f"L,H,W {info.shape} (recorded in {root / METADATA} with the counts)"),
                (
                    "empty encodings",
                    str(empty)
                    if has_empty
                    else f"MISSING in {empty}: write them with `python -m dataprep empty-encodings` or copy them there",
                ),
            ],
        )
    return result
