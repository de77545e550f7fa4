"""One process at a time in an output folder (a run's logging.out_dir, a dataset being written): a lock on
`<folder>/.lock` that the kernel drops when its holder dies, however it dies, so a requeued job is never kept out
by a crashed one. The file also says who holds it (host, pid, Slurm job, since when) for the refusal's message.

What this relies on: POSIX record locks (fcntl F_SETLK through `fcntl.lockf`), which NFS carries to the server
(NLM for v3, the protocol itself for v4), Lustre when mounted with `-o flock` (with `localflock` they only hold
within a node; with `noflock` they fail, below), and GPFS/BeeGFS cluster-wide. On NFSv4 the lock of a node that
died (not just its process) goes when its lease expires (about 90 s). A POSIX lock is not inherited by forked
children (the loader workers), and it is released when its process closes *any* descriptor of the file, so
nothing else in the process may open `.lock`: the file object returned here is the only one. Where the
filesystem has no locks at all, the holder runs unguarded after one warning line.
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


def lock_folder(folder: Path, setting: str) -> IO[str]:
    """Take `folder`'s lock (creating the folder) for as long as the returned file stays open; `setting` is what
    names the folder to the user (a config key or a flag)."""
    folder = Path(folder)
    path = folder / LOCK_FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a link planted in its place is refused (ELOOP), not written through
        handle = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "r+")
    except OSError as exc:
        raise FolderLockError(f"{setting} {folder}: cannot write there ({_reason(exc)})") from None
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
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
    return handle


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return f"{exc.filename} is a symbolic link"
    return f"{exc.strerror}: {exc.filename}" if exc.filename else str(exc.strerror)
