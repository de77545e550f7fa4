"""The list of keys, as their fields declare them: what validate walks, and what `--help-config` and docs/config.md
show."""

from __future__ import annotations

import dataclasses
import json
import textwrap
import typing
from dataclasses import dataclass
from typing import Any

from flux_train.config.convert import type_name
from flux_train.config.sections import Config
from flux_train.config.setting import Accepts


@dataclass(frozen=True)
class Key:
    """One config key, as its field declares it (`setting`)."""

    name: str  # section.key
    type: Any
    default: Any
    help: str
    accepts: Accepts | None
    may_be_empty: bool

    def accepted(self) -> str:
        """Its type, and its range where it has one."""
        return f"{type_name(self.type)}, {self.accepts[0]}" if self.accepts else type_name(self.type)

    def default_text(self) -> str:
        """The default as a YAML value (JSON is YAML: null, true, "text", [16, 56, 56])."""
        return json.dumps(self.default)


def keys() -> list[Key]:
    """Every key, in the order of the sections and their fields."""
    found = []
    for section, cls in typing.get_type_hints(Config).items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            found.append(Key(f"{section}.{f.name}", hints[f.name], default, **f.metadata))
    return found


def keys_help() -> str:
    """Every key, what it takes, its default and what it does (`--help-config`; docs/config.md is the same table)."""
    lines = [
        "Every config key: what it takes, its default (the files in configs/ set others) and what it does. Set one in",
        "a config file's section or with --set SECTION.KEY=VALUE (a YAML value). The same table: docs/config.md.",
    ]
    section = None
    for key in keys():
        if key.name.split(".")[0] != section:
            section = key.name.split(".")[0]
            lines.append("")
        lines.append(f"{key.name}  {key.accepted()}  (default {key.default_text()})")
        lines += textwrap.wrap(
            key.help,
            116,
            initial_indent="    ",
            subsequent_indent="    ",
            break_on_hyphens=False,
            break_long_words=False,
        )
    return "\n".join(lines)
