"""Errors and parameter checks every layer shares, at the bottom of the house (nothing here
imports the rest): datasets, methods, the model loader, sweeps and results all raise `ConfigError`."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A method, dataset, sweep or results parameter is invalid. The message names the field."""


def check(condition: bool, field: str, allowed: str, got: Any) -> None:
    """Raise a `ConfigError` naming the field, its allowed values and what was given."""
    if not condition:
        raise ConfigError(f"{field}: expected {allowed}, got {got!r}")


def is_int(value: Any) -> bool:
    """An int that is not a bool (YAML `true` must not pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)
