"""Accumulated attention over a prompt in bounded memory (tiled; one pass wherever a row fits).

H2O and Keyformer score a key by the attention every query gave it: s_j = sum_i softmax_j(f(x_ij))
over causal logits x_ij (f: identity for H2O, Keyformer's Gumbel/tau transform). Materialising the
[queries, keys] probabilities is quadratic in the prompt (a 32k prompt with 32 query heads is 128
GiB in float32). Instead the queries go in tiles of q rows (all query heads of a KV head together):

- one pass, when the tile's whole causal rows fit the element budget (a 32k prompt with 8 KV heads x
  4 query heads: q = 16 rows on a CPU, 64 on a GPU): softmax over each row, summed over the tile's
  queries into the key scores. Every logit, f and exp is computed once.
- two passes, when they do not (very long or batched prompts; or `tile` asks for key tiles), as
  FlashAttention does for the output: over key tiles, each row's log-sum-exp lse_i of f(x_ij); then
  over the same key tiles, sum_i exp(f(x_ij) - lse_i) into the key scores.

On a GPU a tile is bound by memory traffic, not arithmetic, so every op that reads and writes the
whole tile counts: the logits come out of one product already in [rows, keys] order (no transposing
copy), and the cast to float32, f and the causal mask run as one compiled kernel (mx.compile of the
chain with f inside, per call; traced once per tile shape, so one-pass row widths grow in steps of
WIDTH_STEP keys and a call traces a few shapes, not one per tile). A one-pass tile is then four
kernels, each one pass over the tile in device memory: product, that chain, softmax, column sum
(Keyformer's chain, ~22 ops deep, is two: MLX fuses at most 11 deep).
Tiles are evaluated asynchronously, one waited for as the next is submitted: the host builds a tile
while the device runs the previous one (no host-device sync per tile), and scratch stays bounded
(buffers are allocated when a tile is submitted: an unbounded queue would hold every tile at once).
Scratch: a few tile-sized float32 temporaries of at most two tiles (measured on the CPU: ~2.5 tiles
at the peak), plus the [R, n] scores.
`accumulated_attention_reference` is the plain quadratic version the tests compare against.
On a CUDA GPU, H2O's and Keyformer's sums take kvcompress/kernels/prompt_scores.py instead: the
same two passes with every tile kept on the chip (Keyformer's noise drawn there).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from ....kernels import dispatch
from ....kernels import prompt_scores as prompt_kernels

# Float32 logits per tile. CPU: 64 MiB, large enough that Python's per-op cost stays small against
# the math. GPU: 256 MiB (scratch ~2.5 tiles at the peak: ~0.6 GiB): at 32k a layer's prompt is
# then ~270 tiles, so the host's work per tile (a few ops, sometimes a trace) stays under the
# device's time per tile.
TILE_ELEMENTS = 1 << 24
GPU_TILE_ELEMENTS = 1 << 26
KEY_TILE = 2048  # keys per tile when even one query's row does not fit the budget
# Compiled path: one-pass row widths are rounded up to this many keys (at most the prompt; the
# extra keys are causally masked), so a call retraces a few shapes rather than one per tile.
WIDTH_STEP = 512

# f(logits [R, G, Lq, Tk], query_positions [Lq], key_positions [Tk]) -> transformed logits
Transform = Callable[[mx.array, mx.array, mx.array], mx.array]


def folded_logits(queries: mx.array, keys: mx.array, scale: float) -> mx.array:
    """queries [R, G, L, D] (a KV head's query group on axis 1), keys [R, n, D] -> [R, G, L, n].

    The group is folded into the row axis: broadcasting batch dims is wrong on MLX CUDA.
    """
    R, G, L, D = queries.shape
    q = queries.reshape(R, G * L, D) * scale
    # q @ keys^T comes out in [rows, keys] order (the transposed operand is a GEMM flag, not a copy;
    # keys @ q^T needed a transposing copy after it: 52 against 33 us per layer at 16k slots on the
    # H200, the same on CPU); the product runs in the model's dtype, the softmax in float32
    logits = (q.astype(keys.dtype) @ keys.swapaxes(1, 2)).astype(mx.float32)  # [R, G * L, n]
    return logits.reshape(R, G, L, keys.shape[1])


def _causal_tile(logits, query_positions, key_positions):
    return mx.where(key_positions[None, None, None, :] <= query_positions[None, None, :, None], logits, -mx.inf)


def tile_shape(rows: int, L: int, n: int, elements: int) -> tuple[int, int]:
    """(query rows, keys) per tile for `rows` = R * G logits per (query, key) pair: whole rows (keys
    = n, one pass) when one query's row fits `elements`, else KEY_TILE keys (two passes)."""
    if rows * n <= elements:
        return min(L, elements // (rows * n)), n
    key_tile = min(n, KEY_TILE)
    return max(1, min(L, elements // (rows * key_tile))), key_tile


def accumulated_attention(
    queries: mx.array, keys: mx.array, scale: float, transform: Transform | None = None,
    tile: tuple[int, int] | None = None, fused: bool | None = None,
    kernel_noise: prompt_kernels.PromptNoise | None = None,
) -> mx.array:
    """sum over queries and the group of softmax(transform(causal logits)) -> [R, n] float32.

    queries [R, G, L, D] are the last L of the n key positions (query i sits at n - L + i);
    keys [R, n, D] are at positions 0..n-1. `tile` = (query rows, keys) per tile, or None to size
    tiles to the element budget (TILE_ELEMENTS; GPU_TILE_ELEMENTS on a GPU); a query tile whose
    queries see at most that many keys takes one pass. `fused` (default: on a GPU) compiles the
    per-element chain (cast, transform, mask; exp in the second pass) into one kernel.
    On a GPU without `tile`, kernels/prompt_scores.py's kernels where they run, for no transform
    (H2O) or one they draw themselves (`kernel_noise`: Keyformer's, the same as `transform`).
    """
    R, G, L, D = queries.shape
    n = keys.shape[1]
    gpu = mx.default_device().type == mx.DeviceType.gpu
    cuda = dispatch.gpu_backend() == "cuda"
    if cuda and tile is None and (transform is None or kernel_noise is not None):  # on tensor cores
        if prompt_kernels.fuses(queries, keys, kernel_noise is not None):
            return prompt_kernels.accumulated_attention_fused(queries, keys, scale, kernel_noise)
        if not prompt_kernels.shape_supported(D, keys.dtype):
            dispatch.record_reference("prompt_scores", keys.dtype)
    fused = gpu if fused is None else fused
    q_tile, k_tile = tile or tile_shape(R * G, L, n, GPU_TILE_ELEMENTS if gpu else TILE_ELEMENTS)
    step = WIDTH_STEP if fused else 1
    first = n - L
    # scaled in the queries' dtype, then cast, as folded_logits does
    queries = (queries * scale).astype(keys.dtype)

    def f_logits(logits, query_positions, key_positions):
        """logits [R, G, q, k] in the model's dtype -> f(causal logits) in float32."""
        logits = logits.astype(mx.float32)
        if transform is not None:
            logits = transform(logits, query_positions, key_positions)
        return _causal_tile(logits, query_positions, key_positions)

    def probabilities(logits, query_positions, key_positions, lse):
        return mx.exp(f_logits(logits, query_positions, key_positions) - lse[..., None])

    if fused:  # one kernel each, compiled with this call's transform inside (traced per tile shape)
        f_logits, probabilities = mx.compile(f_logits), mx.compile(probabilities)

    def tile_logits(q0, q1, k0, k1):
        """Logits of queries q0..q1 over keys k0..k1 in the model's dtype [R, G, q, k], and their positions."""
        q = queries[:, :, q0:q1].reshape(R, G * (q1 - q0), D)
        # q @ keys^T comes out in [rows, keys] order (a transposed operand is a GEMM flag, not a copy)
        logits = (q @ keys[:, k0:k1].swapaxes(1, 2)).reshape(R, G, q1 - q0, k1 - k0)
        return logits, mx.arange(first + q0, first + q1, dtype=mx.int32), mx.arange(k0, k1, dtype=mx.int32)

    submitted = []

    def submit(result):
        # start evaluating this tile, then wait for the one before it (whose scratch then frees)
        mx.async_eval(result)
        if submitted:
            mx.eval(submitted.pop())
        submitted.append(result)

    scores = mx.zeros((R, n), mx.float32)
    for q0 in range(0, L, q_tile):
        q1 = min(L, q0 + q_tile)
        visible = first + q1  # the tile's queries see keys 0..visible-1
        if visible <= k_tile:  # whole rows fit: one pass
            width = min(n, k_tile, -(-visible // step) * step)
            probs = mx.softmax(f_logits(*tile_logits(q0, q1, 0, width)), axis=-1, precise=True)  # [R, G, q, width]
            scores = scores.at[:, :width].add(probs.sum(axis=(1, 2)))
            submit(scores)
            continue
        # pass 1: each row's log-sum-exp over key tiles (key 0 is visible to every query, so the
        # first tile makes it finite; a later tile a row cannot see adds exp(-inf) = 0)
        lse = None
        for k0 in range(0, visible, k_tile):
            tile_lse = mx.logsumexp(f_logits(*tile_logits(q0, q1, k0, min(n, k0 + k_tile))), axis=-1)  # [R, G, q]
            lse = tile_lse if lse is None else mx.logaddexp(lse, tile_lse)
            submit(lse)
        # pass 2: normalised probabilities summed into the keys' scores
        for k0 in range(0, visible, k_tile):
            k1 = min(n, k0 + k_tile)
            probs = probabilities(*tile_logits(q0, q1, k0, k1), lse)
            scores = scores.at[:, k0:k1].add(probs.sum(axis=(1, 2)))
            submit(scores)
    return scores


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
