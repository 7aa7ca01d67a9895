"""One regime's measurement: warm-up, calibration, timed rounds, racing, the verdict.

:class:`RegimeRun` times the candidates :func:`~gpuwatchd.tuning.worker.protocol.tune_queue`
prepared (:class:`Slot`) in one thermal regime, as the protocol's docstring describes;
the queue, the regimes' order, the budgets and the set-up and tear-down stay there.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
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
ERROR_MAX = 500

OnBatch = Callable[[BatchRecord], None]
ShouldStop = Callable[[], bool]
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


class Preempted(Exception):
    """``should_stop()`` asked the protocol to give the device back (another process)."""


@dataclass(slots=True)
class Slot:
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


class RegimeRun:
    """One regime's measurement over the prepared candidates."""

    def __init__(
        self,
        workload: Workload,
        slots: list[Slot],
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

    def _active(self) -> list[Slot]:
        return [s for s in self.slots if s.error is None]

    def _racing(self) -> list[Slot]:
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

    def _time(self, slot: Slot, calls: int) -> float | None:
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
            slot.error = f"run: {describe(e, with_type=False, limit=ERROR_MAX)}"
            return None

    def _calibrate(self, slot: Slot, *, pause_after: bool) -> None:
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

    def _unthrottled_batch(self, slot: Slot) -> None:
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

    def _sustained_batch(self, slot: Slot) -> None:
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
        self, slot: Slot, t: float, before: Sample, after: Sample, reject: str | None
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

    def _stats(self, slot: Slot, vs_default: dict[str, Any] | None = None) -> CandidateStats:
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


def _same_code(a: Slot, b: Slot) -> bool:
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
