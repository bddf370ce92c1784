"""mlx-lm's `QuantizedKVCache`: what mlx-lm users already have.

It quantizes keys and values the same way, per token (groups along head_dim), with `mx.quantize`'s
affine formula. KIVI (kivi.py) differs: keys per channel, a full-precision residual window.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from ..adapter import model_layout, trial_error
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
        caches = super().make_cache(model)
        # some models handle the arrays mlx-lm's QuantizedKVCache returns themselves (Phi-2 reads
        # `values.dtype` of what is a tuple here): one probe-sized pass finds out before any work
        error = trial_error(model, f"mlx-quant-{self.bits}-{self.group_size}", lambda: super(MlxQuant, self).make_cache(model))
        if error:
            raise ConfigError(f"mlx-quant: mlx-lm's QuantizedKVCache does not run on {model_layout(model).model_class} "
                              f"({error}); 'kivi' may")
        return caches

    def layer_cache(self, layer, i, n, layout):
        for what, dim in (("head_dim", layer.head_dim), ("value dim", layer.value_dim)):
            if dim % self.group_size:
                raise ConfigError(
                    f"mlx-quant.group_size: expected a divisor of the model's {what} {dim}, got {self.group_size}")
        if layer.sinks:
            raise ConfigError(f"mlx-quant: mlx-lm's quantized attention has no attention sinks, which "
                              f"{layout.model_class} uses; 'kivi' supports them")
        missing = quantized_attention_error(layer.head_dim, self.bits, self.group_size, layout.dtype,
                                            str(mx.default_device()))
        if missing:
            # MLX 0.32's CUDA back-end lacks these kernels (measured on the H200): say so before any work
            raise ConfigError(
                f"mlx-quant: this device's mx.quantized_matmul cannot run mlx-lm's quantized attention "
                f"(bits {self.bits}, group_size {self.group_size}, {layout.dtype}): {missing}; 'kivi' runs here"
            )
        return QuantizedKVCache(group_size=self.group_size, bits=self.bits)


@lru_cache(maxsize=None)
def quantized_attention_error(head_dim: int, bits: int, group_size: int, dtype: mx.Dtype, device: str) -> str | None:
    """None when `mx.quantized_matmul` runs the two products of mlx-lm's quantized attention on the
    default device (one query and a prompt chunk, over an odd token count), else MLX's error."""
    tokens = mx.zeros((1, 1, 67, head_dim), dtype)
    keys = values = mx.quantize(tokens, group_size=group_size, bits=bits)  # [1, 1, 67, D] packed
    try:
        for rows in (1, 8):
            q = mx.zeros((1, 1, rows, head_dim), dtype)
            scores = mx.quantized_matmul(q, *keys, transpose=True, group_size=group_size, bits=bits)  # [.., rows, 67]
            mx.eval(mx.quantized_matmul(scores, *values, transpose=False, group_size=group_size, bits=bits))
    except (RuntimeError, ValueError) as error:
        return str(error)
    return None
