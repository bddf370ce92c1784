"""KIVI (Liu et al., ICML 2024, arXiv:2402.02750): asymmetric 2-bit KV quantization, stored packed.

Keys are quantized per channel (groups of `group_size` tokens along the token axis), values per
token (groups of `group_size` channels), both with min/max asymmetric groups (paper Eq. 1, see
kvcompress/kernels/kivi_quant.py). Recent tokens stay in full precision, as the paper's Algorithm 1
(residual_policy="paper", the default):
- keys: the last T mod R keys are full precision; when R have gathered they are quantized together
  (R a multiple of group_size, so groups sit at multiples of G from position 0);
- values: exactly the last R values are full precision; each step quantizes the oldest one.
residual_policy="grouped" is this project's earlier policy, kept as a named option for comparison:
keys and values alike keep between R and R + G - 1 recent tokens, flushed a whole group at a time.
Prefilling in one shot or token by token quantizes the same positions identically in both.

Unlike a fake-quantizing cache, the codes are what is stored: keys as K^T [B, H_kv, D, T_k] packed
along tokens and values as [B, H_kv, T_v, D] packed along channels (with spare rows, into which a
decode step writes the codes of held residual values ahead of their leaving, in place: most steps
then write nothing), in MLX's quantized layout. Decode attention runs on the codes
(kvcompress/kernels/kivi_attention.py: a fused kernel on GPU, `mx.quantized_matmul` otherwise), the
residual joining the same softmax. `live_kv_bytes` is the bytes of those arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx_lm.models.cache import create_attention_mask

from ...kernels.kivi_attention import PackedSide, decode_attention, used_keys, used_values
from ...kernels.kivi_quant import BITS, GROUP_SIZES, quantize_pack
from ...errors import ConfigError, check, is_int
from ..base import CompressedCache, Method, array_bytes
from .base import PerSideBits, attends_on_codes

RESIDUAL_POLICIES = ("paper", "grouped")
VALUE_ROWS_STEP = 256  # spare value rows allocated at a time while decoding


@dataclass(frozen=True)
class Kivi(PerSideBits, Method):
    """KIVI: keys per channel, values per token, min/max groups, full-precision residual window.

    bits: code width of keys and values (2, 3, 4, 8); key_bits / value_bits override it per side
    (e.g. K4V2). group_size: tokens per key group and channels per value group (32, 64, 128; must
    divide head_dim). residual: R, the full-precision window (see the module docstring; with the
    paper's policy a positive multiple of group_size). residual_policy: "paper" (Algorithm 1) or
    "grouped" (both sides keep R..R+G-1 tokens, flushed in whole groups).
    """

    name = "kivi"
    stores_quantized = True  # an eviction method's `quantize` may name it (methods/composed.py)
    bits: int = 2
    key_bits: int | None = None
    value_bits: int | None = None
    group_size: int = 32
    residual: int = 128
    residual_policy: str = "paper"

    def __post_init__(self):
        self.check_bits(BITS)
        check(self.group_size in GROUP_SIZES, "kivi.group_size", "one of 32, 64, 128", self.group_size)
        check(self.residual_policy in RESIDUAL_POLICIES, "kivi.residual_policy", "one of 'paper', 'grouped'", self.residual_policy)
        ok = is_int(self.residual) and self.residual >= 0
        check(ok, "kivi.residual", "an int >= 0", self.residual)
        if self.residual_policy == "paper":
            ok = self.residual > 0 and self.residual % self.group_size == 0
            check(ok, "kivi.residual", f"a positive multiple of group_size ({self.group_size}) with residual_policy='paper'",
                  self.residual)

    @classmethod
    def store_params(cls, params):
        # A store gets a prompt already cut to its budget, which the paper's 128-token residual may
        # hold whole (SnapKV at 25% of a 512-token prompt keeps 96 tokens: nothing quantized, the
        # eviction's bytes and numbers; issue 48). One group instead: the handed-over keys are codes
        # up to a whole group, the values all but the newest group; the paper's policy otherwise.
        return {"residual": params.get("group_size", cls.group_size), **params}

    def layer_cache(self, layer, i, n, layout):
        if layer.head_dim % self.group_size or layer.value_dim % self.group_size:
            raise ConfigError(
                f"kivi.group_size: expected a divisor of the model's head_dim {layer.head_dim} "
                f"and value dim {layer.value_dim} (values are grouped along channels), got {self.group_size}"
            )
        return self.new_cache(i)

    def new_cache(self, i: int) -> "KiviCache":
        """An empty cache for the i-th compressed layer (the layer checked by `layer_cache`)."""
        return KiviCache(self.k_bits, self.v_bits, self.group_size, self.residual, self.residual_policy)


def _own(x: mx.array) -> mx.array:
    # a slice shares its parent's buffer; copy so the cache does not pin the whole prefill
    return mx.contiguous(x)


class KiviCache(CompressedCache):
    """Packed KIVI storage for one layer (see module docstring).

    keys_packed   = (codes [B, H, D, n_k*kb/32] uint32, scales [B, H, D, n_k/G], zeros [B, H, D, n_k/G])
    values_packed = (codes [B, H, cap, D*vb/32] uint32, scales [B, H, cap, D/G], zeros ...), first n_v rows used,
                    rows n_v .. n_values_coded - 1 the codes of residual values, written ahead
    keys, values  = the full-precision residuals [B, H, offset - n_k, D] and [B, H, offset - n_v, D]
    """

    def __init__(self, key_bits: int = 2, value_bits: int = 2, group_size: int = 32, residual: int = 128,
                 residual_policy: str = "paper"):
        if residual_policy not in RESIDUAL_POLICIES:
            raise ConfigError(f"kivi.residual_policy: expected one of 'paper', 'grouped', got {residual_policy!r}")
        if residual_policy == "paper" and (residual <= 0 or residual % group_size):
            raise ConfigError(f"kivi.residual: expected a positive multiple of group_size ({group_size}) "
                              f"with residual_policy='paper', got {residual!r}")
        self.key_bits, self.value_bits = key_bits, value_bits
        self.group_size, self.residual, self.residual_policy = group_size, residual, residual_policy
        self.keys_packed = self.values_packed = None
        self.keys = self.values = None
        self.n_keys_quantized = self.n_values_quantized = 0
        self.n_values_coded = 0  # value buffer rows holding codes: n_values_quantized plus any written ahead
        self.offset = 0

    def quantized_targets(self, offset: int) -> tuple[int, int]:
        """(keys, values) held as codes once `offset` tokens are in the cache."""
        R, G = self.residual, self.group_size
        if self.residual_policy == "paper":
            return offset - offset % R, max(0, offset - R)
        aged = max(0, offset - R) // G * G
        return aged, aged

    def _append_values(self, new: tuple, n: int) -> None:
        """Write n new value rows after the used ones; grow by VALUE_ROWS_STEP spare rows when full
        (a prefill allocates exactly), so decoding writes its codes in place (`_code_ahead`)."""
        used = self.n_values_quantized
        if self.values_packed is not None and used + n <= self.values_packed[0].shape[2]:
            for buffer, rows in zip(self.values_packed, new):
                buffer[:, :, used : used + n, :] = rows
            return
        spare = VALUE_ROWS_STEP if self.values_packed is not None else 0
        grown = []
        for i, rows in enumerate(new):
            parts = [self.values_packed[i][:, :, :used]] if self.values_packed is not None else []
            parts.append(rows)
            if spare:
                parts.append(mx.zeros((*rows.shape[:2], spare, rows.shape[3]), dtype=rows.dtype))
            grown.append(mx.concatenate(parts, axis=2) if len(parts) > 1 else rows)
        self.values_packed = tuple(grown)

    def _code_ahead(self, held, leaving: int) -> None:
        """Codes for the first `leaving` values of the held residual `held`, written into the value
        buffer past the used rows. Values are quantized per token, so a value's codes do not depend
        on when they are made: this quantizes every held value the buffer's spare rows have room for,
        and the steps after find the codes of their leaving value already written (the paper's
        policy: one quantize-and-write per up to R steps instead of one per step, same codes). The
        buffer grows exactly when and as it did when each value was quantized on leaving (so
        `live_kv_bytes` is unchanged): when the leaving values do not fit."""
        used, coded = self.n_values_quantized, self.n_values_coded
        capacity = 0 if self.values_packed is None else self.values_packed[0].shape[2]
        end = min(held.shape[2], capacity - used)  # held values the buffer has rows for
        bits, G = self.value_bits, self.group_size
        if end < leaving:
            self._append_values(quantize_pack(held[:, :, :leaving], bits, G, per_channel=False), leaving)
            self.n_values_coded = used + leaving
            return
        new = quantize_pack(held[:, :, coded - used : end], bits, G, per_channel=False)
        for buffer, rows in zip(self.values_packed, new):
            buffer[:, :, coded : used + end, :] = rows
        self.n_values_coded = used + end

    def update_and_fetch(self, keys, values):
        # keys, values: [B, H_kv, S, D] post-RoPE. Returns (keys, values) as `PackedSide`s for
        # `attention`. A decode step (S == 1) sees the cache after this step's flush, as the paper's
        # Algorithm 1; a longer chunk sees itself in full precision (as KIVI's prefill does).
        S = keys.shape[2]
        res_k = keys if self.keys is None else mx.concatenate([self.keys, keys], axis=2)
        self.offset += S
        target_k, target_v = self.quantized_targets(self.offset)
        n_v = target_v - self.n_values_quantized  # values that leave the residual now
        before = None
        if S == 1 and self.values is not None and n_v <= self.values.shape[2]:
            # decode: the leaving values are the oldest held ones (the paper's policy: one per step),
            # usually with their codes already written (`_code_ahead`); the rest and the new token
            # are joined in one copy (not a copy of residual + token, then a slice and a second copy)
            held = self.values
            if n_v > 0:
                if target_v > self.n_values_coded:
                    self._code_ahead(held, n_v)
                self.n_values_quantized = target_v
                held = held[:, :, n_v:]
            res_v = mx.concatenate([held, values], axis=2)
        else:
            res_v = values if self.values is None else mx.concatenate([self.values, values], axis=2)
            if S > 1:
                before = (PackedSide(self.keys_packed, self.n_keys_quantized, res_k),
                          PackedSide(self.values_packed, self.n_values_quantized, res_v))
            if n_v > 0:
                self._append_values(quantize_pack(res_v[:, :, :n_v], self.value_bits, self.group_size, per_channel=False),
                                    n_v)
                res_v = _own(res_v[:, :, n_v:])
                self.n_values_quantized = self.n_values_coded = target_v
        if target_k > self.n_keys_quantized:
            n = target_k - self.n_keys_quantized
            new = quantize_pack(res_k[:, :, :n], self.key_bits, self.group_size, per_channel=True)
            if self.keys_packed is None:
                self.keys_packed = new
            else:  # keys grow along their last (token) axis; a flush is R tokens, every R steps
                self.keys_packed = tuple(mx.concatenate([a, b], axis=-1) for a, b in zip(self.keys_packed, new))
            res_k = _own(res_k[:, :, n:])
            self.n_keys_quantized = target_k
        self.keys, self.values = res_k, res_v
        if before is not None:
            return before
        return (PackedSide(self.keys_packed, self.n_keys_quantized, res_k),
                PackedSide(self.values_packed, self.n_values_quantized, res_v))

    def attention(self, queries, keys: PackedSide, values: PackedSide, scale, mask, sinks=None):
        # queries [B, H_q, L, D]; keys/values: the sides update_and_fetch returned; sinks [H_q] or None
        if attends_on_codes(queries, keys.residual.shape[1], sinks):  # decode: attention on the codes
            return decode_attention(queries, keys, values, scale, mask, self.key_bits, self.value_bits, self.group_size)
        # a prefill chunk: its own tokens dominate the work, so dequantize the codes once and use
        # MLX's fused attention (GQA and masks handled there) instead of many-row quantized matmuls.
        # Attention sinks (GPT-OSS) take this path at every step: the codes kernels have no sink
        # logit, and the same dequantized keys and values give the same attention
        k, v = self._dequantize_sides(keys, values)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)

    def _dequantize_sides(self, keys: PackedSide, values: PackedSide) -> tuple[mx.array, mx.array]:
        G = self.group_size
        k, v = [keys.residual], [values.residual]
        if keys.n_packed:
            k.insert(0, mx.dequantize(*used_keys(keys, self.key_bits, G), group_size=G, bits=self.key_bits)
                     .swapaxes(-1, -2).astype(keys.residual.dtype))
        if values.n_packed:
            v.insert(0, mx.dequantize(*used_values(values), group_size=G, bits=self.value_bits).astype(values.residual.dtype))
        return (mx.concatenate(k, axis=2) if len(k) > 1 else k[0]), (mx.concatenate(v, axis=2) if len(v) > 1 else v[0])

    def _sides(self) -> tuple[PackedSide, PackedSide]:
        return (PackedSide(self.keys_packed, self.n_keys_quantized, self.keys),
                PackedSide(self.values_packed, self.n_values_quantized, self.values))

    def dequantized(self) -> tuple[mx.array, mx.array]:
        """Keys and values [B, H, T, D] as attention sees them: dequantized codes + residual."""
        return self._dequantize_sides(*self._sides())

    def make_mask(self, N, return_array=False, window_size=None):
        # every token is kept (as codes or residual), in order: plain causal over offset + N keys
        return create_attention_mask(N, self.offset, return_array, window_size)

    @property
    def tokens_kept(self) -> int:
        return self.offset

    @property
    def quantized_tokens(self) -> int:
        # keys and values leave the residual at different times: a token counts once either is codes
        return max(self.n_keys_quantized, self.n_values_quantized)

    @property
    def live_kv_bytes(self) -> int:
        # resident bytes, the value rows allocated ahead included
        packed = (self.keys_packed or ()) + (self.values_packed or ())
        return array_bytes(*packed, self.keys, self.values)

    def empty(self):
        return self.keys is None

    def is_trimmable(self):
        return True

    def trim(self, n):
        """Drop the last n tokens and restore the policy's split for the new length. Codes past it
        return to the residual dequantized (their original precision is gone) and are quantized
        again by a later flush."""
        n = min(self.offset, n)
        if n == 0:
            return 0
        new_offset = self.offset - n
        target_k, target_v = self.quantized_targets(new_offset)  # never more than held now
        keys, values = self.dequantized()
        G, kb = self.group_size, self.key_bits
        if target_k == 0:
            self.keys_packed = None
        elif target_k < self.n_keys_quantized:
            codes, scales, zeros = self.keys_packed
            self.keys_packed = (_own(codes[..., : target_k * kb // 32]), _own(scales[..., : target_k // G]),
                                _own(zeros[..., : target_k // G]))
        if target_v == 0:
            self.values_packed = None
        elif target_v < self.n_values_quantized:
            self.values_packed = tuple(_own(a[:, :, :target_v]) for a in self.values_packed)
        self.keys = _own(keys[:, :, target_k:new_offset].astype(self.keys.dtype))
        self.values = _own(values[:, :, target_v:new_offset].astype(self.values.dtype))
        self.n_keys_quantized, self.n_values_quantized, self.offset = target_k, target_v, new_offset
        self.n_values_coded = target_v
        return n

    # state: arrays (the used value rows only), then the values that define the cache, so
    # mlx-lm's save/load_prompt_cache (which stores `state` only, scalars included) restores a
    # cache without its config.
    @property
    def state(self):
        k = self.keys_packed or (None, None, None)
        v = (None, None, None) if self.values_packed is None else used_values(self._sides()[1])
        return (*k, *v, self.keys, self.values, *self._meta())

    @state.setter
    def state(self, v):
        k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros, self.keys, self.values = v[:8]
        self.keys_packed = None if k_codes is None else (k_codes, k_scales, k_zeros)
        self.values_packed = None if v_codes is None else (v_codes, v_scales, v_zeros)
        self._set_meta(v[8:])
        self.n_keys_quantized = 0 if k_codes is None else k_codes.shape[-1] * 32 // self.key_bits
        self.n_values_quantized = self.n_values_coded = 0 if v_codes is None else v_codes.shape[2]

    def _meta(self) -> tuple:
        return self.offset, self.key_bits, self.value_bits, self.group_size, self.residual, self.residual_policy

    def _set_meta(self, meta) -> None:
        self.offset, self.key_bits, self.value_bits, self.group_size, self.residual = map(int, meta[:5])
        self.residual_policy = str(meta[5])

    @property
    def meta_state(self):
        return tuple(map(str, self._meta()))

    @meta_state.setter
    def meta_state(self, v):
        self._set_meta(v)


# mlx-lm's load_prompt_cache looks cache classes up by name in mlx_lm.models.cache's globals.
setattr(mlx_cache, "KiviCache", KiviCache)
