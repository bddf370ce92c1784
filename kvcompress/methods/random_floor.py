"""A random floor: every token gets a seeded uniform score when it arrives; the lowest goes.

Any method worth its cost beats this. The score is a counter hash of (seed, layer, row, position),
so a run is reproducible and independent of how the prompt was chunked.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..errors import check, is_int
from .eviction import Eviction
from .counter_hash import mix


@dataclass(frozen=True)
class Random(Eviction):
    """Random eviction (seeded): the floor every scoring method should beat.

    budget: tokens kept per KV head (int) or a fraction of the prompt (float). seed: the draw.
    """

    name = "random"
    decode = "fixed"
    budget: int | float = 0.5
    seed: int = 0

    def __post_init__(self):
        check(is_int(self.seed) and 0 <= self.seed < 2**32, f"{self.name}.seed", "an int in [0, 2**32)", self.seed)
        super().__post_init__()

    def score_new(self, cache, keys, positions):
        u32 = mx.uint32
        rows = mx.arange(positions.shape[0], dtype=u32)[:, None]
        h = mix(mix(mix(mx.array(self.seed, u32)) ^ mx.array(cache.layer, u32)) ^ rows)
        h = mix(h ^ positions.astype(u32))
        return (h >> 8).astype(mx.float32) * (1.0 / (1 << 24))
