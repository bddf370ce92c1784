"""kvcompress.stats: paired bootstrap CI and exact McNemar against hand-computed examples."""

import math

import pytest

from kvcompress.stats import compare, mcnemar_exact, paired_bootstrap_ci


def test_mcnemar_exact_by_hand():
    # b=1, c=5: 2 * P(X <= 1), X ~ Bin(6, 1/2) = 2 * (1 + 6) / 64
    assert mcnemar_exact(1, 5) == pytest.approx(14 / 64)
    assert mcnemar_exact(5, 1) == pytest.approx(14 / 64)
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 64)
    assert mcnemar_exact(3, 3) == 1.0  # 2 * P(X <= 3), X ~ Bin(6, 1/2) = 2 * 42/64 > 1
    assert mcnemar_exact(0, 0) == 1.0


def test_paired_bootstrap_ci_by_hand():
    # diffs [0, 0, 1]: the bootstrap mean is k/3, k ~ Bin(3, 1/3): P(k=0) = 8/27, P(k=3) = 1/27 > 2.5%,
    # so the 2.5% quantile is 0 and the 97.5% quantile is 1
    assert paired_bootstrap_ci([0.0, 0.0, 1.0]) == (0.0, 1.0)
    assert paired_bootstrap_ci([0.25] * 7) == (0.25, 0.25)  # no spread, no interval
    assert paired_bootstrap_ci([0.0, 1.0] * 10) == paired_bootstrap_ci([0.0, 1.0] * 10)  # seeded
    low, high = paired_bootstrap_ci([0.0, 1.0] * 50)  # mean 0.5, sd of the mean 0.05
    assert low == pytest.approx(0.5 - 1.96 * 0.05, abs=0.01) and high == pytest.approx(0.5 + 1.96 * 0.05, abs=0.01)
    assert all(math.isnan(v) for v in paired_bootstrap_ci([]))


def test_compare_verdicts():
    same = compare([1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0])
    assert same.n == 4 and same.diff_mean == 0.0 and same.verdict == "not distinguishable"
    assert same.mcnemar_p == 1.0
    worse = compare([0.0] * 25, [1.0] * 25)
    assert worse.diff_mean == -1.0 and worse.verdict == "worse" and worse.mcnemar_p == pytest.approx(2 / 2**25)
    few = compare([0.0] * 3, [1.0] * 3)  # the bootstrap CI is the point -1, but 3 pairs cannot resolve it
    assert (few.ci_low, few.ci_high) == (-1.0, -1.0) and few.mcnemar_p == 0.25 and few.verdict == "not distinguishable"
    fractional = compare([0.5, 0.75], [1.0, 1.0])
    assert fractional.mcnemar_p is None and fractional.verdict == "worse"
    with pytest.raises(ValueError):
        compare([1.0], [])
