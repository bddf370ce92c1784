"""Route mlx-lm's attention through a cache's own `attention` method when it has one.

mlx-lm model files import `scaled_dot_product_attention` by name (`from .base import ...`), so
patching `mlx_lm.models.base` alone reaches no model. `install()` replaces the name in every loaded
`mlx_lm.models.*` module. Caches without an `attention` method (mlx-lm's own) take the original
path unchanged, so installing the hook never alters a full-cache run.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import mlx.core as mx
from mlx_lm.models import base as _base

original_sdpa = _base.scaled_dot_product_attention


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    # queries: [B, H_q, L, D] post-RoPE; keys/values: whatever cache.update_and_fetch returned;
    # sinks: None, or one logit per query head [H_q] that joins every softmax (GPT-OSS)
    attend = getattr(cache, "attention", None)
    if attend is None:
        return original_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    return attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def install() -> None:
    """Patch every loaded mlx-lm model module (idempotent; call after the model is loaded)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is original_sdpa:
            module.scaled_dot_product_attention = scaled_dot_product_attention


@contextmanager
def routed_through(observer):
    """While inside, every mlx-lm model module whose attention name is the hook calls
    `observer(queries, keys, values, cache, scale, mask, sinks=None)` instead (which calls the hook
    itself): the adapter's probe sees the calls no cache sees (`cache=None`, another layer's keys)."""
    patched = [module for name, module in list(sys.modules.items())
               if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None)
               is scaled_dot_product_attention]
    for module in patched:
        module.scaled_dot_product_attention = observer
    try:
        yield
    finally:
        for module in patched:
            module.scaled_dot_product_attention = scaled_dot_product_attention


def reference_attention(queries, keys, values, scale, mask=None, sinks=None) -> mx.array:
    """Plain softmax attention with GQA, in float32. The reference every fast path is tested against.

    queries [B, H_q, L, D], keys/values [B, H_kv, T, D]; mask None, "causal" (bottom-right aligned),
    a boolean array (True = attend) or an additive array, broadcastable to [B, H_q, L, T]; sinks
    [H_q] or None: an extra logit per query head in the softmax with no value (GPT-OSS).
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
    if sinks is not None:
        sink = mx.broadcast_to(sinks.astype(mx.float32)[None, :, None, None], (B, n_q, L, 1))
        probs = mx.softmax(mx.concatenate([logits, sink], axis=-1), axis=-1)[..., :T]
    else:
        probs = mx.softmax(logits, axis=-1)
    probs = probs.reshape(B, n_kv, rep, L, T)
    return (probs @ v).reshape(B, n_q, L, D).astype(queries.dtype)


def masked_softmax(logits: mx.array, mask, sinks=None) -> mx.array:
    """Attention probabilities [B, H_q, L, T] from scaled logits [B, H_q, L, T] for caches that score
    their own codes: the model's mask (None, "causal" bottom-right aligned, boolean or additive) and,
    where the model has them, one sink logit per query head [H_q] that joins the softmax and weights
    no value (GPT-OSS)."""
    B, n_q, L, T = logits.shape
    if isinstance(mask, str):
        mask = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
    if mask is not None:
        logits = mx.where(mask, logits, -mx.inf) if mask.dtype == mx.bool_ else logits + mask
    if sinks is None:
        return mx.softmax(logits, axis=-1, precise=True)
    sink = mx.broadcast_to(sinks.astype(mx.float32)[None, :, None, None], (B, n_q, L, 1))
    return mx.softmax(mx.concatenate([logits, sink], axis=-1), axis=-1, precise=True)[..., :-1]
