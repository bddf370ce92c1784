"""KNorm (Devoto et al., EMNLP 2024, arXiv:2406.11430): keep the keys with the smallest L2 norm.

The paper finds a low key norm predicts high attention; the score needs no queries. By default the
prompt is compressed once and generated tokens are appended (kvpress's `KnormPress`, the paper's
evaluation); `decoding="evict"` keeps the budget while decoding, evicting the highest-norm
unprotected key, and needs sinks or a recent window (kvcompress/methods/eviction/scoring/scored_once.py says why).
RoPE rotates pairs, so post-RoPE norms equal the paper's pre-RoPE norms.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ...errors import ConfigError
from .scoring.scored_once import ScoredOnce


@dataclass(frozen=True)
class KNorm(ScoredOnce):
    """KNorm: keep the lowest-norm keys (no queries needed).

    budget: tokens kept per KV head (int) or a fraction of the prompt (float).
    decoding: "append" (compress the prompt once, kvpress) or "evict" (keep the budget while decoding).
    n_sink, recent: protected first tokens and recent window (tokens, or a fraction of the budget).
    """

    name = "knorm"
    # 1: the prompt is compressed once by default (it evicted while decoding, unprotected)
    revision = 1

    def __post_init__(self):
        super().__post_init__()
        if self.decoding == "evict" and self.n_sink == 0 and self.recent == 0:
            raise ConfigError(
                "knorm.decoding: 'evict' needs protected tokens (n_sink >= 1 or recent > 0, e.g. n_sink=4, "
                "recent=8): unprotected, each new token is compared with survivors kept for their low norms "
                "and is evicted on arrival; or use decoding='append' (the default, kvpress)")

    def score_new(self, cache, keys, positions):
        return -mx.linalg.norm(keys.astype(mx.float32), axis=-1)
