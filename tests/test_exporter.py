"""The Prometheus collector, scraped over real HTTP from a hand-built state board."""

from __future__ import annotations

import contextlib
import gzip
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator

import pynvml  # type: ignore[import-untyped]
import pytest
from builders import DAEMON_INFO, NOW_UNIX, board_of, full_h200
from fakes_nvml import FakeGpu, FakeNvml
from metric_catalog import ECC_SCOPES, ECC_TYPES, REMAP_CAUSES
from metric_catalog import THROTTLE_REASONS as REASON_LABELS
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families
from slow_fields import GIB, full_slow_reading

from gpuwatchd.exporter import build_registry
from gpuwatchd.exporter.render import MetricsRenderer
from gpuwatchd.exporter.singleflight import SharedFailure, SingleFlight
from gpuwatchd.gate import GateConfig, GateDecision, GateState
from gpuwatchd.monitor.board import GpuSnapshot, PollHealth, StateBoard
from gpuwatchd.monitor.poller import Poller
from gpuwatchd.serve import HttpServer
from gpuwatchd.telemetry.backend import Backend, GpuLost
from gpuwatchd.telemetry.clocks import ManualClock
from gpuwatchd.telemetry.nvml import NvmlBackend
from gpuwatchd.telemetry.sim import SimBackend
from gpuwatchd.telemetry.types import DeviceInfo, Sample, SlowReading, ThrottleReason

R = ThrottleReason

Labels = tuple[tuple[str, str], ...]
Series = dict[tuple[str, Labels], float]


def _sparse_gpu() -> GpuSnapshot:
    """GPU 1: a board that supports little (power, memory clock, reasons, ... are None)."""
    info = DeviceInfo(index=1, uuid="GPU-11111111-bbbb", name="Tesla Oddity")
    sample = Sample(gpu=1, t=160.0, temp_c=40.0, sm_clock_mhz=885.0)
    return GpuSnapshot(
        index=1,
        info=info,
        sample=sample,
        gate=GateDecision(GateState.COOL_STABLE, (), t=160.0, since=150.0),
        health=PollHealth(success=True, duration_s=0.0005, last_success_unix=NOW_UNIX),
    )


def _lost_gpu() -> GpuSnapshot:
    """GPU 2: fell off the bus; its last sample is stale and must not be exported."""
    info = DeviceInfo(
        index=2,
        uuid="GPU-22222222-cccc",
        name="NVIDIA H200",
        power_limit_w=700.0,
        memory_total_bytes=141 * GIB,
    )
    stale = Sample(
        gpu=2, t=90.0, temp_c=70.0, power_w=650.0, reasons=R.SW_POWER_CAP,
        slow=full_slow_reading(t=88.0), field_errors={"power": 1},
    )  # fmt: skip
    return GpuSnapshot(
        index=2,
        info=info,
        sample=stale,
        gate=GateDecision(GateState.UNAVAILABLE, ("gpu lost",), t=160.0, since=91.0),
        health=PollHealth(
            success=False,
            duration_s=0.002,
            lost=True,
            error="GPU 2 is lost",
            last_success_unix=NOW_UNIX - 70,
        ),
        energy_j=999.0,
        throttle_seconds={R.SW_POWER_CAP: 3.5},
    )


def make_board() -> StateBoard:
    """GPU 0 with every field, GPU 1 with few, GPU 2 lost."""
    return board_of(full_h200(), _sparse_gpu(), _lost_gpu())


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[str, str]:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.headers["Content-Type"], response.read().decode()


@pytest.fixture
def board() -> StateBoard:
    return make_board()


@pytest.fixture
def scraped(server: HttpServer) -> str:
    return http_get(server.url + "/metrics")[1]


def series(text: str) -> Series:
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def gpu_series(all_series: Series, metric: str, gpu: int, /, **labels: str) -> float | None:
    """Value of ``metric`` for one GPU (and extra labels), None if absent."""
    want = {"gpu": str(gpu), **labels}
    for (sample_name, sample_labels), value in all_series.items():
        found = dict(sample_labels)
        if sample_name == metric and all(found.get(k) == v for k, v in want.items()):
            return value
    return None


def names_for_gpu(all_series: Series, gpu: int) -> set[str]:
    return {name for (name, labels) in all_series if dict(labels).get("gpu") == str(gpu)}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_check_metrics_reports_nothing(scraped: str) -> None:
    result = subprocess.run(
        ["promtool", "check", "metrics"],
        input=scraped,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_an_empty_board() -> None:
    board = StateBoard()
    text = generate_latest(build_registry(board, DAEMON_INFO)).decode()
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip()
    assert "gpuwatchd_gpu_" not in text  # no GPUs: no per-GPU families at all


def test_values_are_converted_to_base_units(scraped: str) -> None:
    s = series(scraped)
    expect = {
        "gpuwatchd_gpu_temperature_celsius": 61.0,
        "gpuwatchd_gpu_memory_temperature_celsius": 55.0,
        "gpuwatchd_gpu_slowdown_temperature_celsius": 87.0,
        "gpuwatchd_gpu_shutdown_temperature_celsius": 92.0,
        "gpuwatchd_gpu_power_watts": 693.5,
        "gpuwatchd_gpu_power_limit_watts": 700.0,
        "gpuwatchd_gpu_energy_joules_total": 123456.5,
        "gpuwatchd_gpu_sm_clock_hertz": 1.44e9,
        "gpuwatchd_gpu_max_sm_clock_hertz": 1.98e9,
        "gpuwatchd_gpu_memory_clock_hertz": 2.619e9,
        "gpuwatchd_gpu_max_memory_clock_hertz": 3.201e9,
        "gpuwatchd_gpu_utilization_ratio": 1.0,
        "gpuwatchd_gpu_memory_utilization_ratio": 0.45,
        "gpuwatchd_gpu_compute_processes": 2.0,
        "gpuwatchd_gpu_performance_state": 0.0,
        "gpuwatchd_poll_success": 1.0,
        "gpuwatchd_poll_duration_seconds": 0.0011,
        "gpuwatchd_poll_stalled": 0.0,
        "gpuwatchd_gpu_lost": 0.0,
        "gpuwatchd_last_poll_timestamp_seconds": NOW_UNIX,
        "gpuwatchd_gate_open": 0.0,
        "gpuwatchd_gate_state_duration_seconds": 60.0,
    }
    got = {name: gpu_series(s, name, 0) for name in expect}
    assert got == expect


def test_every_series_carries_gpu_and_uuid(scraped: str) -> None:
    s = series(scraped)
    assert gpu_series(s, "gpuwatchd_gpu_temperature_celsius", 0, uuid="GPU-00000000-aaaa") == 61
    per_gpu = [dict(labels) for (name, labels) in s if name.startswith("gpuwatchd_g")]
    assert per_gpu and all({"gpu", "uuid"} <= labels.keys() for labels in per_gpu)


def test_identity_and_build_info(scraped: str) -> None:
    s = series(scraped)
    build = (
        "gpuwatchd_build_info",
        (("backend", "sim"), ("python_version", "3.11.7"), ("version", "9.9.9")),
    )
    assert s[build] == 1.0
    info0 = (
        "gpuwatchd_gpu_info",
        (
            ("driver_version", "580.159.04"),
            ("gpu", "0"),
            ("name", "NVIDIA H200"),
            ("pci_bus_id", "00000000:19:00.0"),
            ("uuid", "GPU-00000000-aaaa"),
        ),
    )
    assert s[info0] == 1.0
    assert gpu_series(s, "gpuwatchd_gpu_info", 1, name="Tesla Oddity", pci_bus_id="") == 1.0


def test_every_throttle_reason_has_a_series(scraped: str) -> None:
    s = series(scraped)
    active = {r: gpu_series(s, "gpuwatchd_gpu_throttle_active", 0, reason=r) for r in REASON_LABELS}
    assert active == {r: float(r == "sw_power_cap") for r in REASON_LABELS}
    seconds = {
        r: gpu_series(s, "gpuwatchd_gpu_throttle_seconds_total", 0, reason=r) for r in REASON_LABELS
    }
    assert seconds == {
        r: {"sw_power_cap": 60.0, "gpu_idle": 5.25}.get(r, 0.0) for r in REASON_LABELS
    }


def test_several_active_reasons_each_show_one() -> None:
    board = StateBoard()
    snap = full_h200()
    reasons = R.HW_SLOWDOWN | R.SW_THERMAL_SLOWDOWN | R.DISPLAY_CLOCK_SETTING
    board.put(GpuSnapshot(0, snap.info, Sample(0, 1.0, reasons=reasons), None, snap.health))
    s = series(generate_latest(build_registry(board, DAEMON_INFO)).decode())
    on = {r for r in REASON_LABELS if gpu_series(s, "gpuwatchd_gpu_throttle_active", 0, reason=r)}
    assert on == {"hw_slowdown", "sw_thermal_slowdown", "display_clock_setting"}


def test_gate_state_is_one_hot(scraped: str) -> None:
    s = series(scraped)
    states = [g.value for g in GateState]
    for gpu, expected in ((0, "throttled"), (1, "cool_stable"), (2, "unavailable")):
        values = {st: gpu_series(s, "gpuwatchd_gate_state", gpu, state=st) for st in states}
        assert values == {st: float(st == expected) for st in states}
        assert gpu_series(s, "gpuwatchd_gate_open", gpu) == float(expected == "cool_stable")


def test_unsupported_fields_are_absent_not_zero(scraped: str) -> None:
    s = series(scraped)
    present = names_for_gpu(s, 1)
    for absent in (
        "gpuwatchd_gpu_power_watts",
        "gpuwatchd_gpu_power_limit_watts",
        "gpuwatchd_gpu_memory_clock_hertz",
        "gpuwatchd_gpu_max_sm_clock_hertz",
        "gpuwatchd_gpu_slowdown_temperature_celsius",
        "gpuwatchd_gpu_shutdown_temperature_celsius",
        "gpuwatchd_gpu_utilization_ratio",
        "gpuwatchd_gpu_compute_processes",
        "gpuwatchd_gpu_energy_joules_total",
        "gpuwatchd_gpu_throttle_active",
        "gpuwatchd_gpu_throttle_seconds_total",
    ):
        assert absent not in present, absent
    assert gpu_series(s, "gpuwatchd_gpu_temperature_celsius", 1) == 40.0
    assert gpu_series(s, "gpuwatchd_gpu_sm_clock_hertz", 1) == 8.85e8


def test_lost_gpu_exports_health_but_no_stale_readings(scraped: str) -> None:
    s = series(scraped)
    assert gpu_series(s, "gpuwatchd_gpu_lost", 2) == 1.0
    assert gpu_series(s, "gpuwatchd_poll_success", 2) == 0.0
    assert gpu_series(s, "gpuwatchd_last_poll_timestamp_seconds", 2) == NOW_UNIX - 70
    assert gpu_series(s, "gpuwatchd_gpu_info", 2) == 1.0
    assert gpu_series(s, "gpuwatchd_gpu_power_limit_watts", 2) == 700.0  # static fact
    present = names_for_gpu(s, 2)
    for stale in (
        "gpuwatchd_gpu_temperature_celsius",
        "gpuwatchd_gpu_power_watts",
        "gpuwatchd_gpu_energy_joules_total",
        "gpuwatchd_gpu_throttle_active",
    ):
        assert stale not in present, stale
    # The daemon's own accumulated throttle time stays true while the GPU is gone.
    assert gpu_series(s, "gpuwatchd_gpu_throttle_seconds_total", 2, reason="sw_power_cap") == 3.5


def test_stalled_gpu_exports_no_readings() -> None:
    snap = full_h200()
    board = StateBoard()
    board.put(
        GpuSnapshot(
            0,
            snap.info,
            snap.sample,
            snap.gate,
            PollHealth(success=True, duration_s=0.001, stalled=True, last_success_unix=NOW_UNIX),
        )
    )
    s = series(generate_latest(build_registry(board, DAEMON_INFO)).decode())
    assert gpu_series(s, "gpuwatchd_poll_stalled", 0) == 1.0
    assert gpu_series(s, "gpuwatchd_gpu_temperature_celsius", 0) is None


def test_gpu_without_device_info_has_empty_uuid_and_no_info_series() -> None:
    board = StateBoard()
    board.put(GpuSnapshot(3, None, Sample(3, 1.0, temp_c=33.0), None, PollHealth(True, 0.001)))
    s = series(generate_latest(build_registry(board, DAEMON_INFO)).decode())
    assert gpu_series(s, "gpuwatchd_gpu_temperature_celsius", 3, uuid="") == 33.0
    assert gpu_series(s, "gpuwatchd_gpu_info", 3) is None
    assert "gpuwatchd_gate_state" not in names_for_gpu(s, 3)
    assert gpu_series(s, "gpuwatchd_last_poll_timestamp_seconds", 3) is None


def test_collector_self_metrics(scraped: str) -> None:
    s = series(scraped)
    assert s[("gpuwatchd_scrape_collector_success", (("collector", "gpu"),))] == 1.0
    duration = s[("gpuwatchd_scrape_collector_duration_seconds", (("collector", "gpu"),))]
    assert 0.0 < duration < 1.0


class _Tuning:
    name = "tuning"

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("gpuwatchd_tuning_sessions", "Test sessions.", labels=())
        family.add_metric([], 7.0)
        yield family


class _Broken:
    """Yields one family, then fails: nothing of it may reach the scrape."""

    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def collect(self) -> Iterator[Metric]:
        self.calls += 1
        family = GaugeMetricFamily("gpuwatchd_broken_partial", "Half-built.", labels=())
        family.add_metric([], 1.0)
        yield family
        raise RuntimeError("store is corrupt")


def test_failing_subcollector_never_breaks_the_scrape(
    board: StateBoard, caplog: pytest.LogCaptureFixture
) -> None:
    broken = _Broken()
    registry = build_registry(board, DAEMON_INFO, extra=[broken, _Tuning()])
    with caplog.at_level("ERROR"):
        first = series(generate_latest(registry).decode())
        second = series(generate_latest(registry).decode())
    for s in (first, second):
        assert s[("gpuwatchd_scrape_collector_success", (("collector", "broken"),))] == 0.0
        assert s[("gpuwatchd_scrape_collector_success", (("collector", "gpu"),))] == 1.0
        assert s[("gpuwatchd_scrape_collector_success", (("collector", "tuning"),))] == 1.0
        assert s[("gpuwatchd_tuning_sessions", ())] == 7.0
        assert ("gpuwatchd_broken_partial", ()) not in s
        assert gpu_series(s, "gpuwatchd_gpu_temperature_celsius", 0) == 61.0
    assert broken.calls == 2
    failures = [r for r in caplog.records if "broken" in r.getMessage()]
    assert len(failures) == 1  # logged once per failure streak, not every scrape


def test_duplicate_collector_names_are_refused(board: StateBoard) -> None:
    with pytest.raises(ValueError, match=r"subcollectors: duplicate collector name\(s\) \['gpu'\]"):
        build_registry(board, DAEMON_INFO, extra=[type("G", (_Tuning,), {"name": "gpu"})()])


def test_registry_is_private(board: StateBoard) -> None:
    from prometheus_client import REGISTRY

    before = generate_latest(REGISTRY)
    build_registry(board, DAEMON_INFO)
    assert b"gpuwatchd_" not in before + generate_latest(REGISTRY)


def test_openmetrics_when_accept_asks(server: HttpServer) -> None:
    content_type, text = http_get(
        server.url + "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert content_type.startswith("application/openmetrics-text")
    assert text.endswith("# EOF\n")
    families = {f.name: f for f in parse_openmetrics(text)}
    assert families["gpuwatchd_gpu_energy_joules"].type == "counter"
    assert families["gpuwatchd_gpu_energy_joules"].unit == "joules"
    assert families["gpuwatchd_build"].type == "info"
    temps = families["gpuwatchd_gpu_temperature_celsius"].samples
    assert {(s.labels["gpu"], s.value) for s in temps} == {("0", 61.0), ("1", 40.0)}


def test_plain_text_by_default(server: HttpServer) -> None:
    content_type, _ = http_get(server.url + "/metrics")
    assert content_type.startswith("text/plain; version=0.0.4")


def test_scrape_does_not_wait_for_a_writer_holding_the_board(
    board: StateBoard, server: HttpServer
) -> None:
    """A poller stuck mid-write (lock held) must not block scrapes."""
    result: list[str] = []
    with board._write_lock:  # what a writer holds while it swaps a snapshot in
        reader = threading.Thread(
            target=lambda: result.append(http_get(server.url + "/metrics")[1])
        )
        reader.start()
        reader.join(timeout=5)
        assert not reader.is_alive(), "scrape blocked on the board's write lock"
    assert gpu_series(series(result[0]), "gpuwatchd_gpu_temperature_celsius", 0) == 61.0


def test_scrape_sees_board_updates_at_once(board: StateBoard, server: HttpServer) -> None:
    """Reused renders never hide a board change, whatever metrics_max_age_s is."""
    before = series(http_get(server.url + "/metrics")[1])
    assert gpu_series(before, "gpuwatchd_gpu_temperature_celsius", 1) == 40.0
    snap = _sparse_gpu()
    board.put(GpuSnapshot(1, snap.info, Sample(1, 200.0, temp_c=45.5), snap.gate, snap.health))
    after = series(http_get(server.url + "/metrics")[1])
    assert gpu_series(after, "gpuwatchd_gpu_temperature_celsius", 1) == 45.5


class _Counting:
    """A sub-collector that counts renders."""

    name = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def collect(self) -> Iterator[Metric]:
        self.calls += 1
        family = GaugeMetricFamily("gpuwatchd_test_renders", "Renders so far.", labels=())
        family.add_metric([], float(self.calls))
        yield family


class _FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _renderer(board: StateBoard, max_age_s: float) -> tuple[MetricsRenderer, _Counting, _FakeClock]:
    counting, clock = _Counting(), _FakeClock()
    registry = build_registry(board, DAEMON_INFO, extra=[counting])
    return MetricsRenderer(registry, board.all, max_age_s, clock=clock), counting, clock


def test_render_is_reused_while_board_unchanged_and_young(board: StateBoard) -> None:
    renderer, counting, clock = _renderer(board, max_age_s=1.0)
    first = renderer.render("", "")
    clock.t += 0.5
    assert renderer.render("", "") is first and counting.calls == 1
    clock.t += 0.5  # max_age reached: data from other collectors may have moved on
    assert renderer.render("", "") is not first and counting.calls == 2


def test_render_is_redone_when_any_snapshot_changes(board: StateBoard) -> None:
    renderer, counting, _ = _renderer(board, max_age_s=60.0)
    renderer.render("", "")
    board.put(full_h200())  # equal content, new object: the poller wrote again
    second = renderer.render("", "")
    assert counting.calls == 2 and b"gpuwatchd_test_renders 2.0" in second.body


def test_render_reuse_can_be_disabled(board: StateBoard) -> None:
    renderer, counting, _ = _renderer(board, max_age_s=0.0)
    for _ in range(3):
        renderer.render("", "")
    assert counting.calls == 3


def test_each_encoding_is_rendered_and_reused_separately(board: StateBoard) -> None:
    renderer, counting, _ = _renderer(board, max_age_s=60.0)
    openmetrics = "application/openmetrics-text; version=1.0.0"
    text = renderer.render("", "")
    om = renderer.render(openmetrics, "")
    zipped = renderer.render("", "gzip")
    assert counting.calls == 3
    assert (text.gzipped, om.gzipped, zipped.gzipped) == (False, False, True)
    assert om.content_type.startswith("application/openmetrics-text")
    assert om.body.endswith(b"# EOF\n") and not text.body.endswith(b"# EOF\n")
    assert gzip.decompress(zipped.body).startswith(b"# HELP gpuwatchd_build_info")
    assert renderer.render(openmetrics, "") is om and counting.calls == 3


def test_negative_max_age_is_refused(board: StateBoard) -> None:
    with pytest.raises(ValueError, match="max_age_s must be >= 0, got -1"):
        MetricsRenderer(build_registry(board, DAEMON_INFO), board.all, -1)


def test_singleflight_shares_one_call_between_concurrent_callers() -> None:
    flight: SingleFlight[str] = SingleFlight()
    release, started = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow() -> str:
        calls.append(1)
        started.set()
        assert release.wait(5)
        return "body"

    results: list[str] = []
    leader = threading.Thread(target=lambda: results.append(flight.run("k", slow)))
    leader.start()
    assert started.wait(5)
    followers = [
        threading.Thread(target=lambda: results.append(flight.run("k", slow))) for _ in range(3)
    ]
    for t in followers:
        t.start()
    time.sleep(0.1)
    assert results == []  # everyone waits on the one call in flight
    release.set()
    for t in (leader, *followers):
        t.join(5)
    assert results == ["body"] * 4 and len(calls) == 1
    assert flight.run("k", lambda: "again") == "again"  # nothing is cached afterwards


def test_singleflight_failure_reaches_every_waiter() -> None:
    flight: SingleFlight[str] = SingleFlight()
    release, started = threading.Event(), threading.Event()

    def failing() -> str:
        started.set()
        assert release.wait(5)
        raise OSError("disk gone")

    errors: list[BaseException] = []

    def call() -> None:
        try:
            flight.run("k", failing)
        except BaseException as exc:
            errors.append(exc)

    leader = threading.Thread(target=call)
    leader.start()
    assert started.wait(5)
    follower = threading.Thread(target=call)
    follower.start()
    time.sleep(0.1)
    release.set()
    leader.join(5)
    follower.join(5)
    kinds = sorted(type(e).__name__ for e in errors)
    assert kinds == ["OSError", "SharedFailure"]
    shared = next(e for e in errors if isinstance(e, SharedFailure))
    assert isinstance(shared.__cause__, OSError)


# -- GPU health (the slow fields) -------------------------------------------------------------


def test_health_values_are_in_base_units(scraped: str) -> None:
    s = series(scraped)
    expect = {
        "gpuwatchd_gpu_memory_used_bytes": 40.0 * GIB,
        "gpuwatchd_gpu_memory_free_bytes": 100.0 * GIB,
        "gpuwatchd_gpu_memory_total_bytes": 140.0 * GIB,
        "gpuwatchd_gpu_row_remap_pending": 1.0,
        "gpuwatchd_gpu_row_remap_failed": 0.0,
        "gpuwatchd_gpu_pcie_tx_bytes_total": 5.0e9,
        "gpuwatchd_gpu_pcie_rx_bytes_total": 7.5e9,
        "gpuwatchd_gpu_pcie_replay_errors_total": 4.0,
        "gpuwatchd_gpu_nvlink_tx_bytes_total": 3.0e12,
        "gpuwatchd_gpu_nvlink_rx_bytes_total": 2.5e12,
        "gpuwatchd_gpu_fan_speed_ratio": 0.55,
    }
    assert {name: gpu_series(s, name, 0) for name in expect} == expect


def test_labelled_health_series(scraped: str) -> None:
    s = series(scraped)
    ecc = {
        (scope, kind): gpu_series(s, "gpuwatchd_gpu_ecc_errors_total", 0, scope=scope, type=kind)
        for scope in ECC_SCOPES
        for kind in ECC_TYPES
    }
    assert ecc == {
        ("volatile", "corrected"): 3.0,
        ("volatile", "uncorrected"): 1.0,
        ("aggregate", "corrected"): 17.0,
        ("aggregate", "uncorrected"): 1.0,
    }
    rows = {c: gpu_series(s, "gpuwatchd_gpu_remapped_rows", 0, cause=c) for c in REMAP_CAUSES}
    assert rows == {"correctable": 2.0, "uncorrectable": 1.0}
    xids = {
        dict(labels)["xid"]: value
        for (name, labels), value in s.items()
        if name == "gpuwatchd_gpu_xid_errors_total" and dict(labels)["gpu"] == "0"
    }
    assert xids == {"48": 1.0, "63": 1.0}
    procs = {
        dict(labels)["pid"]: value
        for (name, labels), value in s.items()
        if name == "gpuwatchd_gpu_process_memory_bytes"
    }
    assert procs == {"4242": 30.0 * GIB, "4243": 9.0 * GIB}
    assert gpu_series(s, "gpuwatchd_gpu_field_errors_total", 0, field="util") == 2.0


def test_health_of_a_gpu_without_slow_fields_is_absent(scraped: str) -> None:
    s = series(scraped)
    present = names_for_gpu(s, 1)
    health = {
        "gpuwatchd_gpu_memory_used_bytes",
        "gpuwatchd_gpu_memory_total_bytes",  # GPU 1 knows no memory size either
        "gpuwatchd_gpu_xid_errors_total",
        "gpuwatchd_gpu_ecc_errors_total",
        "gpuwatchd_gpu_pcie_tx_bytes_total",
        "gpuwatchd_gpu_fan_speed_ratio",
        "gpuwatchd_gpu_process_memory_bytes",
        "gpuwatchd_gpu_field_errors_total",
    }
    assert present & health == set()


def test_a_lost_gpu_exports_no_stale_health_but_its_memory_size(scraped: str) -> None:
    s = series(scraped)
    present = names_for_gpu(s, 2)
    for stale in (
        "gpuwatchd_gpu_memory_used_bytes",
        "gpuwatchd_gpu_xid_errors_total",
        "gpuwatchd_gpu_ecc_errors_total",
        "gpuwatchd_gpu_remapped_rows",
        "gpuwatchd_gpu_process_memory_bytes",
        "gpuwatchd_gpu_field_errors_total",
    ):
        assert stale not in present, stale
    assert gpu_series(s, "gpuwatchd_gpu_memory_total_bytes", 2) == 141.0 * GIB  # static fact


def test_unsupported_health_fields_are_absent_one_by_one() -> None:
    snap = full_h200()
    assert snap.sample is not None
    partial = SlowReading(t=1.0, memory_used_bytes=GIB, xid_errors={})  # nothing else known
    sample = Sample(0, 1.0, temp_c=40.0, slow=partial)
    board = board_of(GpuSnapshot(0, snap.info, sample, snap.gate, snap.health))
    s = series(generate_latest(build_registry(board, DAEMON_INFO)).decode())
    assert gpu_series(s, "gpuwatchd_gpu_memory_used_bytes", 0) == GIB
    for absent in (
        "gpuwatchd_gpu_memory_free_bytes",
        "gpuwatchd_gpu_ecc_errors_total",
        "gpuwatchd_gpu_remapped_rows",
        "gpuwatchd_gpu_row_remap_pending",
        "gpuwatchd_gpu_pcie_tx_bytes_total",
        "gpuwatchd_gpu_nvlink_rx_bytes_total",
        "gpuwatchd_gpu_fan_speed_ratio",
        "gpuwatchd_gpu_xid_errors_total",  # watched, none seen: no code invented
        "gpuwatchd_gpu_process_memory_bytes",
    ):
        assert absent not in names_for_gpu(s, 0), absent
    assert gpu_series(s, "gpuwatchd_gpu_xid_events_total", 0) == 0.0  # watched, none seen


def test_a_gpu_whose_xids_are_not_watched_has_no_xid_total() -> None:
    snap = full_h200()
    unwatched = SlowReading(t=1.0, memory_used_bytes=GIB, xid_errors=None)
    sample = Sample(0, 1.0, temp_c=40.0, slow=unwatched)
    board = board_of(GpuSnapshot(0, snap.info, sample, snap.gate, snap.health))
    s = series(generate_latest(build_registry(board, DAEMON_INFO)).decode())
    assert "gpuwatchd_gpu_xid_events_total" not in names_for_gpu(s, 0)


def test_health_collector_has_its_own_self_metrics(scraped: str) -> None:
    s = series(scraped)
    assert s[("gpuwatchd_scrape_collector_success", (("collector", "gpu_health"),))] == 1.0


def _scrape_polled(backend: Backend, gpus: int) -> Series:
    """Poll each GPU, take the slow path once (as the poller's slow pool does), poll again."""
    board = StateBoard()
    poller = Poller(backend, board, GateConfig())
    for gpu in range(gpus):
        poller.poll(gpu)
    for gpu in range(gpus):
        with contextlib.suppress(GpuLost):
            backend.read_energy(gpu)
    for gpu in range(gpus):
        poller.poll(gpu)
    return series(generate_latest(build_registry(board, DAEMON_INFO)).decode())


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_UNKNOWN, pynvml.NVML_ERROR_TIMEOUT])
def test_one_failing_nvml_field_drops_only_its_own_series(code: int) -> None:
    fake = FakeNvml([FakeGpu(), FakeGpu()])
    backend = NvmlBackend(nvml=fake, xid_wait_s=0.02)
    try:
        fake.fail("nvmlDeviceGetUtilizationRates", code)  # on every GPU, every poll
        fake.fail_field(pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER, code, gpu=1)
        s = _scrape_polled(backend, 2)
    finally:
        backend.close()
    for gpu in (0, 1):
        assert gpu_series(s, "gpuwatchd_poll_success", gpu) == 1.0
        assert gpu_series(s, "gpuwatchd_gpu_utilization_ratio", gpu) is None
        assert gpu_series(s, "gpuwatchd_gpu_temperature_celsius", gpu) == 40.0
        assert gpu_series(s, "gpuwatchd_gpu_power_watts", gpu) == 125.0
        assert gpu_series(s, "gpuwatchd_gpu_field_errors_total", gpu, field="util") == 2.0
        assert gpu_series(s, "gpuwatchd_gpu_nvlink_rx_bytes_total", gpu) == 2048000
    assert gpu_series(s, "gpuwatchd_gpu_pcie_replay_errors_total", 0) == 2.0
    assert gpu_series(s, "gpuwatchd_gpu_pcie_replay_errors_total", 1) is None
    assert gpu_series(s, "gpuwatchd_gpu_field_errors_total", 1, field="pcie_replay") == 1.0


def test_a_lost_gpu_drops_all_its_readings_and_only_its_own() -> None:
    fake = FakeNvml(2)
    backend = NvmlBackend(nvml=fake, xid_wait_s=0.02)
    try:
        fake.fail("nvmlDeviceGetUtilizationRates", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=1)
        s = _scrape_polled(backend, 2)
    finally:
        backend.close()
    assert gpu_series(s, "gpuwatchd_gpu_lost", 1) == 1.0
    assert gpu_series(s, "gpuwatchd_gpu_temperature_celsius", 1) is None
    assert gpu_series(s, "gpuwatchd_gpu_memory_used_bytes", 1) is None
    assert gpu_series(s, "gpuwatchd_gpu_temperature_celsius", 0) == 40.0
    assert gpu_series(s, "gpuwatchd_gpu_memory_used_bytes", 0) == 1_048_576_000


def test_the_simulated_gpu_exports_health_and_an_injected_xid() -> None:
    clock = ManualClock()
    backend = SimBackend(gpus=2, scenario="ecc-error", clock=clock)
    clock.advance(25.0)
    backend.inject_xid(1, 79)
    s = _scrape_polled(backend, 2)
    assert gpu_series(s, "gpuwatchd_gpu_xid_errors_total", 0, xid="48") == 1.0
    assert gpu_series(s, "gpuwatchd_gpu_xid_errors_total", 1, xid="79") == 1.0
    assert gpu_series(s, "gpuwatchd_gpu_xid_events_total", 0) == 2.0  # 48 and 63
    assert gpu_series(s, "gpuwatchd_gpu_xid_events_total", 1) == 1.0
    assert gpu_series(s, "gpuwatchd_gpu_row_remap_pending", 0) == 1.0
    assert gpu_series(s, "gpuwatchd_gpu_row_remap_pending", 1) == 0.0
    unc = gpu_series(s, "gpuwatchd_gpu_ecc_errors_total", 0, scope="volatile", type="uncorrected")
    assert unc == 1.0
    assert gpu_series(s, "gpuwatchd_gpu_memory_used_bytes", 0) == 589 * 2**20
    assert gpu_series(s, "gpuwatchd_gpu_nvlink_tx_bytes_total", 0) == 0.0  # idle: nothing moved
    assert gpu_series(s, "gpuwatchd_gpu_fan_speed_ratio", 0) is None  # passively cooled


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_simulated_health_metrics() -> None:
    clock = ManualClock()
    backend = SimBackend(gpus=1, scenario="ecc-error", clock=clock)
    clock.advance(30.0)
    board = StateBoard()
    poller = Poller(backend, board, GateConfig())
    backend.read_energy(0)
    poller.poll(0)
    text = generate_latest(build_registry(board, DAEMON_INFO)).decode()
    assert "gpuwatchd_gpu_xid_errors_total" in text
    out = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "", out.stdout + out.stderr
