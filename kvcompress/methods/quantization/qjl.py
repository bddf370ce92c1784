"""QJL (Zandieh, Daliri, Han, "QJL: 1-Bit Quantized JL Transform for KV Cache Quantization with Zero
Overhead", AAAI 2025, arXiv:2406.03482; code github.com/amirzandieh/QJL): keys as the sign bits of
a Gaussian sketch plus their norm, values quantized per token.

Keys. S is an m x D matrix of i.i.d. N(0, 1) entries (seeded, one per layer, shared by its heads, as
the reference code's one sketch). A key k is stored as sign(S k) (m bits) and ||k||; for a query q
(not quantized), E_S[<S q, sign(S k)>] = sqrt(2 / pi) <q, k> / ||k||, so
    <q, k> ~= sqrt(pi / 2) / m * ||k|| * <S q, sign(S k)>                    (the paper's Eq. 2 / Lemma 3.2)
is unbiased. As the reference code: in each group of `group_size` tokens the `outliers` channels of
largest norm over the group are split off: the key's inlier part k_in (outliers zeroed) gets the m-bit
sketch and its norm, the outlier part k_out its own `outlier_sketch_dim`-bit sketch (the first
m_out rows of S) and its norm, and the two estimates add:
    <q, k> ~= sqrt(pi/2)/m ||k_in|| <S q_in, sign(S k_in)> + sqrt(pi/2)/m_out ||k_out|| <S_out q_out, sign(S_out k_out)>
with q_in, q_out the query's channels of each part. The first `initial_layers` layers use the larger
`initial_sketch_dim` / `initial_outlier_sketch_dim` (the reference code's 512 / 128 for its first 15).

Values: per token, groups of `group_size` channels, `value_bits`-bit min/max codes (KIVI's values;
kvcompress/kernels/kivi_quant.py), as the reference code's `triton_quantize_and_pack_along_last_dim`.

Recent tokens in full precision, as the reference code: keys are quantized `buffer` tokens at a time
(the last T mod buffer are kept), values once they are more than `buffer` tokens old (the last
`buffer` are kept). The tokens of the current call attend to each other exactly (as TurboQuant's).

A decode step attends on the codes: the query is sketched once, S q against the stored signs is one
matmul, the outlier terms go through the o outlier channels per group (S's columns at those channels
against the signs: T x m x o work, not T x m x D), and values are read by `mx.quantized_matmul`. A
prefill chunk (or a model with sinks) dequantizes the quantized tokens once, in blocks, as the
estimator reads them, and runs MLX's fused attention (`prefill_attention`; docs/methods.md: its peak).

Departures from the reference code: S is i.i.d. Gaussian (the paper's estimator; the code
orthogonalizes its rows in blocks of D, which makes the estimator slightly biased); the inlier
norm is stored itself (the code stores ||k|| and takes sqrt(||k||^2 - ||k_out||^2)); norms are
float16 and value scales / zeros in the model's dtype (the code: the model's dtype, float16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
import numpy as np

from ...attention import install, masked_softmax
from ...errors import ConfigError, check, is_int
from ...kernels.kivi_quant import BITS as VALUE_BITS, GROUP_SIZES, quantize_pack
from ..base import Method, array_bytes
from .base import CodesCache, attention_over, dequantized_blocks, pack, unpack, write_rows

KEY_NAMES = ("k_in_norms", "k_out_norms", "k_out_signs", "k_signs")  # one row per quantized key
VALUE_NAMES = ("v_codes", "v_scales", "v_zeros")  # one row per quantized value


def values_product(probs: mx.array, codes: mx.array, scales: mx.array, zeros: mx.array, group_size: int, bits: int,
                   fused: bool | None = None) -> mx.array:
    """probs [.., rows, n] @ the values the codes [.., n, D] hold: `mx.quantized_matmul`, except on CUDA,
    whose quantized_matmul has no transpose=False implementation for small problem shapes (seen on an
    H100 with MLX 0.32.4: "No implementation for problem shape: 2x32x28x2 ... bits: 2, group size: 32"):
    there the values are dequantized first and multiplied in float32 (the same function up to rounding;
    tests/test_qjl.py compares the two). `fused` forces a path."""
    if fused is None:
        fused = not (mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available())
    if fused:
        return mx.quantized_matmul(probs, codes, scales, zeros, transpose=False, group_size=group_size, bits=bits)
    return probs @ mx.dequantize(codes, scales, zeros, group_size=group_size, bits=bits)


@dataclass(frozen=True)
class Qjl(Method):
    """QJL: keys as 1-bit signs of a Gaussian sketch plus norms (outlier channels sketched apart),
    values per token; the recent tokens in full precision.

    sketch_dim / outlier_sketch_dim: m and m_out, the sign bits per key for its inlier and outlier
    parts (multiples of 32); initial_layers: how many first layers use initial_sketch_dim /
    initial_outlier_sketch_dim instead; outliers: channels per token group sketched apart;
    value_bits: value code width (2, 3, 4, 8); group_size: tokens per outlier group and channels per
    value group (32, 64, 128); buffer: recent tokens kept in full precision (a multiple of
    group_size); seed: the sketches. Defaults: the reference code's LongBench settings.
    """

    name = "qjl"
    stores_quantized = True  # an eviction method's `quantize` may name it (methods/composed.py)
    sketch_dim: int = 256
    outlier_sketch_dim: int = 256
    initial_layers: int = 15
    initial_sketch_dim: int = 512
    initial_outlier_sketch_dim: int = 128
    outliers: int = 8
    value_bits: int = 2
    group_size: int = 32
    buffer: int = 128
    seed: int = 0

    def __post_init__(self):
        for field in ("sketch_dim", "outlier_sketch_dim", "initial_sketch_dim", "initial_outlier_sketch_dim"):
            value = getattr(self, field)
            check(is_int(value) and value > 0 and value % 32 == 0, f"qjl.{field}",
                  "a positive multiple of 32 (sign bits are packed in 32-bit words)", value)
        check(is_int(self.initial_layers) and self.initial_layers >= 0, "qjl.initial_layers", "an int >= 0",
              self.initial_layers)
        check(is_int(self.outliers) and self.outliers >= 1, "qjl.outliers", "an int >= 1", self.outliers)
        check(self.value_bits in VALUE_BITS, "qjl.value_bits", "one of " + ", ".join(map(str, VALUE_BITS)),
              self.value_bits)
        check(self.group_size in GROUP_SIZES, "qjl.group_size", "one of 32, 64, 128", self.group_size)
        check(is_int(self.buffer) and self.buffer > 0 and self.buffer % self.group_size == 0, "qjl.buffer",
              f"a positive multiple of group_size ({self.group_size})", self.buffer)
        check(is_int(self.seed), "qjl.seed", "an int", self.seed)

    @classmethod
    def store_params(cls, params):
        # as KIVI's (kivi.py): a 128-token buffer could hold a budget's kept tokens whole, unquantized
        return {"buffer": params.get("group_size", cls.group_size), **params}

    def make_cache(self, model) -> list:
        install()  # the caches attend over their codes themselves
        return super().make_cache(model)

    def layer_cache(self, layer, i, n, layout):
        if layer.value_dim % self.group_size:
            raise ConfigError(f"qjl.group_size: expected a divisor of the model's value dim {layer.value_dim} "
                              f"(values are grouped along channels), got {self.group_size}")
        if self.outliers >= layer.head_dim:
            raise ConfigError(f"qjl.outliers: expected fewer than the model's head_dim {layer.head_dim}, "
                              f"got {self.outliers}")
        return self.new_cache(i)

    def new_cache(self, i: int) -> "QjlCache":
        """An empty cache for the i-th compressed layer (the layer checked by `layer_cache`): the
        initial sketch sizes below `initial_layers`, its own sketch from the seed and i."""
        initial = i < self.initial_layers
        return QjlCache(self.initial_sketch_dim if initial else self.sketch_dim,
                        self.initial_outlier_sketch_dim if initial else self.outlier_sketch_dim,
                        self.outliers, self.value_bits, self.group_size, self.buffer, self.seed * 100_003 + i)


def sketch(m: int, dim: int, seed: int) -> mx.array:
    """S [m, dim]: i.i.d. standard Gaussians, seeded."""
    return mx.array(np.random.default_rng(seed).standard_normal((m, dim)).astype(np.float32))


def one_hot(channels: mx.array, dim: int) -> mx.array:
    """channels [..., o] -> [..., dim, o] float32: column j is the indicator of channel channels[j]."""
    return (mx.arange(dim)[:, None] == channels[..., None, :].astype(mx.int32)).astype(mx.float32)


class QjlCache(CodesCache):
    """One layer's QJL storage (see the module docstring).

    quantized keys (first n_keys rows): "k_signs" [B, H, n, m/32] uint32, "k_out_signs"
    [B, H, n, m_out/32] uint32, "k_in_norms", "k_out_norms" [B, H, n] f16; their outlier channels
    "k_outliers" [B, H, n/G, o] uint8 (uint16 above 256 dims);
    quantized values (first n_values rows): "v_codes" [B, H, n, Dv*b/32] uint32, "v_scales",
    "v_zeros" [B, H, n, Dv/G] (model dtype);
    full precision: key_tail [B, H, T - n_keys, Dk], value_tail [B, H, T - n_values, Dv].
    """

    def __init__(self, sketch_dim: int = 256, outlier_sketch_dim: int = 256, outliers: int = 8, value_bits: int = 2,
                 group_size: int = 32, buffer: int = 128, seed: int = 0):
        self.m, self.m_out, self.outliers, self.value_bits = sketch_dim, outlier_sketch_dim, outliers, value_bits
        self.group_size, self.buffer, self.seed = group_size, buffer, seed
        self.offset = self.n_keys = self.n_values = 0
        self.key_codes = self.value_codes = self.key_groups = None  # name -> buffer (rows allocated ahead)
        self.key_tail = self.value_tail = None
        self.dims = None  # (H, D_k, D_v)
        self._fresh = None  # (keys, values) of the tokens of the current call, until its attention

    def _setup(self, B: int, H: int, Dk: int, Dv: int, dtype):
        self.dims = (H, Dk, Dv)
        self.dtype = dtype
        self.S = sketch(self.m, Dk, self.seed)  # [m, Dk]; its first m_out rows sketch the outlier parts
        if self.m_out > self.m:  # the outlier sketch needs rows of its own beyond S's
            self.S = mx.concatenate([self.S, sketch(self.m_out - self.m, Dk, self.seed + 1)], axis=0)
        if self.key_tail is None:
            self.key_tail = mx.zeros((B, H, 0, Dk), dtype)
            self.value_tail = mx.zeros((B, H, 0, Dv), dtype)

    # -- quantization ---------------------------------------------------------------------------

    def quantize_keys(self, k: mx.array) -> tuple[dict[str, mx.array], mx.array]:
        """k [B, H, n, D] (n a multiple of group_size) -> the stored rows, and the groups' outlier
        channels [B, H, n/G, o]."""
        B, H, n, D = k.shape
        G = self.group_size
        k = k.astype(mx.float32)
        channel_norms = mx.sqrt(mx.square(k.reshape(B, H, n // G, G, D)).sum(-2))  # [B, H, n/G, D]
        outliers = mx.argsort(-channel_norms, axis=-1)[..., : self.outliers]  # the largest per group
        mask = one_hot(outliers, D).sum(-1)  # [B, H, n/G, D], 1 on the outlier channels
        k_out = (k.reshape(B, H, n // G, G, D) * mask[:, :, :, None]).reshape(B, H, n, D)
        k_in = k - k_out
        signs_in = (k_in @ self.S[: self.m].T >= 0).astype(mx.uint32)
        signs_out = (k_out @ self.S[: self.m_out].T >= 0).astype(mx.uint32)
        rows = {"k_signs": pack(signs_in, 1), "k_out_signs": pack(signs_out, 1),
                "k_in_norms": mx.sqrt(mx.square(k_in).sum(-1)).astype(mx.float16),
                "k_out_norms": mx.sqrt(mx.square(k_out).sum(-1)).astype(mx.float16)}
        return rows, outliers.astype(mx.uint8 if D <= 256 else mx.uint16)

    def key_scores(self, q: mx.array, n: int) -> mx.array:
        """The estimate of <q, k> for queries q [B, H, M, D] and the first n quantized keys (rows of
        whole groups): [B, H, M, n]."""
        B, H, M, D = q.shape
        G, ng = self.group_size, n // self.group_size
        signs = unpack(self.key_codes["k_signs"][:, :, :n], 1, self.m).astype(mx.float32) * 2 - 1  # [B, H, n, m]
        signs_out = unpack(self.key_codes["k_out_signs"][:, :, :n], 1, self.m_out).astype(mx.float32) * 2 - 1
        pick = one_hot(self.key_groups["k_outliers"][:, :, :ng], D)  # [B, H, ng, D, o]
        q_out = q[:, :, None] @ pick  # [B, H, ng, M, o]: the query's outlier channels per group
        S_cols = self.S @ pick  # [B, H, ng, m', o]: S's columns at them
        # <S q_in, s> = <S q, s> - sum_j q_j <S[:, j], s> over the group's outlier channels j
        w_in = signs.reshape(B, H, ng, G, self.m) @ S_cols[..., : self.m, :]  # [B, H, ng, G, o]
        w_out = signs_out.reshape(B, H, ng, G, self.m_out) @ S_cols[..., : self.m_out, :]
        inner = (q @ self.S[: self.m].T) @ signs.swapaxes(-1, -2)  # [B, H, M, n]
        inner = inner - (q_out @ w_in.swapaxes(-1, -2)).swapaxes(2, 3).reshape(B, H, M, n)
        inner_out = (q_out @ w_out.swapaxes(-1, -2)).swapaxes(2, 3).reshape(B, H, M, n)
        c_in, c_out = math.sqrt(math.pi / 2) / self.m, math.sqrt(math.pi / 2) / self.m_out
        norms = self.key_codes["k_in_norms"][:, :, :n].astype(mx.float32)[:, :, None]
        norms_out = self.key_codes["k_out_norms"][:, :, :n].astype(mx.float32)[:, :, None]
        return c_in * norms * inner + c_out * norms_out * inner_out

    # -- mlx-lm protocol ------------------------------------------------------------------------

    def update_and_fetch(self, keys, values):
        # keys [B, H, S, Dk], values [B, H, S, Dv] post-RoPE
        if self.dims is None:
            self._setup(keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3], values.dtype)
        self.dtype = values.dtype  # a model that reads the dtype of what it got back (Phi-2) gets the activations'
        self._fresh = (keys, values)  # this call's own tokens, which its queries see exactly
        self.offset += keys.shape[2]
        self.key_tail = mx.concatenate([self.key_tail, keys], axis=2)
        self.value_tail = mx.concatenate([self.value_tail, values], axis=2)
        n = self.key_tail.shape[2] // self.buffer * self.buffer  # keys: whole buffers at a time
        if n:
            rows, outliers = self.quantize_keys(self.key_tail[:, :, :n])
            self.key_codes = write_rows(self.key_codes, rows, self.n_keys)
            self.key_groups = write_rows(self.key_groups, {"k_outliers": outliers}, self.n_keys // self.group_size)
            self.n_keys += n
            self.key_tail = self._rest(self.key_tail, n)
        n = max(0, self.value_tail.shape[2] - self.buffer)  # values: those older than the last `buffer`
        if n:
            codes, scales, zeros = quantize_pack(self.value_tail[:, :, :n], self.value_bits, self.group_size)
            self.value_codes = write_rows(self.value_codes, {"v_codes": codes, "v_scales": scales, "v_zeros": zeros},
                                     self.n_values)
            self.n_values += n
            self.value_tail = self._rest(self.value_tail, n)
        return self, self  # attention reads the codes from the cache itself

    def _rest(self, tail: mx.array, n: int) -> mx.array:
        """The tail's rows after its first n (just quantized). A view would keep the whole tail alive
        until the next call: after a prefill, the prompt's float32 keys or values. Copied only then
        (a decode step drops one row of ~129, and its next call concatenates anyway)."""
        rest = tail[:, :, n:]
        return mx.contiguous(rest) if n > self.buffer else rest

    def _exact(self, tail: mx.array, fresh: mx.array | None, n_quantized: int) -> tuple[int, mx.array]:
        """How many leading tokens attend through codes, and the exact rows after them: the tail, or
        the call's own tokens where this call quantized some of them."""
        T, S = self.offset, 0 if fresh is None else fresh.shape[2]
        return (n_quantized, tail) if n_quantized <= T - S else (T - S, fresh)

    def prefill_attention(self, queries, fresh_k, fresh_v, scale, mask, sinks=None):
        """A prefill chunk's attention: the quantized tokens before the exact ones dequantized once (keys
        as the estimator's dequantization, so <q, k> is the codes path's score), then the exact rows,
        MLX's fused attention (`dequantized_attention`). The codes path's [B, H, G*L, T] float32
        scores would be GiBs a layer at a 2048-token chunk over a 32k context."""
        nk, exact_k = self._exact(self.key_tail, fresh_k, self.n_keys)
        nv, exact_v = self._exact(self.value_tail, fresh_v, self.n_values)
        keys = dequantized_blocks(self.dequantized_keys, 0, nk, queries.dtype)
        values = dequantized_blocks(self.dequantized_values, 0, nv, queries.dtype)
        return attention_over(queries, keys + [exact_k], values + [exact_v], scale, mask, sinks)

    def attention_on_codes(self, queries, fresh_k, fresh_v, scale, mask, sinks=None):
        """A decode step's attention on the codes: the query sketched once against the stored signs,
        values by `mx.quantized_matmul`, the exact rows as they are."""
        B, n_q, L, Dk = queries.shape
        H, _, Dv = self.dims
        G, T = n_q // H, self.offset
        q = queries.astype(mx.float32).reshape(B, H, G * L, Dk)
        nk, exact_k = self._exact(self.key_tail, fresh_k, self.n_keys)
        scores = q @ exact_k.astype(mx.float32).swapaxes(-1, -2)
        if nk:  # the quantized keys' whole groups, then the ones this call's queries see as codes
            scores = mx.concatenate([self.key_scores(q, self.n_keys)[..., :nk], scores], axis=-1)
        probs = masked_softmax((scores * scale).reshape(B, n_q, L, T), mask, sinks).reshape(B, H, G * L, T)
        nv, exact_v = self._exact(self.value_tail, fresh_v, self.n_values)
        out = probs[..., nv:] @ exact_v.astype(mx.float32)
        if nv:
            codes, scales, zeros = (self.value_codes[name][:, :, :nv] for name in VALUE_NAMES)
            out = out + values_product(probs[..., :nv], codes, scales.astype(mx.float32), zeros.astype(mx.float32),
                                       self.group_size, self.value_bits)
        return out.reshape(B, n_q, L, Dv).astype(queries.dtype)

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """Keys and values [B, H, T, D] as attention sees them, float32: the quantized rows
        (`dequantized_keys`, `dequantized_values`), then the full-precision tails."""
        keys, values = [self.key_tail.astype(mx.float32)], [self.value_tail.astype(mx.float32)]
        if self.n_keys:
            keys.insert(0, self.dequantized_keys(0, self.n_keys))
        if self.n_values:
            values.insert(0, self.dequantized_values(0, self.n_values))
        return mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2)

    def dequantized_keys(self, start: int, end: int) -> mx.array:
        """Quantized keys start..end [B, H, end - start, Dk] float32, the estimator's dequantization:
        sqrt(pi/2)/m ||k_in|| (S^T sign(S k_in)) on a key's inlier channels plus sqrt(pi/2)/m_out
        ||k_out|| (S_out^T sign(S_out k_out)) on its group's outlier channels."""
        Dk, G = self.dims[1], self.group_size
        first, last = start // G, -(-end // G)  # the groups the rows lie in
        rows = slice(first * G, last * G)
        signs = unpack(self.key_codes["k_signs"][:, :, rows], 1, self.m).astype(mx.float32) * 2 - 1
        signs_out = unpack(self.key_codes["k_out_signs"][:, :, rows], 1, self.m_out).astype(mx.float32) * 2 - 1
        mask = one_hot(self.key_groups["k_outliers"][:, :, first:last], Dk).sum(-1)  # [B, H, groups, D]
        mask = mx.repeat(mask, G, axis=2)  # [B, H, rows, D]
        k_in = math.sqrt(math.pi / 2) / self.m * self.key_codes["k_in_norms"][:, :, rows].astype(mx.float32)[..., None] \
            * (signs @ self.S[: self.m])
        k_out = math.sqrt(math.pi / 2) / self.m_out * self.key_codes["k_out_norms"][:, :, rows].astype(mx.float32)[..., None] \
            * (signs_out @ self.S[: self.m_out])
        keys = (1 - mask) * k_in + mask * k_out
        return keys[:, :, start - first * G : end - first * G]

    def dequantized_values(self, start: int, end: int) -> mx.array:
        """Quantized values start..end [B, H, end - start, Dv] float32."""
        codes, scales, zeros = (self.value_codes[name][:, :, start:end] for name in VALUE_NAMES)
        return mx.dequantize(codes, scales, zeros, group_size=self.group_size, bits=self.value_bits).astype(mx.float32)

    @property
    def quantized_tokens(self) -> int:
        # keys leave the buffer in whole buffers, values one by one: a token counts once either is codes
        return max(self.n_keys, self.n_values)

    def _held(self) -> dict[str, mx.array]:
        """Every array held for the tokens held (the used rows of the buffers), by name."""
        if self.dims is None:
            return {}
        held = {"key_tail": self.key_tail, "value_tail": self.value_tail}
        if self.key_codes is not None:
            held.update({name: self.key_codes[name][:, :, : self.n_keys] for name in KEY_NAMES})
            held["k_outliers"] = self.key_groups["k_outliers"][:, :, : self.n_keys // self.group_size]
        if self.value_codes is not None:
            held.update({name: self.value_codes[name][:, :, : self.n_values] for name in VALUE_NAMES})
        return held

    @property
    def live_kv_bytes(self) -> int:
        # the held tokens' arrays, and this layer's sketch S (drawn per layer, held beside them)
        return array_bytes(*self._held().values(), *([] if self.dims is None else [self.S]))

    def empty(self):
        return self.dims is None

    # mlx-lm 0.32's loader rebuilds a cache from `state` alone: the held arrays by name (sorted),
    # then one string with the settings, the dims and the counts (the sketch is redrawn)
    @property
    def state(self):
        held = self._held()
        H, Dk, Dv = self.dims
        meta = ",".join(map(str, (self.m, self.m_out, self.outliers, self.value_bits, self.group_size, self.buffer,
                                  self.seed, H, Dk, Dv, self.offset, self.n_keys, self.n_values, ";".join(sorted(held)))))
        return [*(held[name] for name in sorted(held)), meta]

    @state.setter
    def state(self, v):
        *arrays, meta = v
        *numbers, names = meta.split(",")
        (self.m, self.m_out, self.outliers, self.value_bits, self.group_size, self.buffer, self.seed, H, Dk, Dv,
         self.offset, self.n_keys, self.n_values) = map(int, numbers)
        held = dict(zip(names.split(";"), arrays))
        self.key_tail, self.value_tail = held["key_tail"], held["value_tail"]
        self._setup(self.key_tail.shape[0], H, Dk, Dv, self.value_tail.dtype)
        self.key_codes = {name: held[name] for name in KEY_NAMES} if self.n_keys else None
        self.key_groups = {"k_outliers": held["k_outliers"]} if self.n_keys else None
        self.value_codes = {name: held[name] for name in VALUE_NAMES} if self.n_values else None
        self._fresh = None


# mlx-lm's load_prompt_cache looks cache classes up by name in mlx_lm.models.cache's globals.
setattr(mlx_cache, "QjlCache", QjlCache)
