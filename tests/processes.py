"""Finding a test's worker processes by their environment (Linux /proc)."""
from __future__ import annotations

import os
from pathlib import Path


def pid_with_env(**env: str | int) -> int | None:
    """The pid of a process whose environment holds every NAME=VALUE given, or None."""
    wanted = [f"{name}={value}".encode() for name, value in env.items()]
    for entry in os.listdir("/proc"):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(item in environ for item in wanted):
            return int(entry)
    return None
