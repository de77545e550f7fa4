"""Staging: where a file or folder is written before it is renamed into place, for every command of dataprep and
flux_train (docs/operating.md, "What flux-train writes and removes"). A staging name is created exclusively -- a new
name beside the destination (the same filesystem, so the rename is atomic), never one that exists -- and only what
was created so is removed: a file or folder of the user's that happens to have such a name is never written into
or deleted."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Callable, TypeVar

SUFFIX = ".partial"
T = TypeVar("T")


def _create_beside(final: Path, make: Callable[[Path], T]) -> tuple[Path, T]:
    """A name `.<final's name>.<random>.partial` in final's folder that did not exist, and what `make` (which raises
    FileExistsError where it does) returned for it; permissions as the umask gives (tempfile's are the owner's only)."""
    while True:
        path = final.with_name(f".{final.name}.{secrets.token_hex(4)}{SUFFIX}")
        try:
            return path, make(path)
        except FileExistsError:
            continue


def staging_folder(final: Path) -> Path:
    """A new, empty folder beside `final`, to be renamed to it when complete."""
    return _create_beside(final, Path.mkdir)[0]


def staging_file(final: Path) -> Path:
    """A new, empty file beside `final`, to be renamed to it when complete."""
    return _create_beside(final, lambda p: os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)))[0]


def write_atomic(path: Path, data: str | bytes) -> None:
    """`path` replaced whole by `data` (a crash leaves the old file or the new one, never a part); an OSError is the
    write's own, its staging file removed."""
    tmp, fd = _create_beside(path, lambda p: os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
