"""Tune once per fleet, the scheduler's side: work other hosts answered is skipped (all but a
verified share), the rest is claimed before it runs, claims are renewed and given back.

Each test runs against an in-memory fleet store and against the real store on SQLite and
on PostgreSQL (two "hosts" are two schedulers with different host names on one store).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from builders import candidate, judged, seed_session, wait_until
from store_backends import KINDS, Backend, make_backend
from user_kernels_fakes import sample_request

from gpuwatchd.config import Config
from gpuwatchd.config.loader import TuningConfig
from gpuwatchd.daemon.added_workloads import AddedWorkloads
from gpuwatchd.daemon.user_work import UserWork
from gpuwatchd.gate import GateState
from gpuwatchd.monitor.board import PollHealth, StateBoard
from gpuwatchd.sessions.events import SessionFinished, SessionListener, WorkSkipped
from gpuwatchd.sessions.fleet import (
    SKIP_REASON,
    FleetAnswer,
    FleetPolicy,
    claim_key,
    fleet_answer,
    fleet_policy,
    plan_fleet,
    verify_share,
)
from gpuwatchd.sessions.fleet_settings import FleetConfig
from gpuwatchd.sessions.runner import SessionOutcome
from gpuwatchd.sessions.scheduler import TuneScheduler
from gpuwatchd.store import SessionMeta, SqlStore, StoreError, sqlite_store
from gpuwatchd.store.rows import Claim, WinnerRow
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.types import Regime, RegimeResult, SessionStatus, Versions, Workload

MODEL = "NVIDIA H200"
NOW = 1_800_000_000.0
HOUR = 3600.0
U, S = Regime.UNTHROTTLED, Regime.SUSTAINED
#: What every host has installed (the driver comes from the GPU's DeviceInfo).
STACK = Versions(driver="580.159.04", torch="2.13.0", triton="3.6.0", cudnn="9.19.0")
MANUAL = "manual request"


def sim_workload(name: str) -> Workload:
    return Workload(name, "matmul", {"m": 64, "n": 64, "k": 64}, "bfloat16", ("sim",))


WORK = tuple(sim_workload(f"sim-{i}") for i in range(4))


def versions_now(info: DeviceInfo) -> Versions:
    return Versions(driver=info.driver_version).merge(STACK)


# -- the store: an in-memory fake of the fleet calls, or the real one on SQLite ---------------


class Clock:
    def __init__(self) -> None:
        self.t = NOW

    def __call__(self) -> float:
        return self.t


class FakeFleetStore:
    """The fleet calls of the shared store, in memory.

    ``fleet_winners`` answers only by GPU model (a store may return more than asked: the
    policy checks every row's age, host and versions itself).
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.rows: list[WinnerRow] = []
        self._claims: dict[str, Claim] = {}
        self.calls: list[str] = []
        self.fail_with: Exception | None = None  # what fleet_winners raises
        self.claims_fail_with: Exception | None = None  # what claim raises
        self.claims_wait_for: threading.Event | None = None  # claim waits until it is set
        self.claim_waiting = threading.Event()  # a claim is waiting on claims_wait_for

    def seed(self, host: str, workload: str, regimes: tuple[Regime, ...], measured_at: float,
             *, model: str = MODEL, versions: Versions = STACK) -> None:  # fmt: skip
        for regime in regimes:
            self.rows.append(
                WinnerRow(
                    model,
                    versions,
                    workload,
                    regime,
                    "sim[a]",
                    "sim",
                    1e-3,
                    1.98e9,
                    0.1,
                    False,
                    1,
                    f"GPU-{host}",
                    measured_at,
                    host=host,
                )
            )

    def fleet_winners(self, gpu_model: str, max_age_s: float, *, versions: Versions | None = None,
                      exclude_host: str | None = None) -> list[WinnerRow]:  # fmt: skip
        self.calls.append("fleet_winners")
        if self.fail_with is not None:
            raise self.fail_with
        return [r for r in self.rows if r.gpu_model == gpu_model]

    def claim(self, key: str, host: str, gpu_uuid: str, ttl_s: float) -> bool:
        self.calls.append("claim")
        if self.claims_fail_with is not None:
            raise self.claims_fail_with
        if self.claims_wait_for is not None:  # a stalled database
            self.claim_waiting.set()
            self.claims_wait_for.wait()
        now = self._clock()
        with self._lock:
            held = self._claims.get(key)
            mine = held is not None and (held.host, held.gpu_uuid) == (host, gpu_uuid)
            if held is not None and held.expires_at > now and not mine:
                return False
            since = held.claimed_at if mine and held is not None else now
            self._claims[key] = Claim(key, host, gpu_uuid, since, now + ttl_s)
            return True

    def release(self, key: str, host: str, gpu_uuid: str) -> None:
        self.calls.append("release")
        with self._lock:
            held = self._claims.get(key)
            if held is not None and (held.host, held.gpu_uuid) == (host, gpu_uuid):
                del self._claims[key]

    def claims(self) -> list[Claim]:
        return sorted(self._claims.values(), key=lambda c: c.key)


class RealFleet:
    """The real store (SQLite or PostgreSQL); each host opens it itself."""

    def __init__(self, backend: Backend, clock: Clock) -> None:
        self._backend = backend
        self._clock = clock
        self.store = backend.open(now=clock)
        self._opened = [self.store]

    def for_host(self) -> SqlStore:
        store = self._backend.open(now=self._clock)
        self._opened.append(store)
        return store

    def seed(self, host: str, workload: str, regimes: tuple[Regime, ...], measured_at: float,
             *, model: str = MODEL, versions: Versions = STACK) -> None:  # fmt: skip
        was, self._clock.t = self._clock.t, measured_at
        try:
            meta = SessionMeta(
                gpu_uuid=f"GPU-{host}", gpu_index=0, gpu_model=model, backend="sim",
                workloads=(sim_workload(workload),), regimes=regimes, versions=versions,
                host=host, started_at=measured_at,
            )  # fmt: skip
            results = [
                RegimeResult(
                    workload,
                    r,
                    (candidate("sim[a]", r, 1e-3), candidate("sim[b]", r, 2e-3)),
                    winner="sim[a]",
                    tie=False,
                    margin=1.0,
                    noise=0.01,
                )
                for r in regimes
            ]
            seed_session(self.store, meta, results)
        finally:
            self._clock.t = was

    def claims(self) -> list[Claim]:
        return sorted(self.store.claims(), key=lambda c: c.key)

    def close(self) -> None:
        for store in self._opened:
            store.close()


# -- hosts: a scheduler each, with its own GPU, board and runners ------------------------------


class FakeRunner:
    """Holds each session until released, then ends it with ``status`` and says so."""

    def __init__(self, host: Host, on_finished: SessionListener) -> None:
        self.host = host
        self.on_finished = on_finished
        self.status = SessionStatus.COMPLETED
        self.release = threading.Event()
        self.started = threading.Event()
        self.specs: list[Any] = []
        self.kw: list[dict[str, Any]] = []  # each run_session's keyword arguments

    def pids(self) -> frozenset[int]:
        return frozenset()

    def cancel(self, reason: str) -> bool:
        self.release.set()
        return True

    def run_session(self, spec, info, backend_name, should_preempt, **kw) -> SessionOutcome:
        self.specs.append(spec)
        self.kw.append(kw)
        self.host.started.extend(w.name for w in spec.workloads)
        self.started.set()
        why = None
        while not self.release.wait(0.01):
            why = should_preempt()
            if why:
                break
        if self.host.raises is not None:
            raise self.host.raises
        status = SessionStatus.PREEMPTED if why else self.status
        names = tuple(w.name for w in spec.workloads)
        self.on_finished(SessionFinished(1, info.index, info.uuid, info.name, status, why, names))
        return SessionOutcome(status, why, 1, ())


@dataclass
class Host:
    name: str
    sched: TuneScheduler
    board: StateBoard
    info: DeviceInfo
    runners: list[FakeRunner] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    raises: Exception | None = None  # what its runners raise when released

    def gate(self, state: GateState, reasons: tuple[str, ...] = ()) -> None:
        health = PollHealth(True, 0.001)
        self.board.put(judged(0, self.info, None, state, reasons, t=0.0, since=0.0, health=health))

    def ask(self, workloads=WORK, reason: str = "no_winners") -> None:  # type: ignore[no-untyped-def]
        self.gate(GateState.COOL_STABLE)
        self.sched.request(0, list(workloads), reason)
        self.sched.tick()

    def runner(self) -> FakeRunner:
        assert wait_until(lambda: self.runners and self.runners[0].started.is_set())
        return self.runners[0]

    def idle(self) -> bool:
        return bool(wait_until(lambda: not self.sched.snapshot.running))


@dataclass
class Fleet:
    kind: str
    clock: Clock
    backing: FakeFleetStore | RealFleet
    make: Callable[..., Host]

    def seed(self, *a: Any, **kw: Any) -> None:
        self.backing.seed(*a, **kw)

    def claims(self) -> list[Claim]:
        return self.backing.claims()


@pytest.fixture(params=["fake", *KINDS])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fleet]:
    clock = Clock()
    backing: FakeFleetStore | RealFleet
    if request.param == "fake":
        backing = FakeFleetStore(clock)
    else:
        backing = RealFleet(make_backend(request, tmp_path / "f.db"), clock)
    local = sqlite_store(tmp_path / "local.db") if request.param == "fake" else None
    hosts: list[Host] = []

    def make(name: str = "a", *, verify_fraction: float = 0.0, enabled: bool = True,
             claim_ttl_s: float = 600.0, measure_anyway: tuple[str, ...] = (MANUAL,),
             with_fleet: bool = True, fresh_reasons: tuple[str, ...] = ()) -> Host:  # fmt: skip
        store = backing.for_host() if isinstance(backing, RealFleet) else backing
        cfg = FleetConfig(enabled=enabled, verify_fraction=verify_fraction, claim_ttl_s=claim_ttl_s)
        policy = FleetPolicy(
            store,
            cfg,
            host=name,
            versions_now=versions_now,
            measure_anyway=measure_anyway,
            now=clock,
        )
        info = DeviceInfo(0, f"GPU-{name}", MODEL, driver_version=STACK.driver)
        board = StateBoard()
        host: Host

        def runner_factory(_store: Any, *, on_finished: SessionListener) -> FakeRunner:
            r = FakeRunner(host, on_finished)
            host.runners.append(r)
            return r

        tuning = Config(tuning=TuningConfig(check_interval_s=1.0)).tuning_setup()
        sched = TuneScheduler(
            tuning, board, local if local is not None else store, "sim",
            runner_factory=runner_factory, now=clock, fleet=policy if with_fleet else None,
            fresh_reasons=fresh_reasons,
        )  # fmt: skip
        host = Host(name, sched, board, info)
        hosts.append(host)
        return host

    yield Fleet(request.param, clock, backing, make)
    for h in hosts:  # a "dead" host's session is still waiting: end it
        h.sched.shutdown(timeout=2)
    if isinstance(backing, RealFleet):
        backing.close()
    if local is not None:
        local.close()


def release_all(host: Host) -> None:
    for r in host.runners:
        r.release.set()
    assert host.idle()


# -- skipping what the fleet answered ----------------------------------------------------------


def test_work_with_fresh_fleet_winners_in_every_regime_is_skipped(fleet: Fleet, caplog) -> None:
    fleet.seed("b", "sim-0", (U, S), NOW - 2 * HOUR)
    fleet.seed("b", "sim-1", (U, S), NOW - HOUR)
    a = fleet.make("a")
    caplog.set_level(logging.INFO, logger="gpuwatchd.sessions.scheduler")
    a.ask()
    runner = a.runner()
    assert [w.name for w in runner.specs[0].workloads] == ["sim-2", "sim-3"]
    assert a.sched.snapshot.fleet_skipped_total == {SKIP_REASON: 2}
    assert a.sched.pending() == {0: ("sim-2", "sim-3")}
    assert "GPU 0: sim-0 skipped (fresh_fleet_winner): every regime has a winner measured by b" in (
        caplog.text
    )
    release_all(a)
    assert a.sched.pending() == {}
    assert a.sched.snapshot.fleet_verified_total == 0


def test_work_the_fleet_answered_entirely_starts_no_session(fleet: Fleet) -> None:
    for w in WORK:
        fleet.seed("b", w.name, (U, S), NOW - HOUR)
    a = fleet.make("a")
    a.ask()
    assert wait_until(lambda: not a.sched.pending() and not a.sched.snapshot.running)
    assert a.started == []
    assert a.sched.snapshot.fleet_skipped_total == {SKIP_REASON: 4}
    assert a.sched.snapshot.sessions_total.get("completed") == 0
    assert fleet.claims() == []


@pytest.mark.parametrize(
    ("seed", "why"),
    [
        ({"measured_at": NOW - 8 * 24 * HOUR}, "older than max_winner_age_s (7 days)"),
        ({"versions": Versions(driver="580.159.04", torch="2.12.0")}, "another torch"),
        ({"versions": Versions(driver="570.86.15", torch="2.13.0")}, "another driver"),
        ({"model": "NVIDIA H100 80GB HBM3"}, "another GPU model"),
        ({"regimes": (U,)}, "one regime has no winner"),
    ],
)
def test_winners_that_do_not_answer_for_this_host_are_not_used(fleet: Fleet, seed, why) -> None:
    args: dict[str, Any] = {"host": "b", "regimes": (U, S), "measured_at": NOW - HOUR, **seed}
    fleet.seed(args.pop("host"), "sim-0", args.pop("regimes"), args.pop("measured_at"), **args)
    a = fleet.make("a")
    a.ask(WORK[:1])
    runner = a.runner()
    assert [w.name for w in runner.specs[0].workloads] == ["sim-0"], why
    assert a.sched.snapshot.fleet_skipped_total == {}


@pytest.mark.parametrize(
    "versions",
    [
        Versions(driver="580.159.04", torch="2.13.0+cu128", triton="3.6.0", cudnn="91900"),
        Versions(driver="580.159.04"),  # the rest unknown: never counts as a change
    ],
)
def test_versions_compare_as_drift_compares_them(fleet: Fleet, versions: Versions) -> None:
    fleet.seed("b", "sim-0", (U, S), NOW - HOUR, versions=versions)
    a = fleet.make("a")
    a.ask(WORK[:2])
    assert [w.name for w in a.runner().specs[0].workloads] == ["sim-1"]


def test_an_operators_retune_is_measured_whatever_the_fleet_says(fleet: Fleet) -> None:
    fleet.seed("b", "sim-0", (U, S), NOW - HOUR)
    a = fleet.make("a")
    a.ask(WORK[:1], reason=MANUAL)
    assert [w.name for w in a.runner().specs[0].workloads] == ["sim-0"]
    assert a.sched.snapshot.fleet_skipped_total == {}


# -- verifying a share of the fleet's answers --------------------------------------------------


def test_verify_fraction_one_measures_everything_again_and_counts_it(fleet: Fleet, caplog) -> None:
    for w in WORK[:2]:
        fleet.seed("b", w.name, (U, S), NOW - HOUR)
    a = fleet.make("a", verify_fraction=1.0)
    caplog.set_level(logging.INFO, logger="gpuwatchd.sessions.scheduler")
    a.ask(WORK[:3])
    runner = a.runner()
    assert [w.name for w in runner.specs[0].workloads] == ["sim-0", "sim-1", "sim-2"]
    assert "sim-0 has fresh fleet winners; measuring it again to verify them" in caplog.text
    assert a.sched.snapshot.fleet_verified_total == 0  # counted once measured
    release_all(a)
    assert a.sched.snapshot.fleet_verified_total == 2
    assert a.sched.snapshot.fleet_skipped_total == {}


def test_hosts_verify_the_same_answer_side_by_side(fleet: Fleet) -> None:
    """Each host's share is its own: one verifying host does not hold the others back
    (they would find the answer re-measured when it is done, and draw again)."""
    fleet.seed("b", "sim-0", (U, S), NOW - HOUR)
    a, c = fleet.make("a", verify_fraction=1.0), fleet.make("c", verify_fraction=1.0)
    a.ask(WORK[:1])
    c.ask(WORK[:1])
    assert a.runner() and c.runner()
    assert a.started == c.started == ["sim-0"]
    held = sorted((c.key.rsplit("|", 1)[1], c.host) for c in fleet.claims())
    assert held == [("verify:a", "a"), ("verify:c", "c")]
    release_all(a)
    release_all(c)
    assert a.sched.snapshot.fleet_verified_total == c.sched.snapshot.fleet_verified_total == 1


def test_a_host_draws_its_verify_share_once_however_often_the_answer_is_re_measured() -> None:
    """Other hosts' verifications land while this host's GPUs look one after another: a
    new draw at each look would have the host verify more than its share."""
    clock = Clock()
    store = FakeFleetStore(clock)
    policy = FleetPolicy(store, FleetConfig(verify_fraction=0.5), host="a",  # type: ignore[arg-type]
                         versions_now=versions_now, now=clock)  # fmt: skip
    times = [NOW - HOUR + i for i in range(64)]
    skip_at = next(t for t in times if verify_share("a", MODEL, "sim-0", t) >= 0.5)
    verify_at = next(t for t in times if verify_share("a", MODEL, "sim-0", t) < 0.5)
    info = DeviceInfo(0, "GPU-a", MODEL, driver_version=STACK.driver)
    store.seed("b", "sim-0", (U, S), skip_at)
    first = policy.plan(info, STACK, WORK[:1], (U, S), {})
    assert [w.name for w, _ in first.skipped] == ["sim-0"]
    store.rows.clear()
    store.seed("c", "sim-0", (U, S), verify_at)  # host c verified meanwhile
    other_gpu = replace(info, index=1, uuid="GPU-a-1")
    again = policy.plan(other_gpu, STACK, WORK[:1], (U, S), {})
    assert again.verify == frozenset() and [w.name for w, _ in again.skipped] == ["sim-0"]
    new_at = max(times) + FleetConfig().max_winner_age_s  # the first answer aged out
    clock.t = new_at + 1
    store.rows.clear()
    store.seed("c", "sim-0", (U, S), new_at)
    later = policy.plan(info, STACK, WORK[:1], (U, S), {})  # drawn on the new answer
    assert ("sim-0" in later.verify) == (verify_share("a", MODEL, "sim-0", new_at) < 0.5)


def test_a_preempted_verification_is_not_counted(fleet: Fleet) -> None:
    fleet.seed("b", "sim-0", (U, S), NOW - HOUR)
    a = fleet.make("a", verify_fraction=1.0)
    a.ask(WORK[:1])
    a.runner()
    a.gate(GateState.BUSY, ("1 foreign compute process(es) (pid 77)",))
    assert a.idle()
    assert a.sched.snapshot.fleet_verified_total == 0
    assert a.sched.pending() == {0: ("sim-0",)}


def test_the_verified_share_is_stable_and_differs_between_hosts() -> None:
    work = [sim_workload(f"w{i}") for i in range(400)]
    answers = {w.name: FleetAnswer(w.name, NOW - i, ("b",)) for i, w in enumerate(work)}

    def verified(host: str, fraction: float) -> frozenset[str]:
        return plan_fleet(
            work, answers, host=host, gpu_model=MODEL, verify_fraction=fraction
        ).verify

    quarter = verified("a", 0.25)
    assert 60 <= len(quarter) <= 140  # 100 expected; the hash spreads them
    assert verified("a", 0.25) == quarter  # the same work on every tick
    assert verified("c", 0.25) != quarter  # another host checks other work
    assert verified("a", 0.0) == frozenset()
    assert verified("a", 1.0) == frozenset(answers)
    assert quarter <= verified("a", 0.5)  # a larger share keeps the smaller one's picks
    plan = plan_fleet(work, answers, host="a", gpu_model=MODEL, verify_fraction=0.25)
    assert {w.name for w in plan.run} == quarter
    assert {w.name for w, _ in plan.skipped} == set(answers) - quarter


def test_a_new_fleet_measurement_draws_again() -> None:
    shares = {verify_share("a", MODEL, "w", NOW + i) for i in range(50)}
    assert len(shares) == 50 and all(0.0 <= s < 1.0 for s in shares)
    assert verify_share("a", MODEL, "w", NOW) == verify_share("a", MODEL, "w", NOW)


def test_fleet_answer_needs_every_regime_and_takes_the_newest() -> None:
    def row(regime: Regime, at: float, host: str | None = "b") -> WinnerRow:
        return WinnerRow(MODEL, STACK, "w", regime, "c", "sim", 1e-3, None, None, False, 1,
                         "GPU-b", at, host=host)  # fmt: skip

    kw: dict[str, Any] = dict(gpu_model=MODEL, versions=STACK,
                              now=NOW, max_age_s=HOUR)  # fmt: skip
    rows = [row(U, NOW - 100), row(S, NOW - 50), row(S, NOW - 3000, "c")]
    assert fleet_answer(rows, "w", (U, S), **kw) == FleetAnswer("w", NOW - 50, ("b",))
    assert fleet_answer(rows[:1], "w", (U, S), **kw) is None
    assert fleet_answer(rows[:1], "w", (U,), **kw) == FleetAnswer("w", NOW - 100, ("b",))
    assert fleet_answer([row(U, NOW - 100, None)], "w", (U,), **kw) is None  # whose?
    assert fleet_answer(rows, "w", (), **kw) is None


# -- the race between reading the fleet and claiming ---------------------------------------------


class AnsweredBeforeTheClaim:
    """A host's view of the fleet's store in which host ``b`` records its winners for
    ``names`` (and has given its claims back) just before this host's first claim: after
    this host read the fleet's winners, before it claimed."""

    def __init__(self, fleet: Fleet, store: Any, names: tuple[str, ...]) -> None:
        self._fleet = fleet
        self._store = store
        self._names = names
        self._answered = False
        self.plans = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def fleet_winners(self, *a: Any, **kw: Any) -> list[WinnerRow]:
        self.plans += 1
        return self._store.fleet_winners(*a, **kw)

    def claim(self, key: str, host: str, gpu_uuid: str, ttl_s: float) -> bool:
        if not self._answered:
            self._answered = True
            for name in self._names:
                self._fleet.seed("b", name, (U, S), self._fleet.clock.t)
        return self._store.claim(key, host, gpu_uuid, ttl_s)


def racing(fleet: Fleet, host: Host, names: tuple[str, ...]) -> AnsweredBeforeTheClaim:
    policy = host.sched._fleet
    assert policy is not None
    policy.store = AnsweredBeforeTheClaim(fleet, policy.store, names)
    return policy.store


def test_work_answered_between_reading_the_fleet_and_claiming_is_given_back_and_skipped(
    fleet: Fleet, caplog
) -> None:
    a = fleet.make("a")
    store = racing(fleet, a, ("sim-0",))
    skips: list[WorkSkipped] = []
    a.sched.events.add_skip_listener(skips.append)
    caplog.set_level(logging.INFO, logger="gpuwatchd.sessions.scheduler")
    a.ask(WORK[:2])
    runner = a.runner()
    assert [w.name for w in runner.specs[0].workloads] == ["sim-1"]
    assert store.plans == 2  # asked again once the claims were held
    assert [c.key for c in fleet.claims()] == [claim_key(MODEL, versions_now(a.info), "sim-1")]
    assert a.sched.snapshot.fleet_skipped_total == {SKIP_REASON: 1}
    assert "GPU 0: sim-0 skipped (fresh_fleet_winner): every regime has a winner measured by b" in (
        caplog.text
    )
    assert skips == [WorkSkipped(0, "GPU-a", MODEL, ("sim-0",), SKIP_REASON)]
    release_all(a)
    assert fleet.claims() == [] and a.sched.pending() == {}


def test_work_all_answered_before_the_claim_starts_no_session(fleet: Fleet) -> None:
    a = fleet.make("a")
    racing(fleet, a, tuple(w.name for w in WORK))
    a.ask()
    assert wait_until(lambda: not a.sched.pending() and not a.sched.snapshot.running)
    assert a.started == [] and a.runners[0].specs == []
    assert fleet.claims() == []
    assert a.sched.snapshot.fleet_skipped_total == {SKIP_REASON: len(WORK)}


def test_a_store_failing_after_the_claim_gives_the_claims_back(fleet: Fleet, caplog) -> None:
    if not isinstance(fleet.backing, FakeFleetStore):
        pytest.skip("the fake store fails on demand")
    backing = fleet.backing
    a = fleet.make("a")
    store = racing(fleet, a, ())
    real_claim = store.claim

    def claim_then_fail(*args: Any) -> bool:
        backing.fail_with = StoreError("store postgresql://db/gw: cannot read: refused")
        return real_claim(*args)

    store.claim = claim_then_fail  # type: ignore[method-assign]
    a.ask(WORK[:2])
    assert a.idle()
    assert a.started == [] and fleet.claims() == []
    assert a.sched.pending() == {0: ("sim-0", "sim-1")}
    assert "asking the fleet's store what to tune failed" in caplog.text


def test_work_measured_to_verify_the_fleet_is_not_dropped_by_the_second_look(
    fleet: Fleet,
) -> None:
    fleet.seed("b", "sim-0", (U, S), NOW - HOUR)
    a = fleet.make("a", verify_fraction=1.0)
    store = racing(fleet, a, ())
    a.ask(WORK[:2])
    assert [w.name for w in a.runner().specs[0].workloads] == ["sim-0", "sim-1"]
    assert store.plans == 2
    release_all(a)
    assert a.sched.snapshot.fleet_verified_total == 1  # sim-0; sim-1 had no fleet answer
    assert a.sched.snapshot.fleet_skipped_total == {}


# -- skipped work, as listeners hear of it ----------------------------------------------------


def test_skipped_work_is_announced_once_per_decision(fleet: Fleet) -> None:
    fleet.seed("b", "sim-0", (U, S), NOW - HOUR)
    fleet.seed("b", "sim-2", (U, S), NOW - HOUR)
    a = fleet.make("a")
    skips: list[WorkSkipped] = []
    a.sched.events.add_skip_listener(skips.append)
    a.ask()
    a.runner()
    assert skips == [WorkSkipped(0, "GPU-a", MODEL, ("sim-0", "sim-2"), SKIP_REASON)]
    release_all(a)
    assert len(skips) == 1


def test_a_users_kernel_request_the_fleet_answered_leaves_the_spool(
    fleet: Fleet, tmp_path: Path
) -> None:
    """No session ends here for it: the skip tells the user work it is answered."""
    a = fleet.make("a")
    work = UserWork(
        a.sched,
        models=lambda: {0: MODEL},
        devices=lambda: ("cuda",),
        tuning=lambda: TuningConfig(allowed_modules=("user_kernels",)),
        configured=lambda: (),
        spool_dir=tmp_path / "spool",
        added=AddedWorkloads(tmp_path / "added.json"),
    )
    a.sched.events.add_skip_listener(work.work_skipped)
    name = work.tune_kernel(sample_request(gpu_model=MODEL))["workload"]
    assert len(list((tmp_path / "spool").glob("*.json"))) == 1
    fleet.seed("b", name, (U, S), NOW - HOUR)
    a.gate(GateState.COOL_STABLE)
    a.sched.tick()
    assert wait_until(lambda: not list((tmp_path / "spool").glob("*.json")))
    assert a.idle() and a.started == [] and a.sched.pending() == {}
    assert [w["name"] for w in work.listing(())] == []


# -- claims ------------------------------------------------------------------------------------


def test_two_hosts_free_at_once_start_each_workload_exactly_once(fleet: Fleet) -> None:
    a, b = fleet.make("a"), fleet.make("b")
    for h in (a, b):
        h.gate(GateState.COOL_STABLE)
        h.sched.request(0, list(WORK), "no_winners")
    go = threading.Barrier(2)

    def tick(h: Host) -> None:
        go.wait()
        h.sched.tick()

    threads = [threading.Thread(target=tick, args=(h,)) for h in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wait_until(lambda: len(a.started) + len(b.started) == len(WORK))
    assert sorted(a.started + b.started) == [w.name for w in WORK]
    assert not set(a.started) & set(b.started)
    lost = a if not a.started else b if not b.started else None
    if lost is not None:  # one host claimed everything: the other waits and says why
        assert wait_until(lambda: lost.sched.snapshot.claimed_elsewhere_total == len(WORK))
        assert lost.idle()
        assert lost.sched.snapshot.deferred_total == {"claimed_elsewhere": 1}
        lost.sched.tick()
        assert lost.sched.snapshot.deferred_total == {"claimed_elsewhere": 2}
    held = {c.key.rsplit("|", 1)[1]: c.host for c in fleet.claims()}
    assert held == {n: "a" for n in a.started} | {n: "b" for n in b.started}


def test_work_claimed_elsewhere_is_taken_from_the_fleet_once_that_host_is_done(
    fleet: Fleet,
) -> None:
    a, b = fleet.make("a"), fleet.make("b")
    a.ask(WORK[:2])
    a.runner()
    b.ask(WORK[:2])
    assert wait_until(lambda: b.sched.snapshot.claimed_elsewhere_total == 2)
    assert b.sched.pending() == {0: ("sim-0", "sim-1")}
    # Host a finishes and records its winners; b looks again after the recheck delay.
    for w in WORK[:2]:
        fleet.seed("a", w.name, (U, S), fleet.clock.t)
    release_all(a)
    assert fleet.claims() == []
    b.sched.tick()
    assert b.sched.snapshot.deferred_total["claimed_elsewhere"] == 2
    fleet.clock.t += 31
    b.sched.tick()
    assert wait_until(lambda: not b.sched.pending())
    assert b.started == []
    assert b.sched.snapshot.fleet_skipped_total == {SKIP_REASON: 2}


def test_a_claim_held_by_a_dead_host_lapses_after_its_ttl(fleet: Fleet) -> None:
    dead = fleet.make("dead", claim_ttl_s=60.0)
    dead.ask(WORK[:1])
    dead.runner()  # it dies here: never renews, never releases
    a = fleet.make("a")
    a.ask(WORK[:1])
    assert wait_until(lambda: a.sched.snapshot.claimed_elsewhere_total == 1)
    fleet.clock.t += 59  # a looks again after 30 s: still held
    a.sched.tick()
    assert wait_until(lambda: a.sched.snapshot.claimed_elsewhere_total == 2)
    assert a.started == []
    fleet.clock.t += 31  # the lease ran out at 60 s; a looks again at 89 s
    a.sched.tick()
    assert a.runner().specs[0].workloads == WORK[:1]
    assert [(c.host, c.gpu_uuid) for c in fleet.claims()] == [("a", "GPU-a")]


@pytest.mark.parametrize("ending", ["completed", "failed", "preempted", "raised"])
def test_claims_are_given_back_however_the_session_ends(fleet: Fleet, ending: str) -> None:
    a = fleet.make("a")
    a.gate(GateState.COOL_STABLE)
    a.sched.request(0, list(WORK[:2]), "no_winners")
    if ending == "raised":
        a.raises = RuntimeError("worker exploded")
    a.sched.tick()
    runner = a.runner()
    assert [c.key for c in fleet.claims()] == [
        claim_key(MODEL, versions_now(a.info), w.name) for w in WORK[:2]
    ]
    if ending == "failed":
        runner.status = SessionStatus.FAILED
        runner.release.set()
    elif ending == "preempted":
        a.gate(GateState.BUSY, ("1 foreign compute process(es) (pid 77)",))
    else:
        runner.release.set()
    assert a.idle()
    assert wait_until(lambda: fleet.claims() == [])
    b = fleet.make("b")
    b.ask(WORK[:2])
    assert b.runner().specs[0].workloads == WORK[:2]


def test_a_long_session_renews_its_claims_before_they_lapse(fleet: Fleet) -> None:
    a = fleet.make("a", claim_ttl_s=60.0)
    a.ask(WORK[:1])
    a.runner()
    first = fleet.claims()[0]
    assert first.expires_at == NOW + 60
    fleet.clock.t += 19  # a third of the lease not yet gone
    a.sched.tick()
    assert fleet.claims()[0].expires_at == NOW + 60
    for _ in range(6):  # two minutes, twice the lease
        fleet.clock.t += 20
        a.sched.tick()  # the session's renewer renews, on its own thread
        assert wait_until(lambda: fleet.claims()[0].expires_at == fleet.clock.t + 60)
    b = fleet.make("b")
    b.ask(WORK[:1])
    assert wait_until(lambda: b.sched.snapshot.claimed_elsewhere_total == 1)
    assert b.started == []
    assert fleet.claims()[0].claimed_at == first.claimed_at  # renewed, never lost
    release_all(a)
    assert fleet.claims() == []


def test_a_failed_renewal_is_tried_again_at_the_next_tick(fleet: Fleet, caplog) -> None:
    if not isinstance(fleet.backing, FakeFleetStore):
        pytest.skip("the fake store fails on demand")
    a = fleet.make("a", claim_ttl_s=60.0)
    a.ask(WORK[:1])
    a.runner()
    fleet.clock.t += 20
    fleet.backing.claims_fail_with = StoreError("store postgresql://db/gw: cannot claim work")
    a.sched.tick()
    failed = "GPU 0: renewing the fleet claims failed: store postgresql://db/gw"
    assert wait_until(lambda: failed in caplog.text)
    assert fleet.claims()[0].expires_at == NOW + 60
    fleet.backing.claims_fail_with = None
    fleet.clock.t += 1
    a.sched.tick()
    assert wait_until(lambda: fleet.claims()[0].expires_at == NOW + 21 + 60)


def _tick_in_a_thread(host: Host) -> bool:
    """Whether ``tick`` returned within 5 s (the store it must not wait on never answers)."""
    t = threading.Thread(target=host.sched.tick, daemon=True)
    t.start()
    t.join(5.0)
    return not t.is_alive()


def test_the_tick_never_waits_on_a_stalled_store(fleet: Fleet) -> None:
    """Another host's stalled transaction holds the store's write lock: the renewal waits
    on it, and the scheduler goes on deciding meanwhile."""
    if not isinstance(fleet.backing, FakeFleetStore):
        pytest.skip("the fake store stalls on demand")
    a = fleet.make("a", claim_ttl_s=60.0)
    a.ask(WORK[:1])
    a.runner()
    stalled = threading.Event()
    fleet.backing.claims_wait_for = stalled
    try:
        fleet.clock.t += 20
        assert _tick_in_a_thread(a)
        assert fleet.backing.claim_waiting.wait(5.0)  # the renewal is stuck in the store
        a.sched.request(0, list(WORK[1:2]), "no_winners")  # requests go on being taken
        fleet.clock.t += 20  # due again: the renewer is still busy with the first
        assert _tick_in_a_thread(a) and _tick_in_a_thread(a)
        assert a.sched.pending() == {0: ("sim-0", "sim-1")}  # sim-0 until its session ends
    finally:
        stalled.set()
    assert wait_until(lambda: fleet.claims()[0].expires_at > NOW + 60)  # it went through
    release_all(a)
    assert fleet.claims() == []


def test_a_renewal_never_takes_back_the_claims_of_a_session_that_ended(fleet: Fleet) -> None:
    """The session ends while its renewal waits on the store: the claims are given back
    only once that renewal has finished, so it cannot take them back after the release."""
    if not isinstance(fleet.backing, FakeFleetStore):
        pytest.skip("the fake store stalls on demand")
    a = fleet.make("a", claim_ttl_s=60.0)
    a.ask(WORK[:1])
    runner = a.runner()
    stalled = threading.Event()
    fleet.backing.claims_wait_for = stalled
    fleet.clock.t += 20
    a.sched.tick()
    assert fleet.backing.claim_waiting.wait(5.0)
    runner.release.set()  # the session ends while the renewal waits
    assert wait_until(lambda: a.sched.snapshot.sessions_total["completed"] == 1)
    assert "release" not in fleet.backing.calls  # waits for the renewal to finish
    assert a.sched.snapshot.running == frozenset({0})
    stalled.set()
    assert a.idle()
    assert fleet.claims() == []
    calls = fleet.backing.calls
    assert calls[-1] == "release" and calls.count("release") == 1
    assert calls.index("release") > max(i for i, c in enumerate(calls) if c == "claim")
    a.sched.tick()  # nothing left to renew
    assert fleet.claims() == []


def test_work_asked_for_afresh_tells_the_runner_since_when(fleet: Fleet) -> None:
    """A manual re-tune's session reuses no result a preempted session measured before
    the request; other work may resume as usual."""
    a = fleet.make("a", fresh_reasons=(MANUAL,))
    a.gate(GateState.COOL_STABLE)
    a.sched.request(0, list(WORK[:1]), "no_winners")
    fleet.clock.t += 5
    a.sched.request(0, list(WORK[1:2]), MANUAL)
    a.sched.tick()
    assert a.runner().kw[0]["fresh_after"] == {"sim-1": NOW + 5}
    release_all(a)
    b = fleet.make("b")  # no fresh reasons configured: nothing is asked for afresh
    b.gate(GateState.COOL_STABLE)
    b.sched.request(0, list(WORK[2:3]), MANUAL)
    b.sched.tick()
    assert b.runner().kw[0]["fresh_after"] == {}


# -- without a fleet ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["no policy", "disabled"])
def test_without_a_fleet_nothing_is_skipped_or_claimed(fleet: Fleet, how: str) -> None:
    fleet.seed("b", "sim-0", (U, S), NOW - HOUR)
    a = fleet.make("a", with_fleet=how != "no policy", enabled=how != "disabled")
    a.ask()
    assert a.runner().specs[0].workloads == WORK
    assert fleet.claims() == []
    snap = a.sched.snapshot
    assert (snap.fleet_skipped_total, snap.fleet_verified_total, snap.claimed_elsewhere_total) == (
        {},
        0,
        0,
    )
    if isinstance(fleet.backing, FakeFleetStore):
        assert fleet.backing.calls == []


def test_a_reload_turns_the_fleet_off_and_on(fleet: Fleet) -> None:
    fleet.seed("b", "sim-0", (U, S), NOW - HOUR)
    a = fleet.make("a")
    a.sched.reconfigure(a.sched.cfg, FleetConfig(enabled=False))
    a.ask(WORK[:1])
    assert a.runner().specs[0].workloads == WORK[:1]
    release_all(a)
    a.sched.reconfigure(a.sched.cfg, FleetConfig(enabled=True))
    a.sched.request(0, list(WORK[:1]), "no_winners")
    a.sched.tick()
    assert wait_until(lambda: not a.sched.pending())
    assert len(a.runners[0].specs) == 1


def test_a_failing_fleet_store_backs_off_and_keeps_the_work(fleet: Fleet, caplog) -> None:
    if not isinstance(fleet.backing, FakeFleetStore):
        pytest.skip("the fake store fails on demand")
    fleet.backing.fail_with = StoreError("store postgresql://db/gw: cannot read: refused")
    a = fleet.make("a")
    a.ask(WORK[:1])
    assert a.idle()
    assert a.started == [] and a.sched.pending() == {0: ("sim-0",)}
    assert "GPU 0: asking the fleet's store what to tune failed: store postgresql://db" in (
        caplog.text
    )
    a.sched.tick()
    assert a.sched.snapshot.deferred_total == {"retry_backoff": 1}
    fleet.backing.fail_with = None
    fleet.clock.t += 3601
    a.sched.tick()
    assert a.runner().specs[0].workloads == WORK[:1]


def test_the_policy_exists_only_for_a_shared_store(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("GPUWATCHD_HOST", "node-7")
    kw: dict[str, Any] = {"versions_now": versions_now}
    with sqlite_store(tmp_path / "s.db") as local:
        assert fleet_policy(local, FleetConfig(), **kw) is None

    class Shared(FakeFleetStore):
        shared = True

    policy = fleet_policy(Shared(Clock()), FleetConfig(), measure_anyway=(MANUAL,), **kw)
    assert policy is not None and policy.host == "node-7"
    assert policy.measure_anyway == {MANUAL}


def test_of_the_real_stores_only_postgresql_is_shared(fleet: Fleet) -> None:
    if not isinstance(fleet.backing, RealFleet):
        pytest.skip("a real store's engine says whether it is shared")
    store = fleet.backing.store
    assert store.shared is (fleet.kind == "postgres")
    policy = fleet_policy(store, FleetConfig(), versions_now=versions_now,
                          host="h")  # fmt: skip
    assert (policy is not None) is store.shared


def test_identical_hosts_claim_the_same_key() -> None:
    one = versions_now(DeviceInfo(0, "GPU-x", MODEL, driver_version=STACK.driver))
    two = versions_now(DeviceInfo(3, "GPU-y", MODEL, driver_version=STACK.driver))
    assert claim_key(MODEL, one, "w") == claim_key(MODEL, two, "w")
    newer = STACK.merge(Versions(driver="590.1"))
    assert claim_key(MODEL, one, "w") != claim_key(MODEL, newer, "w")
    assert claim_key(MODEL, one, "w") != claim_key("NVIDIA H100", one, "w")


# -- once per host: its other GPUs ---------------------------------------------------------------


def _second_gpu(host: Host) -> DeviceInfo:
    """Give ``host`` a second GPU of the same model, its gate open."""
    info = DeviceInfo(1, f"{host.info.uuid}-1", MODEL, driver_version=STACK.driver)
    health = PollHealth(True, 0.001)
    host.board.put(judged(1, info, None, GateState.COOL_STABLE, (), t=0.0, since=0.0,
                          health=health))  # fmt: skip
    return info


def test_this_hosts_own_winner_answers_its_work_and_is_never_verified(fleet: Fleet) -> None:
    fleet.seed("a", "sim-0", (U, S), NOW - HOUR)  # measured on this host's other GPU
    a = fleet.make("a", verify_fraction=1.0)  # another host's answer would be verified
    a.ask(WORK[:1])
    assert a.idle()
    assert a.started == [] and a.sched.pending() == {}
    assert a.sched.snapshot.fleet_skipped_total == {SKIP_REASON: 1}
    assert a.sched.snapshot.fleet_verified_total == 0


@pytest.mark.parametrize("verify", [False, True])
def test_a_session_on_one_gpu_answers_the_work_pending_on_the_hosts_other_gpus(
    fleet: Fleet, verify: bool
) -> None:
    """Each key is measured once per host, and verified by at most one of its GPUs."""
    if verify:
        fleet.seed("b", "sim-0", (U, S), NOW - HOUR)
    a = fleet.make("a", verify_fraction=1.0 if verify else 0.0)
    _second_gpu(a)
    a.sched.request(1, list(WORK[:1]), "no_winners")
    a.ask(WORK[:1])  # GPU 0 first; one session at a time: GPU 1 waits
    runner = a.runner()
    assert [w.name for w in runner.specs[0].workloads] == ["sim-0"]
    release_all(a)
    a.sched.tick()
    assert a.idle()
    assert a.started == ["sim-0"], "measured once on this host"
    assert a.sched.pending() == {}
    assert a.sched.snapshot.fleet_skipped_total == {SKIP_REASON: 1}
    assert a.sched.snapshot.fleet_verified_total == (1 if verify else 0)


def test_work_a_reason_measures_anyway_stays_pending_on_the_other_gpu(fleet: Fleet) -> None:
    a = fleet.make("a")
    _second_gpu(a)
    a.sched.request(1, list(WORK[:1]), MANUAL)  # an operator asked for GPU 1 itself
    a.ask(WORK[:1])
    a.runner()
    release_all(a)
    assert a.sched.pending() == {1: ("sim-0",)}
