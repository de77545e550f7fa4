"""A config key's declaration: its field (`setting`), the values it accepts, and the error a bad value raises."""

from __future__ import annotations

import copy
from dataclasses import field
from typing import Any, Callable

from flux_train.errors import UserError


class ConfigError(UserError, ValueError):
    """A bad configuration value; the message names the key path and what is accepted."""

    label = "config error"


# what a number accepts: (the text messages and docs show, the check); 0 is accepted where the key's help gives it
# a meaning (off, unset, none)
Accepts = tuple[str, Callable[[Any], bool]]


def at_least(low: float) -> Accepts:
    return f">= {low}", lambda v: v >= low


def within(low: float, high: float) -> Accepts:
    return f"in [{low}, {high}]", lambda v: low <= v <= high


POSITIVE = ("> 0", lambda v: v > 0)
BELOW_ONE = ("in [0, 1)", lambda v: 0 <= v < 1)  # an AdamW beta of 1 divides by zero in its bias correction
AUTO_OR_POSITIVE = ("-1 (auto) or >= 1", lambda v: v == -1 or v >= 1)
PATCHABLE = ("a positive even number (2x2 patches)", lambda v: v > 0 and v % 2 == 0)
RULES = "fixed by the rules; configurable only so tests and ablations can move it"


def setting(default: Any, help: str, accepts: Accepts | None = None, may_be_empty: bool = False) -> Any:
    """A config key's field: its default, what it does (`help`), the values validate accepts (`accepts`; an optional
    key's null is always accepted) and, for a string, whether empty means something (`may_be_empty`; any other key
    given an empty string, what an unset shell variable gives in --set data.path=$DATA, is refused rather than read
    as unset, since null unsets a key)."""
    metadata = {"help": help, "accepts": accepts, "may_be_empty": may_be_empty}
    if isinstance(default, (list, dict)):  # mutable: every config gets its own copy
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)
