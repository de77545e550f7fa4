"""The flags of every command that reads a config: `--set` and `--help-config` (argparse actions)."""

from __future__ import annotations

import argparse

from flux_train.config.keys import keys_help


def add_overrides(parser: argparse.ArgumentParser) -> None:
    """`--set SECTION.KEY=VALUE` (repeatable) into `overrides`, and `--help-config` listing the keys, as every
    command that reads a config takes them."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        type=assignment,
        metavar="SECTION.KEY=VALUE",
        help="override one config value; repeatable (the keys: --help-config)",
    )
    parser.add_argument(
        "--help-config",
        action=PrintConfigKeys,
        help="print every config key with its type, default and help, and exit",
    )


class PrintConfigKeys(argparse.Action):
    """`--help-config`: answered during parsing, as --help is, before the command's other flags are checked."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(keys_help())
        parser.exit()


def assignment(text: str) -> str:
    """argparse type of --set: KEY=VALUE in one word. `--set train.lr 0.5` would otherwise end in argparse's
    "unrecognized arguments: 0.5", which does not say what the form is."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not SECTION.KEY=VALUE: give the key and its value as one word, e.g. --set {text}=VALUE"
        )
    return text
