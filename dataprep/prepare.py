"""`prepare`: energon metadata for the shards, through energon's own API, without prompts.

Writes `.nv-meta/` (index.sqlite, .info.json, split.yaml with split parts train: train/.*, val: val/.*)
and `dataset.yaml` = CrudeWebdataset (the data is cooked by flux_train.energon_data.cook), as `energon prepare
--split-parts 'train:train/.*' --split-parts 'val:val/.*' --sample-type CrudeWebdataset` would.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import yaml

from dataprep import progress
from dataprep.format import DataprepError
from dataprep.shards import INDEX, PARTIAL
from flux_train.data import EMPTY_CLIP, EMPTY_T5

SPLITS = ("train", "val")
DATASET_YAML = {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}


def split_shards(root: Path, split: str) -> list[str]:
    """The split's tar files relative to root, in index.txt order when there is one."""
    folder = root / split
    if not folder.is_dir():
        return []
    partial = sorted(p.name for p in folder.glob("*" + PARTIAL))
    if partial:
        raise DataprepError(f"{folder}: unfinished shards {partial}; rerun the convert/encode command to finish "
                            f"them before prepare")
    on_disk = sorted(p.name for p in folder.glob("*.tar"))
    index = folder / INDEX
    if index.is_file():
        listed = [line.strip() for line in index.read_text().splitlines() if line.strip()]
        if sorted(listed) != on_disk:
            raise DataprepError(f"{index} lists {len(listed)} shards but {folder} holds {len(on_disk)} .tar files "
                                f"(missing: {sorted(set(listed) - set(on_disk))[:5]}, unlisted: "
                                f"{sorted(set(on_disk) - set(listed))[:5]}); finish or redo the conversion")
        on_disk = listed
    return [f"{split}/{name}" for name in on_disk]


def prepare(root: Path, workers: int = 8, quiet: bool = False) -> dict:
    """Index the shards; returns {split: {"shards": n, "samples": n}}."""
    from megatron.energon.flavors.webdataset import BaseWebdatasetFactory

    root = Path(root)
    tars = [t for split in SPLITS for t in split_shards(root, split)]
    if not tars:
        raise DataprepError(f"{root}: no train/*.tar or val/*.tar shards; convert or encode first")

    def progress_fn(items, length=None):
        return items if quiet else iter(progress.bar(length, "prepare (index shards)", unit="shard", iterable=items))

    try:
        # energon prints its steps to stdout; the return type differs between versions (7.1: a tuple, 7.4: a
        # set) and nothing is needed from it
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            BaseWebdatasetFactory.prepare_dataset(root, tars, split_parts_patterns=[(s, f"{s}/.*") for s in SPLITS],
                                                  shuffle_seed=None, workers=max(1, workers), progress_fn=progress_fn)
    except SystemExit:  # energon >= 7.3 exits on duplicate keys, even from the API
        raise DataprepError(
            f"{root}: energon refused the dataset because sample keys repeat across shards (see its message "
            f"above). NVIDIA's to_webdataset.py restarts keys at 00000000 in val/; reconvert with `python -m "
            f"dataprep convert`, whose keys are unique across train and val") from None
    (root / ".nv-meta" / "dataset.yaml").write_text(yaml.safe_dump(DATASET_YAML, sort_keys=False))
    counts = json.loads((root / ".nv-meta" / ".info.json").read_text())["shard_counts"]
    result = {s: {"shards": sum(1 for t in counts if t.startswith(s + "/")),
                  "samples": sum(n for t, n in counts.items() if t.startswith(s + "/"))} for s in SPLITS}
    if not quiet:
        empty = root / "empty_encodings"
        has_empty = (empty / EMPTY_T5).is_file() and (empty / EMPTY_CLIP).is_file()
        progress.summary("prepare", [
            ("dataset", f"{root} (CrudeWebdataset)"),
            *[(s, f"{c['shards']} shards, {c['samples']} samples") for s, c in result.items()],
            ("empty encodings", str(empty) if has_empty else
             f"MISSING in {empty}: write them with `python -m dataprep empty-encodings` or copy them there"),
        ])
    return result
