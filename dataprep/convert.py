"""`convert`: the MLCommons preprocessed sets (Hugging Face `save_to_disk`, Arrow) -> energon shards.

Columns (docs/data-format.md): __key__ (string), t5_encodings, clip_encodings, mean, logvar (np.save bytes of bf16
viewed as uint16) and timestep (int, val only). The npy bytes are copied unchanged; every sample is checked
first (columns, npy header, dtype, shape, NaN/Inf, timestep, duplicate keys). Shards are converted in
parallel by spawned worker processes, each opening the memory-mapped input itself.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Sized
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from dataprep import progress
from dataprep.extras import require
from dataprep.format import DataprepError, Shape, check_sample, tar_sample
from dataprep.lifetime import die_with_parent
from dataprep.shards import ShardPlan, ShardRecord, SplitWriter, plan_shards, val_first_key

COLUMNS = {"t5_encodings": "t5", "clip_encodings": "clip", "mean": "mean", "logvar": "logvar"}
CHUNK_ROWS = 32  # rows read from Arrow at once: bounds a worker's memory to ~70 MB at full size


def open_input(path: Path, val: bool):
    """The dataset, after checking that it is one and has the columns of the MLCommons layout."""
    require("datasets", "dataprep convert (reading the MLCommons Arrow sets)")
    from datasets import Dataset, DatasetDict, load_from_disk

    try:
        ds = load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise DataprepError(
            f"--{'val' if val else 'train'} {path}: not a Hugging Face save_to_disk dataset ({exc}); "
            "give the folder that save_to_disk wrote"
        ) from None
    if isinstance(ds, DatasetDict):
        raise DataprepError(
            f"{path}: a DatasetDict with splits {list(ds)}; pass one split's folder, e.g. {path / str(next(iter(ds)))}"
        )
    assert isinstance(ds, Dataset)
    need = ["__key__", *COLUMNS] + (["timestep"] if val else [])
    missing = [c for c in need if c not in ds.column_names]
    if missing:
        raise DataprepError(
            f"{path}: missing column(s) {missing}; found {ds.column_names}. Expected the MLCommons "
            f"preprocessed layout: __key__, t5_encodings, clip_encodings, mean, logvar"
            f"{', timestep (val)' if val else ''}"
        )
    for column in COLUMNS:
        dtype = getattr(ds.features[column], "dtype", None)
        if dtype not in ("binary", "large_binary"):
            raise DataprepError(
                f"{path}: column {column} has type {ds.features[column]}, expected binary "
                f"(np.save bytes of bf16 viewed as uint16)"
            )
    return ds


def duplicate_rows(ds, path: Path, skip_bad: bool) -> dict[int, str]:
    """Rows whose __key__ repeats an earlier row: an error, or (skip_bad) rows to skip with the reason."""
    keys = ds.select_columns(["__key__"]).with_format("arrow")[:]["__key__"].to_pylist()
    first: dict = {}
    dupes: dict[int, str] = {}
    for row, key in enumerate(keys):
        if key in first:
            reason = f"duplicate __key__ {key!r} (first at row {first[key]})"
            if not skip_bad:
                raise DataprepError(f"{path}: row {row}: {reason}; fix the input or pass --skip-bad")
            dupes[row] = reason
        else:
            first[key] = row
    return dupes


@dataclass
class ShardJob:
    plan: ShardPlan
    input: str
    root: str
    split: str
    first_key: int
    shape: Shape
    skip_bad: bool
    skip_rows: dict  # row -> reason (duplicates)


_worker: dict = {"tables": {}}  # per worker process: opened inputs, the progress queue, the stop flag


def _init_worker(progress_queue, stop, parent: int) -> None:
    die_with_parent(parent)  # a killed convert takes its pool along (its queues would keep the workers waiting)
    # tqdm's default lock (datasets' loading draws bars in threads) is a semaphore that, once its worker is killed,
    # Python's resource tracker reports as leaked below convert's own line; one process needs a thread lock only
    tqdm.set_lock(threading.RLock())
    _worker.update(queue=progress_queue, stop=stop)


def _table(path: str):
    if path not in _worker["tables"]:
        from datasets import load_from_disk

        _worker["tables"][path] = load_from_disk(path).with_format("arrow")  # memory-mapped
    return _worker["tables"][path]


def _rows(job: ShardJob, skipped: list):
    """The tar samples of one shard, checking every input row."""
    table, val = _table(job.input), job.split == "val"
    for start in range(job.plan.start, job.plan.end, CHUNK_ROWS):
        if _worker["stop"].is_set():
            raise DataprepError("stopped")
        chunk = table[start : min(start + CHUNK_ROWS, job.plan.end)]
        columns = {c: chunk.column(c).to_pylist() for c in ["__key__", *COLUMNS] + (["timestep"] if val else [])}
        nbytes = 0
        for j in range(chunk.num_rows):
            row, key = start + j, columns["__key__"][j]
            parts = {part: columns[c][j] for c, part in COLUMNS.items()}
            timestep = columns["timestep"][j] if val else None
            problems = ([job.skip_rows[row]] if row in job.skip_rows else []) or check_sample(
                key, parts, timestep, val, job.shape
            )
            if problems:
                if not job.skip_bad:
                    raise DataprepError(
                        f"{job.input}: row {row} (__key__ {key!r}): {'; '.join(problems)}; "
                        f"fix the input or pass --skip-bad"
                    )
                skipped.append([row, key, "; ".join(problems)])
                continue
            nbytes += sum(len(b) for b in parts.values())
            yield tar_sample(job.first_key + row, key, parts, timestep)
        _worker["queue"].put((chunk.num_rows, nbytes))


def _convert_shard(job: ShardJob) -> ShardRecord:
    skipped: list = []
    return SplitWriter(Path(job.root), job.split).write(job.plan, _rows(job, skipped), skipped)


class WorkerDied(DataprepError):
    """A pool worker ended abruptly: killed (the out-of-memory killer's SIGKILL) or crashed. Not a bad input."""

    exit_code = 1


def _worker_died(jobs: list[ShardJob]) -> WorkerDied:
    """The shards being written when the pool broke (their partial files: a dead worker's stays, as do those of the
    workers the pool stopped after it), and what to do."""
    writing = [
        f"{job.split}/{job.plan.name}"
        for job in jobs
        if SplitWriter(Path(job.root), job.split).partial(job.plan).exists()
    ]
    where = ("one of " if len(writing) > 1 else "") + ", ".join(writing) if writing else "a shard"
    return WorkerDied(
        f"a convert worker was killed (or crashed) while writing {where}; the out-of-memory killer is the usual "
        "cause (dmesg names it): lower --workers, then run the same command again (finished shards are kept)"
    )


def _run_pool(jobs: list[ShardJob], workers: int, bar) -> dict[str, list[ShardRecord]]:
    """Every shard job on one pool of spawned workers; returns the new records per split."""
    ctx = mp.get_context("spawn")  # fork would copy the parent's Arrow maps and threads
    progress_queue, stop = ctx.Queue(), ctx.Event()
    records: dict[str, list[ShardRecord]] = {}
    pool = ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_worker, initargs=(progress_queue, stop, os.getpid())
    )
    try:
        pending = {pool.submit(_convert_shard, job): job.split for job in jobs}
        while pending:
            done, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            for future in done:
                records.setdefault(pending.pop(future), []).append(future.result())  # a worker's error stops here
            try:
                while True:
                    rows, nbytes = progress_queue.get_nowait()
                    bar.update(rows)
                    bar.set_postfix_str(f"{progress.human_bytes(nbytes)} in last chunk", refresh=False)
            except queue.Empty:
                pass
    except BaseException as exc:
        stop.set()  # running workers abandon their shard (its partial file is removed)
        pool.shutdown(wait=True, cancel_futures=True)
        if isinstance(exc, BrokenProcessPool):
            raise _worker_died(jobs) from None
        raise
    pool.shutdown(wait=True)
    return records


@dataclass
class Split:
    name: str
    input: Path
    ds: Sized  # a datasets.Dataset (datasets: an optional extra)
    writer: SplitWriter
    first_key: int
    done: list  # records of shards finished by an earlier run
    jobs: list


def _plan_split(name: str, path: Path, ds, root: Path, per_shard: int, shape: Shape, skip_bad: bool) -> Split:
    first_key = val_first_key(root) if name == "val" else 0
    skip_rows = duplicate_rows(ds, path, skip_bad)
    writer = SplitWriter(root, name)
    writer.start(
        {
            "input": str(path.resolve()),
            "rows": len(ds),
            "first_key": first_key,
            "samples_per_shard": per_shard,
            "shape": str(shape),
        }
    )
    done, jobs = [], []
    for plan in plan_shards(len(ds), per_shard):
        record = writer.finished(plan)
        if record:
            done.append(record)
        else:
            jobs.append(
                ShardJob(
                    plan,
                    str(path),
                    str(root),
                    name,
                    first_key,
                    shape,
                    skip_bad,
                    {r: why for r, why in skip_rows.items() if plan.start <= r < plan.end},
                )
            )
    return Split(name, path, ds, writer, first_key, done, jobs)


def convert(
    root: Path, train: Optional[Path], val: Optional[Path], per_shard: int, shape: Shape, workers: int, skip_bad: bool
) -> None:
    """Convert the given splits into root/train and root/val, resuming a crashed run."""
    if train is None and val is None:
        raise DataprepError("nothing to convert: give --train and/or --val")
    if per_shard <= 0:
        raise DataprepError(f"--samples-per-shard {per_shard}: must be > 0")
    t0 = time.perf_counter()
    inputs = [
        (name, path, open_input(path, name == "val"))
        for name, path in (("train", train), ("val", val))
        if path is not None
    ]  # every input checked before anything is written
    splits = [_plan_split(name, path, ds, root, per_shard, shape, skip_bad) for name, path, ds in inputs]
    jobs = [job for split in splits for job in split.jobs]
    workers = max(1, min(workers, len(jobs)))
    bar = progress.bar(
        sum(len(s.ds) for s in splits),
        "convert " + "+".join(s.name for s in splits),
        initial=sum(r.end - r.start for s in splits for r in s.done),
    )
    with bar:
        new = _run_pool(jobs, workers, bar) if jobs else {}
    wall = time.perf_counter() - t0
    for split in splits:
        split.writer.finish(split.done + new.get(split.name, []))
        _summarize(split, new.get(split.name, []))
    _summarize_rates([r for records in new.values() for r in records], workers, wall)


def _summarize(split: Split, new: list[ShardRecord]) -> None:
    records = split.done + new
    skipped = [s for r in sorted(records, key=lambda r: r.index) for s in r.skipped]
    rows = len(split.ds)
    progress.summary(
        f"convert {split.name}",
        [
            ("input", f"{split.input} ({rows} rows)"),
            (
                "output",
                f"{split.writer.dir} ({sum(1 for r in records if r.samples)} shards, "
                f"{sum(r.samples for r in records)} samples, keys {split.first_key}..{split.first_key + rows - 1})",
            ),
            ("this run", f"{len(new)} shards written, {len(split.done)} already finished (skipped)"),
            ("skipped inputs", progress.skipped(skipped, split.writer.skipped_list)),
        ],
    )


def _summarize_rates(new: list[ShardRecord], workers: int, wall: float) -> None:
    written, mib = sum(r.samples for r in new), sum(r.bytes for r in new) / 2**20
    busy = sum(r.seconds for r in new) or 1e-9
    progress.summary(
        "convert throughput",
        [
            (
                "total",
                f"{written} samples, {mib:.1f} MiB in {wall:.1f} s with {workers} workers: "
                f"{written / wall:.1f} samples/s, {mib / wall:.1f} MiB/s (start-up included)",
            ),
            ("per worker", f"{written / busy:.1f} samples/s, {mib / busy:.1f} MiB/s (while writing shards)"),
        ],
    )
