"""Compression during decoding (kvpress's `DecodingPress`) for a prompt-time scorer.

Long generations outgrow a budget that only the prompt was cut to. Every `compression_interval`
decode steps, the tokens generated so far are cut to the `target_size` best by the scorer's own
ranking (kvpress's parameter names and defaults: 512 steps, 2048 tokens), so a cache never holds
more than target_size + compression_interval generated tokens. The prompt is compressed by the
scorer at `budget` as every delegating method does (default 1.0: kept whole, as DecodingPress
alone; a smaller budget is kvpress's PrefillDecodingPress). The scorer's protected window (SnapKV's
last 32 tokens) stays protected, so `target_size` must exceed it.

Scores at a compression, over the tokens held: a scorer that scores a token from its key and
position (`score_new`: KNorm, random, StreamingLLM) scores them so; the others take their
prompt-time score (`score_prompt`) with the generated tokens' queries in place of the prompt's,
summarized as the scorer summarizes the prompt's (SnapKV, TOVA: the last `window()` queries),
which plays the part of DecodingPress's hidden-state buffer.

Where we depart from kvpress, and why:
- kvpress compresses the whole cache (prompt and generated) to target_size; here the generated
  part is, and the prompt keeps what `budget` gave it, so the two budgets are separate knobs (the
  issue's "compress the generated part to a target").
- Scorers: those whose score over a compressed cache is what it is over a prompt. H2O and
  Keyformer accumulate over every query since the start (there is no prompt-time score to redo),
  and Expected Attention assumes keys at positions 0..T-1 for its future rotations: refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ...errors import ConfigError, check, is_int
from .scoring.delegating import Delegating
from .base import Eviction, EvictionCache

DECODING_SCORERS = ("snapkv", "tova", "keydiff", "knorm", "random", "streaming")


@dataclass(frozen=True)
class Decoding(Delegating):
    """Compression during decoding: every `compression_interval` steps, the generated tokens are cut
    to `target_size` by `scorer`'s ranking.

    budget: the prompt's budget for the scorer's prompt compression (1.0: the whole prompt).
    scorer: the ranking (its defaults). compression_interval: decode steps between compressions
    (kvpress 512). target_size: generated tokens kept per KV head after a compression (kvpress 2048).
    """

    name = "decoding"
    allowed_scorers = DECODING_SCORERS
    scorer_note = " (module docstring)"
    budget: int | float = 1.0
    compression_interval: int = 512
    target_size: int = 2048

    def __post_init__(self):
        n = self.name
        check(is_int(self.compression_interval) and self.compression_interval >= 1, f"{n}.compression_interval",
              "an int >= 1 (decode steps)", self.compression_interval)
        check(is_int(self.target_size) and self.target_size >= 1, f"{n}.target_size", "an int >= 1 (tokens)",
              self.target_size)
        super().__post_init__()

    @property
    def evicts_while_decoding(self) -> bool:
        return True

    def resolve(self, prompt_tokens: int, layer: int = 0, n_layers: int = 1) -> tuple[int, int]:
        capacity, recent = super().resolve(prompt_tokens, layer, n_layers)
        if recent >= self.target_size:
            raise ConfigError(f"{self.name}.target_size: expected more than the scorer's protected window "
                              f"({self.scorer_name}: {recent} tokens), got {self.target_size}")
        return capacity, recent

    def cache_type(self) -> type:
        return DecodingCache


class DecodingCache(EvictionCache):
    """An eviction cache of a "grow" method that also cuts its generated tokens every N steps."""

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        decoding = self.prompt_len is not None  # the prompt's last query completes the prompt: not decoding
        out = super().attention(queries, keys, values, scale, mask, sinks)
        if not decoding:
            return out
        scorer = self.scorer
        if scorer.needs_queries:  # the generated tokens' queries, as the scorer summarizes a prompt's
            B, n_q, S, D = queries.shape
            R = self._keys.shape[0]
            self.query_summary = scorer.summarize_queries(self, self.query_summary,
                                                          queries.reshape(R, n_q * B // R, S, D))
        generated = self.position - self.answer_start
        if generated and generated % self.config.compression_interval == 0:
            self._compress_generated()
        return out

    def _compress_generated(self):
        """Keep every token from before the answer and the target_size best generated ones."""
        scorer = self.scorer
        earlier = self.positions < self.answer_start  # [R, n]: the prompt as compressed, the question
        kept_before = int(earlier[0].sum().item())  # the same in every row (unpadded)
        if self.length - kept_before <= self.config.target_size:
            return
        if type(scorer).score_new is not Eviction.score_new:
            scores = scorer.score_new(self, self.keys, self.positions)
        else:
            scores = scorer.score_prompt(self, self.keys, self.query_summary)
        self._scores = scores
        step = self.position - 1
        self._scores = mx.where(earlier, mx.inf, scorer.evict_by(self, step))  # random draws here
        self._select(kept_before + self.config.target_size, step)
        self._scores = None  # appended tokens are scored at the next compression
        mx.eval(self.keys, self.values, self.positions)


# mlx-lm's load_prompt_cache looks cache classes up by name in mlx_lm.models.cache's globals.
setattr(mlx_cache, "DecodingCache", DecodingCache)
