"""Paired statistics for configs run on the same samples.

Every config of a sweep answers the very same samples, so a config is compared with a reference
config (the full cache, or a chosen baseline) sample by sample:

- `paired_bootstrap_ci`: the percentile bootstrap (Efron & Tibshirani 1993, ch. 13) of the mean
  paired difference d_i = score_i - reference_i, resampling samples (pairs) with replacement;
- `mcnemar_exact`: the exact McNemar test for 0/1 scores (McNemar 1947; the exact binomial form):
  with b samples right only under the config and c right only under the reference, under H0 the b
  discordant wins are Binomial(b + c, 1/2); p = min(1, 2 * P(X <= min(b, c))).

`compare` puts both together with the verdict a report prints: "not distinguishable" whenever
the interval contains 0 or, for 0/1 scores, McNemar's p >= 0.05.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


def paired_bootstrap_ci(diffs: list[float], level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                        seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of paired differences (seeded, so reproducible)."""
    d = np.asarray(diffs, dtype=np.float64)
    if d.size == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    tail = (1.0 - level) / 2
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts b and c."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


@dataclass(frozen=True)
class Paired:
    n: int  # samples both configs answered
    diff_mean: float  # mean of score - reference score
    ci_low: float
    ci_high: float
    mcnemar_p: float | None  # only when every score is 0 or 1

    @property
    def verdict(self) -> str:
        """"better" / "worse" only when the CI excludes 0 and, for 0/1 scores, McNemar's p < 0.05
        too: with a handful of pairs that all differ the bootstrap interval collapses to a point,
        while the exact test still says "not distinguishable" (3 of 3 discordant: p = 0.25)."""
        if self.n == 0 or math.isnan(self.ci_low):
            return "no pairs"
        if self.ci_low <= 0.0 <= self.ci_high or (self.mcnemar_p is not None and self.mcnemar_p >= 0.05):
            return "not distinguishable"
        return "better" if self.ci_low > 0 else "worse"


def compare(scores: list[float], reference: list[float]) -> Paired:
    """Paired comparison of a config's per-sample scores with a reference's on the same samples."""
    if len(scores) != len(reference):
        raise ValueError(f"paired scores need equal lengths, got {len(scores)} and {len(reference)}")
    diffs = [a - b for a, b in zip(scores, reference)]
    low, high = paired_bootstrap_ci(diffs)
    binary = all(v in (0.0, 1.0) for v in (*scores, *reference))
    p = None
    if binary:
        b = sum(1 for a, r in zip(scores, reference) if a == 1.0 and r == 0.0)
        c = sum(1 for a, r in zip(scores, reference) if a == 0.0 and r == 1.0)
        p = mcnemar_exact(b, c)
    mean = sum(diffs) / len(diffs) if diffs else math.nan
    return Paired(len(diffs), mean, low, high, p)
