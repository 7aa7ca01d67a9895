"""Fleet follow-ups: a host served by the fleet gets a drift reference from the
fleet's winners, and a job on it reads its own host's winners first without a daemon.

A fleet-served host never completes a session of its own, so nothing it does itself
gives its GPUs a reference: before, ``no_winners`` stayed pending (and
GpuwatchdRetunePending fired after 6 h) on every host but the one that tuned. The
references here come from a real store, on SQLite and on PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from builders import (
    GEMM_8192,
    S,
    SettableClock,
    U,
    candidate,
    closed_url,
    h200,
    judged,
    seed_session,
    session_meta,
)
from fakes_backend import FakeBackend
from store_backends import KINDS, make_backend

from gpuwatchd.client import Client
from gpuwatchd.config import STORE_NAME, Config, DaemonConfig, TuningConfig
from gpuwatchd.daemon.process import Daemon
from gpuwatchd.drift import DriftConfig, DriftDetector, ReferenceSync, RetuneReason
from gpuwatchd.drift.seed import reference_from_store
from gpuwatchd.gate import GateState
from gpuwatchd.sessions.events import WorkSkipped
from gpuwatchd.sessions.fleet import SKIP_REASON
from gpuwatchd.store import SessionMeta, SqlStore, sqlite_store
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.types import Regime, RegimeResult, Versions

MHZ = 1e6
NOW = 1_800_000_000.0
HOST = "host-a"
#: The libraries installed on every host (the driver comes from each GPU).
LIBS = Versions(torch="2.13.0", triton="3.6.0")
STACK = Versions(driver="580.159.04").merge(LIBS)
#: This host's GPU: never tuned here.
MINE = h200(0, "GPU-a0", driver_version="580.159.04")
R = RetuneReason


def result(workload: str, regime: Regime, clock_hz: float = 1.98e9) -> RegimeResult:
    """``a`` beats ``b`` by 10% in ``regime``, running at ``clock_hz``."""
    return RegimeResult(
        workload,
        regime,
        (
            candidate("a", regime, 1.0e-3, sm_clock_hz=clock_hz),
            candidate("b", regime, 1.1e-3, sm_clock_hz=clock_hz),
        ),
        winner="a",
        tie=False,
        margin=0.1,
        noise=0.01,
    )


def tuned(store: SqlStore, clock: SettableClock, host: str, gpu_uuid: str, *,
          sustained_hz: float = 1.44e9, workload: str = "gemm", power_limit_w: float = 700.0,
          versions: Versions = STACK) -> int:  # fmt: skip
    """``host`` completes a session of ``workload`` in both regimes on ``gpu_uuid``."""
    meta = SessionMeta(
        gpu_uuid=gpu_uuid, gpu_index=0, gpu_model=MINE.name, backend="nvml",
        workloads=(replace(GEMM_8192, name=workload),), regimes=(U, S), versions=versions,
        host=host, max_sm_clock_hz=1980.0 * MHZ, power_limit_w=power_limit_w,
    )  # fmt: skip
    results = [result(workload, U), result(workload, S, sustained_hz)]
    return seed_session(store, meta, results, tick=lambda: setattr(clock, "t", clock.t + 60.0))


@pytest.fixture(params=KINDS)
def store_and_clock(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[SqlStore, SettableClock]]:
    clock = SettableClock(NOW)
    store = make_backend(request, tmp_path / "fleet.db").open(now=clock)
    yield store, clock
    store.close()


class Drift:
    """This host's drift detector and reference sync, its clocks driven by the test."""

    def __init__(self, store: SqlStore, clock: SettableClock, info: DeviceInfo = MINE) -> None:
        self.info = info
        self.clock = clock
        self.mono = 0.0
        self.detector = DriftDetector(DriftConfig(), lambda: LIBS)
        self.detector.observe(judged(info.index, info, None, GateState.BUSY))
        self.sync = ReferenceSync(
            self.detector, store, host=HOST, versions_now=lambda: LIBS, clock=lambda: self.mono
        )

    def check(self) -> set[RetuneReason]:
        """One drift check as DriftJob runs it: sync, evaluate; the pending reasons."""
        self.sync.sync([self.info])
        self.detector.evaluate(self.clock.t)
        return self.detector.pending(self.info.index)

    def skipped(self) -> None:
        """The scheduler skipped this GPU's work: the fleet answered it."""
        self.sync.work_skipped(WorkSkipped(0, self.info.uuid, self.info.name, ("gemm",),
                                           SKIP_REASON))  # fmt: skip


# -- drift references of a host the fleet serves ------------------------------------------------


def test_a_skip_for_a_fresh_fleet_winner_gives_the_gpu_the_fleets_reference(
    store_and_clock: tuple[SqlStore, SettableClock],
) -> None:
    store, clock = store_and_clock
    drift = Drift(store, clock)
    assert drift.check() == {R.NO_WINNERS}  # nobody tuned yet: this host asks
    tuned(store, clock, "host-b", "GPU-b0", sustained_hz=1.44e9)  # another host does it
    assert drift.check() == {R.NO_WINNERS}  # nothing told this host yet
    drift.skipped()  # its scheduler skipped the work for b's fresh winners
    assert drift.check() == set()
    view = drift.detector.view()[0]
    assert view.reference_clock_hz == 1.44e9 and view.uuid == MINE.uuid
    ref = reference_from_store(store, MINE, host=HOST, libraries=LIBS)
    assert ref is not None and ref.power_limit_w == 700.0 and ref.versions == STACK
    assert ref.max_clock_hz == 1980.0 * MHZ and ref.measured_at == clock.t


def test_a_busy_host_that_never_skips_picks_the_fleets_reference_up_by_itself(
    store_and_clock: tuple[SqlStore, SettableClock],
) -> None:
    """Its gate never opens, so its scheduler never asks the fleet; the GPU waiting on a
    re-tune is looked up again every pending_recheck_s all the same."""
    store, clock = store_and_clock
    drift = Drift(store, clock)
    assert drift.check() == {R.NO_WINNERS}
    tuned(store, clock, "host-b", "GPU-b0")
    drift.mono += 299.0
    assert drift.check() == {R.NO_WINNERS}  # not yet due
    drift.mono += 1.0
    assert drift.check() == set()
    assert drift.detector.view()[0].reference_clock_hz == 1.44e9


def test_a_gpu_with_nothing_pending_is_not_looked_up_again(
    store_and_clock: tuple[SqlStore, SettableClock], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, clock = store_and_clock
    tuned(store, clock, "host-b", "GPU-b0")
    drift = Drift(store, clock)
    assert drift.check() == set()
    reads: list[str] = []

    def counting(name: str) -> Callable[..., list[object]]:
        def read(*_a: object, **_kw: object) -> list[object]:
            reads.append(name)
            return []

        return read

    for name in ("winners", "sessions"):
        monkeypatch.setattr(store, name, counting(name))
    drift.mono += 3600.0
    assert drift.check() == set() and reads == []
    drift.skipped()  # an event still makes it look
    drift.check()
    assert reads == ["sessions", "winners"]


def test_the_fleets_reference_comes_only_from_sessions_at_this_gpus_power_limit(
    store_and_clock: tuple[SqlStore, SettableClock],
) -> None:
    store, clock = store_and_clock
    tuned(store, clock, "host-c", "GPU-c0", workload="conv", sustained_hz=1.40e9)
    tuned(store, clock, "host-b", "GPU-b0", sustained_hz=1.30e9, power_limit_w=600.0)
    ref = reference_from_store(store, MINE, host=HOST, libraries=LIBS)
    # b's newer session ran at 600 W: its clock says nothing about a 700 W GPU.
    assert ref is not None and ref.sustained_clock_hz == 1.40e9 and ref.power_limit_w == 700.0


def test_a_fleet_at_another_power_limit_lends_no_clock_and_this_gpu_is_tuned_here(
    store_and_clock: tuple[SqlStore, SettableClock],
) -> None:
    store, clock = store_and_clock
    tuned(store, clock, "host-b", "GPU-b0", sustained_hz=1.30e9, power_limit_w=600.0)
    drift = Drift(store, clock)
    # Not no_winners (which the fleet would answer and skip again): the winners this GPU
    # is served were measured at 600 W, and the power-limit reason is measured here.
    assert drift.check() == {R.POWER_LIMIT_CHANGED}
    assert drift.detector.view()[0].reference_clock_hz is None


def test_this_hosts_own_winners_give_the_reference_before_the_fleets(
    store_and_clock: tuple[SqlStore, SettableClock],
) -> None:
    store, clock = store_and_clock
    tuned(store, clock, HOST, "GPU-a1", sustained_hz=1.42e9)  # this host's other GPU
    tuned(store, clock, "host-b", "GPU-b0", sustained_hz=1.46e9)  # newer, agrees
    assert store.winners(gpu_model=MINE.name, regime=S, latest=True)[0].host == "host-b"
    ref = reference_from_store(store, MINE, host=HOST, libraries=LIBS)
    assert ref is not None and ref.sustained_clock_hz == 1.42e9


def test_after_an_upgrade_the_fleets_winners_for_the_new_stack_clear_versions_changed(
    store_and_clock: tuple[SqlStore, SettableClock],
) -> None:
    store, clock = store_and_clock
    old = Versions(driver="580.159.04", torch="2.12.0", triton="3.6.0")
    tuned(store, clock, HOST, MINE.uuid, sustained_hz=1.42e9, versions=old)
    drift = Drift(store, clock)
    assert drift.check() == {R.VERSIONS_CHANGED}  # torch 2.12 -> 2.13 here
    tuned(store, clock, "host-b", "GPU-b0", sustained_hz=1.45e9)  # b tunes the new stack
    drift.skipped()
    assert drift.check() == set()
    assert drift.detector.view()[0].reference_clock_hz == 1.45e9
    # With no winners for the new stack anywhere, the GPU's own session stays its reference.
    ref = reference_from_store(store, MINE, host=HOST, libraries=Versions(torch="2.14.0"))
    assert ref is not None and ref.versions == old


def test_the_daemon_refreshes_references_when_its_scheduler_skips_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wiring: the daemon's ReferenceSync listens to its scheduler's skips."""
    monkeypatch.setenv("GPUWATCHD_HOST", HOST)
    daemon = Daemon(
        Config(
            daemon=DaemonConfig(
                state_dir=str(tmp_path),
                listen="127.0.0.1:0",
                control_socket=str(tmp_path / "control.sock"),
            ),
            tuning=TuningConfig(enabled=False),
        ),
        backend=FakeBackend(gpus=1),
    )
    try:
        info = daemon.backend.device_info(0)
        daemon.poller.poll(0)
        daemon.drift_job()
        assert daemon.drift.pending(0) == {R.NO_WINNERS}
        meta = session_meta(host="host-b", gpu_uuid="GPU-b0", gpu_model=info.name,
                            versions=Versions(driver=info.driver_version), power_limit_w=700.0,
                            max_sm_clock_hz=1980.0 * MHZ)  # fmt: skip
        with sqlite_store(tmp_path / STORE_NAME) as peer:
            seed_session(peer, meta, [result("gemm", S, 1.41e9)])
        daemon.drift_job()
        assert daemon.drift.pending(0) == {R.NO_WINNERS}
        daemon.tuner.events.notify_skipped(
            WorkSkipped(0, info.uuid, info.name, ("gemm",), SKIP_REASON)
        )
        daemon.drift_job()
        assert daemon.drift.pending(0) == set()
        assert daemon.drift.view()[0].reference_clock_hz == 1.41e9
    finally:  # never run: only what its constructor opened
        daemon.tuner.shutdown()
        daemon.store.close()


# -- the client without a daemon: this host's own winners first --------------------------------


def test_the_clients_direct_read_prefers_this_hosts_own_winners(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peer's winner stays the fleet's (this host disagreed beyond noise): a job here
    reads the winner this host measured, as /api/v1/winners serves it."""
    path = tmp_path / "w.db"
    with sqlite_store(path) as store:
        peer = session_meta(host="peer", gpu_uuid="GPU-peer", regimes=(U,))
        seed_session(store, peer, [result("gemm", U)])  # a beats b
        seed_session(store, peer, [result("conv", U)])
        mine = session_meta(host=HOST, gpu_uuid="GPU-mine", regimes=(U,))
        flipped = result("gemm", U)
        flipped = replace(
            flipped,
            candidates=(replace(flipped.candidates[0], median_s=1.2e-3), flipped.candidates[1]),
            winner="b",
        )
        seed_session(store, mine, [flipped])
        assert store.winners(workload="gemm", latest=True)[0].candidate == "a"
    monkeypatch.setenv("GPUWATCHD_HOST", HOST)
    client = Client(closed_url(), store=path)
    gemm = client.winner("gemm", "unthrottled")
    assert gemm is not None and (gemm.candidate, gemm.host) == ("b", HOST)
    conv = client.winner("conv", "unthrottled")
    assert conv is not None and (conv.candidate, conv.host) == ("a", "peer")
    monkeypatch.setenv("GPUWATCHD_HOST", "\x07")
    with pytest.raises(Exception, match="GPUWATCHD_HOST"):
        client.winner("gemm", "unthrottled")
