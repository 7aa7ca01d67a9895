"""Racing: which candidates are clearly out of the race, so their timing can stop.

A candidate is out when its median's confidence interval (the protocol's own noise
estimate, :func:`~gpuwatchd.tuning.worker.stats.median_ci`) lies wholly above the
leader's and its median trails the leader's by more than ``min_margin``: more samples
of it could not make it the winner, and a gap that size is no tie either. With few
samples the interval is the full range, so a candidate is dropped only when every one
of its batches was slower than every one of the leader's.

:func:`decided` is racing's other half, the stopping rule: more rounds cannot change the
verdict on the pick (lowest median) against any contender still timed. :func:`decide_race`
is the verdict over a race: a dropped candidate is compared like with like, on the rounds
it was timed in, and is never the pick.
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
    """True when more rounds cannot change the verdict on the pick (lowest median).

    Against each contender, with :func:`~gpuwatchd.tuning.worker.stats.decide`'s margin
    and noise (``noise_k`` times the two medians' relative CI half-widths in quadrature,
    floored at ``min_margin``), the pair is settled when the pick is decided (margin
    over the noise) or the noise is at its floor (a tie within ``min_margin`` that more
    rounds, which only shrink the intervals, cannot turn into a gap worth acting on). A
    tie whose noise is still above the floor is not settled: more rounds may yet show a
    real gap. A contender that ``same_code`` says launches the pick's very kernels is the
    pick, and every candidate needs ``min_samples`` samples first. One candidate alone is
    decided.
    """
    usable = {name: xs for name, xs in samples.items() if xs}
    if any(len(xs) < min_samples for xs in usable.values()):
        return False
    if len(usable) < 2:
        return True
    pick = min(usable, key=lambda name: (stats.median(usable[name]), name))
    if stats.median(usable[pick]) <= 0:
        return False
    for name, xs in usable.items():
        if name == pick or (same_code is not None and same_code(pick, name)):
            continue
        margin, noise = stats.versus(
            usable[pick], xs, noise_k=noise_k, min_margin=min_margin, confidence=confidence
        )
        if not (margin > noise or noise <= min_margin):  # inf noise: undecided
            return False
    return True


def decide_race(
    timed: Mapping[str, Sequence[tuple[int, float]]],
    dropped: Mapping[str, int],
    *,
    noise_k: float,
    min_margin: float,
    confidence: float,
) -> stats.Decision:
    """:func:`~gpuwatchd.tuning.worker.stats.decide` over a race, like with like.

    ``timed`` holds each candidate's samples as ``(round, seconds)``; ``dropped`` maps
    the candidates racing stopped timing to the round after which it did. The finalists
    (the rest) were timed in the same rounds, so the pick is theirs, by ``decide``. A
    dropped candidate's samples end at its drop, and a device that slowed down after it
    (SW thermal, power-cap drift, a lasting HW slowdown) slowed only the finalists: it is
    compared with the pick on the pick's samples from its own rounds only, and is never
    the pick (it would have to be timed again). The runner-up is whichever contender
    trails the pick least, like with like; the pick wins only when that margin beats the
    noise, and the ranking lists the others by their margin behind the pick.
    """
    kw = {"noise_k": noise_k, "min_margin": min_margin, "confidence": confidence}
    finals: dict[str, Sequence[float]] = {
        name: [x for _, x in xs] for name, xs in timed.items() if name not in dropped
    }
    verdict = stats.decide(finals, **kw)
    late = sorted(name for name, xs in timed.items() if name in dropped and xs)
    if not late or not verdict.ranking:
        return verdict
    pick = verdict.ranking[0]
    behind = {name: stats.versus(finals[pick], finals[name], **kw) for name in verdict.ranking[1:]}
    for name in late:
        xs = [x for _, x in timed[name]]
        same_rounds = [x for r, x in timed[pick] if r <= dropped[name]]
        if same_rounds:
            behind[name] = stats.versus(same_rounds, xs, **kw)
        else:  # never timed beside the pick: no evidence either way
            behind[name] = (stats.versus(finals[pick], xs, **kw)[0], math.inf)
    order = sorted(behind, key=lambda name: (behind[name][0], name))
    margin, noise = behind[order[0]]
    won = margin > noise
    return stats.Decision(pick if won else None, not won, margin, noise, (pick, *order))
