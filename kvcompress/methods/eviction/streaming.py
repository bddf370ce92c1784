"""StreamingLLM (Xiao et al., ICLR 2024, arXiv:2309.17453): attention sinks + a recent window.

Keeps the first `n_sink` tokens and the most recent `budget - n_sink`. On the eviction base this is
the "fixed" score s_j = position of j: the lowest unprotected score is the oldest token after the
sinks. Unlike the paper, which re-assigns cache-relative RoPE positions, kept keys keep the positions
they were rotated at and `offset` stays the true position (Keyformer's default), so the eviction
methods differ only in which tokens they keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .base import Eviction


@dataclass(frozen=True)
class Streaming(Eviction):
    """StreamingLLM: keep `n_sink` first tokens plus a recent window, `budget` tokens in all."""

    name = "streaming"
    budget: int | float = 0.5
    n_sink: int = 4
    decode = "fixed"
    score_is_position = True  # so an exact cache evicts in ring order on the host (base.py)

    def score_new(self, cache, keys, positions):
        return positions.astype(mx.float32)  # exact below 2**24 tokens
