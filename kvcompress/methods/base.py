"""The method interface every compression method implements.

A method is two things, as in kvpress: a frozen dataclass config that validates itself, and the
mlx-lm cache class it builds. The config is what a sweep varies and what a run id hashes; the
cache is what the model talks to.

Caches follow mlx-lm's protocol (`offset`, `update_and_fetch`, `state`, `make_mask`, `trim`,
`nbytes`, `empty`). `CompressedCache` adds three things the runner and the attention hook use:

- `from_prefill(keys, values, queries)`: compress a finished full-attention prefill (both
  Keyformer and KIVI compress after the prompt is processed). The default feeds the prompt's keys
  and values through `update_and_fetch`; methods that score with the prompt's queries (Keyformer)
  override it.
- `attention(queries, keys, values, scale, mask)`: optional. When a cache defines it, the patched
  `scaled_dot_product_attention` (kvcompress/attention.py) calls it instead of the fused kernel, so
  a cache can see the real post-RoPE queries or attend over packed codes.
- `live_kv_bytes` / `tokens_kept`: the bytes of the arrays the cache holds for the tokens it holds.
- `kept_positions` / `held_kv`: which original positions a cache still holds and their keys and
  values as attention sees them (evidence survival, kvcompress/evidence.py). Methods that keep
  every token need only `held_kv` (quantizers: their `dequantized()`); eviction methods override both.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from ..adapter import AttentionLayer, ModelLayout, model_layout, native_cache
from ..errors import ConfigError, check, is_int  # noqa: F401  (ConfigError, check re-exported for users)


def array_bytes(*arrays: mx.array | None) -> int:
    """Resident bytes of arrays (None counts as 0)."""
    return sum(a.nbytes for a in arrays if a is not None)


@dataclass(frozen=True)
class Method:
    """Base config. Subclasses set `name` and add validated fields (validate in `__post_init__`)."""

    name: ClassVar[str] = ""
    # Set by methods whose `from_prefill` needs the prompt's post-RoPE queries.
    needs_queries: ClassVar[bool] = False
    # Set by methods that score the prompt by a second forward pass over it (KVzip's reconstruction):
    # the runner and `kvcompress.compress_prompt` run it (kvcompress/reconstruct.py) before selection.
    reconstructs: ClassVar[bool] = False
    # Bumped when a fix changes what this method computes for the same config: the run config
    # (hence the run id) carries it when nonzero, so a resumed sweep recomputes the method's old
    # runs instead of skipping them (ids of methods never bumped stay as they were).
    revision: ClassVar[int] = 0
    # Set by quantizers whose cache can store an eviction method's kept tokens (`quantize`, see
    # methods/composed.py): its cache takes a boolean mask in `attention` and builds empty by `new_cache(i)`.
    stores_quantized: ClassVar[bool] = False
    # Set by quantizers that cannot store an eviction method's kept tokens: why, in words (the
    # ConfigError that refuses them as `quantize` says it).
    store_refusal: ClassVar[str] = ""
    # Which attention layers the method compresses (kvcompress/adapter.py): "global" (every
    # global-attention layer; sliding-window and recurrent layers keep the model's own cache) or
    # "all". Keyword-only, so subclasses declare their own fields as before.
    layers: str = field(default="global", kw_only=True)

    @property
    def evicts_while_decoding(self) -> bool:
        """Whether the cache drops tokens after the prompt (then the protocol changes its numbers)."""
        return False

    def make_cache(self, model) -> list:
        """The model's own prompt cache (mlx-lm's `make_prompt_cache`) with this method's cache on
        every layer it compresses (`layers`), usable as mlx-lm's `prompt_cache`. ConfigError, before
        any work, where a layer cannot be served right (kvcompress/adapter.py says which and why)."""
        layout = model_layout(model)
        targets = layout.targets(self.name, self.layers)
        caches = native_cache(model)
        for i, layer in enumerate(targets):
            caches[layer.index] = self.layer_cache(layer, i, len(targets), layout)
        return caches

    def layer_cache(self, layer: AttentionLayer, i: int, n: int, layout: ModelLayout):
        """This method's cache for `layer`, the i-th of the n layers it compresses."""
        raise NotImplementedError

    @classmethod
    def store_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """A quantizer's `params` as the store of an eviction method's kept tokens (`quantize`,
        methods/composed.py), with the defaults it takes there where they differ from its own."""
        return params

    def for_run(self, answer_budget: int, answer_tokens: int | None = None) -> "Method":
        """This config for a run that may generate `answer_budget` tokens (max_new_tokens) and, where
        known, generates `answer_tokens` (the reference answer): Keyformer anneals tau over one of
        them. Not part of the run id: the task's budget and the run's decode steps already are."""
        return self

    GRID_COLUMNS: ClassVar[tuple[str, ...]] = ("budget", "bits", "tau_init", "tau_end")

    def grid_columns(self) -> dict[str, float | None]:
        """Values of the `runs` columns a sweep groups by; None where the method has no such knob.

        Fields with these names map directly; a method with other knobs (KIVI's key/value bits)
        overrides this.
        """
        values = {c: getattr(self, c, None) for c in self.GRID_COLUMNS}
        return {c: None if v is None else float(v) for c, v in values.items()}

    def label(self) -> str:
        """Readable identity that reports group by: the name, the budget/bits/tau knobs the method
        has, then every other parameter that differs from its default
        ("keyformer budget=0.5 tau=1.0..2.0 score=proxy")."""
        values = self.params()
        parts = [self.name]
        parts += [f"{k}={values[k]}" for k in ("budget", "bits") if k in values]
        if values.get("tau_init") or values.get("tau_end"):
            parts.append(f"tau={values['tau_init']}..{values['tau_end']}")
        shown = {"budget", "bits", "tau_init", "tau_end"}
        parts += [
            f"{f.name}={label_value(values[f.name])}"
            for f in fields(self)
            if f.name not in shown and (f.default is dataclasses.MISSING or values[f.name] != f.default)
        ]
        return " ".join(parts)

    def revisions(self) -> dict[str, int]:
        """The revisions a run config carries, nonzero only (see `revision`): this method's, and those
        of the configs it is built from (a delegating method's scorer, an eviction's quantizer)."""
        return {"method_revision": self.revision} if self.revision else {}

    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_dict(self) -> dict[str, Any]:
        """The full configuration: `method_config(**config.to_dict())` rebuilds it."""
        return {"name": self.name, **self.params()}

    def to_json(self) -> str:
        """Canonical JSON of the full configuration (sorted keys)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """Name, one-line doc and parameters with defaults, for `kvcompress.list_methods()`."""
        params = {}
        for f in fields(cls):
            default = f.default
            if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            params[f.name] = None if default is dataclasses.MISSING else default
        # the docstring's first paragraph says what the method is, the rest its parameters and their values
        paragraphs = [" ".join(p.split()) for p in inspect.cleandoc(cls.__doc__ or "").split("\n\n")]
        return {"name": cls.name, "doc": paragraphs[0], "params_doc": " ".join(paragraphs[1:]), "params": params}


def label_value(value: Any) -> str:
    """A parameter as a label shows it: a nested config's mapping as `name(k=v, ...)`."""
    if isinstance(value, dict) and "name" in value:
        inner = ", ".join(f"{k}={v}" for k, v in value.items() if k != "name")
        return f"{value['name']}({inner})"
    return str(value)


class CompressedCache(_BaseCache):
    """Shared behaviour of kvcompress caches (see module docstring)."""

    # The activations' dtype, for caches that record it (a model may read the dtype of the keys it got
    # back: Phi-2 casts its attention output to it). Kept as the dtype's name: an mx.Dtype does not
    # pickle, and the runner deep-copies a compressed context for each of its uses.
    @property
    def dtype(self) -> mx.Dtype:
        return getattr(mx, self._dtype_name)

    @dtype.setter
    def dtype(self, value: mx.Dtype) -> None:
        self._dtype_name = str(value).rsplit(".", 1)[-1]

    def trim(self, n: int) -> int:
        return 0  # nothing to give back (mlx-lm's `is_trimmable` is False unless a cache says otherwise)

    # A quantizer's exact copy of the current call's tokens ((keys, values): the call's own queries
    # see them exactly), held from update_and_fetch until that call's attention.
    _fresh = None

    def from_prefill(self, keys: mx.array, values: mx.array, queries: mx.array | None) -> None:
        # keys, values: [B, H_kv, T, D] post-RoPE; queries: [B, H_q, T, D] or None
        self.update_and_fetch(keys, values)
        self.forget_call()

    def attach(self, layer: AttentionLayer) -> None:
        """Give a loaded cache what a file cannot hold: its layer's modules (the RoPE, an output
        projection), where it reads them (`kvcompress.load_prompt_cache(path, model)` calls this)."""

    def forget_call(self) -> None:
        """Drop what the current call held for its own attention, where no attention follows an update
        (a prefill handed over, a composed cache's hand-over): otherwise a quantizer would keep the
        tokens' full-precision copy, beside their codes and uncounted, until the next call."""
        self._fresh = None

    def kept_positions(self) -> mx.array | None:
        """True sequence positions of the tokens held, [B * H_kv, n_kept] in the order of
        `held_kv`; None when every position 0 .. offset - 1 is held, in order (no eviction)."""
        return None

    def held_kv(self) -> tuple[mx.array, mx.array]:
        """Keys and values [B, H_kv, n_kept, D] as attention sees them (dequantized where packed)."""
        return self.dequantized()

    @property
    def live_kv_bytes(self) -> int:
        raise NotImplementedError

    @property
    def tokens_kept(self) -> int:
        raise NotImplementedError

    @property
    def quantized_tokens(self) -> int | None:
        """Tokens per row held as codes (a key, a value or both quantized); None for a cache that
        quantizes nothing by design (eviction, the full cache). A quantizer's full-precision window
        holds the rest of `tokens_kept`."""
        return None

    @property
    def nbytes(self) -> int:
        return self.live_kv_bytes

    def size(self) -> int:
        return self.tokens_kept


def check_budget(field: str, budget: int | float) -> None:
    """A budget is a token count (int >= 1) or a fraction of the prompt (float in (0, 1])."""
    is_count = is_int(budget) and budget >= 1
    is_fraction = isinstance(budget, float) and 0.0 < budget <= 1.0
    check(is_count or is_fraction, field, "a token count >= 1 or a prompt fraction in (0, 1]", budget)


def budget_tokens(budget: int | float, prompt_tokens: int) -> int:
    """Resolve a budget to tokens: counts stay, fractions scale the prompt length (at least 1)."""
    if isinstance(budget, float):
        return max(1, round(budget * prompt_tokens))
    return budget
