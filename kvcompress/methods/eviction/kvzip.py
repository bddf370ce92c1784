"""KVzip (Kim et al., NeurIPS 2025, arXiv:2505.23416): query-agnostic importance from context
reconstruction.

After the context is prefilled, the model re-reads it once more behind a "repeat the context"
prompt, in chunks, over the full cache (kvcompress/reconstruct.py drives that pass): for the chunk
of context positions [a, b), the input is "\\n\\nRepeat the previous context exactly." (later chunks:
"...the part of the previous context exactly, starting with" and the previous chunk's last
`postfix` tokens), the chat template's turn end, then the chunk's own tokens. A key's score is the
highest attention any of those queries, in any query head of its KV group, pays it:
s_j = max over (g, t) of softmax_j(q_gt . k / sqrt(d)), the softmax taken, as in the reference code,
over the sinks, the chunk's keys and the repeated tokens' keys (causal) only. Keys a reconstruction
needs are kept; the prompt is compressed once and generated tokens are appended (as the paper).

Head-wise budgets: one top-k over all KV heads of a layer (kvpress's KVzipPress takes it through
AdaKV's compression without the safeguard; KVzip's own code thresholds all heads and layers at
once). Rows are then of different lengths, padded to the layer's longest (resident, counted).
`headwise=False` keeps `budget` tokens in every head. A padded layout holds the longest row in
every head: uncapped, KVzip's head-wise choice held 0.77 of the full cache at budget 0.5 on the
embedded model (a 1k-token passkey context; heads of 12 to 1012 tokens), 55% above its budget, and
0.46 at 0.25. So by default no head
keeps more than `max_head_share` = 1.03 x the per-head budget: with the int32 position each slot
also holds (2-3% of a bfloat16 or float32 key and value at 64 dims), resident bytes stay within 5%
of the budget; `max_head_share=None` is the paper's uncapped allocation.

`kvzip_plus`: kvpress's KVzip+ normalisation, each query head's probability times the size of the
key's contribution to the output, ||W_o^h v_j||_2 (W_o^h: that head's columns of the layer's output
projection), before the max.

Departures (docs/methods.md): the head cap above; the budget is per layer (as every method here; KVzip's default ranks
all layers together), so each layer's resident bytes stay at the budget; the whole held prompt is
the context reconstructed and its first `n_sink` tokens are the kept "system prompt" (our prompts
have no separate one; kvpress: n_sink = 4); KVzip+ leaves out kvpress's division by the query
token's hidden-state norm (a cache sees queries, not the layer's input).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx

from ...errors import ConfigError, check, is_int
from .adakv import headwise_select
from .base import Eviction
from .scoring.prompt_scores import TILE_ELEMENTS, folded_logits


@dataclass(frozen=True)
class KVzip(Eviction):
    """KVzip: keys ranked by the attention a reconstruction of the context pays them; head-wise budgets.

    budget: mean tokens kept per KV head (int) or a fraction of the prompt (float).
    n_sink: first tokens always kept and attended in every chunk's scoring (kvpress 4).
    chunk_size: context tokens reconstructed per forward pass (kvpress 2048; KVzip's code 2000).
    postfix: tokens of the previous chunk quoted in a later chunk's prompt (8, both).
    headwise: one top-k across a layer's KV heads (True, the paper) or `budget` per head.
    max_head_share: with headwise, the most a head keeps, as a multiple of the per-head budget (1.03:
    the padded layout within 5% of the budget; None: uncapped, the paper).
    kvzip_plus: weight each query head's attention by ||W_o^h v||_2 (kvpress's KVzip+; False).
    """

    name = "kvzip"
    decode = "grow"
    reconstructs: ClassVar[bool] = True
    budget: int | float = 0.5
    n_sink: int = 4
    chunk_size: int = 2048
    postfix: int = 8
    headwise: bool = True
    max_head_share: float | None = 1.03
    kvzip_plus: bool = False

    def __post_init__(self):
        n = self.name
        check(is_int(self.chunk_size) and self.chunk_size >= 1, f"{n}.chunk_size", "an int >= 1", self.chunk_size)
        check(is_int(self.postfix) and self.postfix >= 0, f"{n}.postfix", "an int >= 0", self.postfix)
        check(isinstance(self.headwise, bool), f"{n}.headwise", "true or false", self.headwise)
        share = self.max_head_share
        check(share is None or (isinstance(share, (int, float)) and not isinstance(share, bool) and share >= 1),
              f"{n}.max_head_share", "a number >= 1 or null (uncapped)", share)
        check(isinstance(self.kvzip_plus, bool), f"{n}.kvzip_plus", "true or false", self.kvzip_plus)
        super().__post_init__()

    def layer_cache(self, layer, i, n, layout):
        if self.kvzip_plus and layer.out_proj is None:
            raise ConfigError(
                f"{self.name}.kvzip_plus: {layout.model_class} layer {layer.index} has no output projection that "
                f"takes its attention heads' outputs as they are (kvcompress/adapter.py found none), so W_o v is "
                f"unknown; use kvzip_plus=false")
        return super().layer_cache(layer, i, n, layout)

    @property
    def reads_output_projection(self) -> bool:
        return self.kvzip_plus

    def score_chunk(self, cache, queries, repeat_keys, start: int, end: int):
        """Raise the scores of context keys [start, end) to the most attention the chunk's queries
        pay them. queries [R, G, S, D] post-RoPE, the repeated tokens', at positions
        cache.position .. + S - 1; repeat_keys [R, S, D] their keys (not held)."""
        R, G, S, D = queries.shape
        keys = cache.keys  # [R, T, D] the context, positions 0..T-1
        sink = min(self.n_sink, start)
        attended = mx.concatenate([keys[:, :sink], keys[:, start:end], repeat_keys], axis=1)  # [R, n, D]
        n, width = attended.shape[1], end - start
        weights = self._output_weights(cache, start, end) if self.kvzip_plus else None  # [R, G, width]
        # the reference code's softmax is over these keys only; the queries go in tiles (each row's
        # softmax is whole, so the max over tiles is exact) to bound the [R, G, q, n] logits
        tile = max(1, TILE_ELEMENTS // (R * G * n))
        best = None
        for t0 in range(0, S, tile):
            t1 = min(S, t0 + tile)
            logits = folded_logits(queries[:, :, t0:t1], attended, cache.scale)  # [R, G, q, n]
            # repeated token t sees the sinks, the chunk, and repeated tokens 0..t
            visible = mx.arange(n)[None, :] < (sink + width + mx.arange(t0, t1) + 1)[:, None]  # [q, n]
            probs = mx.softmax(mx.where(visible, logits, -mx.inf), axis=-1, precise=True)[..., sink : sink + width]
            if weights is not None:
                probs = probs * weights[:, :, None]
            top = probs.max(axis=(1, 2))  # [R, width]
            best = top if best is None else mx.maximum(best, top)
            mx.eval(best)
        cache._scores[:, start:end] = best

    def _output_weights(self, cache, start: int, end: int) -> mx.array:
        """||W_o^h v_j||_2 of each query head h of a row's group, [R, G, end - start] float32."""
        values = cache.values[:, start:end].astype(mx.float32)  # [R, w, D]
        R = values.shape[0]
        H = R // cache.batch
        weight = cache.out_proj.per_head()  # [H_q, D, hidden]
        G = weight.shape[0] // H
        weight = weight.reshape(H, G, *weight.shape[1:])
        per_head = values.reshape(cache.batch, H, 1, -1, values.shape[-1])  # [B, H, 1, w, D]
        norms = mx.linalg.norm(per_head @ weight[None], axis=-1)  # [B, H, G, w]
        return norms.reshape(R, G, -1)

    def score_prompt(self, cache, keys, queries):
        if not cache.reconstructed:
            raise RuntimeError(
                "kvzip scores the prompt by reconstructing it: prefill it with kvcompress.compress_prompt(model, "
                "tokenizer, cache, prompt) (the sweep runner does this itself), then generate")
        return cache.scores  # [R, T]: the reconstruction pass's maxima (sinks are protected anyway)

    def select(self, cache, ranked, capacity):
        if not self.headwise:
            return super().select(cache, ranked, capacity)
        most = None if self.max_head_share is None else max(capacity, int(self.max_head_share * capacity))
        return headwise_select(cache, ranked, capacity, most)
