"""Find the recorded winner a user kernel may use, or say in one line why there is none.

A winner is usable only when it was measured for this kernel identity and key (the
workload name carries both), on this GPU model, in the asked regime, with the same
Triton, CUDA and driver versions, and names one of the kernel's configs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuwatchd.client import Client, GpuwatchdError
from gpuwatchd.jobside.stack import Stack
from gpuwatchd.telemetry.types import ThrottleReason
from gpuwatchd.tuning.submitted.kernels import versions_mismatch
from gpuwatchd.tuning.types import Regime
from gpuwatchd.tuning.winners import JOB_DEFAULT, KEPT_DEFAULT, VS_DEFAULT
from gpuwatchd.validate import one_line

if TYPE_CHECKING:
    from gpuwatchd.api.winners import Winner

#: Throttle reasons that mean the GPU is already in its sustained, capped state.
_CAPPED = {
    r.label
    for r in (
        ThrottleReason.SW_POWER_CAP,
        ThrottleReason.HW_SLOWDOWN,
        ThrottleReason.SW_THERMAL_SLOWDOWN,
        ThrottleReason.HW_THERMAL_SLOWDOWN,
        ThrottleReason.HW_POWER_BRAKE_SLOWDOWN,
    )
}


@dataclass(frozen=True, slots=True)
class Lookup:
    """The usable winner (or None) and why, in one line."""

    winner: Winner | None
    reason: str


def find_winner(
    client: Client,
    workload: str,
    identity: str,
    regime: Regime,
    stack: Stack,
    labels: Collection[str],
) -> Lookup:
    """The recorded ``regime`` winner of ``workload`` if this job may use it."""
    try:
        w = client.winner(workload, regime, gpu_model=stack.gpu_model)
    except (GpuwatchdError, ValueError) as e:
        return Lookup(None, f"no winners source ({one_line(e)})")
    if w is None:
        return Lookup(None, f"no {regime.value} winner recorded on {stack.gpu_model}")
    why = versions_mismatch(w.versions, stack.versions)
    if why is not None:
        return Lookup(None, f"the recorded winner was measured on another stack ({why})")
    recorded = w.meta.get("identity")
    if recorded is not None and recorded != identity:
        return Lookup(None, "the recorded winner is for another version of the kernel")
    if w.candidate not in labels:
        return Lookup(None, f"the recorded winner {w.candidate!r} is not one of the configs")
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(w.measured_at))
    margin = "a tie within noise" if w.tie else _margin(w.margin)
    return Lookup(
        w,
        f"the {regime.value} winner measured on {w.gpu_model} at {when} "
        f"(session {w.session_id}, {margin}{_versus_job(w.meta)})",
    )


def _margin(margin: float | None) -> str:
    return f"{margin:.1%} ahead" if margin is not None else "margin unknown"


def _versus_job(meta: dict[str, Any]) -> str:
    """How the winner stands against what the job runs without gpuwatchd, where known: the
    config plain Triton picked in a job that filed the key (one of them, if several jobs
    filed it with different picks)."""
    if meta.get(JOB_DEFAULT) is True:
        kept = meta.get(KEPT_DEFAULT) is True
        own = "; Triton's own pick when the key was filed"
        return own + (", nothing beat it beyond the noise" if kept else "")
    vs = meta.get(VS_DEFAULT)
    margin = vs.get("margin") if isinstance(vs, dict) else None
    if isinstance(margin, int | float) and not isinstance(margin, bool) and math.isfinite(margin):
        return f"; {margin:.1%} ahead of Triton's own pick when the key was filed"
    return ""


def auto_regime(client: Client, gpu_uuid: str | None) -> tuple[Regime, str]:
    """``regime="auto"``: the daemon's view of the GPU now decides.

    Unthrottled when the daemon sees it cool and stable with no capping reason,
    sustained otherwise, and sustained when the daemon cannot say (what a long-running
    job sees).
    """
    if gpu_uuid is None:
        return Regime.SUSTAINED, "auto: GPU UUID unknown, assuming sustained"
    try:
        st = client.state(gpu_uuid)
    except (GpuwatchdError, ValueError) as e:
        return Regime.SUSTAINED, f"auto: daemon's view unavailable ({one_line(e)}), sustained"
    capped = sorted(_CAPPED.intersection(st.throttle_reasons or ()))
    if st.state == "cool_stable" and not capped:
        return Regime.UNTHROTTLED, "auto: the daemon sees the GPU cool and stable"
    why = "+".join(capped) if capped else st.state
    return Regime.SUSTAINED, f"auto: the daemon sees the GPU {why}"
