"""Frozen-dataclass configs from dicts/YAML plus `key=value` command-line overrides. Every config goes through
`from_dict`, so an unknown key is always an error naming it and the valid ones (never an ignored typo)."""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem the user can fix (unknown key, bad value, missing file)."""


_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """`value` as the annotated type `tp`: Optional/unions, nested dataclasses from mappings, tuples from lists,
    numbers from strings (YAML reads `1e-3` as one), booleans from true/false/yes/no/1/0."""
    args = typing.get_args(tp)
    if value is None:
        if type(None) in args or tp is Any:
            return None
        raise ConfigError(f"{where} may not be null")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return from_dict(tp, value, where=where)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        errors = []
        for a in (a for a in args if a is not type(None)):
            try:
                return _coerce(a, value, where)
            except (ConfigError, TypeError, ValueError) as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: cannot interpret {value!r} ({'; '.join(errors)})")
    if typing.get_origin(tp) is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return tuple(_coerce(args[0] if args else Any, v, where) for v in value)
    if tp not in _KINDS:
        return value
    bad = ConfigError(f"{where} must be {_KINDS[tp]}, got {value!r}")
    if tp in (bool, str):
        if isinstance(value, tp):
            return value
        if tp is bool and isinstance(value, str) and value.lower() in _BOOLS:
            return _BOOLS[value.lower()]
        raise bad
    if tp is int and (isinstance(value, bool) or (isinstance(value, float) and not value.is_integer())):
        raise bad
    try:
        return tp(value)
    except (TypeError, ValueError):
        raise bad from None


def from_dict(cls: type[T], data: Mapping[str, Any], *, where: str | None = None) -> T:
    """Build dataclass `cls` from `data`; unknown keys raise ConfigError naming them."""
    where = where or cls.__name__
    hints = typing.get_type_hints(cls)  # the fields' types, by name
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown} in {where}; valid keys: {sorted(hints)}")
    kwargs = {k: _coerce(hints[k], v, f"{where}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` overrides (values parsed as YAML) to a nested dict, returning a new dict."""
    out = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, text = item.split("=", 1)
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(text)
        except yaml.YAMLError:
            node[parts[-1]] = text
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML would keep the last one, silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (first at line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path):
    """A YAML file's content; malformed YAML, a key given twice or non-UTF-8 text is a ConfigError naming the file
    and line."""
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"config file {str(path)!r}{at} is not valid YAML: {getattr(e, 'problem', None) or e}") \
            from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {e.start})") from None


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] = ()) -> T:
    """YAML file (optional) + `key=value` overrides -> frozen dataclass `cls`."""
    data = {}
    if path:
        if not Path(path).is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        data = read_yaml(Path(path))
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at top level")
    return from_dict(cls, apply_overrides(data, list(overrides)))


def _flat(d: Mapping, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, Mapping) else {f"{prefix}{k}": v})
    return out


_NO_DEFAULT = object()


def _field_default(obj: Any, dotted: str) -> Any:
    """The declared default of dataclass field `dotted` under `obj` (JSON-shaped), or _NO_DEFAULT."""
    *path, name = dotted.split(".")
    for key in path:
        obj = getattr(obj, key, None)
    if not dataclasses.is_dataclass(obj):
        return _NO_DEFAULT
    f = {f.name: f for f in dataclasses.fields(obj)}.get(name)
    if f is None or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING):
        return _NO_DEFAULT
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return json.loads(json.dumps(to_dict(value) if dataclasses.is_dataclass(value) else value, default=str))


def changed_settings(saved: Mapping, wanted: Any, neutral=()) -> list[str]:
    """Dotted keys whose values differ between `saved` (read back from JSON) and `wanted` (a dataclass or dict),
    as "key: saved there, wanted now"; keys in `neutral`, or under a neutral "section.", are ignored, and so is a
    setting `saved` predates (absent there) that `wanted` holds at its declared default (it changes nothing)."""
    obj = wanted
    wanted = json.loads(json.dumps(to_dict(wanted) if dataclasses.is_dataclass(wanted) else wanted, default=str))
    old, new = _flat(saved), _flat(wanted)
    skip = lambda k: k in neutral or any(n.endswith(".") and k.startswith(n) for n in neutral)  # noqa: E731
    added = lambda k: k not in old and _field_default(obj, k) == new[k]  # noqa: E731
    return [f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in sorted(old.keys() | new.keys())
            if not skip(k) and old.get(k) != new.get(k) and not added(k)]

