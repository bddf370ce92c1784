"""Route mlx-lm's attention through a cache's own `attention` method when it has one.

mlx-lm model files import `scaled_dot_product_attention` by name (`from .base import ...`), so
patching `mlx_lm.models.base` alone reaches no model. `install()` replaces the name in every loaded
`mlx_lm.models.*` module. Caches without an `attention` method (mlx-lm's own) take the original
path unchanged, so installing the hook never alters a full-cache run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import base as _base

_original_sdpa = _base.scaled_dot_product_attention


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    # queries: [B, H_q, L, D] post-RoPE; keys/values: whatever cache.update_and_fetch returned
    attend = getattr(cache, "attention", None)
    if attend is None:
        return _original_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    if sinks is not None:
        raise NotImplementedError("kvcompress caches do not support attention sinks yet")
    return attend(queries, keys, values, scale=scale, mask=mask)


def install() -> None:
    """Patch every loaded mlx-lm model module (idempotent; call after the model is loaded)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is _original_sdpa:
            module.scaled_dot_product_attention = scaled_dot_product_attention


def reference_attention(queries, keys, values, scale, mask=None) -> mx.array:
    """Plain softmax attention with GQA, in float32. The reference every fast path is tested against.

    queries [B, H_q, L, D], keys/values [B, H_kv, T, D]; mask None, "causal" (bottom-right aligned),
    a boolean array (True = attend) or an additive array, broadcastable to [B, H_q, L, T].
    """
    B, n_q, L, D = queries.shape
    n_kv, T = keys.shape[1], keys.shape[2]
    rep = n_q // n_kv
    q = queries.astype(mx.float32).reshape(B, n_kv, rep, L, D)
    k = keys.astype(mx.float32)[:, :, None]
    v = values.astype(mx.float32)[:, :, None]
    logits = (q * scale) @ k.swapaxes(-1, -2)  # [B, H_kv, rep, L, T]
    logits = logits.reshape(B, n_q, L, T)
    if isinstance(mask, str):
        mask = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
    if mask is not None:
        if mask.dtype == mx.bool_:
            logits = mx.where(mask, logits, -mx.inf)
        else:
            logits = logits + mask
    probs = mx.softmax(logits, axis=-1).reshape(B, n_kv, rep, L, T)
    return (probs @ v).reshape(B, n_q, L, D).astype(queries.dtype)


@dataclass(frozen=True)
class AttentionGeometry:
    """What a cache needs to know about the model's attention layers."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope: object  # the layer's RoPE module (mlx.nn.RoPE or a scaled variant); `rope(x, offset)`


def attention_geometry(model) -> AttentionGeometry:
    """Read layer count, head counts, head_dim and the RoPE module from an mlx-lm model."""
    layers = model.layers
    attn = layers[0].self_attn
    head_dim = getattr(attn, "head_dim", None) or attn.k_proj.weight.shape[0] // attn.n_kv_heads
    return AttentionGeometry(len(layers), attn.n_heads, attn.n_kv_heads, head_dim, attn.rope)
