"""KIVI (Liu et al., ICML 2024, arXiv:2402.02750): asymmetric 2-bit KV quantization, stored packed.

Keys are quantized per channel (groups of `group_size` tokens along the token axis), values per
token (groups of `group_size` channels), both with min/max asymmetric groups (paper Eq. 1, see
kvcompress/kernels/kivi_quant.py). The most recent `residual` tokens stay in full precision
(paper Sec. 3.3, Algorithm 1) and are flushed to codes in whole groups, so group boundaries sit at
multiples of `group_size` from position 0: prefilling in one shot or token by token quantizes the
same positions identically.

Unlike a fake-quantizing cache, the codes are what is stored: keys as K^T [B, H_kv, D, T_q] packed
along tokens and values as [B, H_kv, T_q, D] packed along channels, in MLX's quantized layout, so
attention computes scores and outputs with `mx.quantized_matmul(..., transpose=False)` directly on
codes; the residual joins before the softmax. `live_kv_bytes` is the bytes of those arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx_lm.models.cache import create_attention_mask

from ..attention import attention_geometry
from ..kernels.kivi_quant import BITS, GROUP_SIZES, quantize_pack
from .base import CompressedCache, ConfigError, Method, array_bytes, check


@dataclass(frozen=True)
class Kivi(Method):
    """KIVI: keys per channel, values per token, min/max groups, full-precision residual window.

    bits: code width of keys and values (2, 3, 4, 8); key_bits / value_bits override it per side
    (e.g. K4V2). group_size: tokens per key group and channels per value group (32, 64, 128; must
    divide head_dim). residual: recent tokens kept in full precision (int >= 0); the residual holds
    between `residual` and `residual + group_size - 1` tokens, since flushes are whole groups.
    """

    name = "kivi"
    bits: int = 2
    key_bits: int | None = None
    value_bits: int | None = None
    group_size: int = 32
    residual: int = 128

    def __post_init__(self):
        allowed = "one of " + ", ".join(map(str, BITS))
        check(self.bits in BITS, "kivi.bits", allowed, self.bits)
        check(self.key_bits is None or self.key_bits in BITS, "kivi.key_bits", allowed + " or None", self.key_bits)
        check(self.value_bits is None or self.value_bits in BITS, "kivi.value_bits", allowed + " or None", self.value_bits)
        check(self.group_size in GROUP_SIZES, "kivi.group_size", "one of 32, 64, 128", self.group_size)
        ok = isinstance(self.residual, int) and not isinstance(self.residual, bool) and self.residual >= 0
        check(ok, "kivi.residual", "an int >= 0", self.residual)

    @property
    def k_bits(self) -> int:
        return self.bits if self.key_bits is None else self.key_bits

    @property
    def v_bits(self) -> int:
        return self.bits if self.value_bits is None else self.value_bits

    def grid_columns(self) -> dict[str, float | None]:
        # a sweep groups KIVI rows by mean code width (K4V2 -> 3.0); KIVI has no token budget
        return {"budget": None, "bits": (self.k_bits + self.v_bits) / 2, "tau_init": None, "tau_end": None}

    def make_cache(self, model) -> list:
        head_dim = attention_geometry(model).head_dim
        if head_dim % self.group_size:
            raise ConfigError(
                f"kivi.group_size: expected a divisor of the model's head_dim {head_dim} "
                f"(values are grouped along channels), got {self.group_size}"
            )
        return [KiviCache(self.k_bits, self.v_bits, self.group_size, self.residual) for _ in model.layers]


def _own(x: mx.array) -> mx.array:
    # a slice shares its parent's buffer; copy so the cache does not pin the whole prefill
    return mx.contiguous(x)


class KiviCache(CompressedCache):
    """Packed KIVI storage for one layer (see module docstring).

    keys_packed   = (codes [B, H, D, T_q*kb/32] uint32, scales [B, H, D, T_q/G], zeros [B, H, D, T_q/G])
    values_packed = (codes [B, H, T_q, D*vb/32] uint32, scales [B, H, T_q, D/G], zeros [B, H, T_q, D/G])
    keys, values  = the full-precision residual [B, H, T_r, D];  offset = T_q + T_r (true position)
    """

    def __init__(self, key_bits: int = 2, value_bits: int = 2, group_size: int = 32, residual: int = 128):
        self.key_bits, self.value_bits = key_bits, value_bits
        self.group_size, self.residual = group_size, residual
        self.keys_packed = self.values_packed = None
        self.keys = self.values = None
        self.offset = 0

    @property
    def n_quantized(self) -> int:
        return self.offset - (0 if self.keys is None else self.keys.shape[2])

    def _flush_boundary(self, n_quantized: int) -> int:
        """Tokens that should be codes now: all but the residual, rounded down to whole groups."""
        aged = max(0, self.offset - self.residual)
        return max(n_quantized, aged // self.group_size * self.group_size)

    def update_and_fetch(self, keys, values):
        # keys, values: [B, H_kv, S, D] post-RoPE. Returns the pre-flush view for `attention`:
        # ((packed K^T or None, residual + new keys), (packed V or None, residual + new values)),
        # so the S new tokens attend to each other in full precision, as in KIVI's prefill.
        if self.keys is None:
            res_k, res_v = keys, values
        else:
            res_k = mx.concatenate([self.keys, keys], axis=2)
            res_v = mx.concatenate([self.values, values], axis=2)
        view = (self.keys_packed, res_k), (self.values_packed, res_v)
        n_quantized = self.n_quantized
        self.offset += keys.shape[2]
        n_flush = self._flush_boundary(n_quantized) - n_quantized
        if n_flush > 0:
            G = self.group_size
            new_k = quantize_pack(res_k[:, :, :n_flush], self.key_bits, G, per_channel=True)
            new_v = quantize_pack(res_v[:, :, :n_flush], self.value_bits, G, per_channel=False)
            if self.keys_packed is None:
                self.keys_packed, self.values_packed = new_k, new_v
            else:  # keys grow along their last (token) axis, values along rows
                self.keys_packed = tuple(mx.concatenate([a, b], axis=-1) for a, b in zip(self.keys_packed, new_k))
                self.values_packed = tuple(mx.concatenate([a, b], axis=-2) for a, b in zip(self.values_packed, new_v))
            res_k, res_v = _own(res_k[:, :, n_flush:]), _own(res_v[:, :, n_flush:])
        self.keys, self.values = res_k, res_v
        return view

    def attention(self, queries, keys, values, scale, mask):
        # queries [B, H_q, L, D]; keys/values: the views update_and_fetch returned
        (k_packed, k_res), (v_packed, v_res) = keys, values
        B, n_q, L, D = queries.shape
        n_kv = k_res.shape[1]
        rep = n_q // n_kv
        G = self.group_size
        # GQA: fold the query group into the row axis (query head h uses kv head h // rep); the
        # broadcast-over-an-inserted-axis form of quantized_matmul is wrong on CUDA
        q = (queries * scale).reshape(B, n_kv, rep * L, D)
        scores = [q @ k_res.swapaxes(-1, -2)]  # [B, H_kv, rep*L, T_r]
        if k_packed is not None:
            scores.insert(0, mx.quantized_matmul(q, *k_packed, transpose=False, group_size=G, bits=self.key_bits))
        scores = mx.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]
        T = scores.shape[-1]
        scores = scores.reshape(B, n_q, L, T)
        if isinstance(mask, str):  # "causal", bottom-right aligned
            mask = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
        if mask is not None:
            scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
        probs = mx.softmax(scores, axis=-1, precise=True).reshape(B, n_kv, rep * L, T)
        n_packed = T - k_res.shape[2]
        out = probs[..., n_packed:] @ v_res  # [B, H_kv, rep*L, D]
        if v_packed is not None:
            out = out + mx.quantized_matmul(
                probs[..., :n_packed], *v_packed, transpose=False, group_size=G, bits=self.value_bits
            )
        return out.reshape(B, n_q, L, D)

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """Keys and values [B, H, T, D] as attention sees them: dequantized codes + residual."""
        G = self.group_size
        keys, values = [self.keys], [self.values]
        if self.keys_packed is not None:
            keys.insert(0, mx.dequantize(*self.keys_packed, group_size=G, bits=self.key_bits).swapaxes(-1, -2))
            values.insert(0, mx.dequantize(*self.values_packed, group_size=G, bits=self.value_bits))
        return mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2)

    def make_mask(self, N, return_array=False, window_size=None):
        # every token is kept (as codes or residual), in order: plain causal over offset + N keys
        return create_attention_mask(N, self.offset, return_array, window_size)

    @property
    def tokens_kept(self) -> int:
        return self.offset

    @property
    def live_kv_bytes(self) -> int:
        packed = (self.keys_packed or ()) + (self.values_packed or ())
        return array_bytes(*packed, self.keys, self.values)

    def empty(self):
        return self.keys is None

    def is_trimmable(self):
        return True

    def trim(self, n):
        """Drop the last n tokens. Whole groups past the new end are dropped; the kept head of a
        group cut in two returns to the residual dequantized (its original precision is gone), and
        is quantized again by a later flush."""
        n = min(self.offset, n)
        if n == 0:
            return 0
        G, n_quantized, new_offset = self.group_size, self.n_quantized, self.offset - n
        keep = min(n_quantized, new_offset // G * G)
        head_k = head_v = None
        if keep < n_quantized:
            keys, values = self.dequantized()
            head_k = keys[:, :, keep : min(n_quantized, new_offset)]
            head_v = values[:, :, keep : min(n_quantized, new_offset)]
            if keep == 0:
                self.keys_packed = self.values_packed = None
            else:
                kw, vw = keep * self.key_bits // 32, keep * self.value_bits // 32
                k_codes, k_scales, k_zeros = self.keys_packed
                v_codes, v_scales, v_zeros = self.values_packed
                self.keys_packed = (_own(k_codes[..., :kw]), _own(k_scales[..., : keep // G]), _own(k_zeros[..., : keep // G]))
                self.values_packed = (_own(v_codes[..., :keep, :]), _own(v_scales[..., :keep, :]), _own(v_zeros[..., :keep, :]))
        res_len = max(0, new_offset - n_quantized)
        res_k, res_v = self.keys[:, :, :res_len], self.values[:, :, :res_len]
        if head_k is not None:
            res_k = mx.concatenate([head_k.astype(res_k.dtype), res_k], axis=2)
            res_v = mx.concatenate([head_v.astype(res_v.dtype), res_v], axis=2)
        self.keys, self.values = _own(res_k), _own(res_v)
        self.offset = new_offset
        return n

    # state: arrays, then the integers that define the cache, so mlx-lm's save/load_prompt_cache
    # (which stores `state` only, scalars included) restores a cache without its config.
    @property
    def state(self):
        k = self.keys_packed or (None, None, None)
        v = self.values_packed or (None, None, None)
        return (*k, *v, self.keys, self.values, *self._meta())

    @state.setter
    def state(self, v):
        k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros, self.keys, self.values = v[:8]
        self.keys_packed = None if k_codes is None else (k_codes, k_scales, k_zeros)
        self.values_packed = None if v_codes is None else (v_codes, v_scales, v_zeros)
        self._set_meta(v[8:])

    def _meta(self) -> tuple[int, ...]:
        return self.offset, self.key_bits, self.value_bits, self.group_size, self.residual

    def _set_meta(self, meta) -> None:
        self.offset, self.key_bits, self.value_bits, self.group_size, self.residual = map(int, meta)

    @property
    def meta_state(self):
        return tuple(map(str, self._meta()))

    @meta_state.setter
    def meta_state(self, v):
        self._set_meta(v)


# mlx-lm's load_prompt_cache looks cache classes up by name in mlx_lm.models.cache's globals.
setattr(mlx_cache, "KiviCache", KiviCache)
