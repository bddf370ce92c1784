"""The base of methods that score a token once, from its key alone (KNorm, random): no queries.

Such a ranking can compress the prompt once, as kvpress's presses do (`decoding="append"`, the
default): the prompt is cut to the budget and generated tokens are appended without eviction. Or
it can keep the cache at its budget while decoding (`decoding="evict"`): every step evicts the
lowest-ranked unprotected token. A new token then competes with survivors that were selected for
their high ranks, so with a fixed score it is evicted on arrival far more often than chance: KNorm
with neither sinks nor a recent window evicted the answer it was generating (0/8 on passkey at 50%,
8/8 with prompt-only compression). Decode-time eviction therefore asks for protected tokens where
the score is fixed (`n_sink`, `recent`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ....errors import check
from ..base import Eviction

DECODINGS = ("append", "evict")


@dataclass(frozen=True)
class ScoredOnce(Eviction):
    """Base config: `decoding` "append" (compress the prompt once, kvpress) or "evict" (keep the
    budget while decoding); `n_sink` first tokens and a `recent` window are protected."""

    budget: int | float = 0.5
    decoding: str = "append"
    n_sink: int = 0
    recent: int | float = 0

    def __post_init__(self):
        check(self.decoding in DECODINGS, f"{self.name}.decoding", f"one of {DECODINGS}", self.decoding)
        super().__post_init__()

    @property
    def decode(self) -> str:
        # the eviction base's modes: "fixed" scores arriving tokens and evicts while decoding,
        # "grow" scores the prompt once (score_prompt) and appends
        return "fixed" if self.decoding == "evict" else "grow"

    def score_prompt(self, cache, keys, queries):
        # keys [R, T, D]: the whole prompt, at positions 0..T-1
        positions = mx.broadcast_to(mx.arange(keys.shape[1], dtype=mx.int32), keys.shape[:2])
        return self.score_new(cache, keys, positions)
