"""Keyformer (Adnan et al., MLSys 2024, arXiv:2403.09054) on the eviction base.

Keyformer keeps `budget` = k tokens per KV head: a recent window of w tokens plus the k - w "key
tokens" with the highest accumulated score (Sec. 3.3). The score of key j after query step t is

    s_j += softmax_j((x_tj + zeta_tj) / tau_t)                       (paper Eq. 6-8)

with x_tj the real attention logits (post-RoPE, scaled), zeta ~ Gumbel(0, 1) drawn per query head
(as the reference code), and tau_t = tau_init + t (tau_end - tau_init) / T annealed linearly (Eq.
10). t counts generated tokens only: t = 0 at the first answer token, under both protocols (the
prompt, and the question part appended under query-agnostic, use tau_init). T is the answer budget,
as the reference code anneals over `max_new_tokens` (`for_run`: the runner passes the task's answer
budget; `kvcompress.make_cache(..., max_tokens=N)` for drop-in use, else mlx-lm's default 256);
`anneal_over="answer"` takes the reference answer's length instead, and `anneal_steps` fixes T.
With GQA a KV head's score is the sum over its query group.

Noise is a counter-based hash of (seed, layer, query head, query position, key position): the same
however the prompt is chunked, recomputed rather than stored. `noise="frozen"` draws one value per
key position (reference system). `score="proxy"` reproduces the reference system's scoring: the
incoming key acts as the query, the accumulated score is noise-free, and tau * Gumbel noise enters
only the eviction decision.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ...errors import check, is_int
from ...kernels.prompt_scores import PromptNoise
from ...kernels.scored_attention import GumbelNoise
from ...kernels.counter_hash import gumbel_noise_from_streams, noise_streams
from .base import Eviction

SCORES = ("attention", "proxy")
ANNEAL_OVER = ("budget", "answer")
NOISES = ("redraw", "frozen")
DROP_IN_GENERATION = 256  # mlx-lm generate's default max_tokens: the anneal length when none is known


@dataclass(frozen=True)
class Keyformer(Eviction):
    """Keyformer: recent window + key tokens chosen by Gumbel-regularized accumulated attention.

    budget: tokens kept per KV head (int) or a fraction of the prompt (float; paper 0.6).
    recent: recent window w, tokens (int) or a fraction of the budget (float; paper 0.3).
    n_sink: first tokens never evicted (paper: 0).
    tau_init, tau_end: Gumbel-softmax temperature (paper 1 -> 2), annealed over the generated tokens.
    anneal_steps: None (from the run, see anneal_over) or a fixed number of decode steps.
    anneal_over: "budget" (the answer budget, max_new_tokens: reference code) or "answer" (the
        reference answer's length).
    score: "attention" (real queries, paper) or "proxy" (incoming key as query, reference system).
    noise: "redraw" (fresh each step, paper) or "frozen" (one draw per key position).
    positions: "exact" (true RoPE positions) or "compact" (survivors re-rotated to 0..n_kept-1).
    seed: base seed of the noise.
    """

    name = "keyformer"
    needs_queries = True
    # 1: the Gumbel draw u = 1 (one hash value in 2^24) gave +inf noise and NaN scores in the rows
    # it fell in (several per prompt from ~1k tokens); runs from before the fix are recomputed.
    # 2: tau anneals over the answer budget from the first answer token (it annealed over the
    # reference answer's length from the end of the compressed part, so under query-agnostic the
    # question used the schedule up)
    revision = 2
    budget: int | float = 0.6
    recent: int | float = 0.3
    n_sink: int = 0
    tau_init: float = 1.0
    tau_end: float = 2.0
    anneal_steps: int | None = None
    anneal_over: str = "budget"
    score: str = "attention"
    noise: str = "redraw"
    positions: str = "exact"
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        n = self.name
        for field in ("tau_init", "tau_end"):
            value = getattr(self, field)
            finite = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")
            check(finite, f"{n}.{field}", "a finite number > 0 (tau -> 0 is not H2O: use method h2o)", value)
        check(self.anneal_steps is None or (is_int(self.anneal_steps) and self.anneal_steps >= 1),
              f"{n}.anneal_steps", "None (the generated tokens) or an int >= 1", self.anneal_steps)
        check(self.anneal_over in ANNEAL_OVER, f"{n}.anneal_over", f"one of {ANNEAL_OVER}", self.anneal_over)
        check(self.score in SCORES, f"{n}.score", f"one of {SCORES}", self.score)
        check(self.noise in NOISES, f"{n}.noise", f"one of {NOISES}", self.noise)
        check(is_int(self.seed) and 0 <= self.seed < 2**32, f"{n}.seed", "an int in [0, 2**32)", self.seed)

    def for_run(self, answer_budget: int, answer_tokens: int | None = None) -> "Keyformer":
        steps = answer_tokens if self.anneal_over == "answer" and answer_tokens else answer_budget
        if self.anneal_steps is not None or steps < 1:
            return self
        return dataclasses.replace(self, anneal_steps=steps)

    def tau(self, decode_step: mx.array) -> mx.array:
        """Eq. 10: tau_init + t * (tau_end - tau_init) / T, t clipped to [0, T] (the prompt and the
        question are t < 0)."""
        steps = self.anneal_steps or DROP_IN_GENERATION
        t = mx.clip(decode_step.astype(mx.float32), 0, steps)
        return self.tau_init + t * ((self.tau_end - self.tau_init) / steps)

    def _noise(self, cache, rows: int, group: int, query_positions, key_positions):
        steps = None if self.noise == "frozen" else query_positions
        return gumbel_noise_from_streams(_streams(self.seed, cache.layer, rows, group), steps, key_positions)

    def _tau_at(self, cache, query_positions):
        """tau at the query positions, [L, 1] (a float at a decode step's one query)."""
        newest = cache.position - 1
        if query_positions.shape[0] == 1 and cache.answer_start is not None and newest >= cache.answer_start:
            # a decode step: its one query is the newest token (prompt tiles keep the array path)
            return self._step_tau(cache, newest)
        answer_start = cache.answer_start if cache.answer_start is not None else 1 << 30
        return self.tau(query_positions - answer_start)[:, None]

    def _step_tau(self, cache, query_position: int) -> float:
        """`tau` at one decode query position, computed on the host (no MLX ops per layer per step)
        with the same float32 operations, so the value is bit for bit the same."""
        steps = self.anneal_steps or DROP_IN_GENERATION
        t = np.float32(min(max(query_position - cache.answer_start, 0), steps))
        return float(np.float32(self.tau_init) + t * np.float32((self.tau_end - self.tau_init) / steps))

    def transform(self, cache, logits, query_positions, key_positions):
        if self.score == "proxy":
            return logits
        noise = self._noise(cache, *logits.shape[:2], query_positions, key_positions)  # [R, G, L|1, n]
        return (logits + noise) / self._tau_at(cache, query_positions)

    def prompt_kernel_noise(self, cache, rows, group, queries):
        if self.score == "proxy":
            return None
        query_positions = mx.arange(cache.position - queries, cache.position, dtype=mx.int32)
        tau = mx.array(self._tau_at(cache, query_positions), mx.float32).reshape(-1)  # [L, 1] (or one float)
        # the queries are the last of the cache's kept keys (the prompt scores' own positions)
        return PromptNoise(_streams(self.seed, cache.layer, rows, group), self.noise != "frozen",
                           mx.broadcast_to(tau, (queries,)), cache.length - queries)

    def kernel_noise(self, cache, rows, group):
        if self.score == "proxy":
            return None
        query_position = cache.position - 1  # a decode step's one query
        # tau from `_tau_at`, the one place every path (MLX reference, fused kernels) asks for it
        tau = self._tau_at(cache, mx.array([query_position], mx.int32))
        return GumbelNoise(_streams(self.seed, cache.layer, rows, group), cache._positions,
                           None if self.noise == "frozen" else query_position,
                           tau if isinstance(tau, float) else float(tau.item()))

    def score_queries(self, cache, queries, new_keys):
        return new_keys[:, None] if self.score == "proxy" else queries

    def ranks_by_scores(self) -> bool:
        return self.score != "proxy"  # the proxy adds noise to the scores in `evict_by`

    def evict_by(self, cache, step):
        if self.score != "proxy":
            return cache.scores
        noise = self._noise(cache, cache.keys.shape[0], 1, mx.array([step], mx.int32), cache.positions)[:, 0, 0]
        return cache.scores + self._step_tau(cache, step) * noise


@functools.lru_cache(maxsize=4096)
def _streams(seed: int, layer: int, rows: int, group: int) -> mx.array:
    """The noise streams [rows, group] of global query heads b * H_q + h: the same every step, so
    computed once (at decode a step's noise is a few dozen small ops; this was a third of them)."""
    streams = noise_streams(seed, layer, mx.arange(rows * group, dtype=mx.uint32).reshape(rows, group))
    mx.eval(streams)
    return streams
