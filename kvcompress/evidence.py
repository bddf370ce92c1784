"""Evidence survival: how much of a sample's evidence (needle, chain assignments, pass key line)
a compressed cache still holds, and how faithfully.

Per layer and stage ("compressed": right after compression, the question included under
query_agnostic; "final": after the reference answer was decoded):

- kept_min / kept_mean: the fraction of evidence tokens held, min and mean over KV heads (rows);
- key_rel_err / value_rel_err: ||K_held - K|| / ||K|| over the evidence tokens held, against the
  full cache's keys/values (quantizers: their dequantization error; NaN when none is held).

Per run, `depth`: where the evidence sits in the prompt (the report's depth x length heatmap).

Caches say what they hold through two methods (kvcompress/methods/base.py): `kept_positions`
(None: every position held) and `held_kv`; mlx-lm's own caches are read directly.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

STAGES = ("compressed", "final")


def held(cache) -> tuple[mx.array | None, mx.array, mx.array]:
    """(kept positions [R, n] or None, keys [B, H, n, D], values [B, H, n, D]) of one layer."""
    if isinstance(cache, QuantizedKVCache):
        k, v, n = cache.keys, cache.values, cache.offset  # (codes, scales, biases), allocated in steps
        keys = mx.dequantize(*k, group_size=cache.group_size, bits=cache.bits)[..., :n, :]
        values = mx.dequantize(*v, group_size=cache.group_size, bits=cache.bits)[..., :n, :]
        return None, keys, values
    if isinstance(cache, KVCache):
        keys, values = cache.keys_and_values()
        return None, keys, values
    keys, values = cache.held_kv()
    return cache.kept_positions(), keys, values


def evidence_positions(spans: list[tuple[int, int]]) -> np.ndarray:
    return np.array(sorted({p for start, end in spans for p in range(start, end)}), dtype=np.int64)


def depth(spans: list[tuple[int, int]], question_start: int) -> float | None:
    """Where a sample's evidence sits: the first evidence token's position over the prompt tokens
    before the question (0: the prompt's start, near 1: just before the question). NIAH's needle
    depth, measured in the tokens the model saw (instruction included), so every dataset that
    records evidence gets one; None when the sample records none."""
    if not spans or question_start <= 0:
        return None
    return min(start for start, _ in spans) / question_start


def layer_rows(caches: list, full_kv: list, spans: list[tuple[int, int]], stage: str) -> list[dict]:
    """One row per layer: kept fractions and relative errors of the evidence tokens.

    full_kv: per layer the full cache's (keys, values) [B, H, T, D] of the prompt; a layer that
    keeps the model's own cache of another kind (a sliding window, a recurrent state) has a copy of
    that cache instead, and no row (its evidence is the model's business, not the method's).
    """
    evidence = evidence_positions(spans)
    if evidence.size == 0:
        return []
    rows = []
    for layer, (cache, kv) in enumerate(zip(caches, full_kv)):
        if not isinstance(kv, tuple):
            continue
        full_k, full_v = kv
        positions, keys, values = held(cache)
        B, H, n, D = keys.shape
        keys = np.array(keys.astype(mx.float32)).reshape(B * H, n, D)
        values = np.array(values.astype(mx.float32)).reshape(B * H, n, D)
        full_k = np.array(full_k.astype(mx.float32)).reshape(B * H, -1, D)
        full_v = np.array(full_v.astype(mx.float32)).reshape(B * H, -1, D)
        pos = np.broadcast_to(np.arange(n), (B * H, n)) if positions is None else np.array(positions)
        kept, dk, nk, dv, nv = [], 0.0, 0.0, 0.0, 0.0
        for r in range(B * H):
            slots = np.nonzero(np.isin(pos[r], evidence))[0]  # where the held evidence tokens sit
            kept.append(slots.size / evidence.size)
            original = pos[r][slots]
            dk += float(np.sum((keys[r, slots] - full_k[r, original]) ** 2))
            nk += float(np.sum(full_k[r, original] ** 2))
            dv += float(np.sum((values[r, slots] - full_v[r, original]) ** 2))
            nv += float(np.sum(full_v[r, original] ** 2))
        rows.append({
            "layer": layer, "stage": stage, "kept_min": min(kept), "kept_mean": sum(kept) / len(kept),
            "key_rel_err": math.sqrt(dk / nk) if nk else math.nan,
            "value_rel_err": math.sqrt(dv / nv) if nv else math.nan,
        })
    return rows
