"""Errors that name a bad input or a file that cannot be written, and the one way every command reports them: one
line on stderr, exit 2 (bad input) or 74 (storage)."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Callable, NoReturn

EXIT_BAD_INPUT = 2
EXIT_STORAGE = 74  # EX_IOERR: a file the run must write could not be written (a full disk, a quota, a lost mount)


class UserError(Exception):
    """A bad input (a config value, a path, the data, a node); the message names it and the fix."""

    label = "error"  # the line starts "<label>: "
    exit_code = EXIT_BAD_INPUT


class StorageError(UserError):
    """A file the run must write could not be written; the message names the file (the trainer adds the last good
    checkpoint). Not a bad input: the same command succeeds once there is room again."""

    label = "fatal"
    exit_code = EXIT_STORAGE


def output_file(path: Path, flag: str) -> Path:
    """`path`, where a command is to write a file its user named (`flag`); a folder there is a bad input, said before
    any work is done."""
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; give the path of the file to write")
    return path


def write_output(path: Path, flag: str, write: Callable[[Path], object]) -> None:
    """`write(path)` for output_file(path, flag), its folder made first; a write that fails (no such place, no
    permission, a full disk) is one line naming the flag, not a traceback."""
    output_file(path, flag)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
    except OSError as exc:
        raise StorageError(
            f"{flag} {path}: writing it failed ({exc.strerror or exc}); give a path that can be written"
        ) from None


class StateMisfit(ValueError):
    """A checkpoint part's saved state that this run's part cannot take (another recipe's, another set of layers):
    the message says what it holds and what this run has; the part keeps its own state (training.checkpoint.load)."""


def raise_on_every_rank(error: UserError, is_main: bool) -> NoReturn:
    """An error every rank of a run has found alike: the main rank reports it (one line for the run, not one per
    rank), the others exit with its code and say nothing."""
    if is_main:
        raise error
    raise SystemExit(error.exit_code)


def report(error: UserError) -> int:
    """'<label>: <message>' on stderr; returns the error's exit code."""
    print(f"{error.label}: {error}" if error.label else str(error), file=sys.stderr, flush=True)
    return error.exit_code


def reports_user_errors(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap a command's main(argv, ...): a UserError becomes '<label>: <message>' on stderr and its exit code."""

    @functools.wraps(main)
    def wrapped(argv=None, **parts) -> int:
        try:
            return main(argv, **parts)
        except UserError as exc:
            return report(exc)

    return wrapped


class Parser(argparse.ArgumentParser):
    """The argument parser of every command: a bad flag is one line naming it (argparse's own error prints the
    usage block first), exit 2. Subcommands' parsers are of the same class (argparse's default)."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


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
