"""The uncompressed baseline: the model's own mlx-lm prompt cache (`KVCache` per layer, or what the
model's `make_cache` builds: `RotatingKVCache` on sliding-window layers, `ArraysCache` on recurrent ones)."""

from __future__ import annotations

from dataclasses import dataclass

from ..adapter import native_cache
from .base import Method


@dataclass(frozen=True)
class Full(Method):
    """Uncompressed KV cache (mlx-lm's own): the ceiling every method is compared with."""

    name = "full"

    def make_cache(self, model) -> list:
        return native_cache(model)
