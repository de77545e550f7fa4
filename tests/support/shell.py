"""Documented commands as a user types them, in bash: `python` is the interpreter running the tests."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path


def python_on_path(folder: Path) -> dict[str, str]:
    """The environment whose `python` is this interpreter, through a script in `folder` that executes it by its own
    path: a link to a virtualenv's python outside the virtualenv would start the base interpreter, without the
    packages installed in the virtualenv."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "python"
    script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}"}
