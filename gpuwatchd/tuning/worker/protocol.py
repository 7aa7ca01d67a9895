"""The measurement protocol: time every candidate in a thermal regime, decide winner or tie.

``unthrottled``: warm each candidate up (which also calibrates its batch size), then
rounds of short timed batches with pauses between them; a batch during which a limiting
throttle reason appeared or the SM clock sat under ``clock_ratio_min`` of max is kept
as a rejected record, followed by a recovery pause, and retried (nvbench-style).

``sustained``: load the device back-to-back until SM clock and power settle
(:mod:`~gpuwatchd.tuning.worker.settle`), then time batches back-to-back: the steady
state a training loop sees. Only a batch during a transient hardware slowdown is
rejected (and retried at once), until that state has lasted ``transient_max_s``.

In both, candidates are interleaved in a freshly shuffled order each round (seeded) so
drift does not favour whoever runs first, every batch is tagged with the telemetry read
around it, and rounds repeat until every candidate's relative spread is under target or
the time budget (on ``session.now()``, which must advance as batches and pauses run)
ends. ``should_stop`` is polled between batches; when it says so, :class:`Preempted`
is raised and candidates are still torn down.

Deciding faster (all in :class:`ProtocolConfig`): racing stops timing candidates clearly
out of the race after ``min_rounds``, in both regimes, and a regime stops once more
rounds cannot change its pick by more than ``min_margin``
(:mod:`~gpuwatchd.tuning.worker.racing`); a warm-up ends once its calibration has
converged; a regime after the first reuses the first's batch sizes; unthrottled pauses
are as short as the power limiter allows and dropped for kernels that cannot reach the
limit; the sustained regime is skipped when the unthrottled one showed the kernels
cannot be limited (:mod:`~gpuwatchd.tuning.worker.headroom`) and otherwise starts as
soon as the clock's trend is flat; and :func:`tune_queue` runs the sustained regimes of
workloads queued together back to back, each after the first settling on the heat its
predecessor left.

The verdict (:func:`gpuwatchd.tuning.worker.stats.decide`): ``winner`` is set only when the
margin of the fastest median over the runner-up beats the noise; otherwise
``winner=None, tie=True``. With racing (:func:`~gpuwatchd.tuning.worker.racing.decide_race`)
the pick is one of the candidates timed to the end, and a dropped one is weighed against
it on the rounds both were timed in, so a device that slowed down after the drop cannot
make the dropped one look fast. Candidates in a result are ordered fastest first either
way (dropped ones by their margin behind the pick), those that failed while timed last.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from gpuwatchd.tuning.settings import ProtocolConfig
from gpuwatchd.tuning.types import Regime, RegimeResult, Workload
from gpuwatchd.tuning.worker import stats  # noqa: F401 (tests patch protocol.stats.decide)
from gpuwatchd.tuning.worker.candidate import Candidate, CandidateError, DeviceSession
from gpuwatchd.tuning.worker.headroom import LoadEvidence, skip_reason
from gpuwatchd.tuning.worker.regime_run import (
    ERROR_MAX,
    OnBatch,
    Preempted,
    RegimeRun,
    ShouldStop,
    Slot,
)
from gpuwatchd.validate import describe

__all__ = ["BudgetSpent", "Preempted", "measure", "tune", "tune_queue"]

#: Told (queue index, result) as each regime of each workload is decided.
OnResult = Callable[[int, RegimeResult], None]
#: Told (queue index, regime, its time budget in seconds) as a workload's regime run
#: begins (not for a sustained regime that is skipped).
OnStart = Callable[[int, Regime, float], None]
#: A sustained regime that starts within this long of another one's last batch finds
#: the device still at temperature (the H200's die cools with a ~0.3 s time constant).
HEAT_GAP_S = 0.5


class BudgetSpent(Exception):
    """A queue's ``total_budget_s`` ran out before every (workload, regime) was measured."""


def measure(
    workload: Workload,
    candidates: Sequence[Candidate],
    session: DeviceSession,
    regime: Regime | str,
    cfg: ProtocolConfig | None = None,
    on_batch: OnBatch | None = None,
    should_stop: ShouldStop | None = None,
) -> RegimeResult:
    """Set the candidates up, measure them in one regime, tear them down."""
    return tune(workload, candidates, session, [regime], cfg, on_batch, should_stop)[0]


def tune(
    workload: Workload,
    candidates: Sequence[Candidate],
    session: DeviceSession,
    regimes: Iterable[Regime | str] = (Regime.UNTHROTTLED, Regime.SUSTAINED),
    cfg: ProtocolConfig | None = None,
    on_batch: OnBatch | None = None,
    should_stop: ShouldStop | None = None,
    on_result: Callable[[RegimeResult], None] | None = None,
) -> list[RegimeResult]:
    """Measure the candidates in each regime in order, setting each up only once.

    Every candidate that was set up is torn down, whatever happens (Preempted, a CUDA
    error, ...); a candidate whose ``setup`` raises :class:`CandidateError` is kept in
    the results with its error and never timed. ``on_result`` gets each regime's result
    as soon as it is decided, so a preemption in a later regime keeps the earlier ones.
    """
    queue = [(workload, candidates)]
    each = None if on_result is None else (lambda _j, r: on_result(r))
    return tune_queue(queue, session, regimes, cfg, on_batch, should_stop, each)[0]


def tune_queue(
    queue: Sequence[tuple[Workload, Sequence[Candidate]]],
    session: DeviceSession,
    regimes: Iterable[Regime | str] = (Regime.UNTHROTTLED, Regime.SUSTAINED),
    cfg: ProtocolConfig | None = None,
    on_batch: OnBatch | None = None,
    should_stop: ShouldStop | None = None,
    on_result: OnResult | None = None,
    *,
    workload_regimes: Sequence[Iterable[Regime | str] | None] | None = None,
    on_start: OnStart | None = None,
    total_budget_s: float | None = None,
    budget_since: float | None = None,
) -> list[list[RegimeResult]]:
    """:func:`tune` for several workloads at once: one list of results per workload.

    Regimes run in order across the queue (every workload's first regime, then every
    workload's second, ...), so the sustained regimes run back to back: each after the
    first starts on a device its predecessor left at temperature and only needs
    ``warm_settle_window_s`` to show its own clock and power are flat. Every candidate
    of every workload is set up first and torn down at the end.

    ``workload_regimes`` (one entry per workload, None for all of ``regimes``) narrows a
    workload to some of the regimes, e.g. those a resumed session still lacks.
    ``on_start`` is told as each workload's regime begins, so ``on_batch`` records can
    be attributed. With ``total_budget_s`` each regime run gets an equal share of what is
    left of it (at most ``cfg.time_budget_s``), so time a quick run leaves goes to later
    ones; :class:`BudgetSpent` is raised when none is left for a run. That budget counts
    from ``budget_since`` (a ``session.now()`` reading; default: this call), so setting the
    candidates up (compiling, allocating) spends it too, and no more are set up once it
    is spent.
    """
    cfg = cfg or ProtocolConfig()
    order = [_regime(r) for r in regimes]
    wanted = _wanted_regimes(queue, order, workload_regimes)
    for workload, candidates in queue:
        names = [c.name for c in candidates]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"candidates: duplicate names {dupes} in workload {workload.name!r}")
    l2_bytes = getattr(session, "l2_bytes", None) or cfg.l2_bytes
    began = session.now() if budget_since is None else budget_since
    prepared: list[list[Slot]] = []
    try:
        for workload, candidates in queue:
            prepared.append([])
            for cand in candidates:
                if total_budget_s is not None and session.now() - began >= total_budget_s:
                    raise BudgetSpent(
                        f"time budget of {total_budget_s:g} s spent setting up "
                        f"{workload.name}'s candidates"
                    )
                prepared[-1].append(_prepare(cand, l2_bytes, cfg))
        results: list[list[RegimeResult]] = [[] for _ in queue]
        evidence: list[LoadEvidence | None] = [None] * len(queue)
        hot_until: float | None = None  # when our last sustained batch ended
        runs_left = sum(len(w) for w in wanted)
        can_probe = cfg.skip_sustained and bool(
            session.info.power_limit_w and session.info.max_sm_clock_mhz
        )
        for regime in order:
            for j, (workload, _) in enumerate(queue):
                if regime not in wanted[j]:
                    continue
                runs_left -= 1
                ev = evidence[j]
                if regime is Regime.SUSTAINED and ev is not None:
                    evidence[j] = None
                    reason = skip_reason(ev, session.info, cfg.skip_power_ratio)
                    if reason is not None:
                        results[j].append(_sustained_from(results[j][-1], reason))
                        if on_result is not None:
                            on_result(j, results[j][-1])
                        continue
                budget = cfg.time_budget_s
                if total_budget_s is not None:
                    left = total_budget_s - (session.now() - began)
                    if left <= 0:
                        raise BudgetSpent(
                            f"time budget of {total_budget_s:g} s spent before "
                            f"{workload.name} ({regime.value})"
                        )
                    budget = min(budget, left / (runs_left + 1))
                if on_start is not None:
                    on_start(j, regime, budget)
                run = RegimeRun(workload, prepared[j], session, regime, cfg, on_batch, should_stop)
                run.budget_s = budget
                mine = wanted[j]
                follows = mine[mine.index(regime) + 1 : mine.index(regime) + 2]
                probe = can_probe and regime is Regime.UNTHROTTLED and follows == [Regime.SUSTAINED]
                run.evidence = LoadEvidence() if probe else None
                run.warm = (
                    regime is Regime.SUSTAINED
                    and hot_until is not None
                    and session.now() - hot_until <= HEAT_GAP_S
                )
                results[j].append(run.run())
                if on_result is not None:
                    on_result(j, results[j][-1])
                evidence[j] = run.evidence
                hot_until = session.now() if regime is Regime.SUSTAINED else None
        return results
    finally:
        for slots in prepared:
            for slot in slots:
                if slot.set_up:
                    _teardown(slot)


def _wanted_regimes(
    queue: Sequence[tuple[Workload, Sequence[Candidate]]],
    order: list[Regime],
    workload_regimes: Sequence[Iterable[Regime | str] | None] | None,
) -> list[list[Regime]]:
    """Each workload's regimes, in ``order``; ValueError naming a bad entry."""
    if workload_regimes is None:
        return [list(order) for _ in queue]
    if len(workload_regimes) != len(queue):
        raise ValueError(
            f"workload_regimes: {len(workload_regimes)} entries for {len(queue)} workloads"
        )
    out = []
    for (workload, _), mine in zip(queue, workload_regimes, strict=True):
        if mine is None:
            out.append(list(order))
            continue
        chosen = {_regime(r) for r in mine}
        extra = chosen - set(order)
        if extra or not chosen:
            raise ValueError(
                f"workload_regimes: {workload.name!r} needs some of "
                f"{[r.value for r in order]}, got {sorted(r.value for r in chosen)}"
            )
        out.append([r for r in order if r in chosen])
    return out


def _sustained_from(unthrottled: RegimeResult, reason: str) -> RegimeResult:
    """The sustained result of kernels that cannot be limited: the unthrottled one, marked."""
    cands = tuple(
        replace(c, regime=Regime.SUSTAINED, meta={**c.meta, "sustained_skipped": reason})
        for c in unthrottled.candidates
    )
    return replace(unthrottled, regime=Regime.SUSTAINED, candidates=cands)


def _regime(r: Regime | str) -> Regime:
    try:
        return Regime(r)
    except ValueError:
        known = ", ".join(x.value for x in Regime)
        raise ValueError(f"regime: unknown regime {r!r} (known: {known})") from None


def _prepare(cand: Candidate, l2_bytes: int, cfg: ProtocolConfig) -> Slot:
    """Set a candidate up; one that fails is kept with its error and never timed.

    ``l2_bytes`` is the session's own L2 size when it knows it (a CUDA session reads it
    from the device), else the configured one.
    """
    slot = Slot(cand, {})
    try:
        cand.setup()
        slot.set_up = True
        slot.meta = dict(cand.meta())
    except CandidateError as e:
        slot.error = describe(e, with_type=False, limit=ERROR_MAX)
        return slot
    slot.flush = _wants_flush(slot.meta, l2_bytes, cfg)
    return slot


def _wants_flush(meta: Mapping[str, Any], l2_bytes: int, cfg: ProtocolConfig) -> bool:
    """Flush L2 between calls when the working set would otherwise stay cached in it.

    ``auto`` trusts the candidate's ``working_set_bytes`` when it gives one, else its
    boolean ``small`` flag, else assumes a kernel too big to matter.
    """
    if cfg.flush_l2 != "auto":
        return cfg.flush_l2 == "always"
    ws = meta.get("working_set_bytes")
    if isinstance(ws, int | float) and not isinstance(ws, bool):
        return ws <= l2_bytes
    return bool(meta.get("small", False))


def _teardown(slot: Slot) -> None:
    try:
        slot.cand.teardown()
    except CandidateError as e:
        slot.error = slot.error or f"teardown: {describe(e, with_type=False, limit=ERROR_MAX)}"
