"""Score-then-select eviction: the base every eviction method (H2O, Keyformer, SnapKV, ...) builds on.

A method is a frozen config with a budget and a few score hooks; `EvictionCache` does everything
else, batched over rows = (batch, KV head) pairs: keys/values [R, n, D], scores and true positions
[R, n], tokens in temporal order.

How a method scores, as kvpress's `score()`, is one of four decode modes:
- "accumulate" (H2O, Keyformer): a key's score is the sum over queries of softmax(transform(logits)).
  The prompt is scored in bounded memory (prompt_scores.py); each decode step adds its query's share.
- "replace" (TOVA): the score is recomputed from the current query alone (`score_step`).
- "fixed" (StreamingLLM, KNorm, random): each token gets a score once, when it arrives (`score_new`).
- "grow" (SnapKV, PyramidKV, AdaKV, KeyDiff, Expected Attention, CriticalKV): the prompt is scored
  once (`score_prompt`, from its keys and values and what `summarize_queries` kept of its queries:
  the last `window()` by default), compressed, and decoded tokens are appended without eviction
  (as the papers). KVzip scores the prompt by a second pass of the model over it (`reconstructs`:
  kvcompress/reconstruct.py drives it; the cache attends the pass's tokens, scores with their
  queries, `score_chunk`, holds none of them, then selects).

Life of a cache. Prefill keeps every token (full causal attention, however mlx-lm chunks the
prompt); "accumulate" methods score each chunk as it comes, the others summarize its queries
(`summarize_queries`). The first single-token call is the prompt's last query (mlx-lm's generate feeds it alone):
after it the cache resolves the budget to `capacity` tokens per row (and `recent`, the protected
window), scores the prompt and selects: the first `n_sink` and newest `recent` tokens are kept, then
the highest-scoring rest. Each later step adds the new token, updates scores, and evicts the lowest
unprotected token per row (kvcompress/kernels/evict.py). The sweep's `from_prefill` reaches the same
state from a finished full prefill (tested: same positions, same scores).

Tokens that come in a multi-token call after the prompt was compressed (the question part of the
query-agnostic protocol, a new chat turn) are appended without eviction, as kvpress appends the
question to every press's compressed context: the scores still see their queries, and a method that
evicts while decoding then holds `held_limit` = the tokens held when the answer starts (the budget
plus those tokens), evicting from the first generated token on. `answer_start` is the position of
the first generated token (Keyformer's temperature schedule counts from it).

Positions: "exact" keeps every key rotated at its true position and `offset` is the true position;
"compact" re-rotates survivors to slots 0..n-1 and reports `offset = n` (StreamingLLM-style), with
RoPE rotations read off the model's own module. A method may give rows different lengths (AdaKV):
short rows are padded with slots at position PAD, which no query ever sees.

Memory layout. Keys, values, scores and positions live in buffers of `allocated >= length` slots;
slots [0, length) are in use and the arrays methods read (`keys`, `scores`, ...) are views of them.
A decode step writes its token into the key and value buffers in place (MLX updates a buffer in
place when nothing else references it; measured on CPU: a one-token scatter into a [32, 8192, 64]
float32 buffer costs 0.08 ms, the same scatter with a second reference alive 44 ms, a full copy), so:
- exact positions (one pass): the step that evicts a row's token leaves its slot `free`; the next
  step writes its token into that slot. Between steps a cache holds `capacity` tokens in
  `capacity + 1` slots; a step moves one token per row and the slots are in no particular order
  (attention, scores and protection go by true position; `kept_rows` sorts).
  StreamingLLM (`score_is_position`) evicts the oldest non-sink token, the same slot in every row of
  an unpadded cache: the non-sink slots in a ring, oldest first. The host derives the ring once (one
  read of positions and scores, checked) and then advances it as Python ints, so a step writes with
  slice assignments and runs no `evict_slot`, index arrays or arange/astype; padded caches, compact
  positions and every other method keep the kernel path.
- compact positions: eviction shifts and re-rotates every later key (O(n) by nature), as before.
- "grow" methods append into spare room allocated GROW_STEP slots at a time (as mlx-lm's KVCache).
- while decoding on CUDA, key and value buffers are allocated in multiples of KV_ALIGN slots (see there).

Save/load: `state` holds the arrays, what the pending compression needs of the prompt's queries
(`query_summary`: a saved prompt, or a decoding cache between compressions, compresses at its next
call exactly as the original would) and one JSON string with everything else, so mlx-lm's
`save_prompt_cache` writes it; mlx-lm's `load_prompt_cache` finds classes by name in
`mlx_lm.models.cache` only, so importing this module registers `EvictionCache` there. Modules cannot
be saved: `kvcompress.load_prompt_cache(path, model)` gives the layer's RoPE and output projection
back (`attach`). Loaded without the model, a cache whose layer has a RoPE holds `MissingRope`, which
raises where the RoPE is needed (compact positions, Expected Attention's pending compression)
instead of computing as if the layer had none.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import create_attention_mask

from ...adapter import POSITIONAL_ROPES, AttentionLayer, ModelLayout, positional_rope, rope_rotations
from ...attention import install
from ...errors import ConfigError, build, check, is_int
from ...kernels.evict import evict_one, evict_slot, rotate_pairs
from ...kernels.scored_attention import EvictAt, free_slot_zeroed, fuses, scored_attention
from ...kernels.scored_attention import shape_supported as scored_attention_supported
from ..base import CompressedCache, Method, array_bytes, budget_tokens, check_budget
from ..registry import REGISTRY, method_config
from .scoring.prompt_scores import accumulated_attention, folded_logits

DECODE_MODES = ("accumulate", "replace", "fixed", "grow")
POSITION_MODES = ("exact", "compact")
PAD = 2**31 - 1  # position of a padding slot: after every query, so causally invisible
GROW_STEP = 256  # slots a "grow" cache allocates at a time while decoding
# Decoding on MLX's CUDA back-end, the key and value buffers hold a multiple of KV_ALIGN slots, and
# attention reads the slots in use as a slice of them: MLX's CUDA SDPA runs a one-query step through
# cuDNN only for such a slice (mlx-lm's KVCache allocates in 256-token steps), else through its own
# kernel, measured 2.7x slower on the H200 at 16k slots (docs/learned.md). Spare
# slots are not counted as held (`tokens_kept`, `live_kv_bytes`), as mlx-lm's allocation steps are not.
KV_ALIGN = 256


# -- a quantizer that stores the kept tokens (methods/composed.py) ---------------------------------


def quantizers() -> dict[str, type[Method]]:
    """The registered methods that can store an eviction method's kept tokens."""
    return {name: cls for name, cls in REGISTRY.items() if cls.stores_quantized}


def prompt_once_methods() -> list[str]:
    """The eviction methods that compress the prompt once and never evict while decoding."""
    return sorted(name for name, cls in REGISTRY.items()
                  if issubclass(cls, Eviction) and not cls().evicts_while_decoding and not cls().scoring().reconstructs)


def refusal(value: Any) -> str:
    """Why the quantizer `value` (a config or a mapping naming one) cannot store an eviction method's
    kept tokens, where it is a registered quantizer that says so ("" otherwise)."""
    name = type(value).name if isinstance(value, Method) else value.get("name") if isinstance(value, dict) else None
    cls = REGISTRY.get(name) if isinstance(name, str) else None
    return f"{name} cannot store an eviction method's kept tokens: {cls.store_refusal}" if cls and cls.store_refusal else ""


def quantizer_config(owner: Eviction, value: Any) -> Method | None:
    """`owner.quantize` validated into a quantizer config (None stays None); ConfigError naming
    `<method>.quantize...` and the allowed values."""
    if value is None:
        return None
    field, allowed = f"{owner.name}.quantize", quantizers()
    refused = refusal(value)
    if refused:
        raise ConfigError(f"{field}.name: {refused}; expected one of {sorted(allowed)}")
    if isinstance(value, Method):
        if type(value).name not in allowed:
            raise ConfigError(f"{field}: expected a quantizer config, one of {sorted(allowed)}, got {value.label()!r}")
        config = value
    elif isinstance(value, dict):
        if "name" not in value:
            raise ConfigError(f"{field}.name: expected one of {sorted(allowed)}, got no name in {value!r}")
        params = {k: v for k, v in value.items() if k != "name"}
        if value["name"] in allowed:  # a store's own defaults (KIVI's residual: one group), where unset
            params = allowed[value["name"]].store_params(params)
        try:
            config = build(f"{field}.name", allowed, value["name"], params)
        except ConfigError as exc:
            message = str(exc)
            raise ConfigError(message if message.startswith(field) else f"{field}: {message}") from None
        except TypeError as exc:
            raise ConfigError(f"{field}: {exc}") from None
    else:
        raise ConfigError(f"{field}: expected a mapping such as {{'name': 'kivi', 'bits': 4}} or None, got {value!r}")
    if config.layers != "global":
        raise ConfigError(f"{field}.layers: the eviction method's own `layers` says which layers are compressed; "
                          f"expected it unset, got {config.layers!r}")
    if owner.evicts_while_decoding:
        raise ConfigError(
            f"{field}: {owner.name} evicts while decoding, and a token cannot be evicted from quantized storage "
            f"exactly (KIVI packs keys in groups of tokens); expected None, or a method that compresses the prompt "
            f"once: one of {prompt_once_methods()} (as configured by default)")
    if owner.scoring().reconstructs:  # the pass runs in kvcompress.compress_prompt over EvictionCaches only
        raise ConfigError(
            f"{field}: {owner.scoring().name} selects after a reconstruction pass over the prompt, which a "
            f"composed cache does not run (not built yet); expected None, or one of {prompt_once_methods()}")
    return config


@dataclass(frozen=True)
class Eviction(Method):
    """Base config. Subclasses declare the knobs they have as fields (with their paper's defaults);
    a knob a method lacks keeps the class default below and is neither a field nor in its label."""

    budget: int | float = 0.5  # tokens kept per row (int) or a fraction of the prompt (float)
    recent = 0  # protected recent window: tokens (int) or a fraction of the budget (float < 1)
    n_sink = 0  # protected first tokens
    positions = "exact"
    decode: ClassVar[str] = "accumulate"
    # A token's "fixed" score is its true position (StreamingLLM), so the lowest-ranked unprotected
    # token is always the oldest one: an exact-position cache then evicts in ring order, tracked on
    # the host (EvictionCache._ring_slot), and writes a new token's score as a Python float.
    score_is_position: ClassVar[bool] = False
    # Set by methods that read the layer's attention output projection W_o (CriticalKV, KVzip+): their
    # caches get it from `make_cache` and, loaded, from `kvcompress.load_prompt_cache(path, model)`.
    reads_output_projection: ClassVar[bool] = False
    # A quantizer that stores the kept tokens (methods/composed.py): a mapping {"name": "kivi", "bits": 4,
    # ...} or a quantizer config, held as the validated config; None keeps them in full precision.
    # Keyword-only, as `layers`.
    quantize: Any = field(default=None, kw_only=True)
    # Wraps the eviction caches with the quantizer's, in place: methods/composed.py's `compose`, set there,
    # as the composition builds on this module (a lower module does not import a higher one).
    compose: ClassVar[Callable[[Eviction, Any, list], None]]

    def __post_init__(self):
        n = self.name
        object.__setattr__(self, "quantize", quantizer_config(self, self.quantize))
        check_budget(f"{n}.budget", self.budget)
        recent_ok = (is_int(self.recent) and self.recent >= 0) or (isinstance(self.recent, float) and 0.0 <= self.recent < 1.0)
        check(recent_ok, f"{n}.recent", "a token count >= 0 or a budget fraction in [0, 1)", self.recent)
        check(is_int(self.n_sink) and self.n_sink >= 0, f"{n}.n_sink", "an int >= 0", self.n_sink)
        check(self.positions in POSITION_MODES, f"{n}.positions", f"one of {POSITION_MODES}", self.positions)
        if is_int(self.budget):  # a token budget is checked now, a fraction once the prompt is known
            _, recent = self._budget_and_recent(self.budget)
            # it must leave a scored token at any prompt its protected window does not cover
            if shortfall := self.window_shortfall(self.budget + self.n_sink + recent + 2):
                raise ConfigError(shortfall)
            self.resolve(self.budget)  # a subclass's own checks (decoding's target_size)

    @property
    def evicts_while_decoding(self) -> bool:
        return self.decode != "grow"

    # -- identity with a quantizer (methods/composed.py) -------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The full configuration; `quantize` only where set (so configs without it keep their run ids),
        as the quantizer's own full configuration."""
        config = super().to_dict()
        if self.quantize is None:
            del config["quantize"]
        else:
            config["quantize"] = {k: v for k, v in self.quantize.to_dict().items() if k != "layers"}
        return config

    def label(self) -> str:
        """The method's label, then the quantizer's: "snapkv budget=0.5 + kivi bits=4"."""
        if self.quantize is None:
            return super().label()
        return f"{replace(self, quantize=None).label()} + {self.quantize.label()}"

    def revisions(self) -> dict[str, int]:
        quantizer = self.quantize.revision if self.quantize is not None else 0
        return {**super().revisions(), **({"quantize_revision": quantizer} if quantizer else {})}

    def grid_columns(self) -> dict[str, float | None]:
        columns = super().grid_columns()
        if self.quantize is not None:  # budget from the eviction, bits from the quantizer
            columns["bits"] = self.quantize.grid_columns()["bits"]
        return columns

    # -- budget --------------------------------------------------------------------------------

    def resolve(self, prompt_tokens: int, layer: int = 0, n_layers: int = 1) -> tuple[int, int]:
        """(capacity, recent) in tokens for one layer.

        The protected tokens (the first `n_sink` and the newest `recent`) are always kept, with room
        for at least one scored token (an evicting step needs one it may drop): a fractional budget
        that resolves to no more than them (a short prompt) is raised to n_sink + recent + 1 tokens.
        So a prompt the budget or the protected window covers is kept whole, never refused (kvpress
        treats these as no compression); `window_shortfall` says where a budget is raised (a sweep
        refuses such cells up front, kvcompress/sweep.py)."""
        capacity, recent = self._budget_and_recent(prompt_tokens)
        capacity = max(capacity, self.n_sink + recent + 1)
        if capacity >= prompt_tokens:  # nothing to compress in any layer (as PyramidKV's code)
            return capacity, recent
        return self.layer_capacity(capacity, recent, layer, n_layers, prompt_tokens), recent

    def _budget_and_recent(self, prompt_tokens: int) -> tuple[int, int]:
        capacity = budget_tokens(self.budget, prompt_tokens)
        return capacity, round(self.recent * capacity) if isinstance(self.recent, float) else self.recent

    def window_shortfall(self, prompt_tokens: int) -> str:
        """Why the budget leaves no scored token beside the protected ones at a prompt of
        `prompt_tokens` ("" where it leaves one, or where the protected window covers the prompt):
        `resolve` then keeps more than the budget."""
        capacity, recent = self._budget_and_recent(prompt_tokens)
        if capacity > self.n_sink + recent or self.n_sink + recent + 1 >= prompt_tokens:
            return ""
        return (f"{self.name}.budget: expected more tokens than n_sink + recent = {self.n_sink} + {recent} "
                f"(room for at least one scored token), got {self.budget!r} = {capacity} tokens"
                + (f" of a {prompt_tokens}-token prompt" if isinstance(self.budget, float) else ""))

    def layer_capacity(self, capacity: int, recent: int, layer: int, n_layers: int, prompt_tokens: int) -> int:
        """Layer-wise budgets (PyramidKV) override this; the mean over layers stays `capacity`, and
        no layer's exceeds the prompt."""
        return capacity

    # -- score hooks (see the module docstring) ------------------------------------------------

    def scoring(self) -> "Eviction":
        """The config whose score hooks rank tokens (AdaKV delegates to another method)."""
        return self

    def window(self) -> int:
        """How many of the prompt's last queries `score_prompt` needs."""
        return 0

    def linear_scores(self, scores: mx.array) -> mx.array:
        """`score_prompt`'s scores as the quantity they rank (a method that combines them arithmetically,
        CriticalKV, needs it): themselves, unless a method scores in logs (Expected Attention)."""
        return scores

    def summarize_queries(self, cache, summary, queries):
        """"replace" / "grow": what `score_prompt` gets of the prompt's queries, updated with the next
        chunk of them, queries [R, G, S, D] post-RoPE at positions cache.position - S .. cache.position - 1
        (summary None before the first chunk). Here: the last `window()` queries [R, G, <= window, D];
        Expected Attention keeps running moments instead."""
        w = self.window()
        q = queries[:, :, -w:]
        if summary is not None:
            q = mx.concatenate([summary, q], axis=2)[:, :, -w:]
        mx.eval(q)  # a slice must not keep the whole chunk alive
        return q

    def transform(self, cache, logits, query_positions, key_positions):
        """"accumulate": logits [R, G, L, n] -> what the softmax is taken of (H2O: themselves)."""
        return logits

    def score_queries(self, cache, queries, new_keys):
        """"accumulate": what acts as the query [R, G, L, D] (the queries; Keyformer's proxy: keys)."""
        return queries

    def score_prompt(self, cache, keys, queries):
        """"replace" / "grow": scores [R, T] of the prompt's keys [R, T, D] (values: cache.values)
        from `summarize_queries`' summary of its queries (None for a method that needs none)."""
        raise NotImplementedError

    def score_step(self, cache, probs):
        """"replace": new scores [R, n] from this step's attention probabilities [R, G, S, n]."""
        raise NotImplementedError

    def prompt_kernel_noise(self, cache, rows: int, group: int, queries: int):
        """"accumulate": where `transform` is (logits + Gumbel noise) / tau (Keyformer), the noise of
        the prompt's last `queries` queries as kernels/prompt_scores.PromptNoise; else None."""
        return None

    def kernel_noise(self, cache, rows: int, group: int):
        """"accumulate": where `transform` is (logits + Gumbel noise) / tau (Keyformer), this step's
        noise and tau as kernels/scored_attention.GumbelNoise, so the GPU kernels apply it; else None."""
        return None

    def score_step_sums(self, cache, sums, group: int):
        """"replace", one query: new scores [R, n] from its probabilities summed over the G = `group`
        query heads of each row, [R, n] (what the GPU's fused decode step gives)."""
        raise NotImplementedError

    def score_new(self, cache, keys, positions):
        """"fixed": scores [R, S] of arriving keys [R, S, D] at true positions [R, S]."""
        raise NotImplementedError

    def evict_by(self, cache, step: int) -> mx.array:
        """What eviction ranks [R, n] at query position `step` (Keyformer's proxy adds noise here)."""
        return cache.scores

    def ranks_by_scores(self) -> bool:
        """Whether `evict_by` is the scores themselves (then the GPU's scoring launch can pick the
        slot to evict: kvcompress/kernels/scored_attention.py)."""
        return type(self).evict_by is Eviction.evict_by

    def select(self, cache, ranked: mx.array, capacity: int) -> tuple[mx.array, mx.array | None]:
        """Slots to keep [R, k] in temporal order (protected slots rank +inf), and which are real
        ([R, k] bool, or None when every row keeps k). AdaKV overrides this."""
        keep = mx.argpartition(-ranked, kth=capacity - 1, axis=1)[:, :capacity]
        return mx.sort(keep, axis=1), None

    # -- building --------------------------------------------------------------------------------

    def make_cache(self, model) -> list:
        install()  # the caches attend themselves; without the hook nothing would be scored
        caches = super().make_cache(model)
        if self.quantize is not None:
            self.compose(self, model, caches)
        return caches

    def layer_cache(self, layer: AttentionLayer, i: int, n: int, layout: ModelLayout) -> "EvictionCache":
        if layer.value_dim != layer.head_dim:
            raise ConfigError(f"{self.name}: {layout.model_class}'s values have {layer.value_dim} dims and its "
                              f"keys {layer.head_dim}; eviction caches hold both at one head dim")
        if self.positions == "compact" and not positional_rope(layer.rope):
            found = type(layer.rope).__name__ if layer.rope is not None else "none found"
            raise ConfigError(
                f"{self.name}.positions: 'compact' re-rotates kept keys with the model's RoPE, which must "
                f"rotate by position alone (one of {POSITIONAL_ROPES}); {layout.model_class} layer "
                f"{layer.index}: {found}; use positions='exact'")
        # i, n: PyramidKV's layer-wise budgets run over the layers this method compresses
        cache = self.cache_type()(self, i, n, layer.n_kv_heads, layer.head_dim, layer.rope, layer.scale)
        cache.attach(layer)
        return cache

    def cache_type(self) -> type:
        """The cache class (the decoding wrapper's adds compression every N steps to this one)."""
        return EvictionCache


class EvictionCache(CompressedCache):
    """One layer's eviction cache: mlx-lm's cache protocol plus `attention` and `from_prefill`."""

    ring_order = True  # False on an instance: StreamingLLM takes the kernel path (tests, benchmarks)
    # whether a scoring method's unmasked decode step takes `_scored_step` (None: on a GPU); set on an
    # instance, tests run it on the CPU (with the kernels' MLX reference) or keep a GPU on the old path
    fuse_scores: bool | None = None

    def __init__(self, config: Eviction, layer: int, n_layers: int, n_kv_heads: int, head_dim: int, rope, scale: float):
        self.config, self.layer, self.n_layers = config, layer, n_layers
        self.scorer = config.scoring()
        self.n_kv_heads, self.head_dim, self.rope, self.scale = n_kv_heads, head_dim, rope, scale
        self.traditional = getattr(rope, "traditional", False)
        self._keys = self._values = None  # buffers [R, allocated, D]; slots [0, length) in use
        self._scores = None  # [R, allocated] float32 (None once a "grow" method has selected)
        self._positions = None  # [R, allocated] int32 true positions (PAD for padding slots)
        self.length = 0  # slots in use per row
        # the slot whose token the last step evicted (exact positions): [R] int32, or an int where
        # it is the same slot in every row (the ring, see _ring_slot)
        self.free = None
        # StreamingLLM's ring: the non-sink slots, the oldest token's first (a deque of ints, or None:
        # not derived) and whether it was checked since the last selection or load (see _ring_slot)
        self._ring, self._ring_checked = None, False
        self.batch = 0
        self.position = 0  # true position of the next token
        self.offset = 0  # where mlx-lm rotates the next token: position (exact) or n (compact)
        self.prompt_len = self.capacity = self.recent = None  # known once the prompt is complete
        # tokens held while decoding (capacity, plus tokens appended by multi-token calls after the
        # prompt) and the position of the first generated token: see the module docstring
        self.held_limit = self.answer_start = None
        self.padded = False  # rows of different lengths (PAD slots present)
        self.query_summary = None  # what score_prompt needs of the prompt's queries, until selection
        # the layer's attention output projection (kvcompress/adapter.py), where a method reads it
        # (CriticalKV sets it)
        self.out_proj = None
        self.rope_step = None  # (cos, sin) of one RoPE position, for compact-mode eviction
        self._unscored = 0  # tokens appended and not yet seen by attention()
        self._new_keys = None  # [R, S, D] the keys of those tokens
        # KVzip's reconstruction pass (kvcompress/reconstruct.py): the context slice (start, end) the
        # passing queries score, while one runs; and whether one has run over the whole prompt
        self.chunk = None
        self.reconstructed = False

    # -- the slots in use (views of the buffers: no copy) -------------------------------------

    def _used(self, a):
        return a if a is None or a.shape[1] == self.length else a[:, : self.length]

    @property
    def keys(self):
        return self._used(self._keys)  # [R, n, D]

    @property
    def values(self):
        return self._used(self._values)  # [R, n, D]

    @property
    def scores(self):
        return self._used(self._scores)  # [R, n] float32, or None

    @property
    def positions(self):
        return self._used(self._positions)  # [R, n] int32 (a free slot holds its evicted token's)

    # -- mlx-lm protocol ------------------------------------------------------------------------

    def update_and_fetch(self, keys, values):
        # keys, values: [B, H_kv, S, D] post-RoPE
        if self._unscored:
            raise RuntimeError("EvictionCache needs kvcompress's attention hook: call kvcompress.attention.install()")
        B, H, S, D = keys.shape
        R = B * H
        if self.chunk is not None:  # a reconstruction pass: its tokens are attended and scored, never held
            self._unscored, self._new_keys = S, keys.reshape(R, S, D)
            held_keys, held_values = self.held_kv()
            return mx.concatenate([held_keys, keys], axis=2), mx.concatenate([held_values, values], axis=2)
        self.batch = B
        keys, values = keys.reshape(R, S, D), values.reshape(R, S, D)
        if S == 1 and isinstance(self.free, int):  # a decode step into the ring's slot (see _ring_slot)
            # Python scalars, so the step builds no arange / astype (each op costs host time per layer,
            # and each a kernel launch on a GPU); score_is_position: score_new's value, the same float32
            positions, scores = self.position, float(self.position)
        else:
            # an arange, not a host-made constant shared by the layers: that was one launch fewer per
            # layer but slower pipelined on the H200 (docs/learned.md, "Tried and not kept")
            positions = mx.broadcast_to(mx.arange(self.position, self.position + S, dtype=mx.int32), (R, S))
            if self.prompt_len is not None and self.config.decode == "grow":
                scores = None  # appended, never evicted
            elif self.scorer.decode == "fixed":
                scores = self.scorer.score_new(self, keys, positions)
            elif S == 1 and self.free is not None:  # a one-pass decode step: the token goes into the free slot
                # whose score is 0 already ("accumulate": see _zero_free_score) or is replaced by this
                # step's attention with every other ("replace")
                scores = None
            else:
                scores = mx.zeros((R, S), mx.float32)
        self._store(keys, values, scores, positions)
        self.position += S
        self._unscored = S
        self._new_keys = keys
        self._set_offset()
        return self.held_kv()

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        """Attention of the S new queries over the kept tokens, then scoring and eviction.

        `mask` is the model's (made by `make_mask`, or a causal mask of the model's own making:
        kvcompress/adapter.py refuses models that pass anything else); attention masks by the kept
        tokens' true positions instead, which is the same causal mask over the tokens held.
        `sinks` [H_q]: one extra logit per query head in every softmax (GPT-OSS), in the output and
        so in the decode steps' scores; the prompt's accumulated scores leave it out."""
        # queries [B, H_q, S, D]; keys/values: the [B, H_kv, n, D] update_and_fetch returned
        B, n_q, S, D = queries.shape
        R, n = self._keys.shape[0], self.length
        q = queries.reshape(R, n_q * B // R, S, D)  # [R, G, S, D]: a KV head's query group
        new_keys, self._new_keys, self._unscored = self._new_keys, None, 0
        if self.prompt_len is None:  # the prompt: every token so far is kept, in order
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                       mask="causal" if S > 1 else None, sinks=sinks)
            if self.chunk is not None:  # the reconstruction pass (KVzip): scores only, nothing held
                self.scorer.score_chunk(self, q, new_keys, *self.chunk)
                return out
            self._score_prompt_queries(q, new_keys, scale)
            if S == 1:
                self._complete_prompt()
            return out
        if S > 1:  # appended without eviction, before the answer (the question part; module docstring)
            self.held_limit = max(self.held_limit, self.tokens_kept)
            self.answer_start = self.position
            self._ring, self._ring_checked = None, False  # new slots: StreamingLLM's ring is derived anew
        decode = "grow" if self.config.decode == "grow" else self.scorer.decode
        masked = S > 1 or self.padded
        scored = decode in ("accumulate", "replace")  # scores from this step's probabilities
        # One query per row, unmasked: the window and one-shot methods take the full cache's own SDPA
        # (slot order does not matter to an unmasked query); on a GPU the scoring methods take one
        # kernel pass that gives the output and the scores together (`_scored_step`). On a CPU SDPA is
        # the same matmuls, so a scoring method would compute q K^T twice (1.6x a step, measured):
        # there the probabilities below give the output.
        gpu = mx.default_device() == mx.gpu if self.fuse_scores is None else self.fuse_scores
        if not masked and not scored:
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, sinks=sinks)
            self._evict_down()
            return out
        if (not masked and gpu and sinks is None
                and scored_attention_supported(q.shape[1], D, queries.dtype, self._keys.dtype)):
            return self._scored_step(queries, q, new_keys, scale, decode)
        query_positions = None  # built only where used: every op costs host time, per layer per step
        if masked or decode == "accumulate":
            query_positions = mx.arange(self.position - S, self.position, dtype=mx.int32)
        logits = folded_logits(q, self.keys, scale)  # [R, G, S, n]
        if masked:
            logits = self._causal(logits, query_positions)
        if sinks is None:
            probs = mx.softmax(logits, axis=-1, precise=True)
        else:  # the sink's logit joins each query head's softmax; its probability goes to no value
            sink = mx.tile(sinks.astype(logits.dtype).reshape(1, R // B, -1), (B, 1, 1)).reshape(R, -1, 1, 1)
            sink = mx.broadcast_to(sink, (*logits.shape[:3], 1))  # [R, G, S, 1]
            probs = mx.softmax(mx.concatenate([logits, sink], axis=-1), axis=-1, precise=True)[..., :-1]
        if not masked and gpu:  # a shape the kernels do not cover: the output from SDPA (on the H200
            # the probs @ values matmul below cost ~7x it, docs/learned.md)
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, sinks=sinks)
            # the logits evaluated with the output: the still-lazy scores then hold them, not the
            # keys buffer they read, which the next token's write can then update in place
            out = mx.depends(out, logits)
        else:
            values = self.values
            out = (probs.astype(values.dtype).reshape(R, -1, n) @ values).reshape(B, n_q, S, D)
        if decode == "accumulate":
            self._scores = self.scores + self._step_increments(q, new_keys, logits, probs, query_positions, scale)
        elif decode == "replace":
            self._scores = self.scorer.score_step(self, probs)
        self._evict_down()
        return out.astype(queries.dtype)

    def _scored_step(self, queries, q, new_keys, scale, decode):
        """A scoring method's decode step on a GPU (kvcompress/kernels/scored_attention.py): the
        output, the logits and the heads' summed probabilities read the keys and values once, where
        SDPA plus the scores' own logits, softmax and sums read the keys twice in ~8 kernels.
        Where a method's scores are the attention itself (H2O: neither `transform` nor
        `score_queries` overridden), the same launch adds them to the scores."""
        B, n_q, S, D = queries.shape
        R, G, n = q.shape[0], q.shape[1], self.length
        q = q.reshape(R, G, D)
        plain = decode == "accumulate" and self._plain_scores()
        # Keyformer: its noisy softmax in the kernels too, where they run it (else the MLX ops below)
        noise = self.scorer.kernel_noise(self, R, G) if decode == "accumulate" and not plain else None
        device = self.fuse_scores is None  # not a test forcing this path on a CPU
        if noise is not None and device and not fuses(q, True, True, False):
            noise = None
        accumulate = plain or noise is not None
        # the step's new scores are then final: the same launch picks the slot to evict by them
        evict = EvictAt(self._positions, self.config.n_sink, self._recent_start()) \
            if accumulate and self._evicts_by_scores_now() else None
        if evict is not None and device and not fuses(q, True, noise is not None, True):
            evict = None  # evict_slot below
        out, logits, sums, slot = scored_attention(q, self._keys, self._values, n, scale,
                                                   self.scores if accumulate else None, noise, evict)
        if accumulate:
            self._scores = sums
        elif decode == "accumulate":
            logits = logits[:, :, None]  # [R, G, 1, n]
            query_positions = mx.arange(self.position - 1, self.position, dtype=mx.int32)
            self._scores = self.scores + self._step_increments(q[:, :, None], new_keys, logits, None, query_positions,
                                                               scale, sums)
        else:
            self._scores = self.scorer.score_step_sums(self, sums, G)
        if slot is not None:
            self.free = slot  # as _evict_down's one-pass step: the next token goes into this slot
        else:
            self._evict_down()
        return out.reshape(B, n_q, S, D)

    def _evicts_by_scores_now(self) -> bool:
        """Whether `_evict_down` would now pick one slot per row by `scores` (`evict_slot`)."""
        config = self.config
        return (config.decode != "grow" and self.length == self.held_limit + 1 and not self.padded
                and config.positions == "exact" and config.ranks_by_scores()
                and not (self.ring_order and config.score_is_position))

    def _plain_scores(self) -> bool:
        """Whether a decode query's score increments are its probabilities summed over the heads."""
        cls = type(self.scorer)
        return cls.transform is Eviction.transform and cls.score_queries is Eviction.score_queries

    def make_mask(self, N, return_array=False, window_size=None):
        # attention() masks by positions; this is what a caller that asks gets (slot count, causal)
        return create_attention_mask(N, self.length, return_array, window_size)

    def empty(self):
        return self._keys is None

    @property
    def tokens_kept(self) -> int:
        """Tokens held per row: padding slots count (they are resident); the free slot an exact
        cache keeps between steps for its next token does not, nor does unused buffer room."""
        return 0 if self._keys is None else self.length - (self.free is not None)

    @property
    def live_kv_bytes(self) -> int:
        """Bytes of the held tokens: keys and values plus their scores and positions (also resident)."""
        if self._keys is None:
            return 0
        return array_bytes(self.keys, self.values, self.scores, self.positions) // self.length * self.tokens_kept

    def kept_positions(self) -> mx.array:
        """True positions [B * H_kv, n] of the slots, in the order of `held_kv` (PAD: a padding or free slot)."""
        if self.free is None:
            return self.positions
        free = self.free if isinstance(self.free, int) else self.free[:, None]
        return mx.where(mx.arange(self.length)[None] == free, PAD, self.positions)

    def held_kv(self) -> tuple[mx.array, mx.array]:
        """Keys and values [B, H_kv, n, D] slot by slot, as attention sees them (exact positions):
        views of the buffers [B, H_kv, allocated, D] (the slice SDPA's fast decode path needs)."""
        R, allocated, D = self._keys.shape
        shape = (self.batch, R // self.batch, allocated, D)
        return self._keys.reshape(shape)[:, :, : self.length], self._values.reshape(shape)[:, :, : self.length]

    def kept_rows(self) -> list[np.ndarray]:
        """Original token positions each row holds, in temporal order, padding left out."""
        positions = np.array(self.kept_positions())
        return [np.sort(row[row != PAD]) for row in positions]

    # -- runner entry ---------------------------------------------------------------------------

    def from_prefill(self, keys, values, queries=None):
        """Compress a finished full-attention prefill: score the prompt, then one selection.

        keys, values [B, H_kv, T, D] post-RoPE at positions 0..T-1; queries [B, H_q, T, D]
        post-RoPE (needed when the method scores with queries).
        """
        B, H, T, D = keys.shape
        self.config.resolve(T, self.layer, self.n_layers)  # reject before any work
        scorer = self.scorer
        if scorer.needs_queries and queries is None:
            raise ValueError(f"{self.config.name} scores with the prompt's queries: pass them")
        R = B * H
        self.batch = B
        keys, values = keys.reshape(R, T, D), values.reshape(R, T, D)
        positions = mx.broadcast_to(mx.arange(T, dtype=mx.int32), (R, T))
        self.position = T
        scores = scorer.score_new(self, keys, positions) if scorer.decode == "fixed" else mx.zeros((R, T), mx.float32)
        self._set(keys, values, scores, positions)
        if scorer.decode != "fixed" and queries is not None:
            self._score_prompt_queries(queries.reshape(R, queries.shape[1] // H, T, D), keys, self.scale)
        if scorer.reconstructs:  # KVzip selects after its reconstruction pass (end_reconstruction)
            self._set_offset()
        else:
            self._complete_prompt()

    def end_reconstruction(self):
        """After KVzip's reconstruction pass over the whole held prompt (kvcompress/reconstruct.py):
        select by its scores."""
        self.reconstructed = True
        self._complete_prompt()

    # -- internals ------------------------------------------------------------------------------

    def _score_prompt_queries(self, q, new_keys, scale):
        """Prompt queries q [R, G, S, D] at the last S positions (their keys: new_keys [R, S, D]):
        accumulate, or summarize them for `score_prompt` (the window)."""
        scorer = self.scorer
        if scorer.decode == "accumulate":
            def transform(logits, query_positions, key_positions):
                return scorer.transform(self, logits, query_positions, key_positions[None])

            sq = scorer.score_queries(self, q, new_keys)
            # on a GPU the prompt-scoring kernels take H2O's (the attention itself: no transform)
            # and Keyformer's (its noise drawn in them)
            plain = self._plain_scores()
            noise = None if plain else scorer.prompt_kernel_noise(self, q.shape[0], q.shape[1], q.shape[2])
            self._scores = self.scores + accumulated_attention(sq, self.keys, scale, None if plain else transform,
                                                               kernel_noise=noise)
        elif scorer.needs_queries:
            self.query_summary = scorer.summarize_queries(self, self.query_summary, q)

    def _complete_prompt(self):
        self.prompt_len = self.position
        self.capacity, self.recent = self.config.resolve(self.prompt_len, self.layer, self.n_layers)
        self.held_limit, self.answer_start = self.capacity, self.position
        scorer = self.scorer
        # a "grow" method that keeps the whole prompt needs no scores (nor KVzip its reconstruction)
        whole = self.config.decode == "grow" and self.length <= self.capacity
        if scorer.decode in ("replace", "grow") and not whole:
            self._scores = scorer.score_prompt(self, self.keys, self.query_summary)
        self.query_summary = None
        if self.length > self.capacity:
            self._select(self.capacity, self.position - 1)
        if self.config.decode == "grow":
            self._scores = None  # never evicts again: the scores would be dead weight
        self._set_offset()
        mx.eval(self.state[:4])

    def _step_increments(self, q, new_keys, logits, probs, query_positions, scale, prob_sums=None):
        """What a step adds to every score [R, n]; `prob_sums` [R, n]: probs summed over the heads,
        where the fused kernel gave them instead of `probs`."""
        scorer = self.scorer
        sq = scorer.score_queries(self, q, new_keys)
        if sq is not q:
            logits = self._causal(folded_logits(sq, self.keys, scale), query_positions)
        noisy = scorer.transform(self, logits, query_positions, self.positions)
        if noisy is not logits or sq is not q:
            probs = mx.softmax(noisy, axis=-1, precise=True)
        elif prob_sums is not None:
            return prob_sums
        return probs.sum(axis=(1, 2))

    def _causal(self, logits, query_positions):
        visible = self.positions[:, None, None, :] <= query_positions[None, None, :, None]
        return mx.where(visible, logits, -mx.inf)

    def _evict_down(self):
        n = self.length
        if self.config.decode == "grow" or n <= self.held_limit:
            return
        if n == self.held_limit + 1 and not self.padded:
            if self.config.positions == "exact" and (slot := self._ring_slot()) is not None:
                self.free = slot  # no device work: update_and_fetch writes the next token there
                return
            evict_by = self.config.evict_by(self, self.position - 1)
            if self.config.positions == "exact":
                # one pass: nothing moves now; update_and_fetch writes the next token into this slot.
                # Left lazy: the next step's graph evaluates it, just before its write into the
                # positions buffer that this choice reads, so MLX copies that [R, n] int32 buffer
                # (keys and values stay in place). Starting it here with mx.async_eval avoided the
                # copy but cost ~0.2 ms of host time per layer on the H200, up to 2x a step
                # (docs/learned.md, "Eviction kernels")
                self.free = evict_slot(evict_by, self.positions, self.config.n_sink, self._recent_start())
                self._zero_free_score()
                return
            if self.rope_step is None:
                cos, sin = rope_rotations(self.rope, self.head_dim, 2)
                self.rope_step = (cos[1], sin[1])
            self._set(*evict_one(
                self.keys, self.values, self.scores, self.positions, evict_by,
                self.config.n_sink, self.recent, self.rope_step, self.traditional,
            )[:4])
        else:
            self._select(self.held_limit, self.position - 1)
        self._set_offset()

    def _recent_start(self) -> int:
        # the recent window is the newest `recent` tokens, which are all held (protected since they came)
        return self.position - self.recent

    def _ring_slot(self) -> int | None:
        """The slot to evict now as a host int, where eviction follows the ring (see _ring_start),
        else None (the kernel path). Called once per evicting step of an exact, unpadded cache."""
        if not (self.ring_order and self.config.score_is_position):
            return None
        if self._ring is None:
            if self._ring_checked:  # checked since the last selection or load, and it did not hold
                return None
            self._ring_checked = True
            self._ring = self._ring_start()
            if self._ring is None:
                return None
        slot = self._ring[0]
        self._ring.rotate(-1)  # this step's token goes into `slot`: the newest, last in the order
        return slot

    def _ring_start(self) -> deque | None:
        """The non-sink slots, the oldest token's first, from one host read of the positions and
        scores, where every row holds the same positions (so one slot serves every row), all
        distinct, with scores equal to them; else None.

        Then `evict_slot` picks the oldest non-sink token (the lowest score, ties to the lowest
        position; it is below the recent window, as the cache holds capacity + 1 > n_sink + recent
        distinct positions), the step's token takes its slot and is the newest: the order rotates
        by one. Selection keeps slots in slot order, so the oldest need not be in the first slot."""
        positions, scores = np.array(self.positions), np.array(self.scores)  # [R, n] each
        row = positions[0]
        if not ((positions == row).all() and len(np.unique(row)) == len(row)
                and (scores == positions.astype(np.float32)).all()):
            return None
        return deque(int(slot) for slot in np.argsort(row) if row[slot] >= self.config.n_sink)  # n - n_sink slots

    def _select(self, capacity: int, step: int):
        """Keep the protected tokens and the top-ranked rest, `capacity` per row, in slot order."""
        n = self.length
        # by true position, so slots in any order work: the first n_sink tokens and the newest `recent`
        protected = (self.positions < self.config.n_sink) | (self.positions >= self._recent_start())
        ranked = mx.where(protected, mx.inf, self.config.evict_by(self, step))
        if self.padded:
            ranked = mx.where(self.positions == PAD, -mx.inf, ranked)
        keep, real = self.config.select(self, ranked, capacity)

        def take(a):
            return mx.take_along_axis(a, keep[..., None] if a.ndim == 3 else keep, axis=1)

        keys = take(self.keys)
        if self.config.positions == "compact":
            # slot keep[i] was rotated at position keep[i] (slot index); move it to i
            cos, sin = rope_rotations(self.rope, self.head_dim, n)
            back = keep - mx.arange(keep.shape[1])[None]
            keys = rotate_pairs(keys, cos[back], -sin[back], self.traditional)
        positions = take(self.positions)
        self.padded = real is not None
        if real is not None:
            positions = mx.where(real, positions, PAD)
        self._set(keys, take(self.values), None if self.scores is None else take(self.scores), positions)

    def _set(self, keys, values, scores, positions):
        """New arrays, exactly the slots in use (no free slot, no spare room)."""
        self._keys, self._values, self._scores, self._positions = keys, values, scores, positions
        self.length = keys.shape[1]
        self.free = None
        # slots rearranged (selection, a load): the ring is derived again at the next eviction
        self._ring, self._ring_checked = None, False

    def _store(self, keys, values, scores, positions):
        """Place S new tokens ([R, S, D] / [R, S]): the first into each row's free slot if there is
        one, the rest after the slots in use. Each buffer is written once per step; keys and values
        in place (see `_evict_down` for the small [R, n] arrays)."""
        if self._keys is None:
            self._set(keys, values, scores, positions)
            return
        if self.free is not None:
            R, S, D = keys.shape
            first = (lambda a: a) if S == 1 else (lambda a: a[:, :1])  # a decode step: no slicing
            if isinstance(self.free, int):  # the ring: one slot for every row, so slice writes
                f = self.free
                self._keys[:, f : f + 1] = first(keys)
                self._values[:, f : f + 1] = first(values)
                self._positions[:, f : f + 1] = first(positions)  # a Python int on a decode step
                if scores is not None:
                    self._scores[:, f : f + 1] = first(scores)
            else:
                slot = self.free[:, None]  # [R, 1]
                token = mx.broadcast_to(slot[..., None], (R, 1, D))  # one index array for keys and values
                self._keys = mx.put_along_axis(self._keys, token, first(keys), axis=1)
                self._values = mx.put_along_axis(self._values, token, first(values), axis=1)
                self._positions = mx.put_along_axis(self._positions, slot, first(positions), axis=1)
                if scores is not None:
                    self._scores = mx.put_along_axis(self._scores, slot, first(scores), axis=1)
            self.free = None
            if S == 1:
                return
            keys, values, positions = keys[:, 1:], values[:, 1:], positions[:, 1:]
            scores = None if scores is None else scores[:, 1:]
        S = keys.shape[1]
        if S == 0:
            return
        start, end = self.length, self.length + S
        # spare room once decoding: a "grow" cache appends every step; an evicting one needs its
        # capacity + 1 slots (a budget above the prompt fills up first); the prompt comes in chunks
        if self.prompt_len is None:
            spare = 0
        elif self.config.decode == "grow":
            spare = GROW_STEP
        else:
            spare = max(0, min(GROW_STEP, self.held_limit + 1 - end))
        align = KV_ALIGN if self.prompt_len is not None and _on_cuda() else 1
        self._keys, self._values = (_room(a, start, end, spare, align) for a in (self._keys, self._values))
        self._positions = _room(self._positions, start, end, spare)
        self._keys[:, start:end] = keys
        self._values[:, start:end] = values
        self._positions[:, start:end] = positions
        if scores is not None:
            self._scores = _room(self._scores, start, end, spare)
            self._scores[:, start:end] = scores
        self.length = end

    def _zero_free_score(self):
        """Set the free slots' scores to the 0 their next tokens start from ("accumulate": their
        steps add to it). The GPU's scored step gets this from the launch that picks the slots
        (kernels/scored_attention.py), so update_and_fetch writes no score for a decode token."""
        if self.scorer.decode == "accumulate":
            self._scores = free_slot_zeroed(self._scores, self.free)

    def _set_offset(self):
        self.offset = self.position if self.config.positions == "exact" else self.length

    def attach(self, layer: AttentionLayer) -> None:
        """Give a loaded cache its layer's modules back: the RoPE and, where the method reads it, the
        output projection (kvcompress.load_prompt_cache(path, model))."""
        self.rope = layer.rope
        if self.config.reads_output_projection or self.scorer.reads_output_projection:
            self.out_proj = layer.out_proj

    # -- save / load ------------------------------------------------------------------------------

    @property
    def state(self):
        # the slots in use; a free slot is saved with position PAD and found again on load
        cos, sin = self.rope_step or (None, None)
        return (self.keys, self.values, self.scores, self.kept_positions(), cos, sin, self.query_summary,
                self.meta_state)

    @state.setter
    def state(self, v):
        # files from before the query summary was saved have one element fewer (and none pending)
        keys, values, scores, positions, cos, sin, *summary, meta = v
        self._set(keys, values, scores, positions)
        self.rope_step = None if cos is None else (cos, sin)
        self.meta_state = meta
        # mlx-lm's loader gives a saved tuple back as a list
        summary = summary[0] if summary else None
        self.query_summary = tuple(summary) if isinstance(summary, list) else summary

    @property
    def meta_state(self) -> str:
        """Everything but the arrays, as JSON (mlx-lm stores strings in its prompt-cache files)."""
        fields = ("layer", "n_layers", "n_kv_heads", "head_dim", "scale", "traditional", "batch", "position", "offset",
                  "prompt_len", "capacity", "recent", "padded", "held_limit", "answer_start")
        meta = {"config": json.loads(self.config.to_json()), **{f: getattr(self, f) for f in fields}}
        return json.dumps({**meta, "free_slot": self.free is not None, "rope": self.rope is not None})

    @meta_state.setter
    def meta_state(self, v):
        meta = json.loads(v)
        # files from before the question part was appended without eviction
        meta.setdefault("held_limit", meta["capacity"])
        meta.setdefault("answer_start", meta["prompt_len"])
        self.config = method_config(**meta.pop("config"))
        self.scorer = self.config.scoring()
        if meta.pop("free_slot", False):  # saved as position PAD (exact caches are never padded then)
            self.free = mx.argmax(self._positions == PAD, axis=1).astype(mx.int32)
        had_rope = meta.pop("rope", True)  # files from before it was saved: assume the layer had one
        for field, value in meta.items():
            setattr(self, field, value)
        if not hasattr(self, "rope"):  # restored by from_state: no model here (`attach` gives it back)
            self.rope = MissingRope() if had_rope else None
            self.query_summary, self._unscored, self._new_keys = None, 0, None
            self.out_proj, self.chunk, self.reconstructed = None, None, False
        if self.free is not None:  # a file from before the free slot's score was kept at 0 may hold another
            self._zero_free_score()


class MissingRope:
    """The RoPE of a cache loaded without its model (mlx-lm's own loader): a module cannot be saved.
    Calling it raises, so a cache that needs the rotation says how to load it instead of treating the
    layer as one without RoPE."""

    def __call__(self, *args, **kwargs):
        raise RuntimeError("this cache was loaded without its model and needs the model's RoPE here: load it "
                           "with kvcompress.load_prompt_cache(path, model)")


def _on_cuda() -> bool:
    """Whether MLX runs on its CUDA back-end, where KV_ALIGN pays (elsewhere spare slots would only
    cost memory)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def _room(a, start: int, end: int, spare: int, align: int = 1):
    """Buffer `a` [R, allocated, ...] with room for slots [start, end): itself when it has it, else a
    new one holding its first `start` slots (plus `spare` slots more for later steps), its length
    rounded up to a multiple of `align`."""
    if a.shape[1] >= end:
        return a
    allocated = -(-(end + spare) // align) * align
    grown = mx.zeros((a.shape[0], allocated - start, *a.shape[2:]), a.dtype)
    return mx.concatenate([a[:, :start], grown], axis=1)


# mlx-lm's load_prompt_cache looks cache classes up by name in mlx_lm.models.cache's globals.
setattr(mlx_cache, "EvictionCache", EvictionCache)
