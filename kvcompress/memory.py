"""Resident KV bytes of a prompt cache: the arrays it holds for the tokens it holds.

mlx-lm's `KVCache.nbytes` reports allocated capacity (256-token steps). Here every cache is
measured from its arrays sliced to the tokens it holds, so a full cache at 1000 tokens counts
1000 tokens, and a compressed cache counts its packed codes, scales and residual, not an estimate.
A model's own caches on the layers a method leaves alone count too: a `RotatingKVCache` the
tokens of its window it holds, a recurrent layer's `ArraysCache` its state arrays.
"""

from __future__ import annotations

from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from .adapter import layer_kind
from .methods.base import CompressedCache


def layer_live_kv_bytes(cache) -> int:
    if isinstance(cache, CompressedCache):
        return cache.live_kv_bytes
    if isinstance(cache, (KVCache, QuantizedKVCache)):
        if cache.empty():
            return 0
        # both classes allocate in 256-token steps; keys_and_values() slices to [..., :offset, :]
        return sum(a.nbytes for _, a in tree_flatten(cache.keys_and_values()))
    if isinstance(cache, RotatingKVCache):
        if cache.empty():
            return 0
        # allocated in 256-token steps up to its window; after a long multi-token update it holds
        # more (the update's tokens) until the next step trims it back to the window
        held = layer_tokens_kept(cache)
        return sum(a.nbytes // a.shape[2] * held for a in (cache.keys, cache.values))
    if layer_kind(cache) == "recurrent":  # a recurrent layer's state
        return sum(a.nbytes for _, a in tree_flatten(cache.state) if a is not None)
    raise TypeError(f"cannot measure live KV bytes of {type(cache).__name__}")


def layer_tokens_kept(cache) -> int:
    if isinstance(cache, CompressedCache):
        return cache.tokens_kept
    if isinstance(cache, RotatingKVCache):
        return 0 if cache.empty() else min(cache.offset, cache.keys.shape[2])
    return cache.offset


def _attention_caches(prompt_cache: list) -> list:
    """The layers that hold tokens (recurrent layers hold a state instead)."""
    return [c for c in prompt_cache if layer_kind(c) != "recurrent"]


def live_kv_bytes(prompt_cache: list) -> int:
    """Sum over layers of resident KV bytes for held tokens (and recurrent layers' states)."""
    return sum(layer_live_kv_bytes(c) for c in prompt_cache)


def tokens_kept(prompt_cache: list) -> int:
    """Tokens held per attention layer, the mean over them (layer-wise budgets and sliding windows
    differ by layer), rounded."""
    caches = _attention_caches(prompt_cache)
    return round(sum(layer_tokens_kept(c) for c in caches) / len(caches)) if caches else 0


def budget_tokens(prompt_cache: list) -> float | None:
    """The budget each compressed layer resolved to for this prompt, mean over those layers; None
    for methods without a token budget (their caches have no `capacity`)."""
    capacities = [c.capacity for c in prompt_cache if isinstance(c, CompressedCache) and hasattr(c, "capacity")]
    if not capacities or any(c is None for c in capacities):
        return None
    return sum(capacities) / len(capacities)


def layer_quantized_tokens(cache) -> int | None:
    """Tokens one layer holds as codes (None: a layer that quantizes nothing by design)."""
    if isinstance(cache, CompressedCache):
        return cache.quantized_tokens
    if isinstance(cache, QuantizedKVCache):
        return cache.offset  # mlx-lm's quantizes every token on arrival
    return None


def quantized_tokens(prompt_cache: list) -> int | None:
    """Tokens held as codes (a key, a value or both quantized) per quantizing layer, the mean over
    those layers, rounded, as `tokens_kept`; None where no layer quantizes (eviction, the full cache).
    0: a quantizer that holds every token in its full-precision window (a short prompt, or a
    composed cache whose kept tokens fit it): the bytes are a full-precision cache's."""
    counts = [n for n in map(layer_quantized_tokens, prompt_cache) if n is not None]
    return round(sum(counts) / len(counts)) if counts else None
