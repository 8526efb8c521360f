"""Settings trees: nested ``@dataclass`` configs loaded from TOML tables and ``--a.b.c value`` overrides.

Each component owns its section as a plain dataclass (``TrainConfig`` in ``trainguard.train``,
``ABFTConfig`` in ``trainguard.sdc.abft``, ...); a run config is a dataclass whose fields are those
sections. This module loads such a tree strictly:

* keys are checked against the dataclass fields (unknown keys and sections are refused, naming the
  known ones); values are coerced from the field's **real type hints** (``typing.get_type_hints``):
  ``bool``, ``int``, ``float``, ``str``, ``Literal[...]`` (choices), ``list[T]``, ``tuple[T, ...]`` and
  fixed tuples, ``dict[str, Any]``, ``X | None`` and nested dataclasses (sub-tables);
* a section with an ``enabled`` field also accepts a bare boolean (``[sdc] abft = true`` is
  ``[sdc.abft] enabled = true``); a class may declare ``settings_aliases = {"old_key": "new.path"}``
  for renamed keys, and ``set_extra(key, value, from_text)`` to take keys it validates itself;
* after loading, every section's ``validate()`` runs (children first), so impossible values are refused
  before any work starts. Every error is one line (``ConfigError``).

Field help comes from ``field(metadata={"help": ...})`` (:func:`setting`), or else from the comment that
ends the field's line in the class source; :func:`describe` lists every key with its type, default and
help (``trainguard train --help`` is generated from it).
Relies on the standard library (``dataclasses``, ``typing``, ``tomllib``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from trainguard.errors import ConfigError

_MISSING = dataclasses.MISSING


def setting(default: Any = _MISSING, *, help: str, default_factory: Any = _MISSING) -> Any:
    """A dataclass field with a help text (shown by ``describe`` and ``trainguard train --help``)."""
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


# ---------------------------------------------------------------------------------------------------
# Loading


def load_settings(cls: type, path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> Any:
    """``cls`` from an optional TOML file plus overrides, validated."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_toml(path)
    root = from_table(cls, raw)
    for key, value in override_pairs(overrides):
        set_path(root, key, value, from_text=isinstance(value, str))
    return validate_tree(root)


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file not found: {path}")
    if not p.is_file():  # a folder or a device: reading it would fail, or hang on a FIFO
        raise ConfigError(f"config file is not a regular file: {path}")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); config files are TOML in UTF-8") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None


def from_table(cls: type, table: dict[str, Any], path: str = "") -> Any:
    obj = cls()
    if not isinstance(table, dict):
        raise ConfigError(f"config section [{path or cls.__name__}] must be a table")
    for key, value in table.items():
        _assign(obj, str(key), value, False, path)
    return obj


def set_path(root: Any, dotted: str, value: Any, from_text: bool = True) -> None:
    """Set ``a.b.c`` in the tree (``value`` is text from the command line when ``from_text``)."""
    if "." not in dotted:
        raise ConfigError(f"override {dotted!r} must look like section.key")
    parts = dotted.split(".")
    obj, path = root, ""
    while len(parts) > 1:
        part = parts[0]
        aliases = getattr(type(obj), "settings_aliases", {})
        if part in aliases:  # a renamed section: continue along its new path
            parts = aliases[part].split(".") + parts[1:]
            continue
        fields = _fields(obj)
        child = getattr(obj, part) if part in fields else None
        if not (dataclasses.is_dataclass(child) and not isinstance(child, type)):
            where = f"{path}.{part}" if path else part
            known = sorted(n for n in fields if dataclasses.is_dataclass(getattr(obj, n)))
            hint = f" (known: {', '.join(known)})" if known else ""
            raise ConfigError(f"unknown config section {where!r} in override --{dotted}{hint}")
        obj, path, parts = child, (f"{path}.{part}" if path else part), parts[1:]
    _assign(obj, parts[0], value, from_text, path)


def override_pairs(overrides: list[str] | dict[str, Any] | None) -> list[tuple[str, Any]]:
    """``--a.b value`` / ``--a.b=value`` items (or a dict) as (dotted key, value) pairs."""
    if overrides is None:
        return []
    if isinstance(overrides, dict):
        return list(overrides.items())
    pairs, items, i = [], list(overrides), 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--"):
            raise ConfigError(f"unexpected argument {item!r} (overrides look like --section.key value)")
        key = item[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(items):
                raise ConfigError(f"override --{key} needs a value")
            value = items[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def repeated_keys(overrides: list[str]) -> list[str]:
    """One line for each key a command line gives more than once (``--train.steps 5 --train.steps 7``): the last
    value wins, as with any command-line option, and the line says so (a shell variable holding a base command
    line that a key is appended to is the usual way this happens; a typo is the other)."""
    values: dict[str, list[Any]] = {}
    for key, value in override_pairs(overrides):
        values.setdefault(key, []).append(value)
    return [f"--{key} is given {len(v)} times ({', '.join(map(repr, v))}): the last, {v[-1]!r}, is used"
            for key, v in values.items() if len(v) > 1]


def validate_tree(obj: Any, path: str = "") -> Any:
    """Check every value against its type hint and run ``validate()`` of every section, children first;
    returns ``obj`` (what its ``validate()`` returns). Values set in code are checked like loaded ones."""
    validate_children(obj, path)
    check = getattr(obj, "validate", None)
    if callable(check):
        out = check()
        return obj if out is None else out
    return obj


def validate_children(obj: Any, path: str = "") -> None:
    """:func:`validate_tree` of every sub-section, and the type check of ``obj``'s own values."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{path}.{f.name}" if path else f.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            validate_tree(value, name)
        elif f.init:
            setattr(obj, f.name, coerce(name, hints[f.name], value, from_text=False))


def _fields(obj: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj) if f.init}


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception as err:  # an annotation that does not resolve is a bug in the section, not user input
        raise TypeError(f"cannot resolve the type hints of {cls.__name__}: {err}") from err


def _assign(obj: Any, key: str, value: Any, from_text: bool, path: str) -> None:
    name = f"{path}.{key}" if path else key
    aliases = getattr(type(obj), "settings_aliases", {})
    if key in aliases:
        _assign_path(obj, aliases[key], value, from_text, path)
        return
    fields = _fields(obj)
    if key not in fields:
        extra = getattr(obj, "set_extra", None)
        if callable(extra):
            extra(key, value, from_text)
            return
        kind = "section" if not path else "key"
        known = ", ".join(sorted(fields))
        if kind == "section":
            raise ConfigError(f"unknown config section [{key}] (known: {known})")
        raise ConfigError(f"unknown key {name} (known: {known})")
    current = getattr(obj, key)
    if dataclasses.is_dataclass(current) and not isinstance(current, type):
        if isinstance(value, dict):
            for k, v in value.items():
                _assign(current, str(k), v, from_text, name)
            return
        if "enabled" in _fields(current):  # bare boolean: the section's switch
            current.enabled = coerce(f"{name}", bool, value, from_text)
            return
        raise ConfigError(f"config section [{name}] must be a table")
    setattr(obj, key, coerce(name, _hints(type(obj))[key], value, from_text))


def _assign_path(obj: Any, dotted: str, value: Any, from_text: bool, path: str) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        obj = getattr(obj, part)
        path = f"{path}.{part}" if path else part
    _assign(obj, parts[-1], value, from_text, path)


# ---------------------------------------------------------------------------------------------------
# Coercion


def type_name(typ: Any) -> str:
    origin = typing.get_origin(typ)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(typ))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(typ))
    if origin in (list, tuple, dict):
        args = typing.get_args(typ)
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if typ is type(None):
        return "none"
    return getattr(typ, "__name__", str(typ))


class _NotFinite(ValueError):
    """A float setting given NaN or an infinity: no setting means either, and a budget or a size computed from one
    fails far from the input (``int(nan)``) or runs with a meaningless value."""


def coerce(name: str, typ: Any, value: Any, from_text: bool) -> Any:
    """``value`` as ``typ`` (parsed from text when ``from_text``); ``ConfigError`` naming ``name`` otherwise."""
    try:
        out = _coerce(typ, value, from_text)
    except (TypeError, ValueError, OverflowError) as e:
        shown = value if not isinstance(value, str) or len(value) < 60 else value[:57] + "..."
        what = "a finite number" if isinstance(e, _NotFinite) else type_name(typ)
        raise ConfigError(f"{name} must be {what}, got {shown!r}") from None
    args = typing.get_args(typ)
    if typing.get_origin(typ) is list or (typing.get_origin(typ) is tuple and args[-1:] == (Ellipsis,)):
        # a list of names or choices: an item named twice is most often a typo for one left out
        twice = sorted({repr(v) for v in out if out.count(v) > 1})
        if twice:
            raise ConfigError(f"{name}: {', '.join(twice)} given more than once")
    return out


def _coerce(typ: Any, value: Any, from_text: bool) -> Any:
    origin = typing.get_origin(typ)
    if typ is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if type(None) in args and (value is None or (from_text and str(value).lower() in ("none", "null", ""))):
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, from_text)
            except (TypeError, ValueError, OverflowError):
                continue
        raise ValueError
    if origin is Literal:
        choices = typing.get_args(typ)
        for c in choices:
            try:
                v = _coerce(type(c), value, from_text)
            except (TypeError, ValueError):
                continue
            if v == c:
                return c
        raise ValueError
    if typ is bool:
        if from_text and isinstance(value, str):
            low = value.strip().lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if not isinstance(value, bool):
            raise ValueError
        return value
    if typ is int:
        if isinstance(value, bool):
            raise ValueError
        if from_text and isinstance(value, str):
            return int(value.strip())
        if not isinstance(value, int):
            raise ValueError
        return value
    if typ is float:
        if isinstance(value, bool):
            raise ValueError
        if from_text and isinstance(value, str):
            v = float(value.strip())
        elif isinstance(value, (int, float)):
            v = float(value)
        else:
            raise ValueError
        if not math.isfinite(v):
            raise _NotFinite
        return v
    if typ is str:
        if not isinstance(value, str):
            if from_text:
                return str(value)
            raise ValueError
        return value
    if origin in (list, tuple):
        args = typing.get_args(typ)
        if from_text and isinstance(value, str):
            items: Any = [v.strip() for v in value.split(",")] if value.strip() else []
            if not all(items):  # (an empty item, "a,,b" or a trailing comma, is refused, not skipped)
                raise ValueError
        else:
            items = value
        if not isinstance(items, (list, tuple)):
            raise ValueError
        if origin is list:
            inner = args[0] if args else Any
            return [_coerce(inner, v, from_text) for v in items]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, from_text) for v in items)
        if args and len(args) != len(items):
            raise ValueError
        return tuple(_coerce(a, v, from_text) for a, v in zip(args, items)) if args else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError
        return dict(value)
    if isinstance(typ, type) and not isinstance(value, typ):
        raise ValueError
    return value


# ---------------------------------------------------------------------------------------------------
# Help


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, help) of every setting in the tree, depth first."""
    rows: list[tuple[str, str, str, str]] = []
    obj = cls()
    hints = _hints(cls)
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            rows += describe(type(value), key)
            continue
        text = f.metadata.get("help") or _comment_help(cls).get(f.name, "")
        rows.append((key, type_name(hints[f.name]), _show(value), text))
    extra = getattr(cls, "describe_extra", None)
    if callable(extra):
        rows += [(f"{prefix}.{k}" if prefix else k, t, d, h) for k, t, d, h in extra()]
    return rows


def _comment_help(cls: type) -> dict[str, str]:
    """``{field: comment}`` from lines like ``name: type = default  # what it means`` in the class source."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    out = {}
    for line in lines:
        m = re.match(r"^\s+(\w+)\s*:[^#]*#\s*(.+?)\s*$", line)
        if m:
            out.setdefault(m.group(1), m.group(2))
    return out


def _show(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)
