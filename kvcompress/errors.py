"""Errors and parameter checks every layer shares, at the bottom of the house (nothing here
imports the rest): datasets, methods, the model loader, sweeps and results all raise `ConfigError`."""

from __future__ import annotations

import dataclasses
import reprlib
from typing import Any, Mapping


class ConfigError(ValueError):
    """A method, dataset, sweep or results parameter is invalid. The message names the field."""


class StorageError(OSError):
    """A file or store could not be written or read (a full disk, a wrong secret): the message names
    the file; the command line prints it as one line."""


def check(condition: bool, field: str, allowed: str, got: Any) -> None:
    """Raise a `ConfigError` naming the field, its allowed values and what was given."""
    if not condition:
        raise ConfigError(f"{field}: expected {allowed}, got {shown(got)}")


def shown(value: Any, limit: int = 200) -> str:
    """`repr(value)` for an error message, cut to `limit` characters: a value from a file (a YAML
    alias bomb expands to gigabytes) must not become the message."""
    short = reprlib.Repr()  # bounded however deep or wide the value is (repr of a shared DAG is not)
    short.maxlevel, short.maxlist, short.maxdict, short.maxtuple = 4, 12, 12, 12
    short.maxstring = short.maxother = limit
    text = short.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... (cut at {limit} characters)"


def build(kind: str, registry: Mapping[str, type], name: str, params: Mapping[str, Any]) -> Any:
    """`registry[name](**params)` for a registry of dataclass configs (methods, datasets): an unknown
    name or parameter is a `ConfigError` naming it and the allowed ones; the config's own
    `__post_init__` checks the values."""
    if name not in registry:
        raise ConfigError(f"{kind}: expected one of {sorted(registry)}, got {name!r}")
    cls = registry[name]
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ConfigError(f"{name}.{unknown[0]}: unknown parameter; allowed: {allowed or 'none'}")
    return cls(**params)


def is_int(value: Any) -> bool:
    """An int that is not a bool (YAML `true` must not pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)
