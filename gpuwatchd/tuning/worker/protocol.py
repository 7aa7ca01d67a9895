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

import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpuwatchd.telemetry.types import LIMITING_REASONS, POWER_REASONS, Sample, ThrottleReason
from gpuwatchd.tuning.settings import ProtocolConfig
from gpuwatchd.tuning.types import BatchRecord, CandidateStats, Regime, RegimeResult, Workload
from gpuwatchd.tuning.winners import JOB_DEFAULT, KEPT_DEFAULT, VS_DEFAULT
from gpuwatchd.tuning.worker import stats
from gpuwatchd.tuning.worker.candidate import Candidate, CandidateError, DeviceSession
from gpuwatchd.tuning.worker.headroom import LoadEvidence, shows_limit, skip_reason
from gpuwatchd.tuning.worker.racing import decide_race, decided, out_of_race
from gpuwatchd.tuning.worker.settle import settled as device_settled
from gpuwatchd.validate import describe

#: The longest error text kept for one candidate.
_ERROR_MAX = 500

OnBatch = Callable[[BatchRecord], None]
ShouldStop = Callable[[], bool]
#: Told (queue index, result) as each regime of each workload is decided.
OnResult = Callable[[int, RegimeResult], None]
#: Told (queue index, regime, its time budget in seconds) as a workload's regime run
#: begins (not for a sustained regime that is skipped).
OnStart = Callable[[int, Regime, float], None]
#: A sustained regime that starts within this long of another one's last batch finds
#: the device still at temperature (the H200's die cools with a ~0.3 s time constant).
HEAT_GAP_S = 0.5
#: Hardware slowdowns that come and go (a power brake, an HW slowdown signal, the
#: hardware thermal clamp): not the steady state the sustained regime measures.
TRANSIENT_REASONS = (
    ThrottleReason.HW_SLOWDOWN
    | ThrottleReason.HW_THERMAL_SLOWDOWN
    | ThrottleReason.HW_POWER_BRAKE_SLOWDOWN
)
#: A warm-up's calibration has converged once a batch moved its per-call estimate by
#: less than this.
CALIBRATION_CONVERGED_REL = 0.05


class BudgetSpent(Exception):
    """A queue's ``total_budget_s`` ran out before every (workload, regime) was measured."""


class Preempted(Exception):
    """``should_stop()`` asked the protocol to give the device back (another process)."""


@dataclass(slots=True)
class _Slot:
    """A candidate's mutable state across the regimes of one tuning run."""

    cand: Candidate
    meta: dict[str, Any]
    calls: int = 1
    flush: bool = False
    error: str | None = None
    set_up: bool = False  # setup() succeeded, so teardown() is owed
    accepted: list[BatchRecord] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)  # the round of each accepted batch
    rejected: list[BatchRecord] = field(default_factory=list)
    skipped: int = 0  # unthrottled slots given up after max_retries rejections
    calibrated: bool = False  # calls was sized by a warm-up of this run
    out_after: int | None = None  # rounds after which racing stopped timing it

    @property
    def name(self) -> str:
        return self.cand.name

    def reset(self) -> None:
        self.accepted, self.rejected, self.skipped, self.out_after = [], [], 0, None
        self.rounds = []


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
    prepared: list[list[_Slot]] = []
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
                run = _RegimeRun(workload, prepared[j], session, regime, cfg, on_batch, should_stop)
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


def _prepare(cand: Candidate, l2_bytes: int, cfg: ProtocolConfig) -> _Slot:
    """Set a candidate up; one that fails is kept with its error and never timed.

    ``l2_bytes`` is the session's own L2 size when it knows it (a CUDA session reads it
    from the device), else the configured one.
    """
    slot = _Slot(cand, {})
    try:
        cand.setup()
        slot.set_up = True
        slot.meta = dict(cand.meta())
    except CandidateError as e:
        slot.error = describe(e, with_type=False, limit=_ERROR_MAX)
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


def _teardown(slot: _Slot) -> None:
    try:
        slot.cand.teardown()
    except CandidateError as e:
        slot.error = slot.error or f"teardown: {describe(e, with_type=False, limit=_ERROR_MAX)}"


class _RegimeRun:
    """One regime's measurement over the prepared candidates."""

    def __init__(
        self,
        workload: Workload,
        slots: list[_Slot],
        session: DeviceSession,
        regime: Regime,
        cfg: ProtocolConfig,
        on_batch: OnBatch | None,
        should_stop: ShouldStop | None,
    ) -> None:
        self.workload = workload
        self.slots = slots
        self.s = session
        self.regime = regime
        self.cfg = cfg
        self.on_batch = on_batch
        self.should_stop = should_stop
        self.rng = random.Random(f"{cfg.seed}/{workload.name}/{regime.value}")
        self.start = session.now()
        self._last_wall = 0.0  # end-to-end seconds of the last flushed batch
        self.regime_meta: dict[str, Any] = {}
        #: Set (by tune_queue) when this unthrottled regime gathers evidence for skipping the
        #: sustained one: then the warm-ups run back-to-back, and a power probe follows.
        self.evidence: LoadEvidence | None = None
        #: Set (by tune_queue) when a sustained regime follows another one at once.
        self.warm = False
        #: This run's time budget (tune_queue may hand it a share of a job's budget).
        self.budget_s = cfg.time_budget_s
        #: Unthrottled: the pause after a batch now (backs off after power rejections).
        self.pause_s = cfg.pause_s
        self._transient_since: float | None = None  # sustained: when HW slowdown began
        self._round = 0  # the round being timed (1-based; 0 before the first)
        self._load_began = self.start  # when this regime's back-to-back load began
        for slot in slots:
            slot.reset()

    # -- control --------------------------------------------------------------------

    def run(self) -> RegimeResult:
        sustained = self.regime is Regime.SUSTAINED
        probing = self.evidence is not None
        load_began = self._load_began = self.s.now()
        for slot in self._active():
            if self._over_budget():
                break
            if self.cfg.reuse_calibration and slot.calibrated:
                continue
            self._calibrate(slot, pause_after=not (sustained or probing))
            if probing:
                self._read_load(load_began)
        unlimited = False
        if probing:
            self._power_probe(load_began)
            unlimited = self._unlimited()
        if sustained:
            self._settle()
        elif not unlimited:  # let the warm-ups' (or an earlier regime's) heat and power go
            self.s.pause(self.cfg.cool_pause_s)
        rounds = 0
        while self._racing() and not self._over_budget() and rounds < self.cfg.max_rounds:
            self._round = rounds + 1
            order = self._racing()
            self.rng.shuffle(order)
            for slot in order:
                if self._over_budget():
                    break
                if slot.error is not None:
                    continue
                if sustained:
                    self._sustained_batch(slot)
                else:
                    self._unthrottled_batch(slot)
            rounds += 1
            if self._races() and rounds >= self.cfg.min_rounds:
                self._drop_clearly_out(rounds)
            if rounds >= self._rounds_needed() and (self._stable() or self._decided()):
                break
        self.regime_meta["rounds"] = rounds
        return self._result()

    def _unlimited(self) -> bool:
        """After the power probe: drop the unthrottled pauses when the candidates showed
        they cannot reach the power limit (the sustained-skip evidence)."""
        ev = self.evidence
        if not self.cfg.unpaused_when_unlimited or ev is None:
            return False
        if skip_reason(ev, self.s.info, self.cfg.skip_power_ratio) is None:
            return False
        self.pause_s = 0.0
        self.regime_meta["unpaused"] = "cannot reach the power limit"
        return True

    def _decided(self) -> bool:
        """``stop_when_decided``: more rounds cannot change the pick by over min_margin."""
        cfg = self.cfg
        if not cfg.stop_when_decided:
            return False
        racing = self._racing()
        by_name = {s.name: s for s in racing}
        return decided(
            {s.name: [r.seconds_per_call for r in s.accepted] for s in racing},
            confidence=cfg.confidence,
            noise_k=cfg.noise_k,
            min_margin=cfg.min_margin,
            min_samples=cfg.min_rounds,
            same_code=lambda a, b: _same_code(by_name[a], by_name[b]),
        )

    def _active(self) -> list[_Slot]:
        return [s for s in self.slots if s.error is None]

    def _racing(self) -> list[_Slot]:
        """Candidates still timed: no error, not out of the race."""
        return [s for s in self._active() if s.out_after is None]

    def _races(self) -> bool:
        """Racing runs in the unthrottled regime, and with ``race_sustained`` in the other.

        Unthrottled, a throttled batch is rejected, so every candidate's samples stay
        comparable whenever they were taken. Sustained, the steady power cap is kept but
        a batch during a transient hardware slowdown is rejected too (when
        ``transient_max_s`` > 0), so an episode does not bias the contenders' medians; a
        slowdown that lasts (SW thermal, power-cap drift) is kept, and the verdict
        compares a dropped candidate on its own rounds only (:meth:`_result`).
        """
        if not self.cfg.race:
            return False
        if self.regime is Regime.UNTHROTTLED:
            return True
        return self.cfg.race_sustained and self.cfg.transient_max_s > 0

    def _rounds_needed(self) -> int:
        """Rounds before stopping on a stable spread: contenders' (everyone's, sustained)."""
        if self.cfg.race:
            return max(self.cfg.min_rounds, self.cfg.contender_rounds)
        return self.cfg.min_rounds

    def _drop_clearly_out(self, rounds: int) -> None:
        """Stop timing the candidates clearly out of the race (the leader always stays).

        Only a candidate whose own spread is under target can drop out, and only while the
        leader's is too: a confidence interval assumes steady samples, and a drifting device
        (heating, throttling) would judge them against a moving target. A sustained regime
        that settled has shown its device steady already: there the spread is the capped
        clock's hunting (a few percent over short batches), which the intervals cover.
        """
        racing = self._racing()
        samples = {s.name: [r.seconds_per_call for r in s.accepted] for s in racing}
        timed = {name: xs for name, xs in samples.items() if xs}
        if len(timed) < 2:
            return
        leader = min(timed, key=lambda name: (stats.median(timed[name]), name))
        settled_device = self.regime is Regime.SUSTAINED and self.regime_meta.get("settled")
        steady = {
            name: xs
            for name, xs in timed.items()
            if settled_device or stats.relative_spread(xs) < self.cfg.spread_target
        }
        if leader not in steady:
            return
        out = out_of_race(steady, confidence=self.cfg.confidence, min_margin=self.cfg.min_margin)
        for slot in racing:
            if slot.name in out:
                slot.out_after = rounds

    def _over_budget(self) -> bool:
        return self.s.now() - self.start >= self.budget_s

    def _check_stop(self) -> None:
        if self.should_stop is not None and self.should_stop():
            raise Preempted(f"preempted while tuning {self.workload.name} ({self.regime.value})")

    def _stable(self) -> bool:
        for slot in self._racing():
            xs = [r.seconds_per_call for r in slot.accepted]
            if len(xs) < self._rounds_needed():
                return False
            if stats.relative_spread(xs) >= self.cfg.spread_target:
                return False
        return True

    # -- timing ---------------------------------------------------------------------

    def _time(self, slot: _Slot, calls: int) -> float | None:
        """Seconds for ``calls`` calls (each after an L2 flush when the slot needs it).

        A candidate that raises :class:`CandidateError` here is dropped with its error.
        """
        self._check_stop()
        try:
            if not slot.flush:
                return self.s.time_batch(slot.cand, calls)
            total = 0.0
            begin = self.s.now()
            for _ in range(calls):
                self.s.flush_l2()
                total += self.s.time_batch(slot.cand, 1)
            self._last_wall = self.s.now() - begin
            return total
        except CandidateError as e:
            slot.error = f"run: {describe(e, with_type=False, limit=_ERROR_MAX)}"
            return None

    def _calibrate(self, slot: _Slot, *, pause_after: bool) -> None:
        """Warm up back-to-back for ``warmup_s``, growing batches to size the timed ones.

        Sizing uses the fastest per-call time seen: a host hiccup only ever inflates a
        batch, and must not shrink every later batch to a single call.
        """
        cfg = self.cfg
        calls = cfg.min_calls
        begin = self.s.now()
        best = math.inf
        sized = False  # the previous batch was already big enough
        while not self._over_budget():
            self._last_wall = 0.0
            t = self._time(slot, calls)
            if t is None:
                return
            # A flushed batch costs its flushes too: size it by what it takes end to end,
            # or the flushes alone would eat the time budget.
            before = best
            best = min(best, max(max(t, self._last_wall) / calls, 1e-12))
            big_enough = best * calls >= cfg.batch_target_s / 2 or calls >= cfg.max_calls
            took = self.s.now() - begin
            if big_enough and took >= cfg.warmup_s:
                break
            converged = sized and best >= (1.0 - CALIBRATION_CONVERGED_REL) * before
            if big_enough and converged and took >= cfg.warmup_min_s:
                break
            sized = big_enough
            if not big_enough:
                grow = math.ceil(cfg.batch_target_s / 2 / best)
                calls = min(cfg.max_calls, max(2 * calls, grow))
        if math.isfinite(best):
            slot.calls = min(cfg.max_calls, max(cfg.min_calls, round(cfg.batch_target_s / best)))
            slot.calibrated = True
        if pause_after and self.pause_s > 0:
            self.s.pause(self.pause_s)

    def _read_load(self, load_began: float) -> None:
        """Read the device after back-to-back load since ``load_began`` (skip evidence)."""
        if self.evidence is not None:
            loaded = self.s.now() - load_began
            self.evidence.after_load(self.s.sample(), loaded, self.cfg.power_probe_s)

    def _power_probe(self, load_began: float) -> None:
        """Keep the device loaded until ``power_probe_s`` of it, then read after each candidate.

        The warm-ups usually last long enough on their own; the probe tops them up (a
        few candidates, short warm-ups) so a 1 s power average covers load only.
        """
        probe_s = self.cfg.power_probe_s
        while self._active() and not self._over_budget():
            long_enough = self.s.now() - load_began >= probe_s
            for slot in self._active():
                if self._time(slot, slot.calls) is None:
                    continue
                if long_enough:
                    self._read_load(load_began)
                elif self.cfg.probe_ends_on_limit and self.s.now() - load_began >= probe_s / 2:
                    s = self.s.sample()
                    if shows_limit(s, self.s.info):  # our own load is limited: no skip
                        self.regime_meta["probe_ended"] = "limited after half the probe"
                        return
            if long_enough:
                return

    def _settle(self) -> None:
        """Load the device round-robin, no pauses, until mean clock and power stop moving.

        The window judged is the settle window, or two rounds when a round takes longer
        than half of it (many candidates): the trend needs each candidate seen twice.
        """
        cfg = self.cfg
        window_s = cfg.warm_settle_window_s if self.warm else cfg.settle_window_s
        span = window_s
        begin = self.s.now()
        window: list[tuple[Sample, str]] = []  # each sample, and whose batch it followed
        settled = False
        while self._active() and not self._over_budget():
            round_began = self.s.now()
            for slot in self._active():
                if self._time(slot, slot.calls) is None:
                    continue
                window.append((self.s.sample(), slot.name))
            now = self.s.now()
            span = max(window_s, 2.0 * (now - round_began))
            window = [(w, name) for w, name in window if w.t >= now - 2 * span]
            samples, names = [w for w, _ in window], [name for _, name in window]
            # Carried heat: the previous workload's load goes on in the power reading.
            loaded = math.inf if self.warm else now - self._load_began
            if now - begin >= span and device_settled(samples, cfg, span, names, loaded):
                settled = True
                break
            if now - begin >= cfg.settle_timeout_s:
                break
        self.regime_meta["settled"] = settled
        self.regime_meta["settle_s"] = round(self.s.now() - begin, 6)
        if self.warm:
            self.regime_meta["settled_on_carried_heat"] = True

    def _unthrottled_batch(self, slot: _Slot) -> None:
        """One timed batch; rejected ones are recorded, cooled off and retried."""
        for _ in range(self.cfg.max_retries + 1):
            if self._over_budget():
                return
            before = self.s.sample()
            t = self._time(slot, slot.calls)
            if t is None:
                return
            after = self.s.sample()
            if self.evidence is not None:
                self.evidence.seen(before)
                self.evidence.after_batch(after)
            reason = self._reject_reason(before, after)
            self._record(slot, t, before, after, reason)
            if reason is None:
                if self.pause_s > 0:
                    self.s.pause(self.pause_s)
                return
            if _batch_reasons(before, after) & POWER_REASONS or reason.startswith("sm clock"):
                self._back_off()
            self._check_stop()
            self.s.pause(self.cfg.cool_pause_s)
        slot.skipped += 1

    def _back_off(self) -> None:
        """A batch ran into the power limiter (or a low clock): pause longer from now on."""
        cfg = self.cfg
        longest = max(cfg.max_pause_s, cfg.pause_s)
        self.pause_s = min(longest, max(cfg.pause_s, 2.0 * self.pause_s))
        self.regime_meta["pause_s"] = self.pause_s

    def _sustained_batch(self, slot: _Slot) -> None:
        """One back-to-back batch; one timed in a transient hardware slowdown is rejected
        and retried at once, until the slowdown has lasted ``transient_max_s``."""
        while True:
            before = self.s.sample()
            t = self._time(slot, slot.calls)
            if t is None:
                return
            after = self.s.sample()
            reason = self._transient_reason(before, after)
            self._record(slot, t, before, after, reason)
            if reason is None or self._over_budget():
                return

    def _transient_reason(self, before: Sample, after: Sample) -> str | None:
        """Why a sustained batch is not the steady state, or None."""
        limit = self.cfg.transient_max_s
        transient = _batch_reasons(before, after) & TRANSIENT_REASONS
        if not transient or limit <= 0:
            self._transient_since = None
            return None
        if self._transient_since is None:
            self._transient_since = before.t
        if after.t - self._transient_since >= limit:
            return None  # it lasts: this is the steady state
        return "transient: " + ",".join(transient.names())

    def _reject_reason(self, before: Sample, after: Sample) -> str | None:
        """Why a batch is not an unthrottled one, or None.

        Reasons read before the batch catch a throttle already active when it began,
        reasons read after it the state it ended in. The clock is judged after only:
        before a batch an idle GPU may legitimately sit at a low clock.
        """
        limiting = _batch_reasons(before, after) & LIMITING_REASONS
        if limiting:
            return "throttled: " + ",".join(limiting.names())
        max_mhz = self.s.info.max_sm_clock_mhz
        clock = after.sm_clock_mhz
        if max_mhz and clock is not None and clock < self.cfg.clock_ratio_min * max_mhz:
            return (
                f"sm clock {clock:.0f} MHz under {self.cfg.clock_ratio_min:.0%} "
                f"of max {max_mhz:.0f} MHz"
            )
        return None

    def _record(
        self, slot: _Slot, t: float, before: Sample, after: Sample, reject: str | None
    ) -> None:
        rec = BatchRecord(
            candidate=slot.name,
            regime=self.regime,
            seconds_per_call=t / slot.calls,
            calls=slot.calls,
            sm_clock_mhz=after.sm_clock_mhz,
            power_w=after.power_w,
            temp_c=after.temp_c,
            reasons=int(_batch_reasons(before, after)),
            rejected=reject is not None,
            reject_reason=reject,
        )
        if rec.rejected:
            slot.rejected.append(rec)
        else:
            slot.accepted.append(rec)
            slot.rounds.append(self._round)
        if self.on_batch is not None:
            self.on_batch(rec)

    # -- results --------------------------------------------------------------------

    def _result(self) -> RegimeResult:
        """The verdict over the candidates that ran to the end without an error.

        A candidate racing dropped is compared like with like and never picked
        (:func:`~gpuwatchd.tuning.worker.racing.decide_race`); one that failed while
        being timed is never picked either, and is listed after the others by median.
        """
        cfg = self.cfg
        decision = decide_race(
            {
                s.name: list(zip(s.rounds, (r.seconds_per_call for r in s.accepted), strict=True))
                for s in self._active()
            },
            {s.name: s.out_after for s in self._active() if s.out_after is not None},
            noise_k=cfg.noise_k,
            min_margin=cfg.min_margin,
            confidence=cfg.confidence,
        )
        rank = {name: i for i, name in enumerate(decision.ranking)}
        failed = sorted(
            (s for s in self.slots if s.error is not None and s.accepted),
            key=lambda s: (stats.median([r.seconds_per_call for r in s.accepted]), s.name),
        )
        rank.update({s.name: len(rank) + i for i, s in enumerate(failed)})
        ordered = sorted(self.slots, key=lambda s: rank.get(s.name, len(rank)))
        winner, tie = decision.winner, decision.tie
        if winner is not None and len(ordered) >= 2 and _same_code(ordered[0], ordered[1]):
            # Two library picks that launched the very same kernels are one candidate: a
            # gap between them is measurement bias (thread, order), not a faster kernel.
            winner, tie = None, True
            self.regime_meta["tie_reason"] = "winner and runner-up launch the same kernels"
        vs_default = self._versus_default()
        pick = winner or (decision.ranking[0] if tie and decision.ranking else None)
        if vs_default is not None and pick in vs_default and not vs_default[pick]["beats"]:
            winner, tie = None, True
            self.regime_meta[KEPT_DEFAULT] = True
            self.regime_meta["tie_reason"] = "no candidate beats the job's default beyond the noise"
        return RegimeResult(
            workload=self.workload.name,
            regime=self.regime,
            candidates=tuple(self._stats(s, (vs_default or {}).get(s.name)) for s in ordered),
            winner=winner,
            tie=tie,
            margin=decision.margin,
            noise=decision.noise,
        )

    def _versus_default(self) -> dict[str, dict[str, Any]] | None:
        """Each timed candidate against the job's default, on the rounds both were timed in.

        None when no candidate is the job's default or the default has no timing. A
        candidate beats the default when its margin over it exceeds the noise, the rule
        :func:`~gpuwatchd.tuning.worker.stats.decide` applies; a default that racing
        dropped is beaten by every candidate still racing.
        """
        default = next((s for s in self._active() if s.meta.get(JOB_DEFAULT)), None)
        if default is None or not default.accepted:
            return None
        cfg = self.cfg
        base = dict(
            zip(default.rounds, (r.seconds_per_call for r in default.accepted), strict=True)
        )
        out: dict[str, dict[str, Any]] = {}
        for slot in self._active():
            if slot is default or not slot.accepted:
                continue
            mine = dict(zip(slot.rounds, (r.seconds_per_call for r in slot.accepted), strict=True))
            common = sorted(set(mine) & set(base))
            if not common:
                continue
            margin, noise = stats.versus(
                [mine[r] for r in common],
                [base[r] for r in common],
                noise_k=cfg.noise_k,
                min_margin=cfg.min_margin,
                confidence=cfg.confidence,
            )
            dropped = default.out_after is not None and slot.out_after is None
            out[slot.name] = {"margin": margin, "noise": noise, "beats": dropped or margin > noise}
        return out

    def _stats(self, slot: _Slot, vs_default: dict[str, Any] | None = None) -> CandidateStats:
        acc = slot.accepted
        xs = [r.seconds_per_call for r in acc]
        med = stats.median(xs) if xs else None
        spread = stats.relative_spread(xs) if len(xs) >= 2 else None
        clock = _mean(r.sm_clock_mhz for r in acc)
        power = _mean(r.power_w for r in acc)
        reasons = ThrottleReason(0)
        for r in acc:
            reasons |= ThrottleReason.decode(r.reasons)
        meta = dict(slot.meta)
        meta.update(self.regime_meta)
        meta["calls_per_batch"] = slot.calls
        if self.regime is Regime.UNTHROTTLED:
            # NVML power is a ~1 s average: over short batches with pauses it is the duty-
            # cycled mean, not the kernel's draw, so no energy per call is claimed here.
            meta["power_note"] = "1 s average over paused batches"
        meta["flush_l2"] = slot.flush
        if slot.skipped:
            meta["skipped_batches"] = slot.skipped
        if slot.out_after is not None:
            meta["out_of_race_after_rounds"] = slot.out_after
        if slot.error is not None:
            meta["error"] = slot.error
        if vs_default is not None:
            meta[VS_DEFAULT] = vs_default
        return CandidateStats(
            name=slot.name,
            family=slot.cand.family,
            regime=self.regime,
            median_s=med,
            spread=spread if spread is None or math.isfinite(spread) else None,
            samples=len(acc),
            rejected=len(slot.rejected),
            sm_clock_hz=clock * 1e6 if clock is not None else None,
            power_w=power,
            temp_c=_mean(r.temp_c for r in acc),
            energy_j_per_call=(
                power * med
                if power is not None and med is not None and self.regime is Regime.SUSTAINED
                else None
            ),
            reasons=int(reasons),
            meta=meta,
        )


def _same_code(a: _Slot, b: _Slot) -> bool:
    """Both candidates say their kernel names identify the code, and the names match."""
    ka, kb = a.meta.get("kernels"), b.meta.get("kernels")
    return bool(
        ka
        and ka == kb
        and a.meta.get("kernels_identify_code")
        and b.meta.get("kernels_identify_code")
    )


def _batch_reasons(before: Sample, after: Sample) -> ThrottleReason:
    """Reasons seen around a batch; GPU_IDLE only counts after it (idle before is normal)."""
    mask = (int(before.reasons or 0) & LIMITING_REASONS) | int(after.reasons or 0)
    return ThrottleReason.decode(mask)


def _mean(values: Iterable[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None
