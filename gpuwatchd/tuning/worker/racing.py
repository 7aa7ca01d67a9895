"""Racing: which candidates are clearly out of the race, so their timing can stop.

A candidate is out when its median's confidence interval (the protocol's own noise
estimate, :func:`~gpuwatchd.tuning.worker.stats.median_ci`) lies wholly above the
leader's and its median trails the leader's by more than ``min_margin``: more samples
of it could not make it the winner, and a gap that size is no tie either. With few
samples the interval is the full range, so a candidate is dropped only when every one
of its batches was slower than every one of the leader's.

:func:`decided` is racing's other half, the stopping rule: the pick (lowest median) can
no longer be beaten by more than ``min_margin`` by any contender still timed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from gpuwatchd.tuning.worker import stats


def out_of_race(
    samples: Mapping[str, Sequence[float]], *, confidence: float, min_margin: float
) -> set[str]:
    """Names of the candidates clearly slower than the leader (lowest median)."""
    usable = {name: xs for name, xs in samples.items() if xs}
    if len(usable) < 2:
        return set()
    leader = min(usable, key=lambda name: (stats.median(usable[name]), name))
    lead_median = stats.median(usable[leader])
    _, lead_high = stats.median_ci(usable[leader], confidence)
    out = set()
    for name, xs in usable.items():
        if name == leader:
            continue
        low, _ = stats.median_ci(xs, confidence)
        if low > lead_high and stats.median(xs) > lead_median * (1.0 + min_margin):
            out.add(name)
    return out


def decided(
    samples: Mapping[str, Sequence[float]],
    *,
    confidence: float,
    noise_k: float,
    min_margin: float,
    min_samples: int,
    same_code: Callable[[str, str], bool] | None = None,
) -> bool:
    """True when more rounds cannot change the pick by more than ``min_margin``.

    For each contender the noise is :func:`~gpuwatchd.tuning.worker.stats.decide`'s
    (``noise_k`` times the two medians' relative CI half-widths in quadrature): the
    contender may truly be ahead of the pick by up to ``noise - margin``. Once that is at
    most ``min_margin`` for every contender, the pick is settled: a declared winner
    (margin over the noise) and a tie whose noise sits at its floor both qualify. A
    contender that ``same_code`` says launches the pick's very kernels is the pick, and
    every candidate needs ``min_samples`` samples first. One candidate alone is decided.
    """
    usable = {name: xs for name, xs in samples.items() if xs}
    if any(len(xs) < min_samples for xs in usable.values()):
        return False
    if len(usable) < 2:
        return True
    pick = min(usable, key=lambda name: (stats.median(usable[name]), name))
    m_pick = stats.median(usable[pick])
    if m_pick <= 0:
        return False
    h_pick = stats.relative_ci_halfwidth(usable[pick], confidence)
    for name, xs in usable.items():
        if name == pick or (same_code is not None and same_code(pick, name)):
            continue
        margin = (stats.median(xs) - m_pick) / m_pick
        noise = noise_k * math.hypot(h_pick, stats.relative_ci_halfwidth(xs, confidence))
        if not noise - margin <= min_margin:  # inf noise: undecided
            return False
    return True
