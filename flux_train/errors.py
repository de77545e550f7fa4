"""Errors that name a bad input, and the one way every command reports them: one line on stderr, exit 2."""
from __future__ import annotations

import functools
import sys
from typing import Callable

EXIT_BAD_INPUT = 2


class UserError(Exception):
    """A bad input (a config value, a path, the data, a node); the message names it and the fix."""

    label = "error"  # the line starts "<label>: "


def reports_user_errors(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap a command's main(argv): a UserError becomes '<label>: <message>' on stderr and exit code 2."""

    @functools.wraps(main)
    def wrapped(argv=None) -> int:
        try:
            return main(argv)
        except UserError as exc:
            print(f"{exc.label}: {exc}" if exc.label else str(exc), file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT

    return wrapped
