"""Eviction x quantization (issue 40): an eviction method's kept tokens stored by a quantizer.

Every eviction method takes `quantize`, a quantizer config (any method with `stores_quantized`:
KIVI, TurboQuant, QJL), given as a mapping (`quantize={"name": "kivi", "bits": 4}`) or a config. The
run config and id carry the quantizer's full configuration (configs without it keep their ids); the
label names both ("snapkv budget=0.5 + kivi bits=4"); `bits` in the grid columns is the quantizer's.

Semantics, as kvpress's presses over a QuantizedCache (a press compresses the prompt once, decoding
then appends to the quantized cache): the eviction cache holds the prompt in full precision, scores
it and selects once, as without `quantize` (the same kept positions); then its kept tokens, each row
in temporal order, move into the quantizer's cache as one multi-token update, and the eviction
cache's arrays are released. Every later call (decode steps, a question appended in one call)
appends to the quantizer's cache. So the prompt's own attention is full precision: in mlx-lm's
generate, the prompt's last token (fed alone) too, as the eviction cache compresses after it.

Refused with a ConfigError: methods whose kept set changes while decoding (H2O, Keyformer, TOVA,
StreamingLLM; KNorm and random with decoding="evict": `evicts_while_decoding`). Evicting one token
from KIVI's packed groups would re-quantize its group (every other token's codes change) or leave a
hole the group's scales still span; neither is the paper's method nor exact, so they are not built.
Quantizers that cannot be a store are refused naming why (`store_refusal`): KVQuant un-rotates each
stored key by its slot index to quantize it pre-RoPE, and a store's slots are not the kept tokens'
positions; mlx-quant is mlx-lm's own QuantizedKVCache, with no `attention` taking a mask over its slots.

Positions: keys keep their rotation at their true positions (only "exact" methods decode without
eviction); `offset` is the true position of the next token, while the quantizer holds fewer tokens.
The model's mask is for the model's own cache length, so attention builds its own over the
quantizer's slots, as the eviction cache does: every held token precedes the new queries except
the call's own tokens, causal among themselves (None for one query, "causal" for several: what
mlx-lm passes a plain quantizer cache). Head-wise budgets (AdaKV) give rows of different lengths:
short rows end in padding slots (eviction.PAD), which a per-row boolean mask from the kept
positions keeps every query off (KIVI then attends through its reference path on the codes, which
takes any mask; QJL's attention is a masked softmax over its codes). A padding slot holds a copy of
its row's last kept token, so KIVI's per-channel key groups and the outlier channels QJL picks per
group of 32 tokens see kept tokens' values only (the copies weigh the last one more).

The store quantizes the handed-over rows by its own rules, as it would a prompt of that length,
with one default of its own where the quantizer's would quantize nothing (issue 48): a
full-precision window of one group (`store_params`). KIVI's paper residual of 128 tokens, and
QJL's 128-token buffer, hold a budget's kept tokens whole up to 128 (SnapKV at 25% of a 512-token
prompt keeps 96: no token quantized, the eviction's numbers in more bytes); given as a mapping
without `residual` (KIVI) or `buffer` (QJL), the store's is `group_size` (32): KIVI then codes the
kept keys in whole groups and all values but the newest group, QJL its keys in whole buffers of 32
and values once older than the last 32. A `residual` / `buffer` given, or a quantizer config object,
is taken as it is. `quantized_tokens` says how many tokens a layer holds as codes (the runner
records it, runs.quantized_tokens, and warns when it is 0 after the prompt; the reports mark such
a config, sql/pareto.sql). QJL's layers' sketch sizes go by the compressed-layer index, as
without eviction (by default the first 15 layers: 512 / 128 bits).

Resident bytes: the quantizer cache's arrays (codes, scales, norms, residual) plus the kept prompt
positions [B * H_kv, n] int32 this cache holds (evidence, and the padding mask).
"""

from __future__ import annotations

import json

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import create_attention_mask

from ..adapter import model_layout
from .base import CompressedCache
from .eviction.base import PAD, Eviction, EvictionCache


def compose(config: Eviction, model, caches: list) -> None:
    """Wrap the eviction caches `config.make_cache` put on its layers with the quantizer's caches, in
    place. ConfigError, before any work, where the quantizer cannot serve a layer."""
    layout = model_layout(model)
    targets = layout.targets(config.name, config.layers)
    for i, layer in enumerate(targets):
        store = config.quantize.layer_cache(layer, i, len(targets), layout)
        caches[layer.index] = ComposedCache(caches[layer.index], store, i)


class ComposedCache(CompressedCache):
    """One layer: an `EvictionCache` until the prompt is compressed, then a quantizer cache (the store)
    holding the kept tokens and everything after them (see the module docstring)."""

    def __init__(self, eviction: EvictionCache, store: CompressedCache, index: int):
        self.eviction = eviction  # None once the kept tokens moved into the store
        self.store = store
        self.index = index  # the i-th compressed layer (the quantizer's per-layer seed)
        self.prompt_positions = None  # [R, n] int32: true positions of the kept prompt tokens (PAD: padding)
        self.padded = False
        self.position = 0  # true position of the next token, once compressed
        self.batch = 0
        self._capacity = None

    @property
    def offset(self) -> int:
        return self.eviction.offset if self.eviction is not None else self.position

    @property
    def capacity(self) -> int | None:
        """Tokens per row the budget resolved to (None before the prompt is complete)."""
        return self.eviction.capacity if self.eviction is not None else self._capacity

    # -- mlx-lm protocol ------------------------------------------------------------------------

    def update_and_fetch(self, keys, values):
        # keys, values: [B, H_kv, S, D] post-RoPE at true positions offset .. offset + S - 1
        if self.eviction is not None:
            return self.eviction.update_and_fetch(keys, values)
        self.position += keys.shape[2]
        return self.store.update_and_fetch(keys, values)

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        # queries [B, H_q, S, D]; keys/values: what update_and_fetch returned. `mask` is the model's
        # causal mask, rebuilt here over the store's slots (module docstring)
        if self.eviction is not None:
            out = self.eviction.attention(queries, keys, values, scale, mask, sinks=sinks)
            if self.eviction.prompt_len is not None:  # the call that completed (and compressed) the prompt
                self._hand_over()
            return out
        return self.store.attention(queries, keys, values, scale, self._mask(queries.shape), sinks=sinks)

    def from_prefill(self, keys, values, queries=None):
        # keys, values [B, H_kv, T, D] post-RoPE at 0..T-1; queries [B, H_q, T, D] or None
        self.eviction.from_prefill(keys, values, queries)
        self._hand_over()

    def _hand_over(self):
        """Move the eviction cache's kept tokens into the store, each row in temporal order."""
        ev = self.eviction
        R = ev.keys.shape[0]
        positions = ev.kept_positions()  # [R, n]; no free slot: these methods never evict again
        keys, values = ev.keys, ev.values  # [R, n, D]
        self.padded = ev.padded
        if self.padded:
            # padding last (PAD sorts after every position), kept tokens in temporal order; a padding
            # slot takes its row's last kept token (so KIVI's key groups span kept values only)
            order = mx.argsort(positions, axis=1)
            positions = mx.take_along_axis(positions, order, axis=1)
            last = (positions != PAD).sum(axis=1, keepdims=True) - 1  # [R, 1]
            order = mx.take_along_axis(order, mx.minimum(mx.arange(positions.shape[1])[None], last), axis=1)
            keys = mx.take_along_axis(keys, order[..., None], axis=1)
            values = mx.take_along_axis(values, order[..., None], axis=1)
        B = ev.batch
        shape = (B, R // B, keys.shape[1], keys.shape[2])
        self.store.update_and_fetch(keys.reshape(shape), values.reshape(shape))
        self.store.forget_call()  # no attention follows: later calls see these tokens as codes
        self.prompt_positions = mx.contiguous(positions)
        self.position, self.batch, self._capacity = ev.position, B, ev.capacity
        self.eviction = None
        mx.eval(self.prompt_positions, [a for a in self.store.state if isinstance(a, mx.array)])

    def _mask(self, query_shape):
        """The mask over the store's T slots for S new queries (the store's last S slots)."""
        B, n_q, S, _ = query_shape
        if not self.padded:
            return None if S == 1 else "causal"
        T = self.store.offset
        R, n = self.prompt_positions.shape
        H = R // B
        valid = self.prompt_positions != PAD  # [R, n]
        if T > n:  # tokens appended after the prompt: all real
            valid = mx.concatenate([valid, mx.ones((R, T - n), mx.bool_)], axis=1)
        valid = valid.reshape(B, H, 1, 1, T)
        if S > 1:
            valid = valid & (mx.arange(T - S, T)[:, None] >= mx.arange(T)[None])  # [S, T] causal, bottom-right
        return mx.broadcast_to(valid, (B, H, n_q // H, S, T)).reshape(B, n_q, S, T)

    def make_mask(self, N, return_array=False, window_size=None):
        # attention() builds its own mask; this is what a caller that asks gets (slot count, causal)
        if self.eviction is not None:
            return self.eviction.make_mask(N, return_array, window_size)
        return create_attention_mask(N, self.store.offset, return_array, window_size)

    def empty(self):
        return self.eviction is not None and self.eviction.empty()

    def attach(self, layer) -> None:
        if self.eviction is not None:
            self.eviction.attach(layer)
        self.store.attach(layer)

    # -- what it holds --------------------------------------------------------------------------

    @property
    def tokens_kept(self) -> int:
        """Tokens held per row (padding slots count: they are resident)."""
        return self.eviction.tokens_kept if self.eviction is not None else self.store.tokens_kept

    @property
    def quantized_tokens(self) -> int:
        """Tokens per row the store holds as codes (0 before the hand-over). 0 after it: every kept
        token fits the quantizer's full-precision window, so this layer holds what the eviction
        alone would, in more bytes (the store's defaults avoid it: `quantizer_config`)."""
        return 0 if self.eviction is not None else self.store.quantized_tokens

    @property
    def live_kv_bytes(self) -> int:
        if self.eviction is not None:
            return self.eviction.live_kv_bytes
        return self.store.live_kv_bytes + self.prompt_positions.nbytes

    def kept_positions(self) -> mx.array:
        """True positions [B * H_kv, n] of the store's slots (PAD: a padding slot)."""
        if self.eviction is not None:
            return self.eviction.kept_positions()
        R, n = self.prompt_positions.shape
        appended = self.store.offset - n  # tokens after the prompt, at the last positions
        if not appended:
            return self.prompt_positions
        later = mx.broadcast_to(mx.arange(self.position - appended, self.position, dtype=mx.int32), (R, appended))
        return mx.concatenate([self.prompt_positions, later], axis=1)

    def held_kv(self) -> tuple[mx.array, mx.array]:
        """Keys and values [B, H_kv, n, D] as attention sees them (the store's dequantized)."""
        return self.eviction.held_kv() if self.eviction is not None else self.store.dequantized()

    # -- save / load: the eviction cache's state before compression, the store's after, then one JSON

    @property
    def state(self):
        if self.eviction is not None:
            return [*self.eviction.state, self.meta_state]
        return [*self.store.state, self.prompt_positions, self.meta_state]

    @state.setter
    def state(self, v):
        self.meta_state = v[-1]
        if self.phase == "prompt":
            self.eviction = EvictionCache.from_state(list(v[:-1]))
            self.store = self.eviction.config.quantize.new_cache(self.index)
        else:
            self.eviction = None
            self.store = getattr(mlx_cache, self.store_class).from_state(list(v[:-2]))
            self.prompt_positions = v[-2]

    @property
    def meta_state(self) -> str:
        fields = ("index", "padded", "position", "batch", "_capacity")
        return json.dumps({"phase": "prompt" if self.eviction is not None else "store",
                           "store_class": type(self.store).__name__, **{f: getattr(self, f) for f in fields}})

    @meta_state.setter
    def meta_state(self, v):
        for field, value in json.loads(v).items():
            setattr(self, field, value)
        if not hasattr(self, "prompt_positions"):  # restored by from_state
            self.prompt_positions = None


# mlx-lm's load_prompt_cache looks cache classes up by name in mlx_lm.models.cache's globals.
setattr(mlx_cache, "ComposedCache", ComposedCache)


Eviction.compose = staticmethod(compose)  # Eviction.make_cache calls it where `quantize` is set
