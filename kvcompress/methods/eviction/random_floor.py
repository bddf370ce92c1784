"""A random floor: every eviction picks uniformly among the unprotected tokens held; seeded.

Any method worth its cost beats this. The ranking is drawn afresh at every eviction, a counter hash
of (seed, layer, row, step, position), so a run is reproducible and independent of how the prompt
was chunked, and a token's survival does not make it safer later: a score fixed at arrival would
keep the high draws and evict the newest token in about half the steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ...errors import check, is_int
from ...kernels.counter_hash import mix
from .scoring.scored_once import ScoredOnce


@dataclass(frozen=True)
class Random(ScoredOnce):
    """Random eviction (seeded): the floor every scoring method should beat.

    budget: tokens kept per KV head (int) or a fraction of the prompt (float).
    decoding: "append" (compress the prompt once, kvpress) or "evict" (keep the budget while decoding).
    n_sink, recent: protected first tokens and recent window. seed: the draws.
    """

    name = "random"
    # 1: a fresh draw at every eviction (scores were drawn once, at arrival) and, by default, the
    # prompt compressed once
    revision = 1
    seed: int = 0

    def __post_init__(self):
        check(is_int(self.seed) and 0 <= self.seed < 2**32, f"{self.name}.seed", "an int in [0, 2**32)", self.seed)
        super().__post_init__()

    def draw(self, cache, positions: mx.array, step: int) -> mx.array:
        """Uniform [0, 1) ranks [R, n] of the tokens at `positions` [R, n] for the eviction at `step`."""
        u32 = mx.uint32
        rows = mx.arange(positions.shape[0], dtype=u32)[:, None]
        h = mix(mix(mix(mix(mx.array(self.seed, u32)) ^ mx.array(cache.layer, u32)) ^ rows) ^ mx.array(step, u32))
        h = mix(h ^ positions.astype(u32))
        return (h >> 8).astype(mx.float32) * (1.0 / (1 << 24))

    def score_new(self, cache, keys, positions):
        return mx.zeros(positions.shape, mx.float32)  # unused: every eviction draws afresh (evict_by)

    def score_prompt(self, cache, keys, queries):
        # the prompt's draw, which AdaKV(scorer="random") ranks by; `evict_by` gives the same one
        positions = mx.broadcast_to(mx.arange(keys.shape[1], dtype=mx.int32), keys.shape[:2])
        return self.draw(cache, positions, cache.position - 1)

    def evict_by(self, cache, step):
        return self.draw(cache, cache.positions, step)
