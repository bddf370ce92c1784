"""Ada-KV (Feng et al., 2024, arXiv:2407.11550): head-wise budgets from one top-k per layer.

Instead of k tokens in every KV head, a layer keeps the k x H highest scores across all its heads
(per batch element), so heads whose attention is concentrated give slots to heads whose attention
is spread (Alg. 1). Any eviction method's prompt scores can be used (`scorer`, default SnapKV as in
the paper); its protected sinks and window stay in every head. Rows then hold different numbers of
tokens: the batched layout pads short rows with invisible slots (eviction.PAD), which are resident
and counted in live bytes. Like SnapKV, only the prompt is compressed.

The safeguard (kvpress's `AdaKVPress`, `alpha_safeguard` 0.2; the AdaKV repository blends its floor
differently): every head first keeps its own
best `safeguard x capacity` tokens, and only the rest of the layer's budget is allocated by the one
top-k across heads, so no head is starved (and the longest row, which sets the padded layout's
resident size, stays closer to the mean). `safeguard=0` is Alg. 1 without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ...errors import check
from .scoring.delegating import Delegating


@dataclass(frozen=True)
class AdaKV(Delegating):
    """Ada-KV: a layer's budget split across its KV heads by one top-k over their scores.

    budget: mean tokens kept per KV head (int) or a fraction of the prompt (float).
    scorer: the method whose prompt scores rank tokens (its defaults; paper: snapkv; kvpress's
    leaderboard also runs expected_attention).
    safeguard: fraction of the per-head budget each head keeps from its own ranking first (0..1).
    """

    name = "adakv"
    safeguard: float = 0.2

    def __post_init__(self):
        check(isinstance(self.safeguard, (int, float)) and not isinstance(self.safeguard, bool)
              and 0 <= self.safeguard <= 1, f"{self.name}.safeguard", "a number in [0, 1]", self.safeguard)
        super().__post_init__()

    def select(self, cache, ranked, capacity):
        n_safe = int(capacity * self.safeguard)
        if n_safe:  # each head's own best first: lifted above every score the layer-wide top-k sees
            own = mx.argpartition(-ranked, kth=n_safe - 1, axis=1)[:, :n_safe]
            ranked = mx.put_along_axis(ranked, own, mx.array(mx.inf, ranked.dtype), axis=1)
        return headwise_select(cache, ranked, capacity)


def headwise_select(cache, ranked: mx.array, capacity: int, most: int | None = None) -> tuple[mx.array, mx.array]:
    """One top-k of `capacity` x heads over a layer's ranked [R, n] (per batch element), Alg. 1:
    slots to keep [R, longest] in slot order, and which are real [R, longest] (the rest pad).
    `most` (>= capacity): no head keeps more than its own best `most` (bounds the padded layout)."""
    R, n = ranked.shape
    B = cache.batch
    if most is not None and most < n:  # a head's tokens below its own top `most` cannot be chosen
        own = mx.argpartition(-ranked, kth=most - 1, axis=1)[:, :most]
        eligible = mx.put_along_axis(mx.zeros(ranked.shape, mx.bool_), own, mx.array(True), axis=1)
        ranked = mx.where(eligible, ranked, -mx.inf)
    flat = ranked.reshape(B, -1)  # [B, H * n]: one ranking across the layer's heads
    total = capacity * (R // B)
    chosen = mx.argpartition(-flat, kth=total - 1, axis=1)[:, :total]
    keep = mx.put_along_axis(mx.zeros(flat.shape, mx.bool_), chosen, mx.array(True), axis=1).reshape(R, n)
    counts = keep.sum(axis=1)
    longest = counts.max().item()
    slot = mx.arange(n)[None]
    order = mx.argsort(mx.where(keep, slot, slot + n), axis=1)[:, :longest]  # kept slots first, in order
    return order, slot[:, :longest] < counts[:, None]
