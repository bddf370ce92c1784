"""The registry of methods by name: name -> config class.

It sits at the bottom of methods/, below both families, so that a method can look another up by
name (a delegating eviction method its scorer, an eviction method the quantizer that stores its kept
tokens, a cache restoring its config from a saved file) without importing the families above it.
`kvcompress/methods/__init__.py` imports every method and fills `REGISTRY` once, in the order
`kvcompress methods` lists them; a lookup runs only after that (importing any module of
kvcompress.methods imports the package first).
"""

from __future__ import annotations

from typing import Any

from ..adapter import LAYER_CHOICES
from ..errors import build, check
from .base import Method

REGISTRY: dict[str, type[Method]] = {}


def method_config(name: str, **params: Any) -> Method:
    """Build a validated method config, naming the bad field and the allowed values on error."""
    config = build("method", REGISTRY, name, params)
    check(config.layers in LAYER_CHOICES, f"{name}.layers", f"one of {LAYER_CHOICES}", config.layers)
    return config


def list_methods() -> list[dict[str, Any]]:
    """Every registered method with its one-line doc and parameters with their defaults."""
    return [cls.describe() for cls in REGISTRY.values()]
