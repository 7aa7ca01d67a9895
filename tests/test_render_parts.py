"""Rendering collector by collector: the same bytes, the unchanged parts reused, no change hidden.

A render after a board change encodes each collector on its own and reuses the text of
the sub-collectors whose version did not change; these tests pin that the joined body is
byte for byte one encoding of the whole registry (text and OpenMetrics), what is reused
and when, that no board change is ever hidden, and that the board-only collectors run
in the scrape's own thread.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import pytest
from builders import DAEMON_INFO, board_of, full_h200, h200, idle, judged
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from slow_fields import full_slow_reading

from gpuwatchd.exporter.collectors.base import GpuwatchdCollector, Versioned
from gpuwatchd.exporter.collectors.build_info import BuildInfoCollector
from gpuwatchd.exporter.collectors.drift import DriftCollector
from gpuwatchd.exporter.collectors.gpu import GpuCollector
from gpuwatchd.exporter.collectors.health import HealthCollector
from gpuwatchd.exporter.registry import ExporterRegistry, build_registry
from gpuwatchd.exporter.render import MetricsRenderer
from gpuwatchd.gate import GateState
from gpuwatchd.monitor.board import StateBoard

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


class _Source:
    """A sub-collector over a value the test changes; counts runs and their threads."""

    def __init__(
        self, name: str, versioned: bool = True, inline: bool = False, timeless: bool = False
    ) -> None:
        self.name = name
        self.value = 1.0
        self.runs = 0
        self.threads: list[str] = []
        self.runs_inline = inline
        self.timeless = timeless
        if versioned:
            self.version = lambda: self.value

    def collect(self) -> Iterator[Metric]:
        self.runs += 1
        self.threads.append(threading.current_thread().name)
        family = GaugeMetricFamily(f"gpuwatchd_test_{self.name}", "A test value.", labels=())
        family.add_metric([], self.value)
        yield family


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _board() -> StateBoard:
    second = judged(1, h200(1, uuid="GPU-bbbb"), idle(5.0), GateState.WARMING, ("settling",))
    return board_of(full_h200(), second)


def _setup(
    *extra: object, max_age_s: float = 60.0
) -> tuple[StateBoard, ExporterRegistry, MetricsRenderer, _Clock]:
    board, clock = _board(), _Clock()
    registry = ExporterRegistry()
    registry.register(BuildInfoCollector(DAEMON_INFO))
    subs = [GpuCollector(board), HealthCollector(board), *extra]
    # A constant timer: the self-metrics' durations come out the same in every encoding.
    registry.register(GpuwatchdCollector(subs, timer=lambda: 0.0))  # type: ignore[list-item]
    return board, registry, MetricsRenderer(registry, board.all, max_age_s, clock=clock), clock


@pytest.mark.parametrize("accept", ["", OPENMETRICS])
def test_the_joined_parts_are_one_encoding_of_the_whole_registry(accept: str) -> None:
    board, registry, renderer, _ = _setup(_Source("tuning"))
    whole = openmetrics_latest if accept else generate_latest
    for _ in range(2):  # rendered afresh, then from the parts kept
        body = renderer.render(accept, "").body
        assert body == whole(registry)
        board.put(dataclasses.replace(full_h200(), energy_j=7.5))
    assert body.count(b"# EOF") == (1 if accept else 0)


def test_a_versioned_part_is_reused_until_its_version_or_max_age_moves_on() -> None:
    tuning, unversioned = _Source("tuning"), _Source("fleet", versioned=False)
    board, _, renderer, clock = _setup(tuning, unversioned, max_age_s=1.0)
    renderer.render("", "")
    for _ in range(3):  # a poll between scrapes: the whole body is rendered again
        board.put(full_h200())
        body = renderer.render("", "").body
        assert b"gpuwatchd_test_tuning 1.0" in body
    assert (tuning.runs, unversioned.runs) == (1, 4)
    tuning.value = 2.0  # its source changed: the next render shows it
    board.put(full_h200())
    assert b"gpuwatchd_test_tuning 2.0" in renderer.render("", "").body
    assert tuning.runs == 2
    clock.t += 1.0  # max age: re-run even though the version says unchanged
    board.put(full_h200())
    renderer.render("", "")
    assert tuning.runs == 3


def test_a_timeless_part_is_kept_past_max_age_until_its_version_moves_on() -> None:
    tuning = _Source("tuning", timeless=True)
    board, _, renderer, clock = _setup(tuning, max_age_s=1.0)
    renderer.render("", "")
    for _ in range(3):  # scrapes a max age apart, a poll between them
        clock.t += 1.0
        board.put(full_h200())
        assert b"gpuwatchd_test_tuning 1.0" in renderer.render("", "").body
    assert tuning.runs == 1
    tuning.value = 2.0  # its source changed: the next render shows it
    board.put(full_h200())
    assert b"gpuwatchd_test_tuning 2.0" in renderer.render("", "").body
    assert tuning.runs == 2


def test_the_daemons_clockless_collectors_are_timeless_and_the_fleets_is_not() -> None:
    from gpuwatchd.exporter.collectors.fleet import FleetCollector
    from gpuwatchd.exporter.collectors.store import StoreCollector
    from gpuwatchd.exporter.collectors.tuning import TuningCollector

    timeless = (GpuCollector, HealthCollector, TuningCollector, DriftCollector, StoreCollector)
    assert all(getattr(c, "timeless", False) for c in timeless)
    assert not getattr(FleetCollector, "timeless", False)  # its sync age moves with the clock


def test_each_format_keeps_its_own_parts() -> None:
    tuning = _Source("tuning")
    board, _, renderer, _ = _setup(tuning)
    renderer.render("", "")
    renderer.render(OPENMETRICS, "")
    assert tuning.runs == 2
    board.put(full_h200())
    renderer.render("", "")
    renderer.render(OPENMETRICS, "")
    renderer.render("", "gzip")  # gzip compresses the text body: the text parts serve it
    assert tuning.runs == 2


def test_a_failed_part_is_not_kept() -> None:
    class _Failing(_Source):
        def collect(self) -> Iterator[Metric]:
            self.runs += 1
            raise RuntimeError("store gone")

    failing = _Failing("tuning")
    board, _, renderer, _ = _setup(failing)
    for _ in range(3):
        board.put(full_h200())
        body = renderer.render("", "").body
        assert b'gpuwatchd_scrape_collector_success{collector="tuning"} 0.0' in body
    assert failing.runs == 3


def test_no_board_change_is_hidden_and_health_waits_for_a_slow_read() -> None:
    board, _, renderer, _ = _setup()
    health = HealthCollector(board)
    before = health.version()
    snap = board.get(1)
    assert snap is not None and snap.sample is not None
    newer = dataclasses.replace(snap, sample=dataclasses.replace(snap.sample, t=6.0, temp_c=47.0))
    board.put(newer)
    assert b'gpuwatchd_gpu_temperature_celsius{gpu="1",uuid="GPU-bbbb"} 47.0' in (
        renderer.render("", "").body
    )
    assert health.version() == before  # same facts, same slow reading: health text kept
    slow = dataclasses.replace(newer.sample, slow=full_slow_reading())  # type: ignore[arg-type]
    board.put(dataclasses.replace(newer, sample=slow))
    assert health.version() != before
    assert b'gpuwatchd_gpu_memory_used_bytes{gpu="1",uuid="GPU-bbbb"}' in (
        renderer.render("", "").body
    )


def test_board_only_collectors_run_in_the_scrapes_thread() -> None:
    inline, threaded = _Source("drift", inline=True), _Source("tuning")
    _, _, renderer, _ = _setup(inline, threaded)
    renderer.render("", "")
    assert inline.threads == [threading.current_thread().name]
    assert threaded.threads == ["gpuwatchd-collector-tuning"]
    assert GpuCollector.runs_inline and HealthCollector.runs_inline
    assert DriftCollector(dict).runs_inline


def test_versioned_wraps_a_collector_with_its_owners_version() -> None:
    source = _Source("fleet", versioned=False)
    marker = [0]
    wrapped = Versioned(source, lambda: marker[0], runs_inline=True)
    assert (wrapped.name, wrapped.runs_inline, wrapped.version()) == ("fleet", True, 0)
    assert [f.name for f in wrapped.collect()] == ["gpuwatchd_test_fleet"]


def test_the_board_version_moves_on_every_put() -> None:
    board = StateBoard()
    seen = {board.version}
    for _ in range(3):
        board.put(full_h200())
        assert board.version not in seen
        seen.add(board.version)


def test_build_registry_lists_its_collectors_in_order() -> None:
    registry = build_registry(_board(), DAEMON_INFO)
    assert [type(c).__name__ for c in registry.parts] == [
        "BuildInfoCollector",
        "GpuwatchdCollector",
    ]
    extra = BuildInfoCollector(DAEMON_INFO)
    registry.register(extra)
    registry.unregister(extra)
    assert len(registry.parts) == 2


@pytest.mark.parametrize("accept", ["", OPENMETRICS])
@pytest.mark.parametrize("bad", [None, ""])
def test_a_value_that_is_no_number_fails_its_collector_not_the_scrape(
    accept: str, bad: object, caplog: pytest.LogCaptureFixture
) -> None:
    class _NoNumber(_Source):
        def collect(self) -> Iterator[Metric]:
            self.runs += 1
            family = GaugeMetricFamily("gpuwatchd_test_tuning", "A value.", labels=("k",))
            family.add_metric(["a"], 1.0)
            family.add_metric(["b"], bad)  # type: ignore[arg-type]
            yield family

    board, _, renderer, _ = _setup(_NoNumber("tuning"))
    for _ in range(2):
        board.put(full_h200())
        body = renderer.render(accept, "").body
        assert b'gpuwatchd_scrape_collector_success{collector="tuning"} 0.0' in body
        assert b"gpuwatchd_test_tuning" not in body  # no 0.0, no empty value: nothing
        assert b'gpuwatchd_scrape_collector_success{collector="gpu"} 1.0' in body
        assert b"gpuwatchd_gpu_temperature_celsius{" in body
    failures = [r for r in caplog.records if "collector 'tuning' failed" in r.getMessage()]
    assert len(failures) == 1  # logged once per failure streak


def test_a_render_of_inline_collectors_needs_no_other_thread() -> None:
    """render_at_once renders in the caller's thread (the HTTP server's event loop) when
    every collector due reads in-memory state, and refuses, running nothing, when one that
    runs in its own thread is due (a later render runs it there)."""
    inline, threaded = _Source("drift", inline=True), _Source("tuning")
    board, _, renderer, clock = _setup(inline, threaded, max_age_s=1.0)
    assert renderer.render_at_once("", "") is None and threaded.runs == 0
    first = renderer.render("", "")  # runs the threaded one in its thread, keeps its text
    board.put(full_h200())
    at_once = renderer.render_at_once("", "")
    assert at_once is not None and at_once is not first
    assert b"gpuwatchd_test_tuning 1.0" in at_once.body and threaded.runs == 1
    assert inline.threads[-1] == threading.current_thread().name
    clock.t += 1.0  # the kept text aged out: the threaded one must run again
    board.put(full_h200())
    assert renderer.render_at_once("", "") is None and threaded.runs == 1


def test_the_daemons_collectors_all_read_in_memory_state_inline() -> None:
    from daemon_registry import daemon_registry

    registry = daemon_registry(gpus=1).registry
    subs = [w.sub for part in registry.parts if isinstance(part, GpuwatchdCollector)
            for w in part._workers]  # fmt: skip
    assert subs and [s.name for s in subs if not getattr(s, "runs_inline", False)] == []


def test_a_plain_collector_is_run_on_the_loop_only_when_it_says_it_reads_memory() -> None:
    _, registry, renderer, _ = _setup()
    plain = _Source("plain", versioned=False)
    registry.register(plain)  # type: ignore[arg-type]
    assert renderer.render_at_once("", "") is None and plain.runs == 0
    plain.runs_inline = True
    rendered = renderer.render_at_once("", "")
    assert rendered is not None and b"gpuwatchd_test_plain 1.0" in rendered.body


def test_a_format_only_the_library_writes_is_never_rendered_on_the_loop() -> None:
    """Any client may ask for it (an Accept header), and the library's encoders are slow."""
    inline = _Source("drift", inline=True)
    _, _, renderer, _ = _setup(inline)
    dots = "application/openmetrics-text; version=1.0.0; escaping=dots"
    assert renderer.render_at_once("", "") is not None  # ours, on the loop
    assert renderer.render_at_once(dots, "") is None  # the library's: off the loop
    kept = renderer.render(dots, "")
    assert renderer.render_at_once(dots, "") is kept  # a kept body needs no render
