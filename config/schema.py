"""The schema machinery: typed, strict configuration, where YAML maps one-to-one onto dataclasses.

Every section is a dataclass whose fields carry a docstring-like comment and a ``validate()`` that rejects
impossible values *before* any tensor is made (DESIGN principle 6). ``from_dict`` builds a dataclass tree from
plain dicts and refuses unknown keys, naming the nearest valid one, so a typo such as ``moe.capcity_factor``
fails loudly instead of silently training the default. YAML is read safely and without aliases
(``parse_yaml``), and ``--set a.b=c`` overrides are applied to the plain tree before it is typed
(``apply_override``). The sections themselves live beside this module: ``config/model.py``,
``config/parallel.py``, ``config/run.py``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal

import yaml

from config.errors import ConfigError

# Config integers are counts, sizes, intervals and seeds: none needs more than 2^31 - 1, and larger ones overflow
# the 64-bit products the code forms of them (batch x sequence x vocabulary), torch's seeds, or make searches over
# their divisors (the memory check, the planner) run for hours. Refused by name before any work.
MAX_INT = 2**31 - 1


def nearest(name: str, valid: typing.Iterable[str], prefix: str = "") -> str:
    """A 'did you mean' suffix naming the closest valid key, or the list of keys."""
    valid = sorted(valid)
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    if close:
        return f"did you mean '{prefix}{close[0]}'?"
    return f"valid keys: {', '.join(prefix + v for v in valid)}"


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check ``value`` against a field annotation, converting only lossless cases (int -> float)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)

    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors, own_type = [], []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
                if isinstance(arg, type) and isinstance(value, arg) and not isinstance(value, bool):
                    own_type.append(str(exc))  # the value has this arm's type: its reason is the one to give
        if len(errors) == 1 or own_type:
            raise ConfigError((own_type or errors)[0])
        raise ConfigError(f"{where}: {value!r} matches none of {args}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return origin(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value, where)
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if abs(value) > MAX_INT:
            raise ConfigError(f"{where}: {value} is beyond {MAX_INT:,}, the largest integer a config key takes")
        return value
    if annotation is float:
        if isinstance(value, str):  # PyYAML (YAML 1.1) reads 1e-3 and 1.0e6 as strings
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):  # no key means anything by inf or NaN; a diverging run would be the result
            raise ConfigError(f"{where}: {value!r} is not a finite number")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{where}: unsupported annotation {annotation!r}")


def from_dict(cls: type, data: Any, where: str = "") -> Any:
    """Build dataclass ``cls`` from a dict, recursively; unknown keys and bad types raise ConfigError."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            raise ConfigError(f"unknown config key '{path}': {nearest(str(key), names, f'{where}.' if where else '')}")
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def to_dict(obj: Any) -> dict:
    """The plain-dict (YAML-serialisable) form of a config dataclass tree."""
    return dataclasses.asdict(obj)


def require(condition: bool, message: str) -> None:
    """The one check every section's ``validate()`` makes: a ConfigError with ``message`` unless ``condition``."""
    if not condition:
        raise ConfigError(message)


class _NoAliasLoader(yaml.SafeLoader):
    """Safe YAML without aliases or repeated keys. A config has no use for aliases, and nested ones expand
    exponentially (a few hundred bytes of "billion laughs" fill the memory of whatever prints or validates the
    value). A key given twice in one mapping is a mistake YAML itself lets pass (the last value wins, silently)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"alias *{event.anchor}: configs may not use YAML aliases",
                                              event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, where: str):
    """``text`` as YAML (safe, no aliases); a ConfigError naming ``where`` if it is not."""
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where} is not valid YAML: {exc}") from exc


def apply_override(tree: dict, assignment: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML (``null``, ``1e-3``, ``true``)."""
    if "=" not in assignment:
        raise ConfigError(f"override '{assignment}' must look like section.key=value")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{assignment}': '{part}' is not a section")
        node = child
    shown = assignment if len(assignment) <= 80 else assignment[:77] + "..."
    node[parts[-1]] = parse_yaml(raw, f"override '{shown}': the value") if raw.strip() else ""
