"""When two hosts disagree on a fleet winner: the pure rule, no database.

Hosts with the same GPU model and versions should measure the same winner. When a host
finds the fleet's incumbent clearly slower than its own pick, one of the two hosts is
not like the others (cooling, a power limit, a noisy neighbour): overwriting would let
the fleet's pick flap between hosts, so the incumbent stays and the disagreement is
recorded and exported for a person to look at. Anything weaker than "measured slower
beyond noise, on another host" is ordinary re-tuning: the newest result wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatchd.tuning.settings import ProtocolConfig
from gpuwatchd.tuning.types import RegimeResult
from gpuwatchd.tuning.winners import pick_winner

#: The protocol's floor under the noise: a smaller gap is a tie even when it is real.
MIN_MARGIN = ProtocolConfig().min_margin


@dataclass(frozen=True, slots=True)
class Incumbent:
    """The fleet winner a new result is compared with, and where it was measured."""

    candidate: str
    host: str
    gpu_uuid: str
    median_s: float | None


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
