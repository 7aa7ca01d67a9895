"""Robust statistics for kernel timings: medians, IQR spread, median CIs, winner-or-tie.

Kernel timings are skewed (a preempted launch, a late clock ramp) so everything here is
order-statistic based: the median and the interquartile range, and a distribution-free
confidence interval of the median from the binomial distribution of order statistics.
No RNG, so a decision is reproducible from the stored samples alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def median(xs: Sequence[float]) -> float:
    """The sample median; raises ValueError on an empty sequence."""
    return quantile(xs, 0.5)


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method), ``0 <= q <= 1``."""
    if not xs:
        raise ValueError("quantile of an empty sequence")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def relative_spread(xs: Sequence[float]) -> float:
    """IQR / median: the protocol's stability statistic (inf when it cannot be judged)."""
    if len(xs) < 2:
        return math.inf
    m = median(xs)
    if m <= 0:
        return math.inf
    return (quantile(xs, 0.75) - quantile(xs, 0.25)) / m


def median_ci(xs: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free CI of the median: order statistics ``x(j)``, ``x(n+1-j)``.

    ``j`` is the largest rank with ``P(Binom(n, 1/2) < j) <= (1 - confidence) / 2``.
    With too few samples for the nominal coverage the CI is the full range, which is
    conservative: it makes a tie more likely, never a false winner.
    """
    if not xs:
        raise ValueError("median_ci of an empty sequence")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    s = sorted(xs)
    n = len(s)
    tail = (1.0 - confidence) / 2.0
    total = 2**n
    cdf = 0  # numerator of P(Binom(n, 1/2) <= j - 1), kept exact in integers
    j = 0
    while j < n // 2:
        cdf += math.comb(n, j)
        if cdf / total > tail:
            break
        j += 1
    j = max(j, 1)
    return s[j - 1], s[n - j]


def relative_ci_halfwidth(xs: Sequence[float], confidence: float = 0.95) -> float:
    """Half the width of the median CI, relative to the median (inf when undefined)."""
    if len(xs) < 2:
        return math.inf
    m = median(xs)
    if m <= 0:
        return math.inf
    lo, hi = median_ci(xs, confidence)
    return (hi - lo) / (2.0 * m)


@dataclass(frozen=True, slots=True)
class Decision:
    """Winner-or-tie verdict over named sample sets.

    ``winner`` is None on a tie: a margin inside the noise names no winner, so a stored
    winner is always one the data supports. ``ranking`` lists names fastest first by
    median either way, so a caller that must pick something still can.
    """

    winner: str | None
    tie: bool
    margin: float | None  # (runner_up - best) / best, by median
    noise: float | None  # the relative margin needed to declare a winner
    ranking: tuple[str, ...]


def decide(
    samples: dict[str, Sequence[float]],
    *,
    noise_k: float = 1.0,
    min_margin: float = 0.005,
    confidence: float = 0.95,
) -> Decision:
    """Pick the fastest candidate only when its margin over the runner-up beats the noise.

    The noise is ``max(noise_k * sqrt(h_best**2 + h_runner**2), min_margin)`` where ``h``
    is each median's relative CI half-width (the two combine in quadrature as the
    relative error of a ratio does). ``min_margin`` is the floor below which a
    difference is not worth acting on even when it is real. Empty sample sets are
    ignored; one usable candidate wins uncontested (margin and noise None).
    """
    usable = {name: list(xs) for name, xs in samples.items() if xs}
    ranking = tuple(sorted(usable, key=lambda name: (median(usable[name]), name)))
    if not ranking:
        return Decision(None, False, None, None, ())
    if len(ranking) == 1:
        return Decision(ranking[0], False, None, None, ranking)
    best, runner = ranking[0], ranking[1]
    margin, noise = versus(
        usable[best], usable[runner], noise_k=noise_k, min_margin=min_margin, confidence=confidence
    )
    if margin > noise:
        return Decision(best, False, margin, noise, ranking)
    return Decision(None, True, margin, noise, ranking)


def versus(
    best: Sequence[float],
    other: Sequence[float],
    *,
    noise_k: float = 1.0,
    min_margin: float = 0.005,
    confidence: float = 0.95,
) -> tuple[float, float]:
    """``(margin, noise)`` of ``other`` behind ``best``, as :func:`decide` weighs them.

    The margin is ``(median(other) - median(best)) / median(best)`` (negative when
    ``other`` is faster; inf when best's median is not positive), the noise
    ``max(noise_k * sqrt(h_best**2 + h_other**2), min_margin)``; both sets non-empty.
    """
    m_best, m_other = median(best), median(other)
    margin = (m_other - m_best) / m_best if m_best > 0 else math.inf
    h_best = relative_ci_halfwidth(best, confidence)
    h_other = relative_ci_halfwidth(other, confidence)
    return margin, max(noise_k * math.hypot(h_best, h_other), min_margin)
