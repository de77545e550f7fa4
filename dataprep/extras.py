"""The optional packages (pyproject.toml's extras): a command that needs one that is not installed says so in one
line, naming the extra that installs it, instead of ending in a ModuleNotFoundError."""

from __future__ import annotations

import importlib
import os

from dataprep.format import DataprepError

EXTRA = {"datasets": "dataprep", "transformers": "dataprep"}  # module -> the extra of pyproject.toml that has it
# the variable that keeps a package's own progress bars out of our commands' (read as it is imported, and inherited by
# the worker processes that import it again); a value the user set stays
QUIET = {"datasets": "HF_DATASETS_DISABLE_PROGRESS_BARS"}


def require(module: str, needed_for: str) -> None:
    """Import `module` (without its own progress bars), or raise DataprepError naming the extra that installs it."""
    if module in QUIET:
        os.environ.setdefault(QUIET[module], "1")
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:  # the package is there but something it imports is not: its own error says more
            raise
        raise DataprepError(
            f"{needed_for}: the Python package {module} is not installed; install it with the {EXTRA[module]} extra: "
            f"pip install -e '.[{EXTRA[module]}]' (in the repository's folder)"
        ) from None
