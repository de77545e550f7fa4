"""Writing one split's shards: atomic, resumable, with a record per finished shard.

A shard is written as `shard_NNNNNN.tar.partial` (created exclusively: never a file that is there already) and
renamed when complete, then its record (samples, bytes, seconds, skipped inputs) lands in
`<root>/.dataprep/<split>/`; a shard counts as finished only when its record exists, so a crash anywhere leaves
at worst a partial file that the next run of the same conversion (its settings recorded there) removes and redoes.
Shard i holds input rows [i*S, (i+1)*S) minus skipped ones, and sample keys are first_key + row, so a rerun writes
the same bytes (tar mtime 0) whatever was finished before.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from webdataset.writer import TarWriter  # webdataset's stubs do not re-export it from the package

from dataprep import digests
from dataprep.format import DataprepError, DataprepStorageError
from dataprep.staging import write_atomic

SHARD = "shard_{:06d}.tar"
PARTIAL = ".partial"
SHARD_PARTIAL = re.compile(r"^shard_\d{6}\.tar\.partial$")  # the names this module writes shards under
BOOK = ".dataprep"
INDEX = "index.txt"


@dataclass
class ShardPlan:
    index: int
    start: int  # first input row
    end: int  # one past the last input row

    @property
    def name(self) -> str:
        return SHARD.format(self.index)


@dataclass
class ShardRecord:
    index: int
    start: int
    end: int
    samples: int
    bytes: int
    seconds: float
    skipped: list = field(default_factory=list)  # [input row, source key, reason]
    digest: Optional[dict] = None  # the shard's entry in digests.FILE (None: written before there were digests)


def val_first_key(root: Path) -> int:
    """Val keys continue after the train keys, so they are taken from the finished train conversion."""
    settings = SplitWriter(root, "train").settings()
    if settings is None:
        raise DataprepError(
            f"{root}: no train split written by dataprep; val keys continue after the train keys, "
            f"so write --train into the same --out first (or both in one call)"
        )
    return settings["first_key"] + settings["rows"]


def plan_shards(rows: int, per_shard: int) -> list[ShardPlan]:
    return [ShardPlan(i, start, min(start + per_shard, rows)) for i, start in enumerate(range(0, rows, per_shard))]


def _write(path: Path, text: str) -> None:
    """One of the split's files (a record, index.txt, ...), replaced whole; a failed write is one line."""
    try:
        write_atomic(path, text)
    except OSError as exc:
        raise DataprepStorageError(
            f"{path}: writing it failed ({exc.strerror}); make room and rerun the same command"
        ) from None


class SplitWriter:
    """Output of one split (`<root>/<split>/`) and its bookkeeping (`<root>/.dataprep/<split>/`)."""

    def __init__(self, root: Path, split: str):
        self.root, self.split = Path(root), split
        self.dir = self.root / split
        self.book = self.root / BOOK / split

    def start(self, settings: dict) -> None:
        """Create the folders, refuse to resume with other settings, remove the partial shards of a crashed run of
        the same conversion (only those: their names, where its settings are recorded)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.book.mkdir(parents=True, exist_ok=True)
        saved = self.book / "settings.json"
        if saved.is_file():
            before = json.loads(saved.read_text())
            changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
            if changed:
                what = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
                raise DataprepError(
                    f"{self.dir} was started with other settings ({what}); rerun with the original "
                    f"settings to finish it, or delete {self.dir} and {self.book}"
                )
            for stale in self.dir.iterdir():
                if SHARD_PARTIAL.match(stale.name):
                    stale.unlink()
        else:
            _write(saved, json.dumps(settings, indent=1))

    def settings(self) -> Optional[dict]:
        saved = self.book / "settings.json"
        return json.loads(saved.read_text()) if saved.is_file() else None

    def finished(self, plan: ShardPlan) -> Optional[ShardRecord]:
        record = self.book / f"{plan.name}.json"
        if not record.is_file():
            return None
        done = ShardRecord(**json.loads(record.read_text()))
        return done if done.samples == 0 or (self.dir / plan.name).is_file() else None

    def partial(self, plan: ShardPlan) -> Path:
        """Where shard `plan` is written until it is complete."""
        return self.dir / (plan.name + PARTIAL)

    def write(self, plan: ShardPlan, samples: Iterable[dict], skipped: list) -> ShardRecord:
        """Write the samples as shard `plan.index`; `skipped` is filled by the samples' producer."""
        t0 = time.perf_counter()
        final, tmp = self.dir / plan.name, self.partial(plan)
        count = size = 0
        try:
            # "x": created here, never a file that is there; 4 MiB buffers: tar writes 10 KiB records, batch them
            with open(tmp, "xb", buffering=1 << 22) as f:
                digester = digests.Digester(f)
                # mtime 0: byte-identical reruns; tarfile needs only write() of the file object, as Digester has
                writer = TarWriter(digester, encoder=False, mtime=0)  # pyright: ignore[reportArgumentType] - above
                try:
                    for sample in samples:
                        size += writer.write(sample)
                        count += 1
                finally:
                    writer.close()
                f.flush()
                os.fsync(f.fileno())
            if count:
                os.replace(tmp, final)
            else:  # every input row was skipped: no empty tar for energon to index
                tmp.unlink()
                final.unlink(missing_ok=True)
        except FileExistsError:  # from the open: that file is not ours, and stays
            raise DataprepError(
                f"{tmp}: a file of that name is there, not written by this conversion; move it away and rerun"
            ) from None
        except OSError as exc:  # a full disk or a quota: named in one line (from a worker too), and a rerun resumes
            tmp.unlink(missing_ok=True)
            raise DataprepStorageError(
                f"{final}: writing it failed ({exc.strerror}); make room and rerun the same command (finished shards "
                "are kept)"
            ) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        seconds = time.perf_counter() - t0
        record = ShardRecord(plan.index, plan.start, plan.end, count, size, seconds, skipped, digester.entry())
        _write(self.book / f"{plan.name}.json", json.dumps(asdict(record), indent=1))
        return record

    def finish(self, records: list[ShardRecord]) -> None:
        """index.txt (the shards, as NVIDIA's layout has it), their digests and skipped.tsv once every shard is done.
        A split whose every input was skipped (--skip-bad) is an error, not an empty success."""
        written = [r for r in sorted(records, key=lambda r: r.index) if r.samples]
        names = [SHARD.format(r.index) for r in written]
        _write(self.dir / INDEX, "".join(n + "\n" for n in names))
        if all(r.digest for r in written):  # a conversion resumed from one of an earlier version has none to give
            _write(self.dir / digests.FILE, digests.table({n: r.digest for n, r in zip(names, written) if r.digest}))
        rows = [s for r in sorted(records, key=lambda r: r.index) for s in r.skipped]
        skipped = self.book / "skipped.tsv"
        if rows:
            _write(skipped, "row\tkey\treason\n" + "".join(f"{row}\t{key}\t{why}\n" for row, key, why in rows))
        else:
            skipped.unlink(missing_ok=True)
        if rows and not names:
            row, key, why = rows[0]
            raise DataprepError(
                f"{self.dir}: nothing converted: all {len(rows)} input samples were skipped as bad "
                f"(the first: row {row} {key!r}: {why}; all listed in {skipped}); fix the input or the "
                f"options (--shape?), delete {self.dir} and {self.book}, and rerun"
            )

    @property
    def skipped_list(self) -> Path:
        return self.book / "skipped.tsv"
