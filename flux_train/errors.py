"""Errors that name a bad input, and the one way every command reports them: one line on stderr, exit 2."""

from __future__ import annotations

import argparse
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


class Parser(argparse.ArgumentParser):
    """The argument parser of every command: a bad flag is one line naming it (argparse's own error prints the
    usage block first), exit 2. Subcommands' parsers are of the same class (argparse's default)."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")

    def add_overrides(self) -> None:
        """`--set SECTION.KEY=VALUE` (repeatable) into `overrides`, as every command that reads a config takes it."""
        self.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="override one config value; repeatable",
        )


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_number(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
