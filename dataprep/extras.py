"""The optional packages (pyproject.toml's extras): a command that needs one that is not installed says so in one
line, naming the extra that installs it, instead of ending in a ModuleNotFoundError."""

from __future__ import annotations

import importlib

from dataprep.format import DataprepError

EXTRA = {"datasets": "dataprep", "transformers": "dataprep"}  # module -> the extra of pyproject.toml that has it


def require(module: str, needed_for: str) -> None:
    """Import `module`, or raise DataprepError naming the extra that installs it."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:  # the package is there but something it imports is not: its own error says more
            raise
        raise DataprepError(
            f"{needed_for}: the Python package {module} is not installed; install it with the {EXTRA[module]} extra: "
            f"pip install -e '.[{EXTRA[module]}]' (in the repository's folder)"
        ) from None
