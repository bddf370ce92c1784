"""Counter-based random numbers: a value depends only on its coordinates, never on call order.

So noise is the same however a prompt is chunked, is recomputed instead of stored, and differs
across seeds, layers, heads and positions. Used by Keyformer's Gumbel noise and the random floor.
"""

from __future__ import annotations

import mlx.core as mx


def mix(x: mx.array) -> mx.array:
    # "lowbias32" integer finalizer (C. Wellons): full avalanche on uint32
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


def _gumbel_from(step: mx.array, key_positions: mx.array) -> mx.array:
    """step [R, G, L] stream-and-query hashes, key_positions [R or 1, n] -> Gumbel noise [R, G, L, n]."""
    h = mix(step[..., None] ^ key_positions.astype(mx.uint32)[:, None, None, :])
    u = ((h >> 8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))
    # the top 24-bit value, 2^24 - 0.5, rounds to 2^24 in float32: u = 1 would give zeta = +inf and
    # a NaN softmax row (one draw in 2^24: every long Keyformer prompt), so it takes the float below 1
    u = mx.minimum(u, 1.0 - 2.0**-24)
    return -mx.log(-mx.log(u))


def _redrawn_from(stream: mx.array, query_positions: mx.array, key_positions: mx.array) -> mx.array:
    """stream [R, G], query_positions [L], key_positions [R or 1, n] -> Gumbel noise [R, G, L, n]."""
    step = mix(stream[..., None] ^ (query_positions.astype(mx.uint32) + 1))  # [R, G, L]
    return _gumbel_from(step, key_positions)


# The per-element chain is ~17 elementwise ops; on a GPU each would be a kernel reading and writing the
# whole [R, G, L, n] tile (prompt scoring at 32k spent most of its time here). mx.compile fuses them
# (with the step hash before them: a decode step builds a few ops, not a dozen); MLX fuses chains at
# most 11 ops deep, so the element chain is two kernels with one [R, G, L, n] uint32 between them.
# Integer hashing is exact either way; on the CPU MLX compiles with the system C++ compiler per
# shape, which costs more than it saves, so the CPU keeps the plain chain.
_gumbel_fused = mx.compile(_gumbel_from)
_redrawn_fused = mx.compile(_redrawn_from)


def noise_streams(seed: int, layer: int, heads: mx.array) -> mx.array:
    """[R, G] uint32 stream ids of (seed, layer, query head): the part of every draw that no step
    or position changes (callers that draw every step may compute it once)."""
    u32 = mx.uint32
    return mix(mix(mix(mx.array(seed, u32)) ^ mx.array(layer, u32)) ^ heads.astype(u32))


def gumbel_noise(seed: int, layer: int, heads: mx.array, query_positions: mx.array | None, key_positions: mx.array,
                 fused: bool | None = None) -> mx.array:
    """Gumbel(0, 1) noise [R, G, L, n] (L = 1 when query_positions is None: frozen noise).

    heads [R, G] uint32 stream ids (query heads), query_positions [L] true positions of the query
    steps, key_positions [R or 1, n] true positions of the keys. zeta = -log(-log(u)), u uniform in
    (0, 1) from 24 hash bits. `fused` (default: on a GPU) evaluates the element chain as one kernel.
    """
    return gumbel_noise_from_streams(noise_streams(seed, layer, heads), query_positions, key_positions, fused)


def gumbel_noise_from_streams(stream: mx.array, query_positions: mx.array | None, key_positions: mx.array,
                              fused: bool | None = None) -> mx.array:
    """`gumbel_noise` from its `noise_streams` [R, G]."""
    if fused is None:
        fused = mx.default_device().type == mx.DeviceType.gpu
    if query_positions is None:
        step = mix(stream)[..., None]  # [R, G, 1]
        return (_gumbel_fused if fused else _gumbel_from)(step, key_positions)
    return (_redrawn_fused if fused else _redrawn_from)(stream, query_positions, key_positions)
