"""Accumulated attention over a prompt in bounded memory (flash-style tiling).

H2O and Keyformer score a key by the attention every query gave it: s_j = sum_i softmax_j(f(x_ij))
over causal logits x_ij (f: identity for H2O, Keyformer's Gumbel/tau transform). Materialising the
[queries, keys] probabilities is quadratic in the prompt (a 32k prompt with 32 query heads is 128
GiB in float32). Instead, as FlashAttention does for the output:

1. per query tile, over key tiles: the running row maximum m_i and sum l_i = sum_j exp(f(x_ij) - m_i);
2. per key tile, over the query tiles that can see it: sum_i exp(f(x_ij) - m_i) / l_i.

Scratch is one [rows, group, query_tile, key_tile] tile at a time plus m and l [rows, group, L];
each tile row is evaluated before the next is built, so MLX frees it. `accumulated_attention_reference`
is the plain quadratic version the tests compare against.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

# A tile holds about this many float32 logits (64 MiB; about three tile-sized temporaries live at
# once): large enough that Python's per-op cost stays small against the math, small next to a long
# prompt's KV cache.
TILE_ELEMENTS = 1 << 24
KEY_TILE = 2048

# f(logits [R, G, Lq, Tk], query_positions [Lq], key_positions [Tk]) -> transformed logits
Transform = Callable[[mx.array, mx.array, mx.array], mx.array]


def folded_logits(queries: mx.array, keys: mx.array, scale: float) -> mx.array:
    """queries [R, G, L, D] (a KV head's query group on axis 1), keys [R, n, D] -> [R, G, L, n].

    The group is folded into the row axis: broadcasting batch dims is wrong on MLX CUDA.
    """
    R, G, L, D = queries.shape
    q = queries.reshape(R, G * L, D) * scale
    # keys @ q^T transposes only the small query block, never the [n, D] keys; the product runs in
    # the model's dtype (tensor cores on a GPU; float32 on CPU), the softmax in float32
    logits = (keys @ q.astype(keys.dtype).swapaxes(1, 2)).astype(mx.float32)  # [R, n, G * L]
    return logits.swapaxes(1, 2).reshape(R, G, L, keys.shape[1])


def _causal_tile(logits, query_positions, key_positions):
    return mx.where(key_positions[None, None, None, :] <= query_positions[None, None, :, None], logits, -mx.inf)


def accumulated_attention(
    queries: mx.array, keys: mx.array, scale: float, transform: Transform | None = None, tile: tuple[int, int] | None = None
) -> mx.array:
    """sum over queries and the group of softmax(transform(causal logits)) -> [R, n] float32.

    queries [R, G, L, D] are the last L of the n key positions (query i sits at n - L + i);
    keys [R, n, D] are at positions 0..n-1. `tile` = (query rows, keys) per tile, or None to size
    tiles to TILE_ELEMENTS.
    """
    R, G, L, _ = queries.shape
    n = keys.shape[1]
    if tile is None:
        key_tile = min(n, KEY_TILE)
        tile = (max(1, min(L, TILE_ELEMENTS // (R * G * key_tile))), key_tile)
    q_tile, k_tile = tile
    first = n - L

    def tile_logits(q0, q1, k0, k1):
        query_positions = mx.arange(first + q0, first + q1, dtype=mx.int32)
        key_positions = mx.arange(k0, k1, dtype=mx.int32)
        logits = folded_logits(queries[:, :, q0:q1], keys[:, k0:k1], scale)
        if transform is not None:
            logits = transform(logits, query_positions, key_positions)
        if k1 - 1 <= first + q0:  # the whole tile is at or below the diagonal: nothing to mask
            return logits
        return _causal_tile(logits, query_positions, key_positions)

    # pass 1: row max and row sum, key tiles in order (key 0 is visible to every query, so the
    # first tile makes m finite)
    maxima, sums = [], []
    for q0 in range(0, L, q_tile):
        q1 = min(L, q0 + q_tile)
        m = l = None
        for k0 in range(0, first + q1, k_tile):
            logits = tile_logits(q0, q1, k0, min(n, k0 + k_tile))
            tile_max = logits.max(axis=-1)
            if m is None:
                m, l = tile_max, mx.exp(logits - tile_max[..., None]).sum(axis=-1)
            else:
                new = mx.maximum(m, tile_max)
                l = l * mx.exp(m - new) + mx.exp(logits - new[..., None]).sum(axis=-1)
                m = new
            mx.eval(m, l)
        maxima.append(m)
        sums.append(l)
    # pass 2: normalised probabilities summed into per-key scores
    columns = []
    for k0 in range(0, n, k_tile):
        k1 = min(n, k0 + k_tile)
        column = mx.zeros((R, k1 - k0), mx.float32)
        for index, q0 in enumerate(range(0, L, q_tile)):
            q1 = min(L, q0 + q_tile)
            if first + q1 - 1 < k0:  # no query of this tile sees these keys
                continue
            logits = tile_logits(q0, q1, k0, k1)
            m, l = maxima[index], sums[index]
            column = column + (mx.exp(logits - m[..., None]) / l[..., None]).sum(axis=(1, 2))
            mx.eval(column)  # one tile's scratch at a time
        columns.append(column)
    return mx.concatenate(columns, axis=1)


def accumulated_attention_reference(queries, keys, scale, transform: Transform | None = None) -> mx.array:
    """The same sum from the full [R, G, L, n] probabilities (quadratic memory; tests only)."""
    L, n = queries.shape[2], keys.shape[1]
    query_positions = mx.arange(n - L, n, dtype=mx.int32)
    key_positions = mx.arange(n, dtype=mx.int32)
    logits = folded_logits(queries, keys, scale)
    if transform is not None:
        logits = transform(logits, query_positions, key_positions)
    logits = _causal_tile(logits, query_positions, key_positions)
    return mx.softmax(logits, axis=-1, precise=True).sum(axis=(1, 2))
