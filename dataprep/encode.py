"""`encode`: raw image-caption pairs -> the same shards as `convert`, through the reference's encoders.

Inputs: webdataset shards of jpg/png/webp + txt (CC12M), or an image folder + a captions TSV with a header
naming `file_name` and `caption` columns (COCO; an `id`/`image_id` column, if present, becomes the source
key). Images are resized by the split's rule (train: shorter side to 256 + centre crop; val: straight to
256x256), decoded on a thread pool one batch ahead of the encoders. Val samples get timestep k = row mod 8.
Shards are written one at a time and resume like `convert`'s.
"""

from __future__ import annotations

import csv
import itertools
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from dataprep import images, progress
from dataprep.encoders import T5_TOKENS, ImageEncoder, TextEncoders
from dataprep.format import EVAL_TIMESTEP_BINS, IMAGE_SIZE, DataprepError, Shape, check_sample, encode_bf16, tar_sample
from dataprep.shards import SplitWriter, plan_shards, val_first_key

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
OUTPUT_SHAPE = Shape(T5_TOKENS, IMAGE_SIZE // 8, IMAGE_SIZE // 8)  # the Flux VAE downsamples 8x


@dataclass
class Raw:
    row: int
    key: str
    origin: str  # file (and member) it came from, for messages
    image: Callable[[], bytes]  # read lazily: rows of finished shards are never decoded
    caption: Optional[bytes]
    problem: Optional[str] = None


class WdsInput:
    """Webdataset shards: members KEY.jpg|png|webp and KEY.txt, grouped by key in tar order."""

    def __init__(self, tars: list[Path]):
        self.tars = tars
        missing = [t for t in tars if not t.is_file()]
        if missing or not tars:
            raise DataprepError(f"--wds: no such tar file(s): {missing or 'none given'}")

    @staticmethod
    def _groups(tar: Path) -> Iterator[tuple[str, dict]]:
        try:
            with tarfile.open(tar, "r|*") as stream:
                key, parts = None, {}
                for member in stream:
                    data = stream.extractfile(member) if member.isfile() else None
                    if data is None:
                        continue
                    stem, _, ext = member.name.partition(".")  # webdataset: the key ends at the first dot
                    if stem != key and key is not None:
                        yield key, parts
                        parts = {}
                    key = stem
                    parts[ext.lower()] = data.read()
                if key is not None:
                    yield key, parts
        except (tarfile.TarError, OSError) as exc:
            raise DataprepError(f"{tar}: unreadable or truncated tar ({exc}); re-download or drop this shard") from None

    def count(self) -> int:
        total = 0
        for tar in self.tars:
            try:
                with tarfile.open(tar) as t:
                    total += len({m.name.partition(".")[0] for m in t if m.isfile()})
            except (tarfile.TarError, OSError) as exc:
                raise DataprepError(f"{tar}: unreadable tar ({exc})") from None
        return total

    def rows(self) -> Iterator[Raw]:
        row = 0
        for tar in self.tars:
            for key, parts in self._groups(tar):
                image = next((parts[e] for e in IMAGE_EXTS if e in parts), None)
                problem = None if image is not None else f"no image member ({'/'.join(IMAGE_EXTS)})"
                if "txt" not in parts:
                    problem = problem or "no txt caption member"
                # no image member: never read, the row has its problem (b"" keeps the reader's type)
                yield Raw(row, key, f"{tar.name}:{key}", lambda data=image or b"": data, parts.get("txt"), problem)
                row += 1


class FolderInput:
    """An image folder and a TSV with a header (file_name, caption; optional id or image_id)."""

    def __init__(self, folder: Path, tsv: Path):
        if not folder.is_dir():
            raise DataprepError(f"--images {folder}: not a folder")
        if not tsv.is_file():
            raise DataprepError(f"--captions {tsv}: no such file")
        with open(tsv, newline="", encoding="utf-8") as f:
            self.table = list(csv.DictReader(f, delimiter="\t"))
        columns = list(self.table[0]) if self.table else []
        if not {"file_name", "caption"} <= set(columns):
            raise DataprepError(f"{tsv}: needs a header with columns file_name and caption, found {columns}")
        self.key_column = next((c for c in ("id", "image_id", "key") if c in columns), None)
        self.folder, self.tsv = folder, tsv

    def count(self) -> int:
        return len(self.table)

    def rows(self) -> Iterator[Raw]:
        for row, entry in enumerate(self.table):
            file = self.folder / entry["file_name"]
            key = entry[self.key_column] if self.key_column else Path(entry["file_name"]).stem
            problem = None if file.is_file() else f"image file {file} not found"
            yield Raw(
                row, key, f"{self.tsv.name} row {row + 2}", file.read_bytes, (entry["caption"] or "").encode(), problem
            )


def _prepare(raw: Raw, resize) -> tuple[Raw, Optional[torch.Tensor], Optional[str], Optional[str]]:
    """Decode and resize one input: (raw, image tensor, caption, problem)."""
    if raw.problem or raw.caption is None:  # a row without a caption has its problem
        return raw, None, None, raw.problem
    try:
        caption = raw.caption.decode("utf-8").strip()
    except UnicodeDecodeError:
        return raw, None, None, "caption is not UTF-8"
    if not caption:
        return raw, None, None, "empty caption"
    try:
        image = images.to_tensor(resize(images.decode(raw.image())))
    except (ValueError, OSError) as exc:
        return raw, None, None, str(exc)
    return raw, image, caption, None


def _batches(rows: Iterator[Raw], size: int, pool: ThreadPoolExecutor, resize) -> Iterator[list]:
    """Decoded batches, the next one decoding on the pool while the caller encodes the current one."""
    pending = None
    while chunk := list(itertools.islice(rows, size)):
        futures = [pool.submit(_prepare, raw, resize) for raw in chunk]
        if pending:
            yield [f.result() for f in pending]
        pending = futures
    if pending:
        yield [f.result() for f in pending]


@dataclass
class EncodeJob:
    root: Path
    split: str
    per_shard: int
    batch_size: int
    threads: int
    skip_bad: bool
    resize: str


def encode(source, job: EncodeJob, text: TextEncoders, image: ImageEncoder, settings: dict) -> None:
    t0 = time.perf_counter()
    val = job.split == "val"
    first_key = val_first_key(job.root) if val else 0
    rows_total = source.count()
    writer = SplitWriter(job.root, job.split)
    writer.start(
        {
            **settings,
            "rows": rows_total,
            "first_key": first_key,
            "samples_per_shard": job.per_shard,
            "resize": job.resize,
        }
    )
    resize = images.RESIZE[job.resize]
    rows, seen, records, new = source.rows(), {}, [], []
    bar = progress.bar(rows_total, f"encode {job.split}")
    with bar, ThreadPoolExecutor(job.threads) as pool:
        for plan in plan_shards(rows_total, job.per_shard):
            shard_rows = _unique(itertools.islice(rows, plan.end - plan.start), seen)
            done = writer.finished(plan)
            if done:
                records.append(done)
                for _ in shard_rows:  # consume the inputs, keeping the duplicate-key bookkeeping
                    pass
                bar.update(plan.end - plan.start)
                continue
            skipped: list = []
            samples = _encoded(
                _batches(shard_rows, job.batch_size, pool, resize), text, image, job, first_key, val, skipped, bar
            )
            new.append(writer.write(plan, samples, skipped))
            records.append(new[-1])
    writer.finish(records)
    wall = time.perf_counter() - t0
    written = sum(r.samples for r in new)
    skipped = [s for r in records for s in r.skipped]
    progress.summary(
        f"encode {job.split}",
        [
            (
                "output",
                f"{writer.dir} ({sum(1 for r in records if r.samples)} shards, "
                f"{sum(r.samples for r in records)} samples, keys from {first_key})",
            ),
            ("this run", f"{len(new)} shards written, {len(records) - len(new)} already finished (skipped)"),
            ("throughput", f"{written / max(wall, 1e-9):.1f} samples/s in {wall:.1f} s on {text.device}"),
            ("skipped inputs", progress.skipped(skipped, writer.skipped_list)),
        ],
    )


def _unique(rows: Iterator[Raw], seen: dict) -> Iterator[Raw]:
    """Marks inputs whose key repeats an earlier one as bad."""
    for raw in rows:
        if raw.key in seen:
            raw.problem = raw.problem or f"duplicate key {raw.key!r} (first at row {seen[raw.key]})"
        else:
            seen[raw.key] = raw.row
        yield raw


def _encoded(
    batches, text: TextEncoders, image: ImageEncoder, job: EncodeJob, first_key: int, val: bool, skipped: list, bar
) -> Iterator[dict]:
    for batch in batches:
        good = []
        for raw, tensor, caption, problem in batch:
            if problem is None:
                good.append((raw, tensor, caption))
            elif job.skip_bad:
                skipped.append([raw.row, raw.key, problem])
            else:
                raise DataprepError(f"{raw.origin} (row {raw.row}): {problem}; fix the input or pass --skip-bad")
        if good:
            t5, clip = text([caption for _, _, caption in good])
            mean, logvar = image(torch.stack([tensor for _, tensor, _ in good]))
            for i, (raw, _, _) in enumerate(good):
                parts = {
                    "t5": encode_bf16(t5[i]),
                    "clip": encode_bf16(clip[i]),
                    "mean": encode_bf16(mean[i]),
                    "logvar": encode_bf16(logvar[i]),
                }
                problems = check_sample(raw.key, parts, None, False, OUTPUT_SHAPE)
                if problems:  # wrong weights (e.g. T5-base for T5-XXL) must not make a wrong dataset
                    raise DataprepError(
                        f"the encoders produced {'; '.join(problems)} for {raw.origin}; check that "
                        f"--vae/--t5/--clip are the Flux VAE, T5-v1.1-XXL and CLIP-L"
                    )
                yield tar_sample(first_key + raw.row, raw.key, parts, raw.row % EVAL_TIMESTEP_BINS if val else None)
        bar.update(len(batch))
