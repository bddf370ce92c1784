"""TOVA, Token Omission Via Attention (Oren et al., EMNLP 2024, arXiv:2401.06104).

At every step TOVA drops the token the current query attends to least. Scores are not accumulated:
each step replaces them with the current query's attention, averaged over all heads of the layer
(the paper's layer-wise policy, so the KV heads of a batch element keep the same tokens). The
prompt is compressed with its last query the same way. No recent window, no sinks (the paper
observes that the first token survives on its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .base import Eviction
from .scoring.prompt_scores import folded_logits


@dataclass(frozen=True)
class TOVA(Eviction):
    """TOVA: evict the token the current query attends to least (head-averaged, no accumulation).

    budget: tokens kept per KV head (int) or a fraction of the prompt (float).
    """

    name = "tova"
    needs_queries = True
    decode = "replace"
    budget: int | float = 0.5

    def window(self) -> int:
        return 1

    def score_prompt(self, cache, keys, queries):
        # the prompt's last query sees every prompt key: no mask needed
        probs = mx.softmax(folded_logits(queries, keys, cache.scale), axis=-1, precise=True)
        return self.score_step(cache, probs)

    def score_step(self, cache, probs):
        # probs [R, G, S, n] -> the last query, averaged over every head of the batch element
        return self._batch_mean(cache, probs[:, :, -1].mean(axis=1))

    def score_step_sums(self, cache, sums, group):
        return self._batch_mean(cache, sums / group)

    def _batch_mean(self, cache, per_row):
        # per_row [R, n]: a row's heads averaged -> the mean over every KV head of the batch element
        R, n = per_row.shape
        per_batch = per_row.reshape(cache.batch, -1, n).mean(axis=1, keepdims=True)
        return mx.broadcast_to(per_batch, (cache.batch, R // cache.batch, n)).reshape(R, n)
