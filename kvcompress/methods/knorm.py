"""KNorm (Devoto et al., EMNLP 2024, arXiv:2406.11430): keep the keys with the smallest L2 norm.

The paper finds a low key norm predicts high attention; the score needs no queries, so it is
computed once per token as it arrives and the cache evicts the highest-norm unprotected key while
decoding (the paper's fixed-size cache; kvpress applies it to the prompt only). RoPE rotates
pairs, so post-RoPE norms equal the paper's pre-RoPE norms.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .eviction import Eviction


@dataclass(frozen=True)
class KNorm(Eviction):
    """KNorm: keep the lowest-norm keys (no queries needed).

    budget: tokens kept per KV head (int) or a fraction of the prompt (float).
    """

    name = "knorm"
    decode = "fixed"
    budget: int | float = 0.5

    def score_new(self, cache, keys, positions):
        return -mx.linalg.norm(keys.astype(mx.float32), axis=-1)
