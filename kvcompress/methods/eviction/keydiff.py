"""KeyDiff (Park et al., 2025, arXiv:2504.15364): keep the keys least like the head's mean key.

Query-free: a key's score is minus its cosine similarity to its KV head's anchor, the mean of the
head's L2-normalised prompt keys, s_j = -cos(k_j, mean_i k_i / ||k_i||), so the most distinctive keys
are kept. As kvpress's `KeyDiffPress`, the prompt is scored once, on its post-RoPE keys, compressed,
and generated tokens are appended; the paper compresses block by block while prefilling (kvpress's
`BlockPress` around it), which this does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .base import Eviction

EPS = 1e-12  # torch's F.normalize floor for a zero vector's norm


@dataclass(frozen=True)
class KeyDiff(Eviction):
    """KeyDiff: keep the keys least similar (cosine) to their head's mean normalised key; no queries.

    budget: tokens kept per KV head (int) or a fraction of the prompt (float).
    """

    name = "keydiff"
    decode = "grow"
    budget: int | float = 0.5

    def score_prompt(self, cache, keys, queries):
        # keys [R, T, D]: the whole prompt
        unit = unit_rows(keys.astype(mx.float32))
        anchor = unit_rows(unit.mean(axis=1, keepdims=True))  # [R, 1, D]
        return -(unit * anchor).sum(axis=-1)


def unit_rows(x: mx.array) -> mx.array:
    """x / ||x|| along the last axis (a zero row stays zero)."""
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), EPS)
