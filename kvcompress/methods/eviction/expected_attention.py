"""Expected Attention (Devoto et al., 2025, arXiv:2510.00636): the attention future queries are
expected to pay a key, in closed form from the statistics of the prompt's queries.

Queries are taken as Gaussian. From the prompt's pre-RoPE queries q~_i (every query after the first
`n_sink`, as kvpress's `ExpectedAttentionPress`), per query head the mean mu and covariance Sigma
(population: divided by the count). A future query at position t is R_t q~; averaging the RoPE
rotation over the next `n_future_positions` positions T..T+n-1 (R_bar = mean_t R_t) gives
the expected query R_bar mu with covariance R_bar Sigma R_bar^T, and for a key k (post-RoPE), with the
attention scale s, E[exp(s q.k)] = exp(s mu.(R_bar^T k) + s^2/2 (R_bar^T k)^T Sigma (R_bar^T k))
(the Gaussian's moment-generating function; `use_covariance=False` drops the second term). Its
softmax over the prompt's keys but the sinks, averaged over the KV head's query group, is the
expected attention; with `use_vnorm` it is rescaled to (a + epsilon) ||v||, the size of the key's
expected contribution to the output. The first `n_sink` tokens are always kept. The prompt is
compressed once; generated tokens are appended (kvpress's prefill press).

epsilon: kvpress's `ExpectedAttentionPress` defaults to 0.0, but every entry of kvpress's evaluation
registry (the leaderboard) that rescales by the value norm runs 1e-2: `expected_attention` is
`AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))`, so are `decoding_adakv_expected_attention_e2` and
`merging_expected_attention` (NVIDIA/kvpress evaluation/evaluate_registry.py at 8bb29b9; until
2026-01 the registry also had `expected_attention` alone and `adakv_expected_attention` at 0.0). Ours
defaults to the leaderboard's 1e-2, alone and as a delegating method's scorer (AdaKV's default over it
is then kvpress's `expected_attention` entry); `epsilon: 0` is the press's class default. With 0 the
rank is by a ||v|| alone, and a key whose expected attention is tiny is dropped even where its value is large.

Scores are returned as logarithms: log((a + epsilon) ||v||) (log a without `use_vnorm`), computed
from log-softmax (logsumexp over the group), so no expected attention underflows. In float32, a
softmax probability below ~1e-38 is exactly 0, and with epsilon 0 such tokens (30 of 45,540 in one
head of the embedded model) tied at 0 and were ranked arbitrarily; in logs they keep the float64
ranking. The logarithm is monotone, so the selection (per head, or AdaKV's one top-k across a
layer's heads) is kvpress's; a method that combines scores arithmetically (CriticalKV) takes
`linear_scores`.

Pre-RoPE queries come from the post-RoPE ones the attention sees, rotated back with the model's own
RoPE module (kvcompress/methods/eviction/base.py's rope_rotations; scaled RoPEs' constant factor stays on
both the queries and R_bar's rotations, as it does on the future queries); kvpress recomputes them
from the hidden states with the layer's query projection. The moments are kept as running sums
(count, mean and centred second moment, merged per chunk, Chan et al.), so a drop-in prompt that
arrives in chunks needs O(G D^2) per KV head instead of its queries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from ...adapter import rope_rotations
from ...errors import check, is_int
from ...kernels.evict import rotate_pairs
from .base import Eviction


@dataclass(frozen=True)
class ExpectedAttention(Eviction):
    """Expected Attention: keep the keys future queries (Gaussian, from the prompt's) attend to most.

    budget: tokens kept per KV head (int) or a fraction of the prompt (float).
    n_future_positions: future positions the RoPE rotation is averaged over (kvpress 512).
    n_sink: first tokens always kept, and left out of the query statistics (kvpress 4).
    use_covariance: include the queries' covariance term (kvpress True).
    use_vnorm: rescale by the value norm, (score + epsilon) ||v|| (kvpress True).
    epsilon: added before the rescaling (kvpress's leaderboard 1e-2; the press's class default 0.0).
    """

    name = "expected_attention"
    # 1: default epsilon 1e-2 (was 0.0) and log-domain scores (no float32 underflow), 2026-12-07
    revision = 1
    needs_queries = True
    decode = "grow"
    budget: int | float = 0.5
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 1e-2

    def __post_init__(self):
        n = self.name
        check(is_int(self.n_future_positions) and self.n_future_positions >= 1, f"{n}.n_future_positions",
              "an int >= 1", self.n_future_positions)
        check(isinstance(self.use_covariance, bool), f"{n}.use_covariance", "true or false", self.use_covariance)
        check(isinstance(self.use_vnorm, bool), f"{n}.use_vnorm", "true or false", self.use_vnorm)
        check(isinstance(self.epsilon, (int, float)) and not isinstance(self.epsilon, bool) and self.epsilon >= 0,
              f"{n}.epsilon", "a number >= 0", self.epsilon)
        super().__post_init__()

    def summarize_queries(self, cache, summary, queries):
        """Running (count, mean [R, G, D], centred second moment [R, G, D, D] or None) of the
        pre-RoPE queries at positions >= n_sink."""
        S, D = queries.shape[2], queries.shape[3]
        start = cache.position - S
        skip = min(S, max(0, self.n_sink - start))
        if skip == S:
            return summary
        q = queries[:, :, skip:].astype(mx.float32)
        if cache.rope is not None:  # rotate back: R_p^T q
            cos, sin = rope_rotations(cache.rope, D, S - skip, start + skip)
            q = rotate_pairs(q, cos, -sin, cache.traditional)
        count = S - skip
        mean = q.mean(axis=2)  # [R, G, D]
        m2 = None
        if self.use_covariance:
            centred = q - mean[:, :, None]
            m2 = centred.swapaxes(2, 3) @ centred  # [R, G, D, D]
        if summary is not None:  # merge with the earlier chunks' moments
            seen, seen_mean, seen_m2 = summary
            total = seen + count
            delta = mean - seen_mean
            if m2 is not None:
                m2 = seen_m2 + m2 + (delta[..., :, None] * delta[..., None, :]) * (seen * count / total)
            mean = seen_mean + delta * (count / total)
            count = total
        mx.eval(mean, m2)
        return count, mean, m2

    def linear_scores(self, scores: mx.array) -> mx.array:
        return mx.exp(scores)  # score_prompt's are logarithms (module docstring)

    def score_prompt(self, cache, keys, summary):
        # keys [R, T, D] at positions 0..T-1; the first n_sink are kept (protected), scored -inf here.
        # Log scores [R, T] (module docstring).
        R, T, D = keys.shape
        if summary is None:  # no query after the sinks: a prompt of at most n_sink tokens
            return mx.full((R, T), -mx.inf, mx.float32)
        count, mean, m2 = summary
        k = keys[:, self.n_sink :].astype(mx.float32)
        if cache.rope is not None:  # R_bar^T k: the mean rotation of the next positions, transposed
            cos, sin = rope_rotations(cache.rope, D, self.n_future_positions, T)
            k = rotate_pairs(k, cos.mean(axis=0), -sin.mean(axis=0), cache.traditional)
        s = cache.scale
        logits = s * (mean @ k.swapaxes(1, 2))  # [R, G, T - n_sink]
        if m2 is not None:
            covariance = m2 / count
            logits = logits + (s * s / 2) * ((k[:, None] @ covariance) * k[:, None]).sum(axis=-1)
        # log of the softmax averaged over the query group: logsumexp_g(log softmax_g) - log G
        log_softmax = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        expected = mx.logsumexp(log_softmax, axis=1) - math.log(log_softmax.shape[1])  # [R, T - n_sink]
        if self.use_vnorm:  # log((a + epsilon) ||v||); log 0 = -inf where epsilon is 0 or v is 0
            norms = mx.linalg.norm(cache.values[:, self.n_sink :].astype(mx.float32), axis=-1)
            if self.epsilon:
                expected = mx.logaddexp(expected, mx.array(math.log(self.epsilon), mx.float32))
            expected = expected + mx.log(norms)
        return mx.concatenate([mx.full((R, min(T, self.n_sink)), -mx.inf, mx.float32), expected], axis=1)
