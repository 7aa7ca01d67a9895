"""The rules that turn a regime's measurements into a winner, in one place.

The worker's protocol decides winner-or-tie; these rules read that verdict back: which
candidate a winners row records, and whether the two regimes disagree. The store, the
report and the exporter all ask here, so they can never answer differently.
"""

from __future__ import annotations

from gpuwatchd.tuning.types import CandidateStats, RegimeResult

#: Candidate meta key a family sets (true) on what the job runs without gpuwatchd.
JOB_DEFAULT = "job_default"
#: Regime meta key: no candidate beat the job's default beyond the noise, so it stays.
KEPT_DEFAULT = "kept_default"
#: Candidate meta key: ``{"margin", "noise", "beats"}`` of this candidate against the default.
VS_DEFAULT = "vs_default"


def pick_winner(result: RegimeResult) -> CandidateStats | None:
    """The candidate a winners row records: the declared winner, else on a tie the job's
    default where nothing beat it beyond the noise, else the fastest.

    None when nothing was measured (every batch of every candidate rejected).
    """
    if result.winner is not None:
        return next(c for c in result.candidates if c.name == result.winner)
    if not result.tie:
        return None
    kept = next((c for c in result.candidates if c.meta.get(JOB_DEFAULT)), None)
    if kept is not None and kept.meta.get(KEPT_DEFAULT) and kept.median_s is not None:
        return kept
    timed = [c for c in result.candidates if c.median_s is not None]
    return min(timed, key=lambda c: c.median_s or 0.0) if timed else None


def job_default(result: RegimeResult) -> tuple[str | None, bool]:
    """What the job runs without gpuwatchd (its candidate's name, None where the family
    declares none) and whether it stays: it won, or nothing beat it beyond the noise."""
    default = next((c for c in result.candidates if c.meta.get(JOB_DEFAULT)), None)
    if default is None:
        return None, False
    recorded = pick_winner(result)
    return default.name, recorded is not None and recorded.name == default.name


def clear_winner(candidate: str | None, tie: bool) -> str | None:
    """The candidate if it won beyond noise; None for a tie or no result."""
    return None if tie else candidate


def winners_differ(unthrottled: str | None, sustained: str | None) -> bool:
    """Do the regimes pick different kernels? Each argument is that regime's clear winner.

    A tie (None) is no evidence of a difference, so it never counts as one.
    """
    return unthrottled is not None and sustained is not None and unthrottled != sustained
