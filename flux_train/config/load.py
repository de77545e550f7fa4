"""Loading a config: YAML files with their `defaults:` chain merged, `--set` overrides applied, the tree converted
to the typed sections and validated (load_config)."""

from __future__ import annotations

import collections.abc
from pathlib import Path

import yaml

from flux_train.config.convert import build
from flux_train.config.rules import validate
from flux_train.config.sections import Config
from flux_train.config.setting import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _resolve(ref: str, parent: Path) -> Path:
    name = ref if ref.endswith((".yaml", ".yml")) else ref + ".yaml"
    for candidate in (parent / name, CONFIG_DIR / name):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"defaults: cannot find '{ref}' (looked in {parent} and {CONFIG_DIR})")


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without anchors and aliases: a config has no use for them, and nested aliases (a "billion laughs" of a
    few hundred bytes) expand to more values than memory holds. A key given twice in one mapping is refused too:
    YAML keeps the last silently, and the one a user edited may be the other."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise ConfigError(f"line {mark.line + 1}: an alias (*name); write the value out instead")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, collections.abc.Hashable):
                break  # SafeLoader's own error names it
            if key in seen:
                raise ConfigError(
                    f"line {key_node.start_mark.line + 1}: key {key!r} given twice in one mapping (first on line "
                    f"{seen[key]}); keep one"
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def parse_yaml(text: str):
    """A config text or a --set value: plain YAML, aliases refused."""
    return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass


def load_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """Read a config file with its `defaults:` chain merged in; returns a plain nested dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config file not found: {path}; pass --config an existing YAML file (the shipped ones are in {CONFIG_DIR})"
        )
    resolved = path.resolve()
    if resolved in _seen:
        raise ConfigError(f"defaults: cycle through {path}")
    try:
        raw = parse_yaml(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    defaults = raw.pop("defaults", []) or []
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) and d.strip() for d in defaults):
        raise ConfigError(
            f"{path}: defaults: expected a list of config names, e.g. [model/flux-debug], got {defaults!r}"
        )
    merged: dict = {}
    for ref in defaults:
        merged = _deep_merge(merged, load_yaml(_resolve(ref, path.parent), _seen + (resolved,)))
    return _deep_merge(merged, raw)


def apply_override(tree: dict, assignment: str) -> dict:
    """Apply one `section.key=value` (value parsed as YAML) to a nested dict."""
    if "=" not in assignment:
        raise ConfigError(f"--set '{assignment}': expected section.key=value")
    dotted, _, text = assignment.partition("=")
    keys = dotted.strip().split(".")
    if len(keys) < 2 or not all(keys):
        raise ConfigError(f"--set '{assignment}': expected section.key=value")
    try:
        value = parse_yaml(text) if text.strip() else ""
    except yaml.YAMLError:
        opening = text.lstrip()[:1]
        if opening in ("'", '"'):  # YAML reads it as a quoted string: taken verbatim, the stray quote would stay in
            raise ConfigError(
                f"--set {assignment!r}: the value starts with {opening} but is not a quoted string (a quote left "
                "open?); close the quote, or leave the quotes out (the shell's quotes around the whole --set suffice)"
            ) from None
        if opening in ("[", "{"):  # YAML reads it as a list or a mapping: taken verbatim, a typo would become a value
            kind = "list" if opening == "[" else "mapping"
            raise ConfigError(
                f"--set {assignment!r}: the value starts with {opening} but is not a YAML {kind} (a bracket left "
                f"open?); close it, or quote the whole value to mean the text: --set '{dotted}=\"{text}\"'"
            ) from None
        value = text
    except ConfigError as exc:
        raise ConfigError(f"--set '{assignment}': {exc}") from None
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set '{assignment}': '{key}' is not a section")
    node[keys[-1]] = value
    return tree


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    tree = load_yaml(path) if path is not None else {}
    for assignment in overrides:
        tree = apply_override(tree, assignment)
    return validate(build(Config, tree, ""))
