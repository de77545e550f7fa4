"""One process at a time in an output folder (a run's logging.out_dir, a dataset being written): a lock on
`<folder>/.lock` that the kernel drops when its holder dies, however it dies, so a requeued job is never kept out
by a crashed one. The file also says who holds it (host, pid, Slurm job, since when) for the refusal's message.

What this relies on: POSIX record locks (fcntl F_SETLK through `fcntl.lockf`), which NFS carries to the server
(NLM for v3, the protocol itself for v4), Lustre when mounted with `-o flock` (with `localflock` they only hold
within a node; with `noflock` they fail, below), and GPFS/BeeGFS cluster-wide. On NFSv4 the lock of a node that
died (not just its process) goes when its lease expires (about 90 s). A POSIX lock is not inherited by forked
children (the loader workers), and it is released when its process closes *any* descriptor of the file, so
nothing else in the process may open `.lock`: the file object held here is the only one. Where the
filesystem has no locks at all, the holder runs unguarded after one warning line.

Letting go (FolderLock.release, or the end of its `with` block) removes the lock file, and the folders the lock
created if nothing else was written in them: a start that failed leaves no folder holding a lock file only.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO

LOCK_FILE = ".lock"


class FolderLockError(Exception):
    """The folder is held by another process, or cannot be created or written; the message names it."""


class FolderLock:
    """A folder's lock, held until `release` (or the end of a `with` block) or the end of the process."""

    def __init__(self, folder: Path, handle: IO[str], created: list[Path]):
        self.folder, self.handle, self.created = folder, handle, created

    def release(self) -> None:
        """The lock file removed while still held (a process that opened it before then finds it gone once it holds
        it, and takes the new one: lock_folder), then each folder the lock created, deepest first, if empty."""
        if self.handle.closed:
            return
        (self.folder / LOCK_FILE).unlink(missing_ok=True)
        self.handle.close()
        remove_empty(self.created)

    def __enter__(self) -> "FolderLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_folder(folder: Path, setting: str) -> FolderLock:
    """Take `folder`'s lock (creating the folder); `setting` is what names the folder to the user (a config key or a
    flag)."""
    folder = Path(folder)
    path = folder / LOCK_FILE
    created = missing_folders(folder)
    while True:
        handle = _open(path, setting)
        if not _lock(handle, folder, setting) or _is_there(handle, path):
            break
        handle.close()  # its holder removed it as it let go: the one there now is free
    if handle.read()[:5] not in ("", "host "):  # a file of the user's by that name, not a holder's line of ours
        handle.close()
        raise FolderLockError(f"{setting} {folder}: {path} is not a lock file of this tool's; move it away")
    job = os.environ.get("SLURM_JOB_ID")
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(
            f"host {socket.gethostname()} pid {os.getpid()}{f' (Slurm job {job})' if job else ''} since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        )
        handle.flush()
    except OSError as exc:
        handle.close()
        raise FolderLockError(f"{setting} {folder}: cannot write there ({_reason(exc)})") from None
    return FolderLock(folder, handle, created)


def missing_folders(folder: Path) -> list[Path]:
    """`folder` and the folders above it that are not there yet, deepest first: what making it creates."""
    return [p for p in (folder, *folder.parents) if not p.exists()]


def remove_empty(folders: list[Path]) -> None:
    """The folders, deepest first, up to the first that is not empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # something is there
            return


def _open(path: Path, setting: str) -> IO[str]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a link planted in its place is refused (ELOOP), not written through
        return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "r+")
    except OSError as exc:
        raise FolderLockError(f"{setting} {path.parent}: cannot write there ({_reason(exc)})") from None


def _lock(handle: IO[str], folder: Path, setting: str) -> bool:
    """Whether the lock was taken (False: the filesystem takes none); FolderLockError naming the holder if it is
    held."""
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            holder = handle.read().strip() or "a process that has not written its name yet"
            handle.close()
            raise FolderLockError(
                f"{setting} {folder} is in use by {holder}; wait for it to end, or choose another {setting}"
            ) from None
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        print(
            f"warning: {folder}: the filesystem takes no locks ({exc.strerror}); a second process there is not kept out",
            file=sys.stderr,
        )
        return False


def _is_there(handle: IO[str], path: Path) -> bool:
    """Whether the file locked is still the one at `path` (its holder removes it as it lets go)."""
    try:
        there = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(handle.fileno())
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return f"{exc.filename} is a symbolic link"
    return f"{exc.strerror}: {exc.filename}" if exc.filename else str(exc.strerror)
