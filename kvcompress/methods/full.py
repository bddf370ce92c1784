"""The uncompressed baseline: mlx-lm's own `KVCache`."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.models.cache import KVCache

from .base import Method


@dataclass(frozen=True)
class Full(Method):
    """Uncompressed KV cache (mlx-lm `KVCache`): the ceiling every method is compared with."""

    name = "full"

    def make_cache(self, model) -> list:
        return [KVCache() for _ in model.layers]
