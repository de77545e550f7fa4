"""Typed conversion: a YAML tree checked against the sections' type hints, one converter per kind of type (a
table), into the dataclasses; each error names the key path and what it accepts."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Callable, Literal

from flux_train.config.setting import ConfigError


def type_name(tp: Any) -> str:
    """A key's type as messages and docs write it."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is typing.Union:
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin in (list, dict):
        return repr(tp).replace("typing.", "")
    if tp is type(None):  # an optional key's unset value, as YAML writes it
        return "null"
    return getattr(tp, "__name__", str(tp))


def _got(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _optional(value: Any, tp: Any, path: str) -> Any:
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    inner = [a for a in args if a is not type(None)]
    return _convert(value, inner[0], path)


def _literal(value: Any, tp: Any, path: str) -> Any:
    if value not in typing.get_args(tp):
        raise ConfigError(f"{path}: {value!r} is not accepted; expected {type_name(tp)}")
    return value


def _list(value: Any, tp: Any, path: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path}: expected a list, got {_got(value)}")
    (item,) = typing.get_args(tp)
    return [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]


def _dict(value: Any, tp: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping, got {_got(value)}")
    _, item = typing.get_args(tp)
    return {str(k): _convert(v, item, f"{path}.{k}") for k, v in value.items()}


def _bool(value: Any, tp: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    return value


def _int(value: Any, tp: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: expected an integer, got {_got(value)}")
    return value


def _float(value: Any, tp: Any, path: str) -> float:
    if isinstance(value, str):  # YAML 1.1 reads 5e-4 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: expected a number, got {_got(value)}")
    try:
        value = float(value)
    except OverflowError:  # an integer beyond any float
        value = math.inf
    if not math.isfinite(value):  # .nan, .inf, or 1e309 (read as a string, then overflowing)
        raise ConfigError(f"{path}: expected a finite number, got {value}")
    return value


def _str(value: Any, tp: Any, path: str) -> str:
    if isinstance(value, (dict, list)) or value is None:
        raise ConfigError(f"{path}: expected a string, got {_got(value)}")
    return str(value)


Converter = Callable[[Any, Any, str], Any]
# a generic type by its origin (Optional[X] is a Union), a plain one by itself; a section by build()
BY_ORIGIN: dict[Any, Converter] = {typing.Union: _optional, Literal: _literal, list: _list, dict: _dict}
BY_TYPE: dict[Any, Converter] = {bool: _bool, int: _int, float: _float, str: _str}


def _convert(value: Any, tp: Any, path: str) -> Any:
    convert = BY_ORIGIN.get(typing.get_origin(tp)) or BY_TYPE.get(tp)
    if convert is not None:
        return convert(value, tp, path)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    raise ConfigError(f"{path}: unsupported type {tp}")


def build(cls: type, data: Any, path: str) -> Any:
    """The dataclass `cls` (a section, or the whole Config at path "") from a YAML mapping, every key converted."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(str(k) for k in set(data) - set(names))  # str: YAML keys may be numbers
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"unknown key '{where}{unknown[0]}'; accepted keys here: {', '.join(names)}")
    kwargs = {k: _convert(v, hints[k], f"{path}.{k}" if path else k) for k, v in data.items()}
    return cls(**kwargs)
