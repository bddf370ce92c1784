"""What kvcompress needs to know about an mlx-lm model, read from the model itself.

mlx-lm's architectures name their attention modules, head counts and projections differently
(`self_attn.n_kv_heads`, `attention.num_key_value_heads`, a fused `qkv_proj`, MLA's latent), and
some layers are not global attention at all: sliding windows (Gemma 3, GPT-OSS), recurrent state
(Qwen3-Next, LFM2). Instead of reading attribute names, `model_layout` asks the model:

1. The model's own prompt cache (`mlx_lm.models.cache.make_prompt_cache`: `model.make_cache()`
   where the model defines it) gives each layer's kind: `KVCache` is global attention,
   `RotatingKVCache(max_size=W)` a sliding window of W tokens, anything else (ArraysCache,
   CacheList, ChunkedKVCache, ...) is kept as the model's and never compressed.
2. One probe forward pass (a 6-token prompt, then one decode step) with recording caches and
   kvcompress's attention hook shows, per attention layer: the query and KV head counts, head
   dims, the scale, whether the model passes attention sinks, and whether the model attends
   through `scaled_dot_product_attention` with exactly the keys and values the cache returned and
   a plain causal mask. A layer where it does not (Gemma 2's soft-capping, Phi-2's own attention,
   MLA's latent keys and RoPE term in the mask) cannot be served by a cache that attends itself or
   drops tokens: `refusal` says why. The probe also watches every attention call the hook sees, with
   or without a cache, for keys and values read outside the layer's own attention call: another
   call attending on what a layer's cache returned (Gemma 4's KV-shared layers attend with
   `cache=None` on an earlier layer's keys; IQuest Loop Coder's second loop on the first loop's),
   the model reading a cache's keys itself (AFM 7's `cache[-1].keys_and_values()`), or a call with
   `cache=None` on keys no layer's cache returned. A cache that packs or drops tokens would hand
   such a reader codes it cannot read, or a token set chosen for another layer's queries, without
   the reader's own masking: those layers are refused (every layer, where the reader's source is
   unknown), and only the model's own cache (`full`) serves the model.
3. RoPE: the `rope` module of the layer's block (only compact positions need it).
4. The output projection (CriticalKV needs W_o): the linear module of the layer's block whose input,
   in the probe, is exactly the attention's output with the heads side by side, [B, L, H_q * D_v].
   None where no module takes it as it is (an output gate or a norm in between: Qwen3-Next's gated
   attention), so a method that needs it refuses.

A method compresses the layers `targets(layers)` names and keeps the model's own cache on the
others; `make_cache` refuses (ConfigError, before any prefill) where it cannot be right.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from . import attention
from .errors import ConfigError

LAYER_CHOICES = ("global", "all")  # which attention layers a method compresses
PROBE_TOKENS = 6
# RoPE modules whose rotation at position p depends on p alone (compact positions re-rotate keys
# by position differences); DynamicNTKScalingRoPE, for one, changes its base with the length.
POSITIONAL_ROPES = ("RoPE", "Llama3RoPE", "SuScaledRoPE", "YarnRoPE", "ProportionalRoPE")


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer as the probe saw it."""

    index: int  # position in the model's prompt cache list
    kind: str  # "global" | "sliding"
    window: int | None  # sliding window in tokens
    n_heads: int
    n_kv_heads: int
    head_dim: int  # keys' (and queries') last dim
    value_dim: int
    scale: float
    sinks: bool  # the model passes attention sinks (GPT-OSS): one extra logit per query head
    rope: object | None  # the block's RoPE module where one was found
    refusal: str | None  # why no kvcompress cache can serve this layer; None when one can
    out_proj: "OutputProjection | None" = None  # where the probe found it (module docstring, 4)


@dataclass(frozen=True, eq=False)
class OutputProjection:
    """A layer's attention output projection: `module` maps the query heads' outputs side by side,
    [..., n_heads * value_dim] in `dtype`, to the hidden size."""

    module: nn.Module
    n_heads: int
    value_dim: int
    dtype: mx.Dtype

    def __deepcopy__(self, memo) -> "OutputProjection":
        return self  # the model's own module, shared (copying a cache must not copy weights; MLX dtypes cannot be)

    def per_head(self) -> mx.array:
        """W_o^h of every query head, [n_heads, value_dim, hidden] float32 (x_h -> x_h W_o^h): read by
        applying the module to the identity, minus its bias, so a quantized module works as well."""
        width = self.n_heads * self.value_dim
        rows = self.module(mx.eye(width, dtype=self.dtype)) - self.module(mx.zeros((1, width), self.dtype))
        return rows.astype(mx.float32).reshape(self.n_heads, self.value_dim, -1)


@dataclass(frozen=True)
class ModelLayout:
    model_class: str
    kinds: tuple[str, ...]  # per prompt-cache entry: "global" | "sliding" | "recurrent" | "other"
    attention: tuple[AttentionLayer, ...]  # the "global" and "sliding" entries, in order
    dtype: mx.Dtype  # the activations' (what keys and values are stored in)

    @property
    def global_layers(self) -> tuple[AttentionLayer, ...]:
        return tuple(a for a in self.attention if a.kind == "global")

    def targets(self, method: str, layers: str) -> tuple[AttentionLayer, ...]:
        """The attention layers `method` compresses under `layers`; ConfigError where it cannot be right."""
        if layers not in LAYER_CHOICES:
            raise ConfigError(f"{method}.layers: expected one of {LAYER_CHOICES}, got {layers!r}")
        if layers == "all" and any(a.kind == "sliding" for a in self.attention):
            raise ConfigError(
                f"{method}.layers: 'all' compresses sliding-window layers, which kvcompress does not "
                f"support yet ({self.model_class} has them; its own RotatingKVCache already bounds them "
                f"to the window): use layers='global'"
            )
        chosen = self.global_layers
        if not chosen:
            raise ConfigError(f"{method}: {self.model_class} has no global attention layer to compress "
                              f"(layer kinds: {_counts(self.kinds)})")
        refused = [a for a in chosen if a.refusal]
        if refused:
            raise ConfigError(f"{method}: cannot compress {self.model_class}'s attention "
                              f"(layer {refused[0].index}: {refused[0].refusal})")
        return chosen

    def summary(self) -> dict:
        """Counts and geometry for model_info (the first global layer's, else the first layer's)."""
        first = (self.global_layers or self.attention or (None,))[0]
        return {
            "model_class": self.model_class,
            "n_layers": len(self.kinds),
            "layer_kinds": _counts(self.kinds),
            "n_heads": first.n_heads if first else None,
            "n_kv_heads": first.n_kv_heads if first else None,
            "head_dim": first.head_dim if first else None,
        }


def _counts(kinds) -> str:
    return ", ".join(f"{kinds.count(k)} {k}" for k in ("global", "sliding", "recurrent", "other") if k in kinds)


def native_cache(model) -> list:
    """mlx-lm's own prompt cache for `model`: the baseline every method is compared with."""
    return make_prompt_cache(model)


def layer_kind(cache) -> str:
    if type(cache) is KVCache:
        return "global"
    if type(cache) is RotatingKVCache:
        return "sliding"
    if type(cache).__name__ in ("ArraysCache", "MambaCache"):
        return "recurrent"
    return "other"


def model_layout(model) -> ModelLayout:
    """The layout of `model`, probed once per model object (see the module docstring)."""
    layout = model.__dict__.get("_kvcompress_layout") if hasattr(model, "__dict__") else None
    if layout is None:
        layout = _probe(model)
        object.__setattr__(model, "_kvcompress_layout", layout)
    return layout


class _Recorder:
    """Mixed into the model's own cache classes for the probe: records what the model does."""

    def setup_probe(self):
        self.fetched = None  # what the last update_and_fetch returned
        self.calls = []  # one dict per attention call
        self.read_elsewhere = []  # how the model read this layer's keys outside its own attention call
        self.updating = False
        self.handed = []  # keys keys_and_values() gave the model

    def update_and_fetch(self, keys, values):
        self.updating = True  # mlx-lm's caches call keys_and_values themselves here
        try:
            self.fetched = super().update_and_fetch(keys, values)
        finally:
            self.updating = False
        return self.fetched

    def keys_and_values(self):
        # no kvcompress cache has it: a model that calls it reads the keys outside attention (AFM 7)
        held = super().keys_and_values()
        if not self.updating:
            self.read_elsewhere.append("the model reads them with the cache's keys_and_values(), as AFM 7's "
                                       "KV-reuse layers do")
            self.handed.append(held[0])  # so the calls that attend on them are this layer's readers
        return held

    def returned(self, keys) -> bool:
        """Whether `keys` is what this cache gave the model (update_and_fetch, keys_and_values)."""
        return (self.fetched is not None and keys is self.fetched[0]) or any(keys is k for k in self.handed)

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        offset, L = self.offset - queries.shape[2], queries.shape[2]
        fetched = self.fetched or (None, None)
        out = attention.original_sdpa(queries, keys, values, cache=None, scale=scale, mask=mask, sinks=sinks)
        self.calls.append({
            "output": out,
            "queries": queries.shape, "keys": keys.shape, "values": values.shape, "scale": float(scale),
            "sinks": sinks is not None,
            "own_arrays": keys is fetched[0] and values is fetched[1],
            "causal": _is_causal(mask, L, offset, keys.shape[2]),
        })
        return out


class _ProbeKV(_Recorder, KVCache):
    pass


class _ProbeRotating(_Recorder, RotatingKVCache):
    pass


def _is_causal(mask, L: int, offset: int, T: int) -> bool:
    """Whether `mask` lets query i (at position offset + i) see exactly keys 0 .. offset + i."""
    if mask is None:
        return L == 1
    if isinstance(mask, str):
        return mask == "causal"
    if T != offset + L:
        return False
    causal = mx.arange(offset, offset + L)[:, None] >= mx.arange(T)[None]
    if mask.dtype == mx.bool_:
        return bool(mx.all(mx.broadcast_to(mask, (*mask.shape[:-2], L, T)) == causal).item())
    visible = mx.broadcast_to(mask, (*mask.shape[:-2], L, T)) > -1e30  # additive: 0 where visible
    finite_zero = mx.all(mx.where(visible, mask == 0, True))
    return bool((mx.all(visible == causal) & finite_zero).item())


def _probe(model) -> ModelLayout:
    native = native_cache(model)
    kinds = tuple(layer_kind(c) for c in native)
    probes = []
    for cache in native:
        kind = layer_kind(cache)
        if kind == "global":
            probe = _ProbeKV()
        elif kind == "sliding":
            probe = _ProbeRotating(max_size=cache.max_size, keep=cache.keep)
        else:
            probe = cache
        if kind in ("global", "sliding"):
            probe.setup_probe()
        probes.append(probe)
    attention.install()
    blocks = getattr(model, "layers", None)
    # each block's RoPE module, watched during the probe: a layer that holds one and never calls it
    # (Cohere 2's and EXAONE 4's global layers are NoPE) has no RoPE
    spies = [_RopeSpy.watch(b) for b in blocks] if blocks is not None and len(blocks) == len(native) else None
    # and each block's linear modules, for the one that takes the attention output (docstring, 4)
    linears = [_InputSpy.watch(b) for b in blocks] if spies is not None else None
    error = None
    recorders = [p for p in probes if isinstance(p, _Recorder)]
    unowned = []  # attention calls without a layer's cache on keys no layer's cache returned
    try:
        with attention.routed_through(partial(_watch, recorders, unowned)):
            logits = model(mx.zeros((1, PROBE_TOKENS), mx.int32), cache=probes)
            logits = model(mx.zeros((1, 1), mx.int32), cache=probes)
        mx.eval(logits)
    except Exception as exc:  # noqa: BLE001 (any failure is a refusal, said with the model's own error)
        error = f"the probe forward pass failed ({type(exc).__name__}: {exc})"
    finally:
        ropes = [None if spy is None else spy.restore() for spy in spies] if spies is not None else None
        for watched in linears or ():
            for spy in watched:
                spy.restore()
    layers = []
    for i, (cache, kind) in enumerate(zip(probes, kinds)):
        if kind not in ("global", "sliding"):
            continue
        calls = cache.calls
        refusal = error
        if refusal is None and not calls:
            refusal = ("it computes attention itself (the attention hook never ran: e.g. soft-capped "
                       "logits, as Gemma 2), so a cache cannot attend over what it keeps")
        elif refusal is None and not all(c["own_arrays"] for c in calls):
            refusal = ("it attends over other arrays than the cache returned (e.g. MLA's latent keys "
                       "expanded per head, StableLM's keys cast to float32), so a cache that packs or "
                       "drops tokens cannot see what attention sees")
        elif refusal is None and kind == "global" and not all(c["causal"] for c in calls):
            refusal = ("its attention mask is not a plain causal mask (e.g. MLA's RoPE term added to "
                       "it), which a cache that drops or packs tokens cannot honour")
        elif refusal is None and (cache.read_elsewhere or unowned):
            how = cache.read_elsewhere[0] if cache.read_elsewhere else unowned[0]
            refusal = (f"its cached keys and values are read outside its own attention call ({how}): KV "
                       f"sharing across layers, which a cache that packs or drops tokens cannot serve (the "
                       f"reader would get codes, or tokens chosen for this layer's queries); only 'full' runs here")
        first = calls[0] if calls else None
        layers.append(AttentionLayer(
            index=i, kind=kind, window=getattr(native[i], "max_size", None) if kind == "sliding" else None,
            n_heads=first["queries"][1] if first else 0,
            n_kv_heads=first["keys"][1] if first else 0,
            head_dim=first["keys"][3] if first else 0,
            value_dim=first["values"][3] if first else 0,
            scale=first["scale"] if first else 0.0,
            sinks=any(c["sinks"] for c in calls),
            rope=ropes[i] if ropes else None,
            refusal=refusal,
            out_proj=_output_projection(first, linears[i]) if first and linears and error is None else None,
        ))
    dtype = next((c.fetched[0].dtype for c in probes if getattr(c, "fetched", None) is not None), mx.float32)
    return ModelLayout(type(model).__module__.rsplit(".", 1)[-1] + "." + type(model).__name__,
                       kinds, tuple(layers), dtype)


def _watch(recorders: list, unowned: list, queries, keys, values, cache, scale, mask, sinks=None):
    """The probe's view of one attention call, then the call itself (through the hook): whose cache
    returned `keys` (`_Recorder.returned`); a call by another layer's cache or by none is noted on
    that layer (`read_elsewhere`), a call by none on keys no cache returned in `unowned`."""
    owner = next((r for r in recorders if r.returned(keys)), None)
    if owner is not None and cache is not owner:
        by = "an attention call with cache=None" if cache is None else "another layer's attention call"
        owner.read_elsewhere.append(f"{by} attends on them, as Gemma 4's KV-shared layers and IQuest Loop "
                                    f"Coder's second loop do")
    elif owner is None and cache is None:
        unowned.append("an attention call with cache=None attends on keys no layer's cache returned, so any "
                       "layer's may be among them")
    return attention.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask,
                                                  sinks=sinks)


def trial_error(model, key: str, make_caches) -> str | None:
    """The error of a probe-sized forward pass (a 6-token prompt, one decode step) through the caches
    `make_caches()` builds, or None when it runs; once per model and `key`. For caches whose
    arrays the model itself handles (mlx-lm's QuantizedKVCache hands back tuples, and a model that
    reads `values.dtype`, as Phi-2, fails on them)."""
    trials = model.__dict__.setdefault("_kvcompress_trials", {}) if hasattr(model, "__dict__") else {}
    if key not in trials:
        try:
            caches = make_caches()
            mx.eval(model(mx.zeros((1, PROBE_TOKENS), mx.int32), cache=caches))
            mx.eval(model(mx.zeros((1, 1), mx.int32), cache=caches))
            trials[key] = None
        except Exception as exc:  # noqa: BLE001 (reported as the refusal's reason)
            trials[key] = f"{type(exc).__name__}: {exc}"
    return trials[key]


class _RopeSpy(nn.Module):
    """Stands in for a block's RoPE module during the probe and notes whether it is called."""

    def __init__(self, owner: nn.Module, rope: nn.Module):
        super().__init__()
        # plain attributes, not child modules: the owner holds the spy, so no cycle in the module tree
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_rope", rope)
        object.__setattr__(self, "_called", False)

    @classmethod
    def watch(cls, block) -> "_RopeSpy | None":
        """Put a spy in place of the block's RoPE (the first submodule attribute named `rope`)."""
        for _, module in block.named_modules():
            rope = getattr(module, "rope", None)
            if isinstance(rope, nn.Module):
                spy = cls(module, rope)
                module.rope = spy
                return spy
        return None

    def __call__(self, x, *args, **kwargs):
        object.__setattr__(self, "_called", True)
        return self._rope(x, *args, **kwargs)

    def restore(self) -> nn.Module | None:
        """Put the RoPE module back; it, if the probe called it, else None."""
        self._owner.rope = self._rope
        return self._rope if self._called else None


class _InputSpy(nn.Module):
    """Stands in for a linear module of a block during the probe and keeps its first input."""

    def __init__(self, owner: nn.Module, key: str, module: nn.Module):
        super().__init__()
        for name, value in (("_owner", owner), ("_key", key), ("_module", module), ("first_input", None)):
            object.__setattr__(self, name, value)  # plain attributes: no cycle in the module tree

    @classmethod
    def watch(cls, block) -> list["_InputSpy"]:
        """Put a spy in place of every linear module held directly as an attribute in the block."""
        found = [(module, key, child) for _, module in block.named_modules() for key, child in module.items()
                 if isinstance(child, (nn.Linear, nn.QuantizedLinear))]
        spies = []
        for module, key, child in found:
            spy = cls(module, key, child)
            setattr(module, key, spy)
            spies.append(spy)
        return spies

    def __call__(self, x, *args, **kwargs):
        if self.first_input is None:
            object.__setattr__(self, "first_input", x)
        return self._module(x, *args, **kwargs)

    def restore(self) -> None:
        setattr(self._owner, self._key, self._module)


def _output_projection(call: dict, spies: list[_InputSpy]) -> OutputProjection | None:
    """The block's linear module whose first input was the attention's first output [B, H_q, L, D_v]
    with the heads side by side, [B, L, H_q * D_v], unchanged; None where no module took it so."""
    out = call["output"]
    B, H, L, D = out.shape
    flat = out.transpose(0, 2, 1, 3).reshape(B, L, H * D)
    for spy in spies:
        x = spy.first_input
        if x is not None and x.shape == flat.shape and x.dtype == flat.dtype and mx.array_equal(x, flat).item():
            return OutputProjection(spy._module, H, D, x.dtype)
    return None


def positional_rope(rope) -> bool:
    """Whether `rope` rotates by position alone (see POSITIONAL_ROPES)."""
    return rope is not None and type(rope).__name__ in POSITIONAL_ROPES


def rope_rotations(rope, head_dim: int, count: int, start: int = 0) -> tuple[mx.array, mx.array]:
    """cos, sin [count, dims/2] of the model's own RoPE at positions start..start+count-1.

    Read off the module by rotating a probe vector (1 in the first element of every pair), so the
    base, any frequency scaling and the pair layout are the model's, not assumptions. Scaled RoPEs
    (SuScaledRoPE, YaRN) also multiply the rotated part by a constant: the pairs are divided by
    their length, leaving the rotation alone (keys carry that factor once already).
    """
    dims = getattr(rope, "dims", None) or getattr(rope, "dim", None) or head_dim  # SuScaledRoPE: `dim`
    traditional = getattr(rope, "traditional", False)
    first = mx.arange(head_dim)
    first = ((first % 2 == 0) & (first < dims)) if traditional else (first < dims // 2)
    probe = mx.zeros((1, 1, count, head_dim), mx.float32) + first.astype(mx.float32)
    out = (rope(probe, offset=start) if start else rope(probe))[0, 0]
    if traditional:
        cos, sin = out[:, 0:dims:2], out[:, 1:dims:2]
    else:
        cos, sin = out[:, : dims // 2], out[:, dims // 2 : dims]
    length = mx.sqrt(cos * cos + sin * sin)
    return cos / length, sin / length
