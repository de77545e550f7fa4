"""Content digests of a split's shards: computed as dataprep writes each shard, kept beside the shards in
`<split>/digests.json`, checked whole by `verify` and cheaply by the trainer before init_start.

A shard's entry holds its size, the SHA-256 of its first HEAD_BYTES (the start of its first sample, whose key no other
shard holds: a shard swapped for another of the same size differs there) and of each CHUNK_BYTES piece. The trainer
reads the head of every shard the index lists and LOAD_CHUNKS pieces of each split (64 MiB); `verify` reads all.
Data made by other tools has no such file and is read as before: the MLPerf recipes' layout is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

FILE = "digests.json"
HEAD_BYTES = 64 << 10
CHUNK_BYTES = 16 << 20
LOAD_CHUNKS = 4


class Digester:
    """A file being written, wrapped: what is written through it is hashed on the way (no second read)."""

    def __init__(self, out: BinaryIO):
        self.out, self.size = out, 0
        self.head, self.piece, self.chunks = hashlib.sha256(), hashlib.sha256(), []

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.head.update(view[: max(HEAD_BYTES - self.size, 0)])
        done = 0
        while done < len(view):
            take = min(len(view) - done, CHUNK_BYTES - (self.size + done) % CHUNK_BYTES)
            self.piece.update(view[done : done + take])
            done += take
            if (self.size + done) % CHUNK_BYTES == 0:
                self.chunks.append(self.piece.hexdigest())
                self.piece = hashlib.sha256()
        self.size += len(view)
        return self.out.write(data)

    def entry(self) -> dict:
        """The shard's entry in FILE, once it is written."""
        tail = [self.piece.hexdigest()] if self.size % CHUNK_BYTES else []
        return {"size": self.size, "head": self.head.hexdigest(), "chunks": self.chunks + tail}


def table(entries: dict[str, dict]) -> str:
    """FILE's text for the shards' entries (by shard name)."""
    return json.dumps({"head_bytes": HEAD_BYTES, "chunk_bytes": CHUNK_BYTES, "shards": entries}, indent=0) + "\n"


def read(folder: Path) -> dict[str, dict] | None:
    """The entries of a split folder's FILE; None where there is none (data made by another tool). ValueError naming
    the file when it is garbled or of other sizes."""
    path = folder / FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        if (raw["head_bytes"], raw["chunk_bytes"]) != (HEAD_BYTES, CHUNK_BYTES):
            raise ValueError(f"head and chunk sizes {raw['head_bytes']}, {raw['chunk_bytes']}")
        return {name: dict(entry) for name, entry in raw["shards"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None


def _sha256(f: BinaryIO, start: int, length: int) -> str:
    f.seek(start)
    return hashlib.sha256(f.read(length)).hexdigest()


def mismatch(shard: Path, entry: dict, chunks: list[int] | None) -> str | None:
    """How `shard` differs from its entry (None: it does not): size, head, then the chunks given (None: all)."""
    size = shard.stat().st_size
    if size != entry["size"]:
        return f"{size} bytes, its digest records {entry['size']}"
    with open(shard, "rb") as f:
        if _sha256(f, 0, HEAD_BYTES) != entry["head"]:
            return "its first bytes differ from its digest (another shard in its place, or changed)"
        for i in range(len(entry["chunks"])) if chunks is None else chunks:
            if _sha256(f, i * CHUNK_BYTES, CHUNK_BYTES) != entry["chunks"][i]:
                return f"bytes {i * CHUNK_BYTES}-{min((i + 1) * CHUNK_BYTES, size)} differ from its digest (changed)"
    return None


def check(
    folder: Path, names: list[str], entries: dict[str, dict], rng: random.Random | None, threads: int = 1
) -> list[str]:
    """The shards `names` of a split against their entries: every byte (rng None, verify), or every head and
    LOAD_CHUNKS pieces drawn by `rng` (the trainer); `threads` shards at a time (hashlib lets go of the GIL). One
    line per bad shard."""
    pieces = [(name, i) for name in names if name in entries for i in range(len(entries[name]["chunks"]))]
    drawn = None if rng is None else rng.sample(pieces, min(LOAD_CHUNKS, len(pieces)))
    problems = [f"{folder / name}: not in {folder / FILE}" for name in names if name not in entries]

    def problem(name: str) -> str | None:
        chunks = None if drawn is None else [i for shard, i in drawn if shard == name]
        why = mismatch(folder / name, entries[name], chunks)
        return f"{folder / name}: {why}" if why else None

    with ThreadPoolExecutor(max(1, threads)) as pool:
        return problems + [p for p in pool.map(problem, [n for n in names if n in entries]) if p]
