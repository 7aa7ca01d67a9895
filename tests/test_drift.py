"""Drift detection and re-tune triggers, mostly on the simulated GPU in accelerated time.

The simulated runs feed the real poller (``Poller.poll`` on a ``ManualClock``) so the
detector sees exactly the snapshots the daemon's listener would. A "tuning session"
is emulated the way the sustained regime measures one: a heavy load run back to back,
its clock averaged after the first minute; that mean becomes the reference.
"""

from __future__ import annotations

import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from builders import SettableClock, candidate, h200, seed_session
from metric_catalog import KNOWN_METRICS
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.drift import (
    DriftConfig,
    DriftDetector,
    DriftJob,
    LoadWindow,
    ReferenceSync,
    RetuneReason,
    changed_versions,
    current_versions,
    reference_from_store,
)
from gpuwatchd.drift.versions import (
    TorchBuild,
    _literal_assignments,
    installed_torch_build,
    installed_version,
)
from gpuwatchd.drift.window import interquartile_mean
from gpuwatchd.exporter import DaemonInfo, build_registry
from gpuwatchd.exporter.collectors.drift import DriftCollector
from gpuwatchd.gate import GateConfig
from gpuwatchd.monitor.board import GpuSnapshot, PollHealth, StateBoard
from gpuwatchd.monitor.poller import Poller
from gpuwatchd.sessions.events import SessionFinished
from gpuwatchd.store import SessionMeta, SqlStore, sqlite_store
from gpuwatchd.telemetry.clocks import ManualClock
from gpuwatchd.telemetry.sim import H200, SCENARIOS, SimBackend
from gpuwatchd.telemetry.types import (
    POWER_REASONS,
    THERMAL_REASONS,
    DeviceInfo,
    Sample,
    ThrottleReason,
)
from gpuwatchd.tuning.types import (
    Regime,
    RegimeResult,
    SessionStatus,
    Versions,
    Workload,
)

R = RetuneReason
BASE_UNIX = 1_750_000_000.0  # the sim's t = 0 on the wall clock
MHZ = 1e6
LIMITING = int(POWER_REASONS | THERMAL_REASONS)
SIM_VERSIONS = Versions(driver="sim")


def no_library_versions() -> Versions:
    return Versions()


def limited(s: Sample) -> bool:
    return (
        s.util_gpu is not None
        and s.util_gpu >= 0.9
        and s.reasons is not None
        and bool(int(s.reasons) & LIMITING)
    )


# -- a simulated GPU driven in accelerated time -------------------------------------------


class SimRig:
    """One simulated GPU, the real poller, a detector listening, evaluated like the daemon."""

    def __init__(
        self,
        scenario: str,
        seed: int = 0,
        cfg: DriftConfig | None = None,
        step_s: float = 2.0,
        eval_every_s: float = 30.0,
    ) -> None:
        self.clock = ManualClock()
        self.backend = SimBackend(1, scenario, seed=seed, clock=self.clock)
        self.board = StateBoard()
        self.poller = Poller(self.backend, self.board, GateConfig())
        self.detector = DriftDetector(cfg or DriftConfig(), no_library_versions)
        self.poller.add_listener(self._observe)
        self.step_s = step_s
        self.eval_every_s = eval_every_s
        self.evaluating = False  # the daemon seeds references before its first drift check
        self.next_eval = 0.0
        self.transform: Callable[[GpuSnapshot], GpuSnapshot] = lambda s: s
        self.samples: list[Sample] = []
        self.raised: list[tuple[float, RetuneReason]] = []
        self.ratios: list[tuple[float, float | None]] = []  # (sim t, drift ratio)

    def _observe(self, snap: GpuSnapshot) -> None:
        self.detector.observe(self.transform(snap))

    @property
    def t(self) -> float:
        return self.clock.now()

    def run_until(self, t_end: float, each_step: Callable[[float], None] | None = None) -> None:
        while self.t < t_end:
            self.clock.advance(self.step_s)
            if each_step is not None:
                each_step(self.t)
            snap = self.poller.poll(0)
            assert snap.sample is not None
            self.samples.append(snap.sample)
            if self.evaluating and self.t >= self.next_eval:
                self.next_eval = self.t + self.eval_every_s
                for reasons in self.detector.evaluate(BASE_UNIX + self.t).values():
                    self.raised.extend((self.t, r) for r in reasons)
                self.ratios.append((self.t, self.detector.drift_ratio(0)))

    def sustained_mean_mhz(self, start: float, end: float, settle_s: float = 60.0) -> float:
        """Mean clock of throttled samples in [start + settle_s, end): a sustained measurement."""
        clocks = [
            s.sm_clock_mhz
            for s in self.samples
            if start + settle_s <= s.t < end and limited(s) and s.sm_clock_mhz is not None
        ]
        assert len(clocks) >= 20, f"too few sustained samples in [{start}, {end})"
        return statistics.fmean(clocks)

    def set_reference(self, clock_hz: float, **changes: object) -> None:
        info = self.board.get(0).info
        assert info is not None and info.max_sm_clock_mhz is not None
        fields: dict[str, object] = {
            "uuid": info.uuid,
            "sustained_clock_hz": clock_hz,
            "power_limit_w": info.power_limit_w,
            "max_clock_hz": info.max_sm_clock_mhz * MHZ,
            "versions": SIM_VERSIONS,
            "measured_at": BASE_UNIX + self.t,
        }
        fields.update(changes)
        self.detector.set_reference(0, **fields)  # type: ignore[arg-type]
        self.evaluating = True

    def tune_like_a_session(self, duration_s: float = 240.0) -> float:
        """Run a heavy load back to back, set its sustained clock as the reference."""
        start = self.t
        self.backend.set_load(0, 1.0, H200.heavy_load_dynamic_w, pid=31337)
        self.run_until(start + duration_s)
        self.backend.clear_load(0)
        clock_hz = self.sustained_mean_mhz(start, self.t) * MHZ
        self.set_reference(clock_hz)
        return clock_hz

    def known_ratios(self, after: float = 0.0) -> list[float]:
        return [r for t, r in self.ratios if r is not None and t >= after]

    def clock_drift_times(self) -> list[float]:
        return [t for t, r in self.raised if r is R.CLOCK_DRIFT]


# -- (a) a failing fan ----------------------------------------------------------------------


def test_fan_failure_triggers_a_clock_drift_retune_within_10_minutes_of_the_crossing() -> None:
    cfg = DriftConfig()
    rig = SimRig("fan-failure", seed=7, cfg=cfg)
    job = SCENARIOS["fan-failure"].loads[0]
    first_end = job.start_s + job.duration_s
    rig.run_until(first_end)
    # A tuning session's sustained regime measured on the healthy GPU: the first burst.
    reference_mhz = rig.sustained_mean_mhz(job.start_s, first_end)
    rig.set_reference(reference_mhz * MHZ)
    rig.run_until(4 * 3600.0)

    # When did the drift really cross 3%? The first burst whose sustained clock (mean
    # after its first minute) is more than the threshold below the reference.
    crossing = None
    start = job.start_s + job.period_s
    while start + job.duration_s <= rig.t:
        mean = rig.sustained_mean_mhz(start, start + job.duration_s)
        if mean < reference_mhz * (1.0 - cfg.threshold):
            crossing = start
            break
        start += job.period_s
    assert crossing is not None, "the scenario never drifted past the threshold"
    assert 2 * 3600 < crossing < 3.5 * 3600  # the scenario's documented ~2.8 h

    assert rig.raised, "no re-tune was requested"
    assert {r for _, r in rig.raised} == {R.CLOCK_DRIFT}  # nothing else changed
    (fired,) = rig.clock_drift_times()  # once per episode, not at every evaluation
    assert crossing <= fired <= crossing + 600.0, (crossing, fired)
    assert rig.detector.pending(0) == {R.CLOCK_DRIFT}
    evidence = rig.known_ratios()
    assert min(evidence) < -cfg.threshold  # it saw the clock fall, signed negative
    assert max(evidence) < cfg.threshold


def test_a_new_reference_after_the_retune_clears_the_drift() -> None:
    rig = SimRig("fan-failure", seed=3)
    job = SCENARIOS["fan-failure"].loads[0]
    rig.run_until(job.start_s + job.duration_s)
    rig.set_reference(rig.sustained_mean_mhz(job.start_s, job.start_s + job.duration_s) * MHZ)
    rig.run_until(3.5 * 3600)
    assert rig.detector.pending(0) == {R.CLOCK_DRIFT}
    # The re-tune measures the degraded GPU: the latest burst becomes the reference.
    last = job.start_s + ((rig.t - job.start_s) // job.period_s - 1) * job.period_s
    rig.set_reference(rig.sustained_mean_mhz(last, last + job.duration_s) * MHZ)
    assert rig.detector.pending(0) == set()
    rig.run_until(rig.t + 1800)  # two more bursts on the same (now slowly drifting) GPU
    assert rig.clock_drift_times() == rig.clock_drift_times()[:1]


def test_periodic_job_is_fan_failures_healthy_twin() -> None:
    """The fleet's reference host: the same job, its clock stays where fan-failure's starts."""
    job = SCENARIOS["periodic-job"].loads[0]
    assert job == SCENARIOS["fan-failure"].loads[0]
    healthy, failing = SimRig("periodic-job", seed=5), SimRig("fan-failure", seed=5)
    end = 3.5 * 3600.0
    for rig in (healthy, failing):
        rig.run_until(end)
    first = (job.start_s, job.start_s + job.duration_s)
    last_start = job.start_s + ((end - job.start_s) // job.period_s - 1) * job.period_s
    last = (last_start, last_start + job.duration_s)
    healthy_first, healthy_last = (healthy.sustained_mean_mhz(*w) for w in (first, last))
    assert abs(healthy_last / healthy_first - 1.0) < 0.01  # no decline with working fans
    assert abs(failing.sustained_mean_mhz(*first) / healthy_first - 1.0) < 0.01
    assert failing.sustained_mean_mhz(*last) < 0.95 * healthy_last  # >5% under its twin


# -- (b) a day of stable scenarios with production noise -------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    start: float
    end: float
    kind: str  # heavy: the tuned kind of work; light: util < 0.9; memory: busy, never capped
    util: float
    dynamic_w: float


def noise_schedule(rng: random.Random, start: float, end: float) -> list[Job]:
    """Production jobs separated by idle gaps, each lasting 5-45 minutes."""
    jobs = []
    t = start
    while t < end:
        t += rng.uniform(120.0, 1800.0)
        kind = rng.choice(("heavy", "heavy", "light", "memory"))
        duration = rng.uniform(300.0, 2700.0)
        util = {"heavy": 1.0, "light": rng.uniform(0.1, 0.85), "memory": rng.uniform(0.9, 1.0)}
        jobs.append(Job(t, t + duration, kind, util[kind], rng.uniform(50.0, 400.0)))
        t += duration
    return jobs


class NoisyProduction:
    """Drives the sim's external load from a schedule; heavy jobs wobble every 10 s."""

    def __init__(self, rig: SimRig, jobs: list[Job], rng: random.Random) -> None:
        self.rig, self.jobs, self.rng = rig, jobs, rng
        self.i = 0
        self.current: Job | None = None
        self.redraw_at = 0.0

    def __call__(self, t: float) -> None:
        while self.i < len(self.jobs) and self.jobs[self.i].end <= t:
            self.i += 1
        job = (
            self.jobs[self.i] if self.i < len(self.jobs) and self.jobs[self.i].start <= t else None
        )
        backend = self.rig.backend
        if job is None:
            if self.current is not None:
                backend.clear_load(0)
        elif job.kind == "heavy":
            if job is not self.current or t >= self.redraw_at:
                # The same kind of work as the tuned one, with normal load noise.
                util = self.rng.uniform(0.93, 1.0)
                dynamic = H200.heavy_load_dynamic_w * self.rng.uniform(0.97, 1.03)
                backend.set_load(0, util, dynamic, pid=777)
                self.redraw_at = t + 10.0
        elif job is not self.current:
            backend.set_load(0, job.util, job.dynamic_w, pid=777)
        self.current = job


@pytest.mark.parametrize("scenario", ["idle", "power-cap"])
def test_a_day_of_a_stable_scenario_with_load_noise_triggers_no_retune(scenario: str) -> None:
    rig = SimRig(scenario, seed=11, step_s=3.0)
    rig.tune_like_a_session()
    rng = random.Random(f"noise:{scenario}")
    production = NoisyProduction(rig, noise_schedule(rng, rig.t, 86_400.0), rng)
    rig.run_until(86_400.0, production)

    assert rig.raised == []
    assert rig.detector.pending(0) == set()
    # Not vacuous: the detector had enough sustained-load evidence to judge drift for
    # hours of the day, and it found the clock where the session measured it.
    known = rig.known_ratios()
    assert len(known) >= 0.15 * len(rig.ratios), (len(known), len(rig.ratios))
    assert abs(statistics.median(known)) < 0.015


# -- (c) a power-limit change ------------------------------------------------------------------


def test_a_power_limit_change_triggers_one_retune_until_the_new_reference() -> None:
    rig = SimRig("power-cap", seed=5)
    rig.tune_like_a_session()
    rig.run_until(1800.0)
    assert rig.raised == []

    lowered = 600.0
    rig.transform = lambda s: replace(s, info=replace(s.info, power_limit_w=lowered))
    changed_at = rig.t
    rig.run_until(changed_at + 3600.0)
    assert [r for _, r in rig.raised] == [R.POWER_LIMIT_CHANGED]
    assert rig.raised[0][0] <= changed_at + rig.eval_every_s + rig.step_s
    assert rig.detector.pending(0) == {R.POWER_LIMIT_CHANGED}

    rig.set_reference(rig.detector.view()[0].reference_clock_hz, power_limit_w=lowered)
    assert rig.detector.pending(0) == set()
    rig.run_until(rig.t + 3600.0)
    assert [r for _, r in rig.raised] == [R.POWER_LIMIT_CHANGED]


# -- (d) production bursts alone ---------------------------------------------------------------


def bursts(rig: SimRig, on_s: float, period_s: float) -> Callable[[float], None]:
    """A production job of the tuned kind that runs ``on_s`` out of every ``period_s``."""
    start = rig.t + 60.0

    def drive(t: float) -> None:
        on = t >= start and (t - start) % period_s < on_s
        if on and not was[0]:
            rig.backend.set_load(0, 1.0, H200.heavy_load_dynamic_w, pid=4343)
        elif was[0] and not on:
            rig.backend.clear_load(0)
        was[0] = on

    was = [False]
    return drive


def test_short_production_bursts_never_give_enough_evidence() -> None:
    rig = SimRig("idle", seed=2)
    true_hz = rig.tune_like_a_session()
    rig.set_reference(true_hz * 1.10)  # even a reference 10% off cannot be tripped
    session_end = rig.t
    rig.run_until(6 * 3600.0, bursts(rig, on_s=90.0, period_s=300.0))
    assert rig.raised == []
    # Once the session's own samples have left the window, nothing is ever judged.
    assert rig.known_ratios(after=session_end + rig.detector.cfg.window_s) == []


def test_long_production_bursts_match_the_reference_when_nothing_drifted() -> None:
    rig = SimRig("idle", seed=2)
    rig.tune_like_a_session()
    rig.run_until(6 * 3600.0, bursts(rig, on_s=420.0, period_s=900.0))
    assert rig.raised == []
    known = rig.known_ratios()
    assert len(known) >= 100 and max(abs(r) for r in known) < 0.015


def test_the_same_bursts_against_a_wrong_reference_do_trigger() -> None:
    """The previous two tests could not pass by a detector that never fires."""
    rig = SimRig("idle", seed=2)
    true_hz = rig.tune_like_a_session()
    rig.set_reference(true_hz * 1.06, measured_at=BASE_UNIX - 86_400.0)
    rig.run_until(3 * 3600.0, bursts(rig, on_s=420.0, period_s=900.0))
    assert [r for _, r in rig.raised] == [R.CLOCK_DRIFT]
    assert rig.detector.drift_ratio(0) == pytest.approx(1 / 1.06 - 1, abs=0.01)


# -- the other reasons, on hand-built snapshots ------------------------------------------------

INFO = h200(uuid="GPU-test-0", driver_version="580.159.04")
STACK = Versions(
    driver="580.159.04", cuda="12.8", torch="2.11.0+cu128", triton="3.5.0", cudnn="91900"
)


def snapshot(
    t: float,
    clock_mhz: float = 1440.0,
    util: float = 1.0,
    reasons: ThrottleReason = ThrottleReason.SW_POWER_CAP,
    info: DeviceInfo = INFO,
) -> GpuSnapshot:
    sample = Sample(gpu=info.index, t=t, sm_clock_mhz=clock_mhz, util_gpu=util, reasons=reasons)
    return GpuSnapshot(info.index, info, sample, None, PollHealth(True, 0.001))


def feed(det: DriftDetector, start: float, end: float, step: float = 1.0, **kw: object) -> None:
    t = start
    while t < end:
        det.observe(snapshot(t, **kw))  # type: ignore[arg-type]
        t += step


def reference(det: DriftDetector, gpu: int = 0, **changes: object) -> bool:
    fields: dict[str, object] = {
        "uuid": INFO.uuid,
        "sustained_clock_hz": 1440.0 * MHZ,
        "power_limit_w": 700.0,
        "max_clock_hz": 1980.0 * MHZ,
        "versions": STACK,
        "measured_at": BASE_UNIX,
    }
    fields.update(changes)
    return det.set_reference(gpu, **fields)  # type: ignore[arg-type]


class Libraries:
    """A settable ``versions_now``."""

    def __init__(self, versions: Versions) -> None:
        self.versions = versions

    def __call__(self) -> Versions:
        return self.versions


@pytest.fixture
def libs() -> Libraries:
    # As importlib.metadata spells the same stack: no +cu128, cuDNN's 4-part version.
    return Libraries(Versions(torch="2.11.0", triton="3.5.0", cudnn="9.19.0.56"))


def test_same_stack_spelled_differently_is_no_change(libs: Libraries) -> None:
    det = DriftDetector(DriftConfig(), libs)
    reference(det)
    det.observe(snapshot(0.0))
    assert det.evaluate(BASE_UNIX + 60) == {}


def test_a_library_upgrade_triggers_versions_changed_once(libs: Libraries) -> None:
    det = DriftDetector(DriftConfig(), libs)
    reference(det)
    det.observe(snapshot(0.0))
    assert det.evaluate(BASE_UNIX + 60) == {}
    libs.versions = replace(libs.versions, triton="3.6.0")
    assert det.evaluate(BASE_UNIX + 90) == {0: [R.VERSIONS_CHANGED]}
    assert det.evaluate(BASE_UNIX + 120) == {}
    assert det.pending(0) == {R.VERSIONS_CHANGED}


def test_a_driver_upgrade_triggers_versions_changed(libs: Libraries) -> None:
    det = DriftDetector(DriftConfig(), libs)
    reference(det)
    det.observe(snapshot(0.0, info=replace(INFO, driver_version="590.10")))
    assert det.evaluate(BASE_UNIX + 60) == {0: [R.VERSIONS_CHANGED]}


def test_a_version_unknown_on_either_side_is_not_a_change() -> None:
    assert changed_versions(Versions(torch="2.11.0"), Versions(torch=None, cudnn="9.1")) == ()
    assert changed_versions(STACK, Versions(torch="2.11.0+cu126")) == ("torch",)
    assert changed_versions(STACK, Versions(cudnn="9.20.0.48")) == ("cudnn",)
    assert changed_versions(Versions(cudnn="8907"), Versions(cudnn="8.9.7.29")) == ()


def test_a_max_clock_change_triggers_once(libs: Libraries) -> None:
    det = DriftDetector(DriftConfig(), libs)
    reference(det)
    det.observe(snapshot(0.0, info=replace(INFO, max_sm_clock_mhz=1785.0)))
    assert det.evaluate(BASE_UNIX + 60) == {0: [R.MAX_CLOCK_CHANGED]}
    assert det.evaluate(BASE_UNIX + 90) == {}


def test_old_winners_are_stale_once_until_fresh_ones_arrive(libs: Libraries) -> None:
    det = DriftDetector(DriftConfig(max_winner_age_s=7 * 86_400.0), libs)
    reference(det, measured_at=BASE_UNIX - 8 * 86_400.0)
    det.observe(snapshot(0.0))
    assert det.evaluate(BASE_UNIX) == {0: [R.WINNERS_STALE]}
    assert det.evaluate(BASE_UNIX + 30) == {}
    reference(det, measured_at=BASE_UNIX)
    assert det.pending(0) == set()
    assert det.evaluate(BASE_UNIX + 60) == {}
    off = DriftDetector(DriftConfig(max_winner_age_s=0), libs)
    reference(off, measured_at=BASE_UNIX - 400 * 86_400.0)
    assert off.evaluate(BASE_UNIX) == {}


def test_a_gpu_without_winners_asks_once_and_a_reference_clears_it(libs: Libraries) -> None:
    det = DriftDetector(DriftConfig(), libs)
    det.observe(snapshot(0.0))
    assert det.evaluate(BASE_UNIX) == {0: [R.NO_WINNERS]}
    assert det.evaluate(BASE_UNIX + 30) == {}
    assert det.pending(0) == {R.NO_WINNERS}
    assert reference(det) is True
    assert det.pending(0) == set()
    assert det.evaluate(BASE_UNIX + 60) == {}


def test_re_setting_the_same_reference_keeps_pending_reasons(libs: Libraries) -> None:
    det = DriftDetector(DriftConfig(), libs)
    reference(det)
    det.observe(snapshot(0.0, info=replace(INFO, power_limit_w=650.0)))
    assert det.evaluate(BASE_UNIX + 60) == {0: [R.POWER_LIMIT_CHANGED]}
    assert reference(det) is False  # a periodic re-seed with nothing new
    assert det.pending(0) == {R.POWER_LIMIT_CHANGED}
    assert det.evaluate(BASE_UNIX + 90) == {}


def test_drift_must_hold_for_the_dwell_time_and_a_return_resets_it(libs: Libraries) -> None:
    cfg = DriftConfig(dwell_s=300.0, cooldown_s=0.0, settle_s=0.0, min_load_s=60.0)
    det = DriftDetector(cfg, libs)
    reference(det)
    feed(det, 0.0, 120.0, clock_mhz=1380.0)  # -4.2%
    assert det.evaluate(BASE_UNIX + 120) == {}
    assert det.drift_ratio(0) == pytest.approx(1380 / 1440 - 1)
    feed(det, 120.0, 360.0, clock_mhz=1380.0)
    assert det.evaluate(BASE_UNIX + 360) == {}  # 240 s held
    feed(det, 360.0, 1000.0, clock_mhz=1440.0)  # back: the episode ends
    assert det.evaluate(BASE_UNIX + 1000) == {}
    assert det.drift_ratio(0) == pytest.approx(0.0)
    feed(det, 1000.0, 1700.0, clock_mhz=1500.0)  # +4.2%: a new episode, faster GPU
    assert det.evaluate(BASE_UNIX + 1700) == {}
    feed(det, 1700.0, 2001.0, clock_mhz=1500.0)
    assert det.evaluate(BASE_UNIX + 2001) == {0: [R.CLOCK_DRIFT]}
    assert det.drift_ratio(0) == pytest.approx(1500 / 1440 - 1)


def test_no_clock_drift_retune_within_the_cooldown_of_a_fresh_reference(libs: Libraries) -> None:
    cfg = DriftConfig(dwell_s=0.0, cooldown_s=3600.0, settle_s=0.0, min_load_s=60.0)
    det = DriftDetector(cfg, libs)
    reference(det, measured_at=BASE_UNIX)
    feed(det, 0.0, 300.0, clock_mhz=1300.0)
    assert det.evaluate(BASE_UNIX + 300) == {}
    assert det.evaluate(BASE_UNIX + 3600) == {0: [R.CLOCK_DRIFT]}


def test_a_lost_gpu_withholds_its_learned_clock(libs: Libraries) -> None:
    cfg = DriftConfig(dwell_s=0.0, cooldown_s=0.0, settle_s=0.0, min_load_s=60.0)
    det = DriftDetector(cfg, libs)
    reference(det)
    feed(det, 0.0, 60.0, clock_mhz=1300.0)
    det.observe(GpuSnapshot(0, INFO, None, None, PollHealth(False, 0.0, lost=True)))
    assert det.evaluate(BASE_UNIX + 60) == {}
    assert det.drift_ratio(0) is None


def test_another_gpu_in_the_slot_starts_its_learned_clock_over(libs: Libraries) -> None:
    cfg = DriftConfig(settle_s=0.0, min_load_s=60.0)
    det = DriftDetector(cfg, libs)
    reference(det)
    feed(det, 0.0, 120.0)
    det.evaluate(BASE_UNIX)
    assert det.drift_ratio(0) == pytest.approx(0.0)
    det.observe(snapshot(121.0, info=replace(INFO, uuid="GPU-other")))
    det.evaluate(BASE_UNIX + 1)
    assert det.drift_ratio(0) is None
    assert det.view()[0].uuid == "GPU-other"


# -- the learned-clock window ------------------------------------------------------------------


def test_interquartile_mean_ignores_the_tails_and_is_not_quantised() -> None:
    assert interquartile_mean({}) is None
    assert interquartile_mean({1440.0: 10, 9999.0: 2, 10.0: 2}) == 1440.0
    assert interquartile_mean({1425.0: 2, 1440.0: 2}) == pytest.approx(1432.5)


def test_only_load_throttled_for_the_settle_time_counts() -> None:
    w = LoadWindow(window_s=600.0, settle_s=60.0, util_min=0.9)
    cap = ThrottleReason.SW_POWER_CAP
    for t in range(0, 300):  # busy all along but unthrottled: a memory-bound job
        w.add(float(t), 1.0, ThrottleReason(0), 1980.0)
    for t in range(300, 359):  # a 59 s power-capped burst on top of it
        w.add(float(t), 1.0, cap, 1700.0)
    assert w.samples == 0
    for t in range(359, 600):
        w.add(float(t), 1.0, cap, 1440.0)
    assert w.samples == 600 - 360 and w.load_s == pytest.approx(240.0)
    assert w.estimate_mhz(min_samples=20, min_load_s=120.0) == 1440.0
    w.add(700.0, 0.5, cap, 1440.0)  # idle again; the window keeps the evidence it has
    assert w.estimate_mhz(min_samples=20, min_load_s=120.0) == 1440.0
    w.add(1300.0, 0.0, None, None)  # ten minutes later it has expired
    assert w.samples == 0 and w.estimate_mhz(1, 1.0) is None


def test_a_clock_going_backwards_starts_over() -> None:
    w = LoadWindow(window_s=600.0, settle_s=0.0, util_min=0.9)
    for t in range(100):
        w.add(float(t), 1.0, ThrottleReason.SW_THERMAL_SLOWDOWN, 1300.0)
    w.add(5.0, 1.0, ThrottleReason.SW_THERMAL_SLOWDOWN, 1300.0)
    assert w.samples == 1


def test_observe_is_cheap() -> None:
    det = DriftDetector(DriftConfig(), no_library_versions)
    snaps = [snapshot(i * 0.1, clock_mhz=1440.0 + 15 * (i % 7 - 3)) for i in range(20_000)]
    start = time.perf_counter()
    for s in snaps:
        det.observe(s)
    per_call = (time.perf_counter() - start) / len(snaps)
    assert per_call < 20e-6, f"{per_call * 1e6:.1f} µs per observe"  # ~2 µs on a laptop core
    det.evaluate(BASE_UNIX)
    assert det.view()[0].learned_clock_hz == pytest.approx(1440.0 * MHZ, rel=0.01)


# -- configuration -----------------------------------------------------------------------------


def test_config_defaults_and_table() -> None:
    cfg = DriftConfig.from_mapping({"threshold": 0.05, "dwell_s": 600, "max_winner_age_s": 0})
    assert cfg.threshold == 0.05 and cfg.dwell_s == 600.0 and cfg.max_winner_age_s == 0.0
    assert DriftConfig.from_mapping({}) == DriftConfig()


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"threshold": 1.5}, "drift.threshold: must be between 0 and 1"),
        ({"threshold": "3%"}, "drift.threshold: expected a number"),
        ({"dwell_s": -1}, "drift.dwell_s: must be >= 0"),
        ({"window_s": 0}, "drift.window_s: must be > 0"),
        ({"min_load_s": 900}, "drift.min_load_s: must not exceed window_s"),
        ({"min_samples": 0}, "drift.min_samples: must be an integer >= 1"),
        ({"util_min": 0}, "drift.util_min: must be within (0, 1]"),
        ({"enabled": "yes"}, "drift.enabled: expected true or false"),
        ({"treshold": 0.03}, "drift.treshold: unknown key"),
        ({"max_winner_age_s": float("inf")}, "drift.max_winner_age_s: expected a finite number"),
    ],
)
def test_bad_config_names_the_key(table: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as err:
        DriftConfig.from_mapping(table)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


# -- versions without torch --------------------------------------------------------------------


def test_current_versions_from_package_metadata() -> None:
    installed = {
        "torch": "2.11.0",
        "triton": "3.5.0",
        "nvidia-cudnn-cu12": "9.19.0.56",
    }
    v = current_versions(INFO, lookup=installed.get)
    assert v == Versions(driver="580.159.04", torch="2.11.0", triton="3.5.0", cudnn="9.19.0")
    assert changed_versions(STACK, v) == ()
    both = {**installed, "nvidia-cudnn-cu13": "9.20.0.48"}
    assert current_versions(None, lookup=both.get).cudnn is None  # which one torch loads?
    assert current_versions(None, lookup={}.get) == Versions()


def test_current_versions_read_which_cuda_torch_was_built_for() -> None:
    """A +cu130 and a +cu128 build of one torch release are different stacks."""
    installed = {"torch": "2.13.0", "triton": "3.5.0"}

    def build() -> TorchBuild:
        return TorchBuild("2.13.0+cu128", "12.8")

    v = current_versions(INFO, lookup=installed.get, torch_build=build)
    assert (v.torch, v.cuda) == ("2.13.0+cu128", "12.8")
    cu130 = replace(STACK, torch="2.13.0+cu130", cuda="13.0")
    cu128 = replace(STACK, torch="2.13.0+cu128", cuda="12.8")
    assert changed_versions(cu130, v) == ("cuda", "torch")
    assert changed_versions(cu128, v) == ()
    assert changed_versions(replace(STACK, cuda="12.8"), replace(STACK, cuda="13.0")) == ("cuda",)
    # The file unreadable: the metadata's bare version, no CUDA; a worker's +cu128 against
    # it is unknown on one side, never a change.
    bare = current_versions(INFO, lookup=installed.get, torch_build=lambda: None)
    assert (bare.torch, bare.cuda) == ("2.13.0", None)
    assert changed_versions(cu128, bare) == ()
    # A version file of another release than the installed distribution is not trusted.
    other = current_versions(INFO, lookup={"torch": "2.12.0"}.get, torch_build=build)
    assert (other.torch, other.cuda) == ("2.12.0", None)
    # No torch installed: the file is not even read.
    assert current_versions(INFO, lookup={}.get, torch_build=build).cuda is None


def test_torchs_version_file_is_read_as_text() -> None:
    source = (
        "from typing import Optional\n"
        "__all__ = ['__version__', 'cuda']\n"
        "__version__ = '2.9.0+cu128'\n"
        "cuda: Optional[str] = '12.8'\n"
        "hip: Optional[str] = None\n"
        "git_version = compute()\n"  # not a literal: ignored
    )
    found = _literal_assignments(source)
    assert found["__version__"] == "2.9.0+cu128" and found["cuda"] == "12.8"
    assert found["hip"] is None and "git_version" not in found
    installed = installed_torch_build()  # this machine's torch (a CPU build)
    assert installed is not None and installed.version is not None
    assert installed.version.split("+")[0] == (installed_version("torch") or "").split("+")[0]


def test_reading_versions_never_imports_torch() -> None:
    code = (
        "import sys; from gpuwatchd.drift import current_versions; current_versions(); "
        "import gpuwatchd.exporter.collectors.drift; assert 'torch' not in sys.modules"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# -- references from the store, and the daemon job --------------------------------------------

GEMM = Workload("gemm", "matmul", {"m": 8192, "n": 8192, "k": 8192}, "bf16", ("torch.matmul",))


def regime_result(regime: Regime, clock_hz: float) -> RegimeResult:
    """``a`` wins at ``clock_hz`` under the power cap; the runner-up's clock was 1% higher."""
    a = candidate("a", regime, 1.0e-3, sm_clock_hz=clock_hz, reasons=0x4)
    b = candidate("b", regime, 1.1e-3, sm_clock_hz=clock_hz * 1.01, reasons=0x4)
    return RegimeResult(
        "gemm",
        regime,
        (a, b),
        winner="a",
        tie=False,
        margin=0.1,
        noise=0.01,
    )


@pytest.fixture
def store_clock() -> SettableClock:
    return SettableClock(BASE_UNIX)


@pytest.fixture
def store(tmp_path: Path, store_clock: SettableClock) -> Iterator[SqlStore]:
    s = sqlite_store(tmp_path / "drift.db", now=store_clock)
    yield s
    s.close()


def tune(
    store: SqlStore,
    clock: SettableClock,
    info: DeviceInfo,
    results: list[RegimeResult],
    versions: Versions = STACK,
) -> SessionFinished:
    """Record a completed session as the runner does; returns what the runner announces."""
    meta = SessionMeta.for_device(
        info, backend="nvml", workloads=(GEMM,), regimes=(Regime.SUSTAINED,), versions=versions
    )
    sid = seed_session(store, meta, results, tick=lambda: clock.advance(100.0))
    return SessionFinished(sid, info.index, info.uuid, info.name, SessionStatus.COMPLETED)


def test_reference_from_the_gpus_latest_session(
    store: SqlStore, store_clock: SettableClock
) -> None:
    assert reference_from_store(store, INFO) is None
    tune(store, store_clock, INFO, [regime_result(Regime.SUSTAINED, 1.45e9)])
    store_clock.t += 1000.0
    # A later session that measured only the unthrottled regime keeps the clock.
    tune(store, store_clock, INFO, [regime_result(Regime.UNTHROTTLED, 1.98e9)])
    ref = reference_from_store(store, INFO)
    assert ref is not None
    assert ref.sustained_clock_hz == 1.45e9  # the winner's clock, not the runner-up's
    assert ref.power_limit_w == 700.0 and ref.max_clock_hz == 1980.0 * MHZ
    assert ref.measured_at == store_clock.t and ref.versions == STACK

    sibling = replace(INFO, index=1, uuid="GPU-test-1")
    borrowed = reference_from_store(store, sibling)
    assert borrowed is not None and borrowed.uuid == "GPU-test-1"
    assert borrowed.sustained_clock_hz == 1.45e9
    assert reference_from_store(store, replace(INFO, uuid="GPU-l4", name="NVIDIA L4")) is None

    # A new power limit: an older session's clock no longer describes the GPU.
    tune(store, store_clock, replace(INFO, power_limit_w=600.0), [])
    assert reference_from_store(store, INFO).sustained_clock_hz is None  # type: ignore[union-attr]


def test_the_daemon_job_seeds_references_and_requests_retunes(
    store: SqlStore, store_clock: SettableClock
) -> None:
    board = StateBoard()
    l4 = DeviceInfo(1, "GPU-l4", "NVIDIA L4", driver_version="580.159.04", power_limit_w=72.0)
    for info in (INFO, l4):
        board.put(snapshot(0.0, info=info))
    tune(store, store_clock, INFO, [regime_result(Regime.SUSTAINED, 1.44e9)])
    libs = Libraries(Versions(torch="2.11.0"))
    det = DriftDetector(DriftConfig(), libs)
    for snap in board.all():
        det.observe(snap)
    requests: list[tuple[int, tuple[str, ...], str]] = []
    sync = ReferenceSync(det, store)
    job = DriftJob(
        det,
        sync,
        board,
        request=lambda gpu, wl, why: requests.append((gpu, tuple(w.name for w in wl), why)),
        workloads=lambda: (GEMM,),
        now=lambda: store_clock.t,
    )
    assert job() == {1: [R.NO_WINNERS]}  # the H200 has its reference; the L4 none
    assert requests == [(1, ("gemm",), "no_winners")]
    assert det.view()[0].reference_clock_hz == 1.44e9

    libs.versions = Versions(torch="2.12.0")
    store_clock.t += 60.0
    assert job() == {0: [R.VERSIONS_CHANGED]}
    assert requests[-1] == (0, ("gemm",), "versions_changed")
    assert job() == {}  # asked once

    # The re-tune completes under the new stack; the store is read again only once the
    # session is announced, and its reference clears the reason.
    done = tune(store, store_clock, INFO, [regime_result(Regime.SUSTAINED, 1.44e9)], Versions(
        driver="580.159.04", torch="2.12.0"))  # fmt: skip
    assert det.pending(0) == {R.VERSIONS_CHANGED}
    sync.session_finished(replace(done, status=SessionStatus.FAILED))  # changes no reference
    assert job() == {}
    assert det.pending(0) == {R.VERSIONS_CHANGED}
    sync.session_finished(done)
    assert job() == {}
    assert det.pending(0) == set() and det.pending(1) == {R.NO_WINNERS}


# -- metrics -----------------------------------------------------------------------------------


def scrape(det: DriftDetector, board: StateBoard) -> str:
    info = DaemonInfo("0.0.test", "sim", "3.11")
    registry = build_registry(board, info, extra=[DriftCollector(det.view)])
    return generate_latest(registry).decode()


def drift_series(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("gpuwatchd_clock_drift_ratio", "gpuwatchd_retune_pending"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_have_every_reason_and_a_ratio_only_when_known(libs: Libraries) -> None:
    cfg = DriftConfig(settle_s=0.0, min_load_s=60.0, dwell_s=0.0, cooldown_s=0.0)
    det = DriftDetector(cfg, libs)
    board = StateBoard()
    other = replace(INFO, index=1, uuid="GPU-test-1")
    reference(det)
    det.observe(snapshot(0.0, info=other))
    det.evaluate(BASE_UNIX)
    series = drift_series(scrape(det, board))
    assert not any(name == "gpuwatchd_clock_drift_ratio" for name, _ in series)
    pending = {
        (dict(labels)["gpu"], dict(labels)["reason"]): v
        for (name, labels), v in series.items()
        if name == "gpuwatchd_retune_pending"
    }
    assert set(pending) == {(g, r.value) for g in ("0", "1") for r in RetuneReason}
    assert pending[("1", "no_winners")] == 1.0
    assert sum(pending.values()) == 1.0

    feed(det, 0.0, 120.0, clock_mhz=1368.0)
    det.evaluate(BASE_UNIX + 120)
    series = drift_series(scrape(det, board))
    ratio = series[
        ("gpuwatchd_clock_drift_ratio", (("gpu", "0"), ("uuid", INFO.uuid)))
    ]  # fmt: skip
    assert ratio == pytest.approx(-0.05)
    assert series[
        ("gpuwatchd_retune_pending", (("gpu", "0"), ("reason", "clock_drift"), ("uuid", INFO.uuid)))
    ] == 1.0  # fmt: skip
    for name, labels in series:
        assert {k for k, _ in labels} == KNOWN_METRICS[name]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_check_metrics_accepts_the_drift_collector(libs: Libraries) -> None:
    det = DriftDetector(DriftConfig(settle_s=0.0, min_load_s=60.0), libs)
    board = StateBoard()
    for snap in (snapshot(0.0), snapshot(0.0, info=replace(INFO, index=1, uuid="GPU-1"))):
        board.put(snap)
    reference(det)
    feed(det, 0.0, 120.0, clock_mhz=1400.0)
    det.evaluate(BASE_UNIX + 120)
    text = scrape(det, board)
    assert "gpuwatchd_clock_drift_ratio{" in text and "gpuwatchd_retune_pending{" in text
    done = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout
