"""DuoAttention (Xiao et al., ICLR 2025, arXiv:2410.10819): retrieval heads and streaming heads.

A few KV heads ("retrieval heads") need the whole context; the others ("streaming heads") attend
only to the first `n_sink` tokens and the newest `recent` (StreamingLLM). Retrieval heads keep
every token, streaming heads keep sinks + window, and both keep doing so while decoding. Which
heads stream: the lowest-scoring ones of one ranking over every KV head of every compressed layer
(kvpress's `DuoAttentionPress`), by one of two head scores:

- `pattern`: a file of per-layer per-KV-head retrieval scores, [layers, KV heads] for the layers
  this method compresses (the model's global attention layers, in order): DuoAttention's shipped
  `full_attention_heads.tsv` (tab-separated rows), a `.npy` array, or a `.json` list of lists.
  Scores are clipped to [0, 1], as DuoAttention's `load_attn_pattern` and kvpress do.
- none (default): kvpress's on-the-fly estimate (`duo_attention_on_the_fly`): per layer the mean
  pre-RoPE query and key over sample sequences, each repeated over QUERY_TOKENS positions and
  rotated there; a query head's score is the area under the cumulative attention curve of the
  last query, averaged over the KV head's query group and the samples.

Defaults as DuoAttention's released patterns (and kvpress's on-the-fly mode): 128 sinks, 256 recent.
A streaming head is the eviction base's StreamingLLM cache: between steps it holds the sinks and the
newest `recent` tokens, and a decode step's query sees those and itself.

Where we depart, and why:
- The share of streaming heads comes from `budget` (the knob every sweep varies), not from
  kvpress's `head_compression_ratio`: with a prompt of T tokens, a budget of C tokens per KV head
  and W = n_sink + recent, a fraction s = (T - C) / (T - W) of the heads streams (kvpress's
  head_compression_ratio = s), so the mean tokens held over heads is C. The paper trains its gates
  and thresholds them instead; this ranks the same scores.
- The on-the-fly samples are SAMPLES seeded random token sequences of SAMPLE_TOKENS tokens, not 50
  BookSum chapters: nothing can be downloaded here, and `make_cache` gets a model, not a
  tokenizer. Computed once per model object.
- Memory is freed, not masked: kvpress masks streaming heads' middle tokens in attention and keeps
  them resident; here retrieval heads and streaming heads live in separate arrays (a full KVCache
  for the first, the eviction base's StreamingLLM cache for the second), so resident bytes are
  the budget's.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache, create_attention_mask

from ...adapter import AttentionLayer, model_layout, native_cache, rope_rotations
from ...attention import install
from ...errors import ConfigError, check, is_int
from ...kernels.evict import rotate_pairs
from ..base import CompressedCache, array_bytes
from ..registry import method_config
from .base import PAD, Eviction, EvictionCache
from .streaming import Streaming

SAMPLES, SAMPLE_TOKENS, QUERY_TOKENS = 4, 256, 500  # kvpress: 50 texts, q_len 500
SAMPLE_SEED = 42
PATTERN_SUFFIXES = (".tsv", ".txt", ".npy", ".json")


@dataclass(frozen=True)
class DuoAttention(Eviction):
    """DuoAttention: retrieval heads keep every token, streaming heads sinks + a recent window.

    budget: mean tokens kept per KV head (int) or a fraction of the prompt (float); sets the share
    of streaming heads. n_sink, recent: what a streaming head keeps (paper's patterns: 128, 256).
    pattern: a file of per-layer per-KV-head retrieval scores (module docstring); None: on the fly.
    """

    name = "duoattention"
    decode = "fixed"  # streaming heads keep evicting while decoding
    budget: int | float = 0.5
    n_sink: int = 128
    recent: int = 256
    pattern: str | None = None

    def __post_init__(self):
        n = self.name
        check(is_int(self.recent) and self.recent >= 1, f"{n}.recent", "an int >= 1 (window tokens)", self.recent)
        check(self.pattern is None or (isinstance(self.pattern, str) and Path(self.pattern).suffix in PATTERN_SUFFIXES),
              f"{n}.pattern", f"None or a path ending in one of {PATTERN_SUFFIXES}", self.pattern)
        if self.pattern is not None and not Path(self.pattern).is_file():
            raise ConfigError(f"{n}.pattern: expected an existing file, got {self.pattern!r}")
        super().__post_init__()

    def streaming(self) -> Streaming:
        """What a streaming head is: StreamingLLM with n_sink + recent tokens."""
        return Streaming(budget=self.n_sink + self.recent, n_sink=self.n_sink)

    def streaming_heads(self, scores: list[np.ndarray], prompt_tokens: int) -> list[np.ndarray]:
        """Which KV heads stream, per layer (bool [H_kv] each), for a prompt of `prompt_tokens`: the
        round(s x heads) lowest scores over all layers, s = (T - C) / (T - n_sink - recent)."""
        capacity, _ = self.resolve(prompt_tokens)
        flat = np.concatenate(scores)
        streams = np.zeros(flat.size, bool)
        if capacity < prompt_tokens:
            share = (prompt_tokens - capacity) / (prompt_tokens - self.n_sink - self.recent)
            streams[np.argsort(flat, kind="stable")[: round(share * flat.size)]] = True
        return np.split(streams, np.cumsum([s.size for s in scores])[:-1])

    def make_cache(self, model) -> list:
        install()
        layout = model_layout(model)
        targets = layout.targets(self.name, self.layers)
        for i, layer in enumerate(targets):  # the eviction base refuses what it cannot serve, before scoring
            self.streaming().layer_cache(layer, i, len(targets), layout)
        scores = self.head_scores(model, targets)
        caches = native_cache(model)
        for i, layer in enumerate(targets):
            caches[layer.index] = DuoAttentionCache(self, scores, i, layer.n_heads, layer.n_kv_heads, layer.head_dim,
                                                    layer.rope, layer.scale)
        return caches

    def head_scores(self, model, targets: tuple[AttentionLayer, ...]) -> list[np.ndarray]:
        """Retrieval scores [H_kv] per compressed layer: the pattern file's, else on the fly."""
        if self.pattern is None:
            return on_the_fly_scores(model, targets)
        return load_pattern(self.pattern, [layer.n_kv_heads for layer in targets], f"{self.name}.pattern")


def load_pattern(path: str, heads: list[int], field: str) -> list[np.ndarray]:
    """A pattern file's scores, clipped to [0, 1]; ConfigError unless it is [len(heads), heads]."""
    suffix = Path(path).suffix
    try:
        if suffix == ".npy":
            scores = np.load(path, allow_pickle=False)
        elif suffix == ".json":
            scores = np.array(json.loads(Path(path).read_text()), dtype=np.float64)
        else:
            scores = np.loadtxt(path, dtype=np.float64, delimiter="\t", ndmin=2)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{field}: cannot read {path!r} as per-layer per-KV-head scores: {exc}") from exc
    expected = (len(heads), heads[0])
    if len(set(heads)) != 1 or scores.shape != expected or not np.isfinite(scores).all():
        raise ConfigError(f"{field}: expected finite scores of shape [compressed layers, KV heads] = "
                          f"{list(expected) if len(set(heads)) == 1 else heads} for this model, got "
                          f"shape {list(scores.shape)} from {path!r}")
    return list(np.clip(scores, 0.0, 1.0))


# -- on-the-fly head scores (kvpress's duo_attention_on_the_fly) ------------------------------------


def area_scores(mean_q: mx.array, mean_k: mx.array, rope, scale: float, length: int = QUERY_TOKENS) -> mx.array:
    """Scores [B, H_kv] from mean pre-RoPE queries [B, H_q, D] and keys [B, H_kv, D]: each repeated
    at positions 0..length-1 and rotated there (the model's own RoPE; none where it has none), the
    last query's softmax attention over the keys, cumulated over key positions and averaged (the
    area under the cumulative attention curve), then averaged over each KV head's query group."""
    B, H_q, D = mean_q.shape
    H = mean_k.shape[1]
    q = mx.broadcast_to(mean_q[:, :, None].astype(mx.float32), (B, H_q, length, D))
    k = mx.broadcast_to(mean_k[:, :, None].astype(mx.float32), (B, H, length, D))
    if rope is not None:
        q, k = rope(q), rope(k)
    last = q[:, :, -1].reshape(B, H, H_q // H, D)  # [B, H_kv, G, D]
    logits = (last @ k.swapaxes(-1, -2)) * scale  # [B, H_kv, G, length]
    probs = mx.softmax(logits, axis=-1, precise=True)
    return mx.cumsum(probs, axis=-1).mean(axis=-1).mean(axis=-1)


class _Recorder(KVCache):
    """A full KVCache that keeps the post-RoPE queries it attends with."""

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        self.queries = queries  # [B, H_q, T, D]
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


_ON_THE_FLY: dict[int, tuple[weakref.ref, list[np.ndarray]]] = {}  # id(model) -> (model, scores)


def on_the_fly_scores(model, targets: tuple[AttentionLayer, ...]) -> list[np.ndarray]:
    """Scores [H_kv] per target layer from one forward pass over SAMPLES seeded random sequences:
    each layer's pre-RoPE queries and keys (post-RoPE ones rotated back), averaged over the
    sequence, then `area_scores`, averaged over the samples. Cached per model object."""
    held = _ON_THE_FLY.get(id(model))
    if held is not None and held[0]() is model:
        return held[1]
    install()
    vocab = model(mx.zeros((1, 1), mx.int32)).shape[-1]
    rng = np.random.default_rng(SAMPLE_SEED)
    tokens = mx.array(rng.integers(0, vocab, (SAMPLES, SAMPLE_TOKENS)), mx.int32)
    caches = native_cache(model)
    for layer in targets:
        caches[layer.index] = _Recorder()
    mx.eval(model(tokens, cache=caches))
    scores = []
    for layer in targets:
        recorder = caches[layer.index]
        q, k = recorder.queries, recorder.keys[:, :, :SAMPLE_TOKENS]
        if layer.rope is not None:  # back to pre-RoPE: rotate each position by minus its angle
            cos, sin = rope_rotations(layer.rope, layer.head_dim, SAMPLE_TOKENS)
            traditional = getattr(layer.rope, "traditional", False)
            q, k = rotate_pairs(q, cos, -sin, traditional), rotate_pairs(k, cos, -sin, traditional)
        per_sample = area_scores(q.astype(mx.float32).mean(axis=2), k.astype(mx.float32).mean(axis=2),
                                 layer.rope, layer.scale)
        scores.append(np.array(per_sample.mean(axis=0), dtype=np.float64))
    _ON_THE_FLY[id(model)] = (weakref.ref(model), scores)
    return scores


# -- the cache ------------------------------------------------------------------------------------


class DuoAttentionCache(CompressedCache):
    """One layer: a full KVCache over the prompt until it is complete (the first single-token call,
    as the eviction base), then retrieval heads in a full KVCache and streaming heads in a
    StreamingLLM EvictionCache; attention runs over each and the outputs go back in head order."""

    def __init__(self, config: DuoAttention, scores: list[np.ndarray], layer: int, n_heads: int, n_kv_heads: int,
                 head_dim: int, rope, scale: float):
        self.config, self.scores, self.layer = config, scores, layer
        self.n_heads, self.n_kv_heads, self.head_dim, self.scale = n_heads, n_kv_heads, head_dim, scale
        self.prompt = KVCache()  # every head, until the prompt is complete
        self.retrieval: KVCache | None = None
        self.streaming: EvictionCache | None = None
        self.streams: np.ndarray | None = None  # bool [H_kv] once the prompt is complete
        self._split = None  # see _indices
        self.offset = 0
        self.rope = rope

    @property
    def rope(self):
        return self._rope

    @rope.setter
    def rope(self, rope):
        self._rope = rope
        if self.streaming is not None:
            self.streaming.rope = rope

    def attach(self, layer) -> None:
        self.rope = layer.rope

    # -- head groups ---------------------------------------------------------------------------

    def _heads(self, streams: bool) -> np.ndarray:
        return np.nonzero(self.streams == streams)[0]

    def _indices(self):
        """(KV-head index, query-head index) of the retrieval and the streaming group, and the
        permutation from the groups' concatenated query heads back to the model's order; built once
        after the split (a decode step then builds no index arrays)."""
        if self._split is None:
            G = self.n_heads // self.n_kv_heads
            groups = [(self._heads(streams), (self._heads(streams)[:, None] * G + np.arange(G)).reshape(-1))
                      for streams in (False, True)]
            back = np.argsort(np.concatenate([q for kv, q in groups if kv.size]))
            self._split = ([(mx.array(kv, mx.int32), mx.array(q, mx.int32)) for kv, q in groups],
                           mx.array(back, mx.int32))
        return self._split

    def _complete_prompt(self, keys, values):
        """Split the prompt's keys/values [B, H_kv, T, D] into the two head groups."""
        T = keys.shape[2]
        self.streams = self.config.streaming_heads(self.scores, T)[self.layer]
        self.prompt, self._split = None, None
        retrieval, streaming = self._heads(False), self._heads(True)
        if retrieval.size:
            self.retrieval = KVCache()
            index = mx.array(retrieval, mx.int32)
            self.retrieval.state = (keys[:, index], values[:, index], T)
        if streaming.size:
            index = mx.array(streaming, mx.int32)
            self.streaming = EvictionCache(self.config.streaming(), self.layer, 1, int(streaming.size), self.head_dim,
                                           self.rope, self.scale)
            self.streaming.from_prefill(keys[:, index], values[:, index])
        mx.eval(self.state[:-1])

    # -- mlx-lm protocol -------------------------------------------------------------------------

    def update_and_fetch(self, keys, values):
        # keys, values: [B, H_kv, S, D] post-RoPE
        self.offset += keys.shape[2]
        if self.prompt is not None:
            return self.prompt.update_and_fetch(keys, values)
        self._fetched = [None, None]
        groups, _ = self._indices()
        for i, part in enumerate((self.retrieval, self.streaming)):
            if part is not None:
                index = groups[i][0]
                self._fetched[i] = part.update_and_fetch(keys[:, index], values[:, index])
        return keys, values  # attention() reads the parts' own

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        # queries [B, H_q, S, D]
        S = queries.shape[2]
        causal = "causal" if S > 1 else None
        if self.prompt is not None:
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=causal, sinks=sinks)
            if S == 1:
                self._complete_prompt(*self.prompt.keys_and_values())
            return out
        outs = []
        groups, back = self._indices()
        for i, part in enumerate((self.retrieval, self.streaming)):
            if part is None:
                continue
            index = groups[i][1]
            q, s = queries[:, index], None if sinks is None else sinks[index]
            k, v = self._fetched[i]
            if i == 0:
                outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=causal, sinks=s))
            else:
                outs.append(part.attention(q, k, v, scale, mask, sinks=s))
        self._fetched = None
        if len(outs) == 1:
            return outs[0]
        return mx.concatenate(outs, axis=1)[:, back]  # the groups' query heads back in the model's order

    def from_prefill(self, keys, values, queries=None):
        """Split a finished full-attention prefill (keys, values [B, H_kv, T, D])."""
        self.config.resolve(keys.shape[2])  # reject before any work
        self.offset = keys.shape[2]
        self._complete_prompt(keys, values)

    def make_mask(self, N, return_array=False, window_size=None):
        return create_attention_mask(N, self.offset, return_array, window_size)

    def empty(self):
        return self.offset == 0

    # -- what it holds ---------------------------------------------------------------------------

    @property
    def tokens_kept(self) -> int:
        """Tokens held per KV head, the mean over heads (retrieval and streaming heads differ)."""
        if self.prompt is not None:
            return self.prompt.offset
        held = self.retrieval.offset * self._heads(False).size if self.retrieval is not None else 0
        if self.streaming is not None:
            held += self.streaming.tokens_kept * self._heads(True).size
        return round(held / self.n_kv_heads)

    @property
    def live_kv_bytes(self) -> int:
        if self.prompt is not None:
            return 0 if self.prompt.empty() else array_bytes(*self.prompt.keys_and_values())
        held = array_bytes(*self.retrieval.keys_and_values()) if self.retrieval is not None else 0
        return held + (self.streaming.live_kv_bytes if self.streaming is not None else 0)

    def kept_positions(self) -> mx.array | None:
        """[B * H_kv, n] true positions (PAD: a streaming head's empty slot), n the longest head's."""
        if self.prompt is not None:
            return None
        return self._padded()[0]

    def held_kv(self) -> tuple[mx.array, mx.array]:
        if self.prompt is not None:
            return self.prompt.keys_and_values()
        return self._padded()[1:]

    def _padded(self):
        """Both head groups in one padded view, in the model's head order (for evidence survival)."""
        positions, keys, values, heads = [], [], [], []
        n = self.retrieval.offset if self.retrieval is not None else self.streaming.length
        if self.retrieval is not None:
            k, v = self.retrieval.keys_and_values()
            positions.append(mx.broadcast_to(mx.arange(n, dtype=mx.int32), (k.shape[0], k.shape[1], n)))
            keys.append(k), values.append(v), heads.append(self._heads(False))
        if self.streaming is not None:
            k, v = self.streaming.held_kv()  # [B, H_s, m, D], m <= n
            B, H_s, m, D = k.shape
            p = self.streaming.kept_positions().reshape(B, H_s, m)
            pad = n - m
            positions.append(mx.pad(p, ((0, 0), (0, 0), (0, pad)), constant_values=PAD))
            keys.append(mx.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0))))
            values.append(mx.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0))))
            heads.append(self._heads(True))
        back = mx.array(np.argsort(np.concatenate(heads)), mx.int32)
        positions = mx.concatenate(positions, axis=1)[:, back]
        B = positions.shape[0]
        return (positions.reshape(B * self.n_kv_heads, n), mx.concatenate(keys, axis=1)[:, back],
                mx.concatenate(values, axis=1)[:, back])

    # -- save / load -----------------------------------------------------------------------------

    @property
    def state(self):
        # [keys, values] of the prompt or of the retrieval heads (None where none), the streaming
        # part's state (None x 7 where none), then everything else as JSON
        if self.prompt is not None:
            kv = list(self.prompt.keys_and_values()) if not self.prompt.empty() else [None, None]
        else:
            kv = list(self.retrieval.keys_and_values()) if self.retrieval is not None else [None, None]
        part = list(self.streaming.state) if self.streaming is not None else [None] * 8  # EvictionCache.state's
        return [*kv, *part, self.meta_state]

    @state.setter
    def state(self, v):
        keys, values, *part, meta = v
        self.meta_state = meta
        held = None if keys is None else keys.shape[2]
        if self.streams is None:
            self.prompt = KVCache()
            if keys is not None:
                self.prompt.state = (keys, values, held)
            self.retrieval = None
        else:
            self.prompt = None
            self.retrieval = None if keys is None else KVCache()
            if keys is not None:
                self.retrieval.state = (keys, values, held)
        self.streaming = None if part[0] is None else EvictionCache.from_state(part)
        self._rope = None  # kvcompress.load_prompt_cache(path, model) gives it back

    @property
    def meta_state(self) -> str:
        streams = None if self.streams is None else self.streams.tolist()
        return json.dumps({"config": json.loads(self.config.to_json()), "scores": [s.tolist() for s in self.scores],
                           "layer": self.layer, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
                           "head_dim": self.head_dim, "scale": self.scale, "offset": self.offset,
                           "streams": streams})

    @meta_state.setter
    def meta_state(self, v):
        meta = json.loads(v)
        self.config = method_config(**meta["config"])
        self.scores = [np.array(s, np.float64) for s in meta["scores"]]
        self.layer, self.n_heads, self.n_kv_heads = meta["layer"], meta["n_heads"], meta["n_kv_heads"]
        self.head_dim, self.scale, self.offset = meta["head_dim"], meta["scale"], meta["offset"]
        self.streams = None if meta["streams"] is None else np.array(meta["streams"], bool)
        self._split = None


# mlx-lm's load_prompt_cache looks cache classes up by name in mlx_lm.models.cache's globals.
setattr(mlx_cache, "DuoAttentionCache", DuoAttentionCache)
