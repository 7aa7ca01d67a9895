"""When two hosts disagree on a fleet winner: the pure rule, no database.

Hosts with the same GPU model and versions should measure the same winner. When a host
finds the fleet's incumbent clearly slower than its own pick, one of the two hosts is
not like the others (cooling, a power limit, a noisy neighbour): overwriting would let
the fleet's pick flap between hosts, so the incumbent stays and the disagreement is
recorded and exported for a person to look at. Anything weaker than "measured slower
beyond noise, on another host" is ordinary re-tuning: the newest result wins.

The incumbent stays only while it is fresh (:func:`keeps_incumbent`): one measured
longer ago than the fleet trusts a winner (``[fleet] max_winner_age_s``) is replaced
by the new pick, the disagreement still recorded. Otherwise a host that once measured
wrong would hold the fleet's pick against every healthy host for ever.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpuwatchd.tuning.settings import ProtocolConfig
from gpuwatchd.tuning.types import RegimeResult
from gpuwatchd.tuning.winners import pick_winner

#: The protocol's floor under the noise: a smaller gap is a tie even when it is real.
MIN_MARGIN = ProtocolConfig().min_margin
#: How long a disputed incumbent is kept when nobody says otherwise: the ``[fleet]``
#: table's default ``max_winner_age_s`` (7 days; the daemon sets the configured one).
DEFAULT_KEEP_INCUMBENT_S = 7 * 86400.0


@dataclass(frozen=True, slots=True)
class Incumbent:
    """The fleet winner a new result is compared with, and where it was measured."""

    candidate: str
    host: str
    gpu_uuid: str
    median_s: float | None
    measured_at: float | None = None  # unix seconds; None: unknown, treated as stale


def threshold(noise: float | None) -> float:
    """The relative gap a disagreement must exceed: the result's noise, at least the floor."""
    return max(noise or 0.0, MIN_MARGIN)


def disagreement_gap(incumbent: Incumbent, new_host: str, result: RegimeResult) -> float | None:
    """How much slower ``result`` measured the incumbent than its own pick, if they disagree.

    The gap is relative (``incumbent's median / pick's median - 1``, both measured on
    ``new_host``). None, meaning "no disagreement: the newest result wins", when the
    incumbent was measured on the same host, the result is a tie or picks the same
    candidate, or the incumbent's candidate was not timed in it, or the gap is within
    :func:`threshold`.
    """
    if incumbent.host == new_host or result.tie:
        return None
    pick = pick_winner(result)
    if pick is None or pick.name == incumbent.candidate or not pick.median_s:
        return None
    theirs = next((c for c in result.candidates if c.name == incumbent.candidate), None)
    if theirs is None or theirs.median_s is None:
        return None
    gap = theirs.median_s / pick.median_s - 1.0
    return gap if gap > threshold(result.noise) else None


def keeps_incumbent(incumbent: Incumbent, now: float, keep_for_s: float) -> bool:
    """Whether a disputed ``incumbent`` stays the fleet's winner at ``now``: only while it
    was measured at most ``keep_for_s`` ago (an unknown age is not fresh)."""
    measured = incumbent.measured_at
    if measured is None or not math.isfinite(measured):
        return False
    return now - measured <= keep_for_s
