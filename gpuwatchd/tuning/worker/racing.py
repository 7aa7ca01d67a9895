"""Racing: which candidates are clearly out of the race, so their timing can stop.

A candidate is out when its median's confidence interval (the protocol's own noise
estimate, :func:`~gpuwatchd.tuning.worker.stats.median_ci`) lies wholly above the
leader's and its median trails the leader's by more than ``min_margin``: more samples
of it could not make it the winner, and a gap that size is no tie either. With few
samples the interval is the full range, so a candidate is dropped only when every one
of its batches was slower than every one of the leader's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
