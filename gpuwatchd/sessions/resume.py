"""Which results of earlier, preempted sessions a new session may reuse, and what is left.

A production host's gate may open for 20 s at a time: a plan longer than that only
finishes if each session keeps what the ones before it measured. A result is reused
when it was recorded by a **preempted** session (a completed session's results are
winners already; a failed one's may carry the failure) of the **same GPU** (UUID),
at most ``max_age_s`` ago (winners measured under older conditions are measured
again) and **after the GPU's last completed session** (whose winners superseded it),
for the **same workload definition** (a workload redefined under its name is new
work), on the **same driver, power limit and maximum SM clock** as the session being
started, and, checked when the worker says hello (or, with nothing left to measure,
against the versions installed now), the **same software stack**
(:class:`~gpuwatchd.tuning.types.Versions` key). Reusable results from different
stacks are never mixed: only those of the newest result's stack are kept.

Work requested for a fresh measurement (an operator's re-tune, a drift trigger) never
reuses a result recorded before that request (``fresh_after``): the session that was
preempted while measuring it may still be resumed.

The unit is the (workload, regime) pair: a regime interrupted half way is measured
again from the start.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Collection, Mapping
from dataclasses import replace

from gpuwatchd.store import SessionMeta, SqlStore, StoredResult
from gpuwatchd.tuning.session_spec import SessionSpec
from gpuwatchd.tuning.types import Regime, Workload
from gpuwatchd.tuning.versions import same_version

log = logging.getLogger("gpuwatchd.sessions.resume")

Pair = tuple[str, Regime]

#: Power limits closer than this are the same (NVML reports milliwatts).
POWER_LIMIT_TOLERANCE_W = 0.5
#: Maximum SM clocks closer than this are the same.
MAX_CLOCK_TOLERANCE_HZ = 0.5e6


def check_max_age(value: object) -> float:
    """``resume_max_age_s`` as a float: a finite number >= 0 (0 turns resuming off)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < math.inf:
        return float(value)
    raise ValueError(f"resume_max_age_s must be a finite number >= 0, got {value!r}")


def _differs(now: float | None, then: float | None, tolerance: float) -> bool:
    """Known on one side only, or further apart than ``tolerance``."""
    if now is None or then is None:
        return (now is None) != (then is None)
    return abs(now - then) > tolerance


def conditions_differ(meta: SessionMeta, source: SessionMeta) -> str | None:
    """Why results measured in session ``source`` do not hold for ``meta``, or None."""
    if meta.gpu_uuid != source.gpu_uuid:
        return f"GPU {source.gpu_uuid}, now {meta.gpu_uuid}"
    if not same_version("driver", meta.versions.driver, source.versions.driver):
        return f"driver {source.versions.driver}, now {meta.versions.driver}"
    if _differs(meta.power_limit_w, source.power_limit_w, POWER_LIMIT_TOLERANCE_W):
        return f"power limit {source.power_limit_w} W, now {meta.power_limit_w} W"
    if _differs(meta.max_sm_clock_hz, source.max_sm_clock_hz, MAX_CLOCK_TOLERANCE_HZ):
        return f"max SM clock {source.max_sm_clock_hz} Hz, now {meta.max_sm_clock_hz} Hz"
    return None


def workload_text(workload: Workload) -> str:
    """A workload's definition as canonical JSON: a tuple and its stored list compare equal."""
    return json.dumps(workload.to_json(), sort_keys=True, separators=(",", ":"))


def workload_differs(spec: SessionSpec, name: str, source: SessionMeta) -> str | None:
    """Why session ``source``'s ``name`` is not the spec's workload of that name, or None."""
    theirs = next((w for w in source.workloads if w.name == name), None)
    ours = next((w for w in spec.workloads if w.name == name), None)
    if theirs is None or ours is None:
        return f"workload {name} is not in both sessions"
    if workload_text(theirs) != workload_text(ours):
        return f"workload {name} was redefined since"
    return None


def oldest_reusable(store: SqlStore, gpu_uuid: str, since: float) -> float:
    """``since``, or just after the GPU's last completed session ended if that is later:
    a completed session's winners supersede what was measured before it."""
    last = store.last_completed_at(gpu_uuid)
    return since if last is None else max(since, math.nextafter(last, math.inf))


def reusable_results(
    store: SqlStore,
    spec: SessionSpec,
    meta: SessionMeta,
    *,
    since: float,
    fresh_after: Mapping[str, float] | None = None,
) -> dict[Pair, StoredResult]:
    """The spec's pairs already measured by a preempted session that still hold for ``meta``.

    ``since`` (unix seconds, the store's clock) is the oldest ``recorded_at`` accepted;
    results from before the GPU's last completed session are never accepted.
    ``fresh_after`` maps a workload requested for a fresh measurement to when it was
    requested: older results of it are not reused. The stack is not known yet (the
    worker reports it): the caller checks it at hello.
    """
    since = oldest_reusable(store, spec.gpu_uuid, since)
    found = store.resumable_results(spec.gpu_uuid, spec.pairs(), since=since)
    fresh = fresh_after or {}
    sources: dict[int, SessionMeta | None] = {}
    kept: dict[Pair, StoredResult] = {}
    for pair, stored in found.items():
        if stored.session_id not in sources:
            row = store.session(stored.session_id)
            sources[stored.session_id] = row.meta if row is not None else None
        source = sources[stored.session_id]
        why = _why_not(spec, meta, pair, stored, source, fresh.get(pair[0]))
        if why is not None:
            log.info("not reusing %s from session %d: %s", pair_text(pair), stored.session_id, why)
            continue
        kept[pair] = stored
    if not kept:
        return {}
    newest = max(kept.values(), key=lambda s: s.recorded_at).versions.key()
    return {p: s for p, s in kept.items() if s.versions.key() == newest}


def _why_not(
    spec: SessionSpec,
    meta: SessionMeta,
    pair: Pair,
    stored: StoredResult,
    source: SessionMeta | None,
    fresh_after: float | None,
) -> str | None:
    """Why ``stored`` (from session ``source``) may not be reused for ``pair``, or None."""
    if source is None:
        return "its session is gone"
    if fresh_after is not None and stored.recorded_at < fresh_after:
        return "measured before the fresh measurement was requested"
    return conditions_differ(meta, source) or workload_differs(spec, pair[0], source)


def remaining_spec(spec: SessionSpec, done: Collection[Pair]) -> SessionSpec | None:
    """``spec`` without the pairs in ``done``, or None when nothing is left.

    A workload with every regime done is dropped; one with some left keeps only those
    (``SessionSpec.workload_regimes``). The time budget shrinks in proportion, so each
    remaining pair gets the share it had in the whole spec.
    """
    pairs = spec.pairs()
    left: dict[str, tuple[Regime, ...]] = {}
    for w in spec.workloads:
        regimes = tuple(r for r in spec.regimes_of(w.name) if (w.name, r) not in done)
        if regimes:
            left[w.name] = regimes
    n_left = sum(map(len, left.values()))
    if n_left == 0:
        return None
    if n_left == len(pairs):
        return spec
    return replace(
        spec,
        workloads=tuple(w for w in spec.workloads if w.name in left),
        workload_regimes={n: rs for n, rs in left.items() if rs != spec.regimes},
        time_budget_s=spec.time_budget_s * n_left / len(pairs),
    )


def describe_reuse(reuse: Mapping[Pair, StoredResult]) -> str:
    """``mm (unthrottled) from session 3, mm (sustained) from session 5``: for the log."""
    return ", ".join(f"{pair_text(p)} from session {s.session_id}" for p, s in reuse.items())


def pair_text(pair: Pair) -> str:
    return f"{pair[0]} ({pair[1].value})"
