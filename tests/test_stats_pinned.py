"""Order statistics pinned to hand-computed values: quantiles, spread, median CIs.

Written against the mutation test (``bench/mutation_test.py``): each case fixes one
boundary or formula that a wrong operator or an off-by-one would move.
"""

from __future__ import annotations

import math

import pytest

from gpuwatchd.tuning.worker import stats

TWENTY = [100.0 + i for i in range(20)]  # 100 .. 119, median 109.5


@pytest.mark.parametrize(
    ("xs", "q", "want"),
    [
        ([40.0, 10.0, 30.0, 20.0], 0.5, 25.0),  # interpolated between the middle two
        ([40.0, 10.0, 30.0, 20.0], 0.0, 10.0),  # both ends are valid q
        ([40.0, 10.0, 30.0, 20.0], 1.0, 40.0),
        ([40.0, 10.0, 30.0, 20.0], 0.25, 17.5),
        ([40.0, 10.0, 30.0, 20.0], 0.75, 32.5),
        ([10.0, 20.0, 30.0, 40.0, 50.0], 0.75, 40.0),  # exactly on a rank
        ([7.0], 0.5, 7.0),  # one sample: every quantile is it
        ([7.0], 1.0, 7.0),
        ([1.0, 3.0], 0.5, 2.0),
    ],
)
def test_quantile_interpolates_linearly_between_ranks(
    xs: list[float], q: float, want: float
) -> None:
    assert stats.quantile(xs, q) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("q", [-0.01, 1.01, math.nan])
def test_quantile_rejects_q_outside_zero_to_one(q: float) -> None:
    with pytest.raises(ValueError, match="q must be in"):
        stats.quantile([1.0, 2.0], q)


def test_empty_inputs_are_errors() -> None:
    with pytest.raises(ValueError, match="empty"):
        stats.quantile([], 0.5)
    with pytest.raises(ValueError, match="empty"):
        stats.median([])
    with pytest.raises(ValueError, match="empty"):
        stats.median_ci([])


def test_median_of_odd_and_even_counts() -> None:
    assert stats.median([3.0, 1.0, 2.0]) == 2.0
    assert stats.median([4.0, 1.0, 3.0, 2.0]) == 2.5


@pytest.mark.parametrize(
    ("xs", "want"),
    [
        ([1.0, 3.0], 0.5),  # two samples are enough: q25 1.5, q75 2.5, median 2
        ([1.0, 2.0, 3.0, 4.0, 5.0], 2.0 / 3.0),
        ([2.0, 2.0, 2.0], 0.0),
        ([1.0], math.inf),  # one sample cannot be judged
        ([0.0, 0.0], math.inf),  # a zero median has no relative spread
        ([-1.0, -1.0, 2.0], math.inf),  # nor a negative one
    ],
)
def test_relative_spread_is_iqr_over_median(xs: list[float], want: float) -> None:
    assert stats.relative_spread(xs) == pytest.approx(want)


@pytest.mark.parametrize(
    ("n", "confidence", "ranks"),
    [
        # j = largest rank with P(Binom(n, 1/2) < j) <= (1 - confidence) / 2, at least 1.
        (1, 0.95, (1, 1)),
        (2, 0.95, (1, 2)),
        (6, 0.95, (1, 6)),  # P(B <= 0) = 1/64 <= 0.025 < P(B <= 1) = 7/64
        (8, 0.95, (1, 8)),  # P(B <= 1) = 9/256 > 0.025
        (9, 0.95, (2, 8)),  # P(B <= 1) = 10/512 <= 0.025 < P(B <= 2) = 46/512
        (10, 0.95, (2, 9)),
        (10, 0.5, (4, 7)),  # P(B <= 3) = 176/1024 <= 0.25 < P(B <= 4) = 386/1024
        (20, 0.95, (6, 15)),
        (20, 0.99, (4, 17)),  # P(B <= 3) = 1351/2^20 <= 0.005 < P(B <= 4)
        (20, 0.5, (8, 13)),
        (4, 0.01, (2, 3)),  # a tiny confidence: the loop stops at n // 2
        (5, 0.01, (2, 4)),
        (3, 0.01, (1, 3)),
        (7, 0.875, (2, 6)),  # P(B <= 1) = 8/128 equals the tail 0.0625 exactly: included
        (7, 1 - 15 / 128, (1, 7)),  # tail 7.5/128: between P(B <= 1) - P(B = 0) and P(B <= 1)
    ],
)
def test_median_ci_uses_the_binomial_order_statistics(
    n: int, confidence: float, ranks: tuple[int, int]
) -> None:
    xs = [float(10 * (n - i)) for i in range(n)]  # descending: the CI must sort first
    lo, hi = stats.median_ci(xs, confidence)
    assert (lo, hi) == (10.0 * ranks[0], 10.0 * ranks[1])


@pytest.mark.parametrize("confidence", [0.0, 1.0, -0.5, 1.5])
def test_median_ci_confidence_must_be_strictly_between_zero_and_one(confidence: float) -> None:
    with pytest.raises(ValueError, match="confidence must be in"):
        stats.median_ci([1.0, 2.0, 3.0], confidence)


def test_median_ci_default_confidence_is_95_percent() -> None:
    assert stats.median_ci(TWENTY) == stats.median_ci(TWENTY, 0.95) == (105.0, 114.0)


@pytest.mark.parametrize(
    ("xs", "confidence", "want"),
    [
        (TWENTY, 0.95, (114.0 - 105.0) / (2 * 109.5)),  # half the CI over the median
        (TWENTY, 0.5, (112.0 - 107.0) / (2 * 109.5)),
        ([1.0, 3.0], 0.95, (3.0 - 1.0) / (2 * 2.0)),
        ([5.0, 5.0, 5.0], 0.95, 0.0),
        ([1.0], 0.95, math.inf),
        ([0.0, 0.0, 0.0], 0.95, math.inf),
        ([-2.0, -1.0], 0.95, math.inf),
    ],
)
def test_relative_ci_halfwidth(xs: list[float], confidence: float, want: float) -> None:
    assert stats.relative_ci_halfwidth(xs, confidence) == pytest.approx(want, rel=1e-12)


def test_relative_ci_halfwidth_default_confidence_is_95_percent() -> None:
    assert stats.relative_ci_halfwidth(TWENTY) == stats.relative_ci_halfwidth(TWENTY, 0.95)
    assert stats.relative_ci_halfwidth(TWENTY) != stats.relative_ci_halfwidth(TWENTY, 0.5)


def test_versus_without_options_weighs_as_decide_does_without_them() -> None:
    best = [100.0 + i for i in range(20)]  # a 95% CI half-width of 4.1% of the median
    other = [x * 1.05 for x in best]
    d = stats.decide({"best": best, "other": other})
    assert stats.versus(best, other) == (d.margin, d.noise)
    assert d.noise is not None and d.noise > 0.005  # the CIs decide, not the floor
