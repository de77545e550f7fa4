"""Finding a test's processes by their environment (Linux /proc)."""

from __future__ import annotations

import os
from pathlib import Path


def pids_with_env(**env: str | int) -> list[int]:
    """The pids of the processes whose environment holds every NAME=VALUE given."""
    wanted = [f"{name}={value}".encode() for name, value in env.items()]
    pids = []
    for entry in os.listdir("/proc"):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(item in environ for item in wanted):
            pids.append(int(entry))
    return pids


def pid_with_env(**env: str | int) -> int | None:
    """The pid of a process whose environment holds every NAME=VALUE given, or None."""
    return next(iter(pids_with_env(**env)), None)


def parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:  # it has exited
        return None


def children(pid: int) -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and parent(int(entry)) == pid]


def alive(pid: int) -> bool:
    """Running, not exited (a zombie waiting for its parent to collect it has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def maps(pid: int) -> str:
    """The files and regions mapped into a process ("" once it has exited)."""
    try:
        return Path(f"/proc/{pid}/maps").read_text(errors="replace")
    except OSError:
        return ""
