"""Fleet views: the clock comparison, the daemon's fleet sync on a real store, the collector.

FleetSync runs against a real store (SQLite, and a real PostgreSQL) filled through the
store API, as several hosts would fill a shared one (each row names its host). The
collector's output goes through the real aggregator and exposition, is parsed back,
checked against tests/metric_catalog.py and by ``promtool check metrics``.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from builders import NOW_UNIX, SettableClock, board_of, candidate, h200, idle, judged
from metric_catalog import KNOWN_METRICS, SOURCE
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry
from store_backends import KINDS, make_backend

from gpuwatchd.daemon.fleet_sync import FleetSync
from gpuwatchd.drift.detector import GpuDriftView
from gpuwatchd.drift.fleet import (
    RECENT_DISAGREEMENTS_S,
    ClockGroup,
    FleetSnapshot,
    coverage,
    group_clocks,
    is_outlier,
    power_limit_label,
    versions_label,
)
from gpuwatchd.exporter.collectors.base import GpuwatchdCollector
from gpuwatchd.exporter.collectors.fleet import FleetCollector
from gpuwatchd.gate import GateState
from gpuwatchd.sessions.tuning_view import TuningSnapshot
from gpuwatchd.store import StoreError
from gpuwatchd.store.rows import HostClock, SessionMeta
from gpuwatchd.tuning.types import Regime, RegimeResult, SessionStatus, Versions, Workload

PROMTOOL = shutil.which("promtool")
H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
STACK = Versions(driver="580.159.04", cuda="12.8", torch="2.11.0")
MHZ = 1e6


def clock(host: str, mhz: float, *, model: str = H200, limit: float | None = 700.0) -> HostClock:
    return HostClock(host, f"GPU-{host}", model, limit, mhz * MHZ, NOW_UNIX)


def view(uuid: str, mhz: float | None) -> GpuDriftView:
    hz = None if mhz is None else mhz * MHZ
    return GpuDriftView(uuid, None, hz, None, frozenset())


# -- the comparison ----------------------------------------------------------------------


def test_groups_are_model_and_whole_watt_power_limit_with_their_median() -> None:
    rows = [
        clock("a", 1440),
        clock("b", 1400, limit=699.999),  # NVML's milliwatts: the same 700 W limit
        clock("c", 1500),
        clock("d", 1450),
        clock("e", 1200, limit=600.0),
        clock("f", 1300, model=H100),
    ]
    groups = group_clocks(rows)
    assert list(groups) == [
        ClockGroup(H100, "700"),
        ClockGroup(H200, "600"),
        ClockGroup(H200, "700"),
    ]
    h200 = groups[ClockGroup(H200, "700")]
    assert h200.peers == 4 and h200.median_hz == 1445 * MHZ  # mean of the middle two
    assert [c.host for c in h200.clocks] == ["a", "b", "c", "d"]
    assert groups[ClockGroup(H200, "600")].peers == 1
    assert power_limit_label(None) == "" and ClockGroup.of(H200, None).power_limit == ""


def test_outlier_is_more_than_5_percent_under_in_a_group_of_three() -> None:
    assert is_outlier(1353.6 * MHZ, 1440 * MHZ, 3)  # 6% under
    assert not is_outlier(1382.4 * MHZ, 1440 * MHZ, 3)  # 4% under
    assert not is_outlier(1368 * MHZ, 1440 * MHZ, 3)  # exactly 5%: not more than
    assert not is_outlier(1000 * MHZ, 1440 * MHZ, 2)  # too few to judge
    group = group_clocks([clock("a", 1440), clock("b", 1440), clock("slow", 1300)])
    (only,) = group.values()
    assert [c.host for c in only.outliers()] == ["slow"]
    assert only.ratio(1296 * MHZ) == pytest.approx(0.9)


def test_versions_label_names_the_known_fields_in_order() -> None:
    assert versions_label(STACK) == "driver=580.159.04,cuda=12.8,torch=2.11.0"
    assert versions_label(Versions()) == "unknown"


# -- a store filled through its API, as hosts would fill a shared one ---------------------


@pytest.fixture
def store_clock() -> SettableClock:
    return SettableClock(NOW_UNIX)


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path, store_clock: SettableClock) -> Any:
    """An empty store on each back end (a fresh PostgreSQL database, or a SQLite file)."""
    s = make_backend(request, tmp_path / "fleet.db").open(now=store_clock)
    yield s
    s.close()


def record(
    store: Any,
    host: str,
    workload: str,
    times: dict[str, float],
    *,
    model: str = H200,
    versions: Versions = STACK,
    regime: Regime = Regime.SUSTAINED,
) -> None:
    """A completed session on ``host`` timing ``times`` (candidate -> median s)."""
    work = Workload(workload, "matmul", {"m": 64, "n": 64, "k": 64}, "bf16", ("torch.matmul",))
    meta = SessionMeta(
        gpu_uuid=f"GPU-{host}",
        gpu_index=0,
        gpu_model=model,
        backend="sim",
        workloads=(work,),
        regimes=(regime,),
        versions=versions,
        host=host,
    )
    cands = tuple(
        candidate(name, regime, t) for name, t in sorted(times.items(), key=lambda kv: kv[1])
    )
    winner = cands[0].name
    result = RegimeResult(workload, regime, cands, winner, False, 0.2, 0.01)
    sid = store.start_session(meta)
    store.record_result(sid, result)
    store.finish_session(sid, SessionStatus.COMPLETED)


def fill_fleet(store: Any) -> None:
    """Three other H200 hosts at 700 W, one H100; winners and one disagreement."""
    for row in (clock("peer-1", 1440), clock("peer-2", 1450), clock("peer-3", 1430)):
        store.report_host_clock(row)
    store.report_host_clock(clock("h100-1", 1300, model=H100))
    record(store, "peer-1", "gemm", {"a": 1e-3, "b": 2e-3})
    record(store, "peer-2", "gemm", {"a": 1.2e-3, "b": 1e-3})  # disagrees beyond noise
    record(store, "peer-1", "conv", {"a": 1e-3, "b": 2e-3})
    record(store, "peer-3", "gemm", {"a": 1e-3}, versions=Versions(driver="575.0"))
    record(store, "h100-1", "gemm", {"a": 1e-3}, model=H100)


def this_host() -> Any:
    """GPU 0 and 1 are H200s with a learned clock (GPU 1 6% under), GPU 2 none, GPU 3 no info."""
    snaps = [
        judged(i, h200(i, uuid=f"GPU-me-{i}"), idle(1.0, gpu=i), GateState.COOL_STABLE)
        for i in range(3)
    ]
    snaps.append(judged(3, None, None, GateState.UNAVAILABLE))
    board = board_of(*snaps)
    views = {
        0: view("GPU-me-0", 1440),
        1: view("GPU-me-1", 1353.6),
        2: view("GPU-me-2", None),
        3: view("", 1400),
    }
    return board, views


def fleet_sync(store: Any, **kw: Any) -> FleetSync:
    board, views = this_host()
    args: dict[str, Any] = {
        "max_age_s": 1800.0,
        "winner_max_age_s": 86400.0,
        "host": "me",
        "now": lambda: NOW_UNIX,
    }
    return FleetSync(store, board, lambda: views, **(args | kw))


def test_sync_writes_this_hosts_learned_clocks_and_reads_the_fleets(store: Any) -> None:
    fill_fleet(store)
    sync = fleet_sync(store)
    snap = sync()
    assert snap is sync.snapshot and not snap.stale and snap.synced_at == NOW_UNIX
    mine = {c.gpu_uuid: c for c in store.host_clocks() if c.host == "me"}
    # Only GPUs with a learned clock and known facts are written.
    assert set(mine) == {"GPU-me-0", "GPU-me-1"}
    assert mine["GPU-me-1"].sustained_clock_hz == 1353.6 * MHZ
    assert mine["GPU-me-1"].gpu_model == H200 and mine["GPU-me-1"].power_limit_w == 700.0
    assert [(c.gpu, c.uuid, c.clock_hz) for c in snap.own] == [
        (0, "GPU-me-0", 1440 * MHZ),
        (1, "GPU-me-1", 1353.6 * MHZ),
    ]
    group = snap.groups[ClockGroup(H200, "700")]
    assert group.peers == 5  # three peers and this host's two GPUs
    assert group.median_hz == 1440 * MHZ
    assert group.is_outlier(1353.6 * MHZ)
    # This host has no H100: the fleet's H100 rows are not read (a sync's cost stays the
    # same however many models and hosts the fleet has).
    assert ClockGroup(H100, "700") not in snap.groups
    assert snap.disagreements == {(H200, "gemm", "sustained"): 1}
    assert snap.recent_disagreements == {(H200, "gemm", "sustained"): 1}
    assert snap.coverage == {
        (H200, "driver=575.0"): 1,
        (H200, "driver=580.159.04,cuda=12.8,torch=2.11.0"): 2,
    }


def test_stale_clocks_and_old_winners_are_left_out(store: Any, store_clock: SettableClock) -> None:
    store.report_host_clock(clock("gone", 1000))  # reported, then silent
    record(store, "gone", "old", {"a": 1e-3})
    store_clock.advance(3600.0)  # an hour later, by every clock
    store.report_host_clock(replace(clock("peer", 1440), updated_at=store_clock()))
    snap = fleet_sync(store, max_age_s=1800.0, winner_max_age_s=1800.0, now=store_clock)()
    assert snap.groups[ClockGroup(H200, "700")].peers == 3  # me twice and peer, not gone
    assert snap.coverage == {}


class FlakyStore:
    """The real store, except that every call raises ``error`` while it is set."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.error: Exception | None = None

    def __getattr__(self, name: str) -> Any:
        if self.error is not None and name != "where":
            raise self.error
        return getattr(self.store, name)


def test_an_unchanged_clock_is_written_again_only_as_it_ages(store: Any) -> None:
    """Each sync rewriting every GPU's row would write a fleet's every row each minute."""
    t = [NOW_UNIX]
    writes: list[str] = []

    class Spy:
        def report_host_clock(self, row: HostClock) -> None:
            writes.append(row.gpu_uuid)
            store.report_host_clock(row)

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

    board, views = this_host()
    sync = FleetSync(Spy(), board, lambda: views, max_age_s=1800.0, winner_max_age_s=86400.0,
                     host="me", now=lambda: t[0])  # fmt: skip
    sync()
    assert writes == ["GPU-me-0", "GPU-me-1"]
    t[0] += 60
    sync()
    assert writes == ["GPU-me-0", "GPU-me-1"]  # unchanged and fresh: not written
    views[1] = view("GPU-me-1", 1300)
    t[0] += 60
    sync()
    assert writes[2:] == ["GPU-me-1"]  # a changed clock is written at once
    t[0] = NOW_UNIX + 600  # a third of max_age_s after GPU 0's write
    snap = sync()
    assert writes[3:] == ["GPU-me-0"]
    mine = {c.gpu_uuid: c for c in store.host_clocks() if c.host == "me"}
    assert mine["GPU-me-0"].updated_at == NOW_UNIX + 600
    assert mine["GPU-me-1"].sustained_clock_hz == 1300 * MHZ
    assert snap.groups[ClockGroup(H200, "700")].peers == 2  # both still counted


def test_store_errors_mark_the_snapshot_stale_and_are_logged_once_each(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fill_fleet(store)
    flaky = FlakyStore(store)
    sync = fleet_sync(flaky)
    good = sync()
    caplog.set_level(logging.INFO, logger="gpuwatchd.daemon.fleet_sync")
    flaky.error = StoreError("cannot open store db:5432: connection refused")
    for _ in range(3):
        stale = sync()  # never raises
    assert stale.stale and stale.synced_at == good.synced_at
    assert stale.groups == good.groups and stale.own == good.own  # the last good values
    flaky.error = RuntimeError("boom")
    sync()
    mine = [r for r in caplog.records if r.name == "gpuwatchd.daemon.fleet_sync"]
    warnings = [r.getMessage() for r in mine if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "connection refused" in warnings[0] and "RuntimeError: boom" in warnings[1]
    flaky.error = None
    assert not sync().stale
    (recovered,) = [r for r in caplog.records if r.name == mine[0].name][len(mine) :]
    assert "works again" in recovered.getMessage() and recovered.levelno == logging.INFO


@pytest.mark.parametrize("key", ["max_age_s", "winner_max_age_s", "interval_s"])
@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "60", True])
def test_bad_settings_are_refused_naming_the_field(store: Any, key: str, bad: object) -> None:
    with pytest.raises(ValueError, match=f"fleet sync: {key} must be"):
        fleet_sync(store, **{key: bad})


# -- the collector -------------------------------------------------------------------------


def scrape(collector: FleetCollector) -> dict[str, list[Any]]:
    """Samples by name, through the real aggregator and exposition format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpuwatchdCollector([collector]))
    text = generate_latest(registry).decode()
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def one(samples: dict[str, list[Any]], name: str, **labels: str) -> float:
    (match,) = [s for s in samples[name] if labels.items() <= s.labels.items()]
    return float(match.value)


def test_a_disagreement_counts_as_recent_for_a_day(store: Any) -> None:
    """The alert's gauge: the disagreement leaves it a day later, the store still has it."""
    fill_fleet(store)
    recorded = store.disagreements()[0].recorded_at
    within = fleet_sync(store, now=lambda: recorded + RECENT_DISAGREEMENTS_S - 60)()
    assert within.recent_disagreements == {(H200, "gemm", "sustained"): 1}
    after = fleet_sync(store, now=lambda: recorded + RECENT_DISAGREEMENTS_S + 60)()
    assert after.recent_disagreements == {}
    assert after.disagreements == {(H200, "gemm", "sustained"): 1}
    samples = scrape(FleetCollector(lambda: after, lambda: TUNING, now=lambda: NOW_UNIX))
    assert "gpuwatchd_fleet_recent_disagreements" not in samples
    assert len(samples["gpuwatchd_fleet_disagreements"]) == 1


TUNING = TuningSnapshot(
    {},
    {},
    frozenset(),
    {},
    None,
    fleet_skipped_total={"fresh_fleet_winner": 4},
    fleet_verified_total=1,
    claimed_elsewhere_total=2,
)


def test_collector_exports_the_comparison_the_store_facts_and_the_fleet_work(store: Any) -> None:
    fill_fleet(store)
    sync = fleet_sync(store)
    sync()
    samples = scrape(
        FleetCollector(lambda: sync.snapshot, lambda: TUNING, now=lambda: NOW_UNIX + 7)
    )
    gpu1 = {"gpu": "1", "uuid": "GPU-me-1", "gpu_model": H200, "power_limit_watts": "700"}
    assert one(samples, "gpuwatchd_fleet_sustained_clock_hertz", **gpu1) == 1353.6 * MHZ
    assert one(samples, "gpuwatchd_fleet_median_sustained_clock_hertz", **gpu1) == 1440 * MHZ
    assert len(samples["gpuwatchd_fleet_sustained_clock_hertz"]) == 2  # GPUs 0 and 1
    # Peers only for this host's groups: the H100 group is not this host's business.
    (peers,) = samples["gpuwatchd_fleet_peers"]
    assert peers.labels == {"gpu_model": H200, "power_limit_watts": "700"} and peers.value == 5
    key = {"gpu_model": H200, "workload": "gemm", "regime": "sustained"}
    assert one(samples, "gpuwatchd_fleet_disagreements", **key) == 1
    assert one(samples, "gpuwatchd_fleet_recent_disagreements", **key) == 1
    assert len(samples["gpuwatchd_fleet_coverage_workloads"]) == 2  # this host's H200s only
    assert (
        one(samples, "gpuwatchd_fleet_coverage_workloads", gpu_model=H200, versions="driver=575.0")
        == 1
    )
    assert one(samples, "gpuwatchd_fleet_work_skipped_total", reason="fresh_fleet_winner") == 4
    assert one(samples, "gpuwatchd_fleet_verified_total") == 1
    assert one(samples, "gpuwatchd_fleet_claimed_elsewhere_total") == 2
    assert one(samples, "gpuwatchd_fleet_sync_age_seconds") == 7
    assert one(samples, "gpuwatchd_fleet_sync_success") == 1
    assert one(samples, "gpuwatchd_scrape_collector_success", collector="fleet") == 1


def test_collector_before_any_sync_and_before_any_fleet_work() -> None:
    """Nothing to compare yet; the work counters exist at 0 so rate() sees the first one."""
    plain = TuningSnapshot({}, {}, frozenset(), {}, None)
    samples = scrape(FleetCollector(FleetSnapshot, lambda: plain))
    fleet = {name for name in samples if name.startswith("gpuwatchd_fleet_")}
    assert fleet == {
        "gpuwatchd_fleet_work_skipped_total",
        "gpuwatchd_fleet_verified_total",
        "gpuwatchd_fleet_claimed_elsewhere_total",
    }
    assert one(samples, "gpuwatchd_fleet_work_skipped_total", reason="fresh_fleet_winner") == 0


def test_a_stale_sync_keeps_its_values_and_says_so() -> None:
    group = group_clocks([clock("a", 1440)])
    snap = FleetSnapshot(groups=group, synced_at=NOW_UNIX - 300, stale=True)
    samples = scrape(FleetCollector(lambda: snap, lambda: TUNING, now=lambda: NOW_UNIX))
    assert one(samples, "gpuwatchd_fleet_sync_success") == 0
    assert one(samples, "gpuwatchd_fleet_sync_age_seconds") == 300


def test_exposed_names_and_labels_match_the_catalogue(store: Any, tmp_path: Path) -> None:
    fill_fleet(store)
    sync = fleet_sync(store)
    sync()
    collector = FleetCollector(lambda: sync.snapshot, lambda: TUNING, now=lambda: NOW_UNIX)
    exposed: dict[str, set[str]] = {}
    for name, samples in scrape(collector).items():
        if name.startswith("gpuwatchd_fleet_"):
            exposed[name] = {label for s in samples for label in s.labels}
    catalogue = {name: set(KNOWN_METRICS[name]) for name, src in SOURCE.items() if src == "fleet"}
    assert exposed == catalogue
    if PROMTOOL is None:
        pytest.skip("promtool not installed")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpuwatchdCollector([collector]))
    result = subprocess.run(
        [PROMTOOL, "check", "metrics"],
        input=generate_latest(registry).decode(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_coverage_counts_distinct_workloads_per_model_and_stack(store: Any) -> None:
    record(store, "a", "gemm", {"x": 1e-3}, regime=Regime.UNTHROTTLED)
    record(store, "a", "gemm", {"x": 1e-3}, regime=Regime.SUSTAINED)
    record(store, "b", "conv", {"x": 1e-3})
    assert coverage(store.winners()) == {(H200, "driver=580.159.04,cuda=12.8,torch=2.11.0"): 2}


def test_the_fleet_sync_reads_group_medians_not_every_hosts_clock(store: Any) -> None:
    fill_fleet(store)
    calls: list[str] = []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(store, name)

    snap = fleet_sync(Spy())()
    assert "clock_medians" in calls and "host_clocks" not in calls
    assert snap.groups[ClockGroup(H200, "700")].peers >= 3
