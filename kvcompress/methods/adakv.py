"""Ada-KV (Feng et al., 2024, arXiv:2407.11550): head-wise budgets from one top-k per layer.

Instead of k tokens in every KV head, a layer keeps the k x H highest scores across all its heads
(per batch element), so heads whose attention is concentrated give slots to heads whose attention
is spread (Alg. 1). Any eviction method's prompt scores can be used (`scorer`, default SnapKV as in
the paper); its protected sinks and window stay in every head. Rows then hold different numbers of
tokens: the batched layout pads short rows with invisible slots (eviction.PAD), which are resident
and counted in live bytes. Like SnapKV, only the prompt is compressed. Not included: the
"safeguard" minimum per head of later versions of the paper's code.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..errors import check
from .eviction import Eviction

SCORERS = ("snapkv", "h2o", "tova", "knorm", "keyformer", "streaming", "random")


@dataclass(frozen=True)
class AdaKV(Eviction):
    """Ada-KV: a layer's budget split across its KV heads by one top-k over their scores.

    budget: mean tokens kept per KV head (int) or a fraction of the prompt (float).
    scorer: the method whose prompt scores rank tokens (its defaults; paper: snapkv).
    """

    name = "adakv"
    decode = "grow"
    budget: int | float = 0.5
    scorer: str = "snapkv"

    def __post_init__(self):
        check(self.scorer in SCORERS, f"{self.name}.scorer", f"one of {SCORERS}", self.scorer)
        super().__post_init__()

    @property
    def needs_queries(self) -> bool:
        return self.scoring().needs_queries

    def scoring(self) -> Eviction:
        from . import REGISTRY  # the registry imports this module

        return REGISTRY[self.scorer](budget=self.budget)

    def resolve(self, prompt_tokens: int, layer: int = 0, n_layers: int = 1) -> tuple[int, int]:
        return self.scoring().resolve(prompt_tokens, layer, n_layers)

    @property
    def n_sink(self) -> int:
        return self.scoring().n_sink

    def select(self, cache, ranked, capacity):
        R, n = ranked.shape
        B = cache.batch
        flat = ranked.reshape(B, -1)  # [B, H * n]: one ranking across the layer's heads
        total = capacity * (R // B)
        chosen = mx.argpartition(-flat, kth=total - 1, axis=1)[:, :total]
        keep = mx.put_along_axis(mx.zeros(flat.shape, mx.bool_), chosen, mx.array(True), axis=1).reshape(R, n)
        counts = keep.sum(axis=1)
        longest = counts.max().item()
        slot = mx.arange(n)[None]
        order = mx.argsort(mx.where(keep, slot, slot + n), axis=1)[:, :longest]  # kept slots first, in order
        return order, slot[:, :longest] < counts[:, None]
