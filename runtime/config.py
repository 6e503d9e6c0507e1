"""Config: YAML files → typed msgspec structs, with `a.b=c` overrides and errors that name the field.

Each component declares a struct (`forbid_unknown_fields=True`, a one-line comment per field); a run
config composes them. `load(path, RunConfig, overrides=["learner.lr=1e-6"])` reads the YAML, applies
the overrides (values parsed as YAML scalars, so `=3` is an int and `=true` a bool), and converts
strictly: a misspelt key or a wrong type raises `ConfigError("learner.lrr: unknown field")` at start,
before any process is spawned. Never pass raw dicts around past this module.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

T = TypeVar("T")

_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`")
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]+)`")
_NAMED = re.compile(r"^[A-Za-z_][\w.\[\]]*: ")


class ConfigError(ValueError):
    """A config is invalid; the message starts with the dotted name of the field."""


def _dotted(path: str) -> str:
    # msgspec paths look like ".learner.lr" or ".actors[0].threads"
    return path.lstrip(".")


def _explain(err: msgspec.ValidationError, where: str) -> ConfigError:
    m = _AT.match(str(err))
    what, path = (m.group("what"), m.group("path") or "") if m else (str(err), "")
    field = _dotted(path)
    if u := _UNKNOWN.search(what):
        field, what = ".".join(p for p in (field, u.group("field")) if p), "unknown field"
    elif u := _MISSING.search(what):
        field, what = ".".join(p for p in (field, u.group("field")) if p), "required field is missing"
    else:
        what = what[0].lower() + what[1:] if what else what
    prefix = f"{where}: " if where else ""
    if not field and _NAMED.match(what):  # a check of the whole struct that names its own field
        return ConfigError(f"{prefix}{what}")
    return ConfigError(f"{prefix}{field or '<root>'}: {what}")


def convert(data: Any, typ: type[T], *, where: str = "") -> T:
    """`data` (plain YAML/JSON values) as `typ`, strictly; ConfigError names the bad field."""
    try:
        return msgspec.convert(data, typ, strict=True)
    except msgspec.ValidationError as e:
        raise _explain(e, where) from None


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Applies one `a.b.c=value` override in place (creating intermediate maps)."""
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r} must look like key.sub=value")
    parts = key.strip().split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, cannot set {key!r}")
        node = child
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads "1e-5" (no dot) as a string; a user means the number
        node[parts[-1]] = value
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot parse override value {raw!r}: {e}") from None


def read_yaml(path: Path | str) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    try:
        # A run's config.json is read as JSON: YAML 1.1 would read its 1e-06 as a string.
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def load(path: Path | str | None, typ: type[T], overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Reads `path` (or starts empty), applies `overrides`, and converts to `typ`."""
    tree = read_yaml(path) if path is not None else {}
    for o in overrides:
        apply_override(tree, o)
    return convert(tree, typ)


def to_dict(config: msgspec.Struct) -> dict[str, Any]:
    """The resolved config as plain values (for logging once at start and for the run directory)."""
    return msgspec.to_builtins(config)
