"""mlx-lm's `QuantizedKVCache`: what mlx-lm users already have.

It quantizes keys and values the same way, per token (groups along head_dim), with `mx.quantize`'s
affine formula. KIVI (kivi.py) differs: keys per channel, a full-precision residual window.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.models.cache import QuantizedKVCache

from ..attention import attention_geometry
from ..errors import ConfigError, check
from .base import Method


@dataclass(frozen=True)
class MlxQuant(Method):
    """mlx-lm `QuantizedKVCache`: per-token affine quantization of keys and values."""

    name = "mlx-quant"
    bits: int = 4
    group_size: int = 64

    def __post_init__(self):
        check(self.bits in (2, 3, 4, 5, 6, 8), "mlx-quant.bits", "one of 2, 3, 4, 5, 6, 8", self.bits)
        check(self.group_size in (32, 64, 128), "mlx-quant.group_size", "one of 32, 64, 128", self.group_size)

    def make_cache(self, model) -> list:
        head_dim = attention_geometry(model).head_dim
        if head_dim % self.group_size:
            raise ConfigError(
                f"mlx-quant.group_size: expected a divisor of the model's head_dim {head_dim}, got {self.group_size}"
            )
        return [QuantizedKVCache(group_size=self.group_size, bits=self.bits) for _ in model.layers]
