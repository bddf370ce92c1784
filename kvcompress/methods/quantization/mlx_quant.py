"""mlx-lm's `QuantizedKVCache`: what mlx-lm users already have.

It quantizes keys and values the same way, per token (groups along head_dim), with `mx.quantize`'s
affine formula. KIVI (kivi.py) differs: keys per channel, a full-precision residual window.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import QuantizedKVCache

from ...adapter import model_layout, trial_error
from ...attention import install, original_sdpa
from ...errors import ConfigError, check
from ..base import Method


@dataclass(frozen=True)
class MlxQuant(Method):
    """mlx-lm `QuantizedKVCache`: per-token affine quantization of keys and values."""

    name = "mlx-quant"
    store_refusal = ("its cache is mlx-lm's own QuantizedKVCache, which has none of what a composed cache calls "
                     "on its store: an `attention` method taking a mask over the slots held (mlx-lm attends "
                     "through it with the model's mask, sized for the true positions), a dequantized view, "
                     "resident bytes; not built")
    bits: int = 4
    group_size: int = 64

    def __post_init__(self):
        check(self.bits in (2, 3, 4, 5, 6, 8), "mlx-quant.bits", "one of 2, 3, 4, 5, 6, 8", self.bits)
        check(self.group_size in (32, 64, 128), "mlx-quant.group_size", "one of 32, 64, 128", self.group_size)

    def make_cache(self, model) -> list:
        install()  # sink layers' caches attend themselves
        build = super().make_cache  # refuses what the layout rules out (ConfigError) first
        caches = build(model)
        # some models handle the arrays mlx-lm's QuantizedKVCache returns themselves (Phi-2 reads
        # `values.dtype` of what is a tuple here): one probe-sized pass, once per model, finds out
        error = trial_error(model, f"mlx-quant-{self.bits}-{self.group_size}", lambda: build(model))
        if error:
            raise ConfigError(f"mlx-quant: mlx-lm's QuantizedKVCache does not run on {model_layout(model).model_class} "
                              f"({error}); 'kivi' may")
        return caches

    def layer_cache(self, layer, i, n, layout):
        for what, dim in (("head_dim", layer.head_dim), ("value dim", layer.value_dim)):
            if dim % self.group_size:
                raise ConfigError(
                    f"mlx-quant.group_size: expected a divisor of the model's {what} {dim}, got {self.group_size}")
        missing = quantized_attention_error(layer.head_dim, self.bits, self.group_size, layout.dtype,
                                            str(mx.default_device()))
        if missing:
            # MLX 0.32's CUDA back-end lacks these kernels (measured on the H200): say so before any work
            raise ConfigError(
                f"mlx-quant: this device's mx.quantized_matmul cannot run mlx-lm's quantized attention "
                f"(bits {self.bits}, group_size {self.group_size}, {layout.dtype}): {missing}; 'kivi' runs here"
            )
        cache = SinkQuantizedKVCache if layer.sinks else QuantizedKVCache
        return cache(group_size=self.group_size, bits=self.bits)


class SinkQuantizedKVCache(QuantizedKVCache):
    """mlx-lm's QuantizedKVCache on a layer with attention sinks (GPT-OSS). mlx-lm's quantized
    attention has no sink logit (it raises), so this cache attends over its dequantized keys and
    values with MLX's fused attention, the sinks included: the same codes, the same attention up to
    float rounding, and the same bytes held."""

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        # queries [B, H_q, L, D]; keys/values: the (codes, scales, biases) update_and_fetch returned
        if sinks is None:
            return original_sdpa(queries, keys, values, cache=self, scale=scale, mask=mask)
        k, v = (mx.dequantize(*side, group_size=self.group_size, bits=self.bits).astype(queries.dtype)
                for side in (keys, values))
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)


# mlx-lm's load_prompt_cache looks cache classes up by name in mlx_lm.models.cache's globals.
setattr(mlx_cache, "SinkQuantizedKVCache", SinkQuantizedKVCache)


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
