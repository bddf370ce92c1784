"""The quantizers' shared base: per-side bit widths, growing code buffers, the decode/prefill split
(a decode step attends on the codes, a prefill chunk over blocks of dequantized tokens), and the
bit packing of codes of any width that TurboQuant, QJL and KVQuant store."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
import numpy as np

from ...errors import check
from ..base import CompressedCache


class PerSideBits:
    """For quantizers with `bits` and optional `key_bits` / `value_bits` overrides (KIVI, TurboQuant,
    KVQuant)."""

    def check_bits(self, allowed_bits: tuple) -> None:
        """ConfigError naming `<method>.bits` / `.key_bits` / `.value_bits` when not in `allowed_bits`."""
        allowed = "one of " + ", ".join(map(str, allowed_bits))
        check(self.bits in allowed_bits, f"{self.name}.bits", allowed, self.bits)
        for side in ("key_bits", "value_bits"):
            value = getattr(self, side)
            check(value is None or value in allowed_bits, f"{self.name}.{side}", allowed + " or None", value)

    @property
    def k_bits(self) -> int:
        return self.bits if self.key_bits is None else self.key_bits

    @property
    def v_bits(self) -> int:
        return self.bits if self.value_bits is None else self.value_bits

    def grid_columns(self) -> dict[str, float | None]:
        # a sweep groups these rows by mean code width (K4V2 -> 3.0); they have no token budget
        return {"budget": None, "bits": (self.k_bits + self.v_bits) / 2, "tau_init": None, "tau_end": None}


ROWS_STEP = 256  # token rows allocated at a time, as mlx-lm's KVCache


def write_rows(arrays: dict[str, mx.array] | None, new: dict[str, mx.array], start: int) -> dict[str, mx.array]:
    """Write `new` (name -> [B, H, n, ...]) at token rows start .. start + n of `arrays` (same names),
    growing every buffer ROWS_STEP rows at a time as mlx-lm's KVCache does; rows past the ones in use
    are allocated, not held tokens. Returns the buffers (new ones where they grew)."""
    end = start + next(iter(new.values())).shape[2]
    if arrays is None or end > next(iter(arrays.values())).shape[2]:
        grow = -(-(end - start) // ROWS_STEP) * ROWS_STEP
        arrays = {
            name: mx.concatenate([arrays[name][:, :, :start], mx.zeros((*a.shape[:2], grow, *a.shape[3:]), a.dtype)], axis=2)
            if arrays is not None else mx.zeros((*a.shape[:2], grow, *a.shape[3:]), a.dtype)
            for name, a in new.items()
        }
    for name, a in new.items():
        arrays[name][:, :, start:end] = a
    return arrays


DECODE_ROWS = 8  # query rows per KV head up to which a quantizer attends on its codes: a decode step's GQA group
DEQUANTIZE_BLOCK = 2048  # held tokens a quantizer's prefill path dequantizes at a time (mlx-lm's prefill chunk)


def attends_on_codes(queries: mx.array, kv_heads: int, sinks: mx.array | None) -> bool:
    """Whether a quantizer's call attends on its codes (a decode step: at most DECODE_ROWS query rows
    per KV head, no sinks) rather than through `attention_over` (a prefill chunk, or sinks).
    queries [B, H_q, L, D]."""
    return sinks is None and queries.shape[1] // kv_heads * queries.shape[2] <= DECODE_ROWS


class CodesCache(CompressedCache):
    """A quantizer that stores each token as codes when it arrives and lets the call that brought it
    attend to it exactly (TurboQuant, QJL): `update_and_fetch` keeps the call's tokens in `_fresh`;
    `attention` gives them, once, to the path the call takes: on the codes for a decode step
    (`attention_on_codes`), through the held tokens dequantized once for a prefill chunk or sinks
    (`prefill_attention`). Both take (queries [B, H_q, L, D], fresh_k, fresh_v, scale, mask, sinks)."""

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        # keys, values: this cache itself (update_and_fetch returned it); the codes are read from it
        fresh_k, fresh_v = self._fresh if self._fresh is not None else (None, None)
        self._fresh = None
        if attends_on_codes(queries, self.dims[0], sinks):
            return self.attention_on_codes(queries, fresh_k, fresh_v, scale, mask, sinks)
        return self.prefill_attention(queries, fresh_k, fresh_v, scale, mask, sinks)

    def make_mask(self, N, return_array=False, window_size=None):
        # every token is held, in order: plain causal over offset + N keys
        return mlx_cache.create_attention_mask(N, self.offset, return_array, window_size)

    @property
    def tokens_kept(self) -> int:
        return self.offset


def dequantized_blocks(dequantize, start: int, end: int, dtype: mx.Dtype) -> list[mx.array]:
    """Held codes dequantized for a quantizer's prefill path: dequantize(a, b) gives rows a..b of one
    side, [B, H_kv, b - a, D] float32, exactly what its codes path scores or sums (so the two paths
    agree to float rounding). Rows start..end, DEQUANTIZE_BLOCK at a time, each block cast to `dtype`
    and evaluated before the next is made: a layer's float32 transients stay one block's, not the
    context's (MLX evaluates independent branches of a graph side by side, so unevaluated blocks
    would all be in flight at once: measured on TurboQuant-4 keys, 8k tokens, 8 KV heads, the
    transients were 7x the keys' float32 size with every block in flight, 1x one block at a time)."""
    blocks = []
    for a in range(start, end, DEQUANTIZE_BLOCK):
        blocks.append(dequantize(a, min(end, a + DEQUANTIZE_BLOCK)).astype(dtype))
        if end - start > DEQUANTIZE_BLOCK:
            mx.eval(blocks[-1])
    return blocks


def attention_over(queries: mx.array, keys: list[mx.array], values: list[mx.array], scale: float, mask,
                   sinks: mx.array | None = None) -> mx.array:
    """A quantizer's prefill path: MLX's fused attention of queries [B, H_q, L, D] over pieces of
    keys and values [B, H_kv, n, D] in token order (dequantized blocks, the exactly held tokens, the
    call's own), concatenated in the queries' dtype.

    The queries' dtype, as the full cache's attention: float32 on CPU (where the quality runs are, so
    their numbers do not move), float16 on GPU (MLX's fused kernel accumulates in float32; its CUDA
    back-end fuses half-precision prefill attention, while a float32 call may take the unfused path,
    which materializes a [B, H_q, L, T] score matrix)."""
    dtype = queries.dtype
    k, v = ([a.astype(dtype) for a in side if a.shape[2]] for side in (keys, values))
    k = mx.concatenate(k, axis=2) if len(k) > 1 else k[0]
    v = mx.concatenate(v, axis=2) if len(v) > 1 else v[0]
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)


def pack(codes: mx.array, bits: int) -> mx.array:
    """codes [..., D] (ints < 2^bits) -> [..., ceil(D * bits / 32)] uint32, a little-endian bit
    stream (the last word zero-padded where D * bits is not a multiple of 32). 32 codes fill `bits`
    words exactly; word k of such a group is the sum (an OR: the fields are disjoint) of the run of
    codes that overlap it, each shifted to where it starts (bits past 32 drop: they belong to the next
    word), the first shifted down where it began in word k - 1. The transients stay [..., D] (not a
    [..., D * bits] bit array: a prefill chunk's quantization must not hold `bits` x its codes)."""
    *lead, dim = codes.shape
    pad = -dim % 32
    codes = codes.astype(mx.uint32)
    if pad:
        codes = mx.concatenate([codes, mx.zeros((*lead, pad), mx.uint32)], axis=-1)
    groups = codes.reshape(*lead, (dim + pad) // 32, 32)  # [..., n_groups, 32]
    words = []
    for k in range(bits):
        first, last = 32 * k // bits, min(31, (32 * k + 31) // bits)  # the codes overlapping word k
        start = np.arange(first, last + 1) * bits - 32 * k  # where each starts in word k (< 0: in word k - 1)
        up, down = (mx.array(np.maximum(sign * start, 0).astype(np.uint32)) for sign in (1, -1))
        words.append(((groups[..., first : last + 1] << up) >> down).sum(axis=-1).astype(mx.uint32))
    words = mx.stack(words, axis=-1).reshape(*lead, -1)  # [..., n_groups * bits]
    return words[..., : -(-dim * bits // 32)]


def unpack(words: mx.array, bits: int, dim: int) -> mx.array:
    """The inverse of `pack`: [..., W] uint32 -> codes [..., dim] uint32. Code j sits at bit j * bits:
    its low part in word j * bits // 32, shifted down, and where it straddles two words, its high part
    at the bottom of the next. Works on gathered words, [..., dim] at a time (not a [..., W, 32] bit
    array: the dequantization of a long context must not hold `bits` x its codes' floats)."""
    start = np.arange(dim) * bits
    word, shift = start // 32, start % 32
    low = mx.take(words, mx.array(word.astype(np.int32)), axis=-1) >> mx.array(shift.astype(np.uint32))
    straddles = shift + bits > 32
    if straddles.any():
        high = mx.take(words, mx.array(np.minimum(word + 1, words.shape[-1] - 1).astype(np.int32)), axis=-1)
        up = mx.array(np.where(straddles, 32 - shift, 0).astype(np.uint32))  # 0: no high part (masked below)
        low = low | mx.where(mx.array(straddles), high << up, 0).astype(mx.uint32)
    return low & (2**bits - 1)
