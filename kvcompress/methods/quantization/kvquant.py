"""KVQuant (Hooper et al., NeurIPS 2024, arXiv:2401.18079): pre-RoPE per-channel keys, per-token
values, non-uniform codebooks and dense-and-sparse outliers, stored packed.

- Keys are quantized per channel *before* RoPE (paper Sec. 3.1-3.2): mlx-lm hands the cache keys
  already rotated at known positions, so the cache rotates them back with the model's own RoPE
  (`rope_rotations`, an exact inverse up to float error) and stores codes of the pre-RoPE keys; at
  attention it dequantizes and rotates them again at their positions (the paper's fused
  "dequantize + RoPE" kernel, here plain MLX). Models whose RoPE cannot be inverted by position
  (NoPE layers, none found, a length-dependent base) are refused.
- Per-channel thresholds (Sec. 3.4, per-vector dense-and-sparse): for each key channel the
  outlier_fraction/2 and 1 - outlier_fraction/2 quantiles of the calibration keys; the channel is
  normalized to [-1, 1] by their midpoint and half-range, and an entry outside [-1, 1] is an outlier
  kept sparse in float16 (its token-major flat index as int32, its value), not coded. Values are
  per token: the ceil(outlier_fraction/2 * D) largest and as many smallest entries of each value
  vector are its outliers (KVQuant's per-token quantile thresholds, computed online), the rest are
  normalized by their own min/max.
- Non-uniform codes (nuq, Sec. 3.3): 2^bits centroids per layer and side (`codebook="layer"`, the
  paper's) or per KV head and channel (`codebook="channel"`), from 1-D k-means over the normalized
  non-outlier entries (deterministic init at quantiles, at most 50 Lloyd iterations, the
  reference code's iteration cap). A normalized entry is coded as its nearest centroid.
- Attention sink (Sec. 3.5): the first `n_sink` tokens are kept in full precision.

Departures (docs/methods.md): the paper calibrates thresholds and codebooks offline on a
calibration set and weights k-means by Fisher information (squared gradients); we calibrate on the
prompt, once, when the first tokens are quantized (normally the prompt's call: its non-sink keys
and values, residual included), with unweighted k-means, since an inference run has no gradients.
Decode tokens reuse those thresholds and codebooks (keys beyond the prompt's range become sparse
outliers). Q-Norm is not built. `residual` (a full-precision window of the most recent tokens, 0 by
default as in the paper) is this project's knob for comparing with KIVI. The tokens of the current
call attend exactly (as KIVI's prefill and TurboQuant do); their codes serve later calls.

This module is the plain MLX reference (no fused kernel): every call dequantizes the coded rows
held before it, a transient built in blocks (base.dequantized_blocks, so its peak stays one block's
floats), and runs MLX's fused attention. `live_kv_bytes` counts the packed codes, the per-token and
per-channel scales, the codebooks, the sparse outliers, the sinks and the residual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
import numpy as np

from ...adapter import POSITIONAL_ROPES, positional_rope, rope_rotations
from ...attention import install
from ...errors import ConfigError, check, is_int
from ...kernels.evict import rotate_pairs
from ..base import CompressedCache, Method, array_bytes
from .base import PerSideBits, attention_over, dequantized_blocks, pack, unpack

BITS = (2, 3, 4)
CODEBOOKS = ("layer", "channel")
KMEANS_ITERATIONS = 50  # KVQuant's reference calibration caps k-means at 50 iterations
ROWS_STEP = 256  # code rows allocated at a time while decoding (a prefill allocates exactly)
TINY_RANGE = 1e-6  # a constant channel or token: its half-range, so normalizing stays finite


@dataclass(frozen=True)
class KVQuant(PerSideBits, Method):
    """KVQuant: pre-RoPE per-channel keys, per-token values, nuq codebooks, sparse fp16 outliers.

    bits: code width of keys and values (2, 3, 4); key_bits / value_bits override it per side.
    outlier_fraction: share of entries kept sparse in float16 (keys: per-channel thresholds at the
    prompt's outlier_fraction/2 quantiles; values: that share of each vector's extremes), 0 for none.
    residual: the most recent tokens kept in full precision (0: none, as the paper).
    n_sink: the first tokens kept in full precision (the paper's attention sink: 1).
    codebook: "layer" (one codebook per layer and side, the paper's) or "channel" (per KV head and
    channel). Thresholds and codebooks are calibrated on the prompt (module docstring).
    """

    name = "kvquant"
    store_refusal = ("its keys are quantized pre-RoPE by rotating each stored key back by its slot index, and a "
                     "composed store's slots are not the kept tokens' positions (they are scattered), so it would "
                     "quantize keys rotated by (position - slot), not the paper's pre-RoPE keys")
    bits: int = 3
    key_bits: int | None = None
    value_bits: int | None = None
    outlier_fraction: float = 0.01
    residual: int = 0
    n_sink: int = 1
    codebook: str = "layer"

    def __post_init__(self):
        self.check_bits(BITS)
        ok = isinstance(self.outlier_fraction, (int, float)) and not isinstance(self.outlier_fraction, bool)
        check(ok and 0 <= self.outlier_fraction < 0.5, "kvquant.outlier_fraction", "a number in [0, 0.5)",
              self.outlier_fraction)
        check(is_int(self.residual) and self.residual >= 0, "kvquant.residual", "an int >= 0", self.residual)
        check(is_int(self.n_sink) and self.n_sink >= 0, "kvquant.n_sink", "an int >= 0", self.n_sink)
        check(self.codebook in CODEBOOKS, "kvquant.codebook", "one of 'layer', 'channel'", self.codebook)

    def make_cache(self, model) -> list:
        install()  # the caches attend over their codes themselves
        return super().make_cache(model)

    def layer_cache(self, layer, i, n, layout):
        if layer.head_dim % 32 or layer.value_dim % 32:
            raise ConfigError(f"kvquant: key and value dims must be multiples of 32 (codes are packed in 32-bit "
                              f"words); {layout.model_class} has {layer.head_dim} and {layer.value_dim}")
        if not positional_rope(layer.rope):
            found = type(layer.rope).__name__ if layer.rope is not None else "none found (NoPE or not a `rope` module)"
            raise ConfigError(
                f"kvquant: keys are quantized before RoPE by rotating the cached keys back with the model's RoPE, "
                f"which must rotate by position alone (one of {POSITIONAL_ROPES}); {layout.model_class} layer "
                f"{layer.index}: {found}")
        return KVQuantCache(self.k_bits, self.v_bits, float(self.outlier_fraction), self.residual, self.n_sink,
                            self.codebook, layer.rope)


# -- the quantizer: plain functions over [B, H, n, D] arrays (float32; k-means on the host) --------


def quantile(x: mx.array, q: float) -> mx.array:
    """The q-quantile of x [C, N] along N, linear interpolation (numpy's default): [C]."""
    s = mx.sort(x, axis=-1)
    at = q * (x.shape[-1] - 1)
    lo, frac = math.floor(at), at - math.floor(at)
    hi = min(lo + 1, x.shape[-1] - 1)
    return s[:, lo] * (1 - frac) + s[:, hi] * frac


def kmeans_1d(groups: list[np.ndarray], levels: int) -> np.ndarray:
    """Centroids [G, levels] (ascending, float64) of 1-D k-means over each group's entries: init at the
    (k + 1/2) / levels order statistics, then Lloyd's iterations until nothing moves (at most
    KMEANS_ITERATIONS). An empty cell keeps its centroid; an empty group gets a uniform grid on
    [-1, 1]. On the host, once per layer: in 1-D a cell is a run of the sorted entries, so each
    iteration is a binary search of the edges and prefix sums (tests/test_kvquant.py holds the plain
    assign-and-average form it is checked against)."""
    out = np.empty((len(groups), levels))
    for g, x in enumerate(groups):
        x = np.sort(x.astype(np.float64))
        if x.size == 0:
            out[g] = np.linspace(-1, 1, levels)
            continue
        centroids = x[np.minimum(np.floor((np.arange(levels) + 0.5) / levels * x.size).astype(int), x.size - 1)]
        prefix = np.concatenate([[0.0], np.cumsum(x)])
        for _ in range(KMEANS_ITERATIONS):
            # cell k holds edge[k-1] < x <= edge[k] (as `nearest` assigns): x[bounds[k] : bounds[k+1]]
            edges = (centroids[1:] + centroids[:-1]) / 2
            bounds = np.concatenate([[0], np.searchsorted(x, edges, side="right"), [x.size]])
            count = np.diff(bounds)
            total = prefix[bounds[1:]] - prefix[bounds[:-1]]
            updated = np.where(count > 0, total / np.maximum(count, 1), centroids)
            if np.array_equal(updated, centroids):
                break
            centroids = updated
        out[g] = centroids
    return out


def nearest(x: mx.array, book: mx.array) -> mx.array:
    """Index of the nearest entry of `book` [..., K] (ascending, broadcast against x [...]) for each
    entry of x: the number of cell edges (midpoints) below it. Edges in float32: a float16 book's
    midpoints rounded to float16 would move them by up to half a float16 step."""
    book = book.astype(mx.float32)
    edges = (book[..., 1:] + book[..., :-1]) / 2
    return (x[..., None] > edges).sum(axis=-1).astype(mx.uint32)


def book_for(book: mx.array) -> mx.array:
    """A codebook [Hb, Db, K] (Hb, Db: 1 for a layer's, H and D for per-channel ones) as [1, Hb, 1, Db, K],
    broadcasting against codes [B, H, n, D]."""
    return book[None, :, None]


def key_calibration(pre: mx.array, fraction: float, bits: int, per_channel: bool) -> dict[str, mx.array]:
    """Per-channel zero and half-range [H, D] (float16) and the codebook [Hb, Db, 2^bits] (float16)
    from pre-RoPE keys pre [B, H, n, D]."""
    B, H, n, D = pre.shape
    x = pre.astype(mx.float32).transpose(1, 3, 0, 2).reshape(H * D, B * n)  # [channels, samples]
    lower, upper = quantile(x, fraction / 2), quantile(x, 1 - fraction / 2)
    zero = ((upper + lower) / 2).reshape(H, D).astype(mx.float16)
    half = mx.maximum((upper - lower) / 2, TINY_RANGE).reshape(H, D).astype(mx.float16)
    normal = (pre.astype(mx.float32) - zero[None, :, None]) / half[None, :, None]  # [B, H, n, D]
    book = _codebook(normal, mx.abs(normal) <= 1, bits, per_channel)
    return {"k_zero": zero, "k_half": half, "k_book": book}


def _codebook(normal: mx.array, inside: mx.array, bits: int, per_channel: bool) -> mx.array:
    """k-means codebook [Hb, Db, 2^bits] float16 of the normalized entries [B, H, n, D] inside [-1, 1]."""
    B, H, n, D = normal.shape
    x, keep = np.array(normal.astype(mx.float32)), np.array(inside)
    if per_channel:  # one group per KV head and channel
        groups = [x[:, h, :, d][keep[:, h, :, d]] for h in range(H) for d in range(D)]
        return mx.array(kmeans_1d(groups, 2**bits).reshape(H, D, -1).astype(np.float16))
    return mx.array(kmeans_1d([x[keep]], 2**bits).reshape(1, 1, -1).astype(np.float16))


def value_outliers(fraction: float, dim: int) -> int:
    """Entries per value vector kept sparse: ceil(fraction / 2 * dim) at each end (0 if fraction is 0)."""
    return 2 * math.ceil(fraction / 2 * dim) if fraction > 0 else 0


def value_split(values: mx.array, fraction: float) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Per-token zero and half-range [B, H, n] (float16) of the non-outlier entries, and the outliers'
    channels [B, H, n, n_out] and values (float16) of values [B, H, n, D]."""
    D = values.shape[-1]
    each = value_outliers(fraction, D) // 2
    v = values.astype(mx.float32)
    order = mx.argsort(v, axis=-1)
    s = mx.take_along_axis(v, order, axis=-1)
    lo, hi = s[..., each], s[..., D - 1 - each]  # the dense part's min and max
    zero = ((hi + lo) / 2).astype(mx.float16)
    half = mx.maximum((hi - lo) / 2, TINY_RANGE).astype(mx.float16)
    channels = mx.concatenate([order[..., :each], order[..., D - each:]], axis=-1)
    out_values = mx.take_along_axis(v, channels, axis=-1).astype(mx.float16)
    index_type = mx.uint8 if D <= 256 else mx.uint16
    return zero, half, channels.astype(index_type), out_values


def value_calibration(values: mx.array, fraction: float, bits: int, per_channel: bool) -> mx.array:
    """The value codebook [Hb, Db, 2^bits] (float16) from values [B, H, n, D]."""
    zero, half, channels, _ = value_split(values, fraction)
    normal = (values.astype(mx.float32) - zero[..., None]) / half[..., None]
    outlier = mx.zeros(values.shape, mx.bool_)
    if channels.shape[-1]:
        outlier = mx.put_along_axis(outlier, channels.astype(mx.int32), mx.array(True), axis=-1)
    return _codebook(normal, ~outlier, bits, per_channel)


def lookup(book: mx.array, codes: mx.array) -> mx.array:
    """The entries [B, H, n, D] float32 of codes [B, H, n, D] in `book` [Hb, Db, K]."""
    Hb, Db, K = book.shape
    base = (mx.arange(Hb)[:, None] * Db + mx.arange(Db)[None]) * K  # [Hb, Db]
    return book.reshape(-1).astype(mx.float32)[base[None, :, None] + codes.astype(mx.int32)]


class KVQuantCache(CompressedCache):
    """One layer's KVQuant storage (see the module docstring). Tokens in position order:

    sinks     sink_keys, sink_values [B, H, <=n_sink, D] as they came (post-RoPE keys)
    coded     rows[...] [B, H, cap, ...], the first n_coded in use (positions n_sink ..):
              k_codes [.., Dk*kb/32] uint32 (pre-RoPE keys), v_codes [.., Dv*vb/32] uint32,
              v_zero, v_half [B, H, cap] f16, v_out_channels [.., n_out] uint8, v_out_values [.., n_out] f16
              calib: k_zero, k_half [H, Dk] f16, k_book, v_book [Hb, Db, 2^bits] f16
              key outliers: k_out_index [n] int32 (flat, token-major over [n_coded, B, H, Dk]), k_out_values [n] f16
    residual  keys, values [B, H, <=residual, D] as they came
    """

    def __init__(self, key_bits: int = 3, value_bits: int = 3, outlier_fraction: float = 0.01, residual: int = 0,
                 n_sink: int = 1, codebook: str = "layer", rope=None):
        self.key_bits, self.value_bits, self.outlier_fraction = key_bits, value_bits, outlier_fraction
        self.residual, self.n_sink, self.codebook, self.rope = residual, n_sink, codebook, rope
        self.offset, self.n_coded = 0, 0
        self.sink_keys = self.sink_values = self.keys = self.values = None
        self.rows, self.calib = None, None
        self.k_out_index = self.k_out_values = None
        self.dtype_name = "float16"  # the activations' once keys arrive (a name: mx.Dtype cannot be deep-copied)
        self._fresh = None  # (keys, values) of the current call's tokens, until its attention

    @property
    def dtype(self) -> mx.Dtype:
        """The activations' dtype: what attention returns, and what a model that reads the fetched
        values' dtype (Phi-2) gets."""
        return getattr(mx, self.dtype_name)

    # -- RoPE ---------------------------------------------------------------------------------------

    def _rotate(self, keys: mx.array, start: int, sign: float) -> mx.array:
        """Keys [B, H, n, D] at positions start.. rotated by the model's RoPE (sign=1) or back (-1)."""
        if self.rope is None:
            raise RuntimeError("a kvquant cache needs the model's RoPE: kvcompress.load_prompt_cache(path, model)")
        cos, sin = rope_rotations(self.rope, keys.shape[-1], keys.shape[2], start)
        return rotate_pairs(keys.astype(mx.float32), cos, sign * sin, getattr(self.rope, "traditional", False))

    # -- quantization -------------------------------------------------------------------------------

    def _calibrate(self, pre: mx.array, values: mx.array) -> None:
        per_channel = self.codebook == "channel"
        self.calib = key_calibration(pre, self.outlier_fraction, self.key_bits, per_channel)
        self.calib["v_book"] = value_calibration(values, self.outlier_fraction, self.value_bits, per_channel)

    def quantize(self, pre: mx.array, values: mx.array) -> tuple[dict[str, mx.array], np.ndarray, np.ndarray]:
        """Pre-RoPE keys and values [B, H, n, D] -> their code rows, and the key outliers' flat indices
        (token-major over [n, B, H, Dk], from this chunk's first token) and values (numpy)."""
        c = self.calib
        normal = (pre.astype(mx.float32) - c["k_zero"][None, :, None]) / c["k_half"][None, :, None]
        k_codes = nearest(mx.clip(normal, -1, 1), book_for(c["k_book"]))
        zero, half, channels, out_values = value_split(values, self.outlier_fraction)
        v_normal = (values.astype(mx.float32) - zero[..., None]) / half[..., None]
        v_codes = nearest(mx.clip(v_normal, -1, 1), book_for(c["v_book"]))
        rows = {"k_codes": pack(k_codes, self.key_bits), "v_codes": pack(v_codes, self.value_bits),
                "v_zero": zero, "v_half": half, "v_out_channels": channels, "v_out_values": out_values}
        if self.outlier_fraction == 0:
            return rows, np.zeros(0, np.int32), np.zeros(0, np.float16)
        # the outliers' count varies per token (fixed thresholds): found on the host
        token_major = np.array(pre.astype(mx.float32).transpose(2, 0, 1, 3)).reshape(-1)
        outside = np.abs(np.array(normal.transpose(2, 0, 1, 3)).reshape(-1)) > 1
        index = np.nonzero(outside)[0].astype(np.int32)
        return rows, index, token_major[index].astype(np.float16)

    def _store(self, pre: mx.array, values: mx.array) -> None:
        rows, index, out_values = self.quantize(pre, values)
        B, H, n, D = pre.shape
        if (self.n_coded + n) * B * H * D >= 2**31:
            raise ConfigError("kvquant: the key outliers' int32 flat indices cannot address this many tokens")
        start, end = self.n_coded, self.n_coded + n
        if self.rows is None or end > self.rows["v_zero"].shape[2]:
            spare = ROWS_STEP if self.rows is not None else 0
            self.rows = {
                name: mx.concatenate([self.rows[name][:, :, :start], a] if self.rows is not None else [a], axis=2)
                for name, a in rows.items()
            }
            if spare:
                self.rows = {name: mx.concatenate([a, mx.zeros((*a.shape[:2], spare, *a.shape[3:]), a.dtype)], axis=2)
                             for name, a in self.rows.items()}
        else:
            for name, a in rows.items():
                self.rows[name][:, :, start:end] = a
        index = mx.array(index + start * B * H * D)
        out_values = mx.array(out_values)
        if self.k_out_index is None:
            self.k_out_index, self.k_out_values = index, out_values
        elif index.size:
            self.k_out_index = mx.concatenate([self.k_out_index, index])
            self.k_out_values = mx.concatenate([self.k_out_values, out_values])
        self.n_coded = end

    def _used(self) -> dict[str, mx.array]:
        return {name: a[:, :, : self.n_coded] for name, a in self.rows.items()}

    def dequantize_coded(self) -> tuple[mx.array, mx.array]:
        """The coded tokens' pre-RoPE keys and values [B, H, n_coded, D], float32."""
        return self.coded_keys(0, self.n_coded), self.coded_values(0, self.n_coded)

    def coded_keys(self, start: int, end: int) -> mx.array:
        """Coded rows start..end's pre-RoPE keys [B, H, end - start, Dk], float32: codebook entries
        scaled per channel, the sparse outliers in place of their dense entries."""
        c, codes = self.calib, self.rows["k_codes"][:, :, start:end]
        B, H, n = codes.shape[:3]
        Dk = c["k_zero"].shape[1]
        normal = lookup(c["k_book"], unpack(codes, self.key_bits, Dk))
        keys = normal * c["k_half"].astype(mx.float32)[None, :, None] + c["k_zero"].astype(mx.float32)[None, :, None]
        if self.k_out_index.size:
            # the outliers' flat indices are token-major over every coded row: those of other rows go to
            # one spare slot past the block's entries, dropped after the scatter
            size = n * B * H * Dk
            local = self.k_out_index - start * B * H * Dk
            local = mx.where((local >= 0) & (local < size), local, size)
            flat = mx.concatenate([keys.transpose(2, 0, 1, 3).reshape(-1), mx.zeros((1,), mx.float32)])
            flat[local] = self.k_out_values.astype(mx.float32)
            keys = flat[:size].reshape(n, B, H, Dk).transpose(1, 2, 0, 3)
        return keys

    def coded_values(self, start: int, end: int) -> mx.array:
        """Coded rows start..end's values [B, H, end - start, Dv], float32: codebook entries scaled per
        token, the per-token outliers in place."""
        r = {name: a[:, :, start:end] for name, a in self.rows.items()}
        Dv = r["v_codes"].shape[-1] * 32 // self.value_bits
        values = lookup(self.calib["v_book"], unpack(r["v_codes"], self.value_bits, Dv))
        values = values * r["v_half"].astype(mx.float32)[..., None] + r["v_zero"].astype(mx.float32)[..., None]
        if r["v_out_channels"].shape[-1]:
            values = mx.put_along_axis(values, r["v_out_channels"].astype(mx.int32),
                                       r["v_out_values"].astype(mx.float32), axis=-1)
        return values

    # -- mlx-lm protocol ----------------------------------------------------------------------------

    def update_and_fetch(self, keys, values):
        # keys [B, H, S, Dk] post-RoPE at positions offset..offset+S-1, values [B, H, S, Dv]
        self.dtype_name = _dtype_name(values.dtype)
        self._fresh = (keys, values)  # this call's own tokens, which its queries see exactly
        S = keys.shape[2]
        sink = max(0, min(S, self.n_sink - self.offset))
        if sink:
            self.sink_keys = _join(self.sink_keys, keys[:, :, :sink])
            self.sink_values = _join(self.sink_values, values[:, :, :sink])
        self.offset += S
        held_k, held_v = _join(self.keys, keys[:, :, sink:]), _join(self.values, values[:, :, sink:])
        leaving = 0 if held_k is None else held_k.shape[2] - self.residual
        if leaving > 0:
            start = self.n_sink + self.n_coded  # position of held_k's first token
            if self.calib is None:  # calibrated once, on every non-sink token held now (normally the prompt's)
                self._calibrate(self._rotate(held_k, start, -1), held_v)
            self._store(self._rotate(held_k[:, :, :leaving], start, -1), held_v[:, :, :leaving])
            held_k, held_v = mx.contiguous(held_k[:, :, leaving:]), mx.contiguous(held_v[:, :, leaving:])
            if held_k.shape[2] == 0:
                held_k = held_v = None
        self.keys, self.values = held_k, held_v
        return self, self  # attention reads the codes from the cache itself

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """Keys (post-RoPE) and values [B, H, T, D] as attention sees them, in the activations' dtype."""
        keys, values = [], []
        if self.sink_keys is not None:
            keys.append(self.sink_keys), values.append(self.sink_values)
        if self.n_coded:
            k, v = self.dequantize_coded()
            keys.append(self._rotate(k, self.n_sink, 1)), values.append(v)
        if self.keys is not None:
            keys.append(self.keys), values.append(self.values)
        return (mx.concatenate([k.astype(self.dtype) for k in keys], axis=2),
                mx.concatenate([v.astype(self.dtype) for v in values], axis=2))

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        """Attention of queries [B, H_q, L, Dk] (post-RoPE) over the tokens held before the call as
        attention sees them (`dequantized`), then the call's own exactly, through MLX's fused
        attention (base.attention_over). No attention on the codes is built: every call, decode steps
        included, dequantizes the coded rows, DEQUANTIZE_BLOCK at a time, so a layer's float32
        transients stay a block's and the peak stays near the full cache's."""
        fresh_k, fresh_v = ([], []) if self._fresh is None else ([a] for a in self._fresh)
        self._fresh = None
        before = self.offset - sum(k.shape[2] for k in fresh_k)  # the tokens held before this call
        n_sinks = min(before, 0 if self.sink_keys is None else self.sink_keys.shape[2])
        n_coded = min(self.n_coded, before - n_sinks)
        n_residual = before - n_sinks - n_coded  # the residual's first ones (the rest are the call's)
        dtype = self.dtype
        keys = dequantized_blocks(lambda a, b: self._rotate(self.coded_keys(a, b), self.n_sink + a, 1), 0, n_coded,
                                  dtype)
        values = dequantized_blocks(self.coded_values, 0, n_coded, dtype)
        if n_sinks:
            keys.insert(0, self.sink_keys[:, :, :n_sinks]), values.insert(0, self.sink_values[:, :, :n_sinks])
        if n_residual:
            keys.append(self.keys[:, :, :n_residual]), values.append(self.values[:, :, :n_residual])
        return attention_over(queries, keys + fresh_k, values + fresh_v, scale, mask, sinks)

    def make_mask(self, N, return_array=False, window_size=None):
        # every token is held, in order: plain causal over offset + N keys
        return mlx_cache.create_attention_mask(N, self.offset, return_array, window_size)

    @property
    def tokens_kept(self) -> int:
        return self.offset

    @property
    def quantized_tokens(self) -> int:
        return self.n_coded  # the sinks and the residual stay in full precision

    @property
    def live_kv_bytes(self) -> int:
        # the used code rows (rows allocated ahead hold no token), calibration, outliers, sinks, residual
        rows = self._used().values() if self.rows is not None else ()
        calib = self.calib.values() if self.calib is not None else ()
        return array_bytes(*rows, *calib, self.k_out_index, self.k_out_values, self.sink_keys, self.sink_values,
                           self.keys, self.values)

    def empty(self):
        return self.offset == 0

    def attach(self, layer) -> None:
        self.rope = layer.rope

    # mlx-lm's loader rebuilds a cache from `state` alone (`from_state`): the arrays (None where not
    # held yet), then one string with the settings. The RoPE module cannot be saved:
    # kvcompress.load_prompt_cache(path, model) gives it back.
    ROW_NAMES = ("k_codes", "v_codes", "v_zero", "v_half", "v_out_channels", "v_out_values")
    CALIB_NAMES = ("k_zero", "k_half", "k_book", "v_book")

    @property
    def state(self):
        rows = self._used() if self.rows is not None else {}
        calib = self.calib or {}
        meta = (f"{self.key_bits},{self.value_bits},{self.outlier_fraction},{self.residual},{self.n_sink},"
                f"{self.codebook},{self.offset},{self.n_coded}")
        return [*(rows.get(n) for n in self.ROW_NAMES), *(calib.get(n) for n in self.CALIB_NAMES), self.k_out_index,
                self.k_out_values, self.sink_keys, self.sink_values, self.keys, self.values, meta]

    @state.setter
    def state(self, v):
        *arrays, meta = v
        kb, vb, fraction, residual, n_sink, codebook, offset, n_coded = meta.split(",")
        self.key_bits, self.value_bits, self.outlier_fraction = int(kb), int(vb), float(fraction)
        self.residual, self.n_sink, self.codebook = int(residual), int(n_sink), codebook
        self.offset, self.n_coded = int(offset), int(n_coded)
        rows, calib = arrays[:6], arrays[6:10]
        self.rows = dict(zip(self.ROW_NAMES, rows)) if rows[0] is not None else None
        self.calib = dict(zip(self.CALIB_NAMES, calib)) if calib[0] is not None else None
        (self.k_out_index, self.k_out_values, self.sink_keys, self.sink_values, self.keys, self.values) = arrays[10:]
        held = self.values if self.values is not None else self.sink_values
        self.dtype_name = _dtype_name(held.dtype) if held is not None else "float16"
        self._fresh = None
        if not hasattr(self, "rope"):  # restored by from_state: no model here
            self.rope = None


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]  # "mlx.core.float32" -> "float32"


def _join(a: mx.array | None, b: mx.array) -> mx.array | None:
    """a then b along tokens (None for nothing)."""
    if b.shape[2] == 0:
        return a
    return b if a is None else mx.concatenate([a, b], axis=2)


# mlx-lm's load_prompt_cache looks cache classes up by name in mlx_lm.models.cache's globals.
setattr(mlx_cache, "KVQuantCache", KVQuantCache)
