"""CriticalKV (Feng et al., 2025, arXiv:2502.03805): any scorer's prompt scores re-weighted by how
much a token's value can move the layer's output.

A token's contribution to the attention output is its attention times W_o v projected through the
layer's output projection, so the scorer's score a_j is weighted by the L1 norm of the projected
value, ||W_o^h v_j||_1 (W_o^h: query head h's columns of the output projection), averaged over the
KV head's query group: a'_j = (a_j + epsilon) * mean_h ||W_o^h v_j||_1. Selection has two stages
(the paper's, as kvpress's `CriticalKVPress`): first each head keeps the top
int(first_stage_ratio x capacity) tokens by the scorer's own ranking (protected tokens first), then
the rest of its budget by a'. Defaults as kvpress: epsilon 1e-4, first_stage_ratio 0.5, scorer
(here) SnapKV at its defaults. Only the prompt is compressed, as the scorers' prompt compression.

The output projection is the module the adapter's probe found consuming the heads' outputs side by
side (kvcompress/adapter.py); where there is none (an attention whose output is gated or mixed
before its projection), `make_cache` refuses. Its weight is read by applying the module to the
identity (minus its bias), so quantized projections work too.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ...errors import ConfigError, check
from .scoring.delegating import Delegating

TILE_ELEMENTS = 1 << 24  # float32 elements of one [R, tokens, hidden] projection tile


@dataclass(frozen=True)
class CriticalKV(Delegating):
    """CriticalKV: a scorer's scores times the L1 norm of the output-projected values, two-stage.

    budget: tokens kept per KV head (int) or a fraction of the prompt (float).
    scorer: the method whose prompt scores are re-weighted (its defaults).
    epsilon: added to the scores before the re-weighting (kvpress 1e-4).
    first_stage_ratio: fraction of each head's budget kept by the scorer's ranking alone (kvpress 0.5).
    """

    name = "criticalkv"
    reads_output_projection = True
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5

    def __post_init__(self):
        n = self.name
        check(isinstance(self.epsilon, (int, float)) and not isinstance(self.epsilon, bool) and self.epsilon >= 0,
              f"{n}.epsilon", "a number >= 0", self.epsilon)
        check(isinstance(self.first_stage_ratio, (int, float)) and not isinstance(self.first_stage_ratio, bool)
              and 0 <= self.first_stage_ratio <= 1, f"{n}.first_stage_ratio", "a number in [0, 1]",
              self.first_stage_ratio)
        super().__post_init__()

    def layer_cache(self, layer, i, n, layout):
        if layer.out_proj is None:
            raise ConfigError(
                f"{self.name}: {layout.model_class} layer {layer.index} has no output projection that takes its "
                f"attention heads' outputs as they are (kvcompress/adapter.py found none), so W_o v is unknown")
        return super().layer_cache(layer, i, n, layout)

    def select(self, cache, ranked, capacity):
        # ranked [R, n]: the scorer's scores, protected tokens +inf
        first = int(capacity * self.first_stage_ratio)
        lifted = mx.zeros(ranked.shape, mx.bool_)
        if first:
            top = mx.argpartition(-ranked, kth=first - 1, axis=1)[:, :first]
            lifted = mx.put_along_axis(lifted, top, mx.array(True), axis=1)
        weighted = (cache.scorer.linear_scores(ranked) + self.epsilon) * projected_value_norms(cache)
        ranked = mx.where(lifted | (ranked == mx.inf), mx.inf, weighted)
        return super().select(cache, ranked, capacity)


def projected_value_norms(cache) -> mx.array:
    """mean over a KV head's query group of ||W_o^h v_j||_1 -> [R, n] float32 (cache.values [R, n, D])."""
    if cache.out_proj is None:
        raise RuntimeError("criticalkv needs the layer's output projection: make the cache with make_cache, "
                           "load a saved one with kvcompress.load_prompt_cache(path, model)")
    values = cache.values.astype(mx.float32)
    R, n, D = values.shape
    B = cache.batch
    H = R // B
    weight = cache.out_proj.per_head()  # [H_q, D, hidden]
    G = weight.shape[0] // H
    weight = weight.reshape(H, G, D, -1)
    per_batch = values.reshape(B, H, n, D)
    step = max(1, TILE_ELEMENTS // (R * weight.shape[-1]))
    norms = []
    for t0 in range(0, n, step):
        v = per_batch[:, :, t0 : t0 + step]  # [B, H, t, D]
        total = 0
        for g in range(G):  # one query head of each group at a time: [B, H, t, hidden]
            total = total + mx.abs(v @ weight[None, :, g]).sum(axis=-1)
        norms.append((total / G).reshape(R, -1))
        mx.eval(norms[-1])
    return mx.concatenate(norms, axis=1)
