"""Resident KV bytes of a prompt cache: the arrays it holds for the tokens it holds.

mlx-lm's `KVCache.nbytes` reports allocated capacity (256-token steps). Here every cache is
measured from its arrays sliced to the tokens it holds, so a full cache at 1000 tokens counts
1000 tokens, and a compressed cache counts its packed codes, scales and residual, not an estimate.
"""

from __future__ import annotations

from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .methods.base import CompressedCache


def layer_live_kv_bytes(cache) -> int:
    if isinstance(cache, CompressedCache):
        return cache.live_kv_bytes
    if isinstance(cache, (KVCache, QuantizedKVCache)):
        if cache.empty():
            return 0
        # both classes allocate in 256-token steps; keys_and_values() slices to [..., :offset, :]
        return sum(a.nbytes for _, a in tree_flatten(cache.keys_and_values()))
    raise TypeError(f"cannot measure live KV bytes of {type(cache).__name__}")


def layer_tokens_kept(cache) -> int:
    if isinstance(cache, CompressedCache):
        return cache.tokens_kept
    return cache.offset


def live_kv_bytes(prompt_cache: list) -> int:
    """Sum over layers of resident KV bytes for held tokens."""
    return sum(layer_live_kv_bytes(c) for c in prompt_cache)


def tokens_kept(prompt_cache: list) -> int:
    """Tokens held per layer, the mean over layers (layer-wise budgets differ by layer), rounded."""
    return round(sum(layer_tokens_kept(c) for c in prompt_cache) / len(prompt_cache))


def budget_tokens(prompt_cache: list) -> float | None:
    """The budget each layer resolved to for this prompt, mean over layers; None for methods
    without a token budget (their caches have no `capacity`)."""
    capacities = [getattr(c, "capacity", None) for c in prompt_cache]
    if any(c is None for c in capacities):
        return None
    return sum(capacities) / len(capacities)
