"""Secrets kept out of what flux-train shows and archives: the value of a variable whose name looks secret
(SECRET_NAMES, plus the patterns of env.masked_vars) becomes MASK in the agent's log, `submit --dry-run` and its
messages, and the run folder's config.yaml. The real values still reach the workers' environment."""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import typing
from typing import Iterable, Mapping

from flux_train.config import Config

SECRET_NAMES = ("*TOKEN*", "*KEY*", "*SECRET*", "*PASSWORD*", "*PASSWD*", "*CREDENTIAL*")
MASK = "***"
# NAME=value inside a string: a command-line word (--env=HF_TOKEN=x, -e HF_TOKEN=x) or a list (ALL,HF_TOKEN=x)
ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=([^\s,]*)")


def looks_secret(name: str, extra: Iterable[str] = ()) -> bool:
    """Whether a variable's name matches SECRET_NAMES or an extra fnmatch pattern, in any case."""
    return any(fnmatch.fnmatchcase(name.upper(), pattern.upper()) for pattern in (*SECRET_NAMES, *extra))


def mask_text(text: str, extra: Iterable[str] = ()) -> str:
    """`text` with the value of every secret-looking NAME=value in it masked."""

    def one(match: re.Match) -> str:
        name, value = match.groups()
        return f"{name}={MASK if looks_secret(name, extra) else mask_text(value, extra)}"

    return ASSIGNMENT.sub(one, text)


def mask_env(env: Mapping[str, str], extra: Iterable[str] = ()) -> dict[str, str]:
    """Variables as they may be shown: secret-looking ones masked."""
    return {name: MASK if looks_secret(name, extra) else mask_text(value, extra) for name, value in env.items()}


def masked(cfg: Config) -> Config:
    """A copy of a Config to show or archive: in every mapping (env.vars, slurm.additional) the values of
    secret-looking keys masked, and in every string (container.extra_args, ...) secret-looking NAME=value."""
    extra = cfg.env.masked_vars

    def walk(value):
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(
                value, **{f.name: walk(getattr(value, f.name)) for f in dataclasses.fields(value)}
            )
        if isinstance(value, dict):
            return {k: MASK if looks_secret(k, extra) else walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return mask_text(value, extra) if isinstance(value, str) else value

    return typing.cast(Config, walk(cfg))
