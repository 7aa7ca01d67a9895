"""gpuwatchd's text-format encoder writes exactly what prometheus_client writes."""

from __future__ import annotations

import gc
import math
import re
import tracemalloc
from collections.abc import Iterator

import pytest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    StateSetMetricFamily,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from gpuwatchd.exporter import DaemonInfo, build_registry
from gpuwatchd.exporter.text_format import TextEncoder
from gpuwatchd.gate import GateDecision, GateState
from gpuwatchd.monitor.board import GpuSnapshot, PollHealth, StateBoard
from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason

# Collector durations differ between two renders; everything else must be identical.
_DURATION = re.compile(rb"(gpuwatchd_scrape_collector_duration_seconds\{[^}]*\}) \S+")


def _without_durations(body: bytes) -> bytes:
    return _DURATION.sub(rb"\1 D", body)


class _Fixed:
    """A collector that yields the same families every time."""

    def __init__(self, *families: Metric) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def _registry(*families: Metric) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(*families))
    return registry


def _board(gpus: int) -> StateBoard:
    board = StateBoard()
    for i in range(gpus):
        info = DeviceInfo(
            index=i,
            uuid=f"GPU-{i}",
            name='NVIDIA "H200"\\ SXM',
            driver_version="580.159.04",
            max_sm_clock_mhz=1980.0,
            power_limit_w=700.0,
            slowdown_temp_c=87.0,
        )
        sample = Sample(
            gpu=i,
            t=10.0,
            temp_c=61.0 + i,
            power_w=693.25,
            sm_clock_mhz=1440.0,
            mem_clock_mhz=2619.0,
            reasons=ThrottleReason.SW_POWER_CAP,
            util_gpu=1.0,
            util_mem=0.45,
            procs=(1000 + i,),
            pstate=0,
        )
        gate = GateDecision(GateState.THROTTLED, ("capped",), 10.0, 4.0, 10.0)
        health = PollHealth(True, 0.0004, last_success_t=10.0, last_success_unix=1.7e9)
        board.put(
            GpuSnapshot(
                i,
                info,
                sample,
                gate,
                health,
                energy_j=123456.789,
                throttle_seconds={ThrottleReason.SW_POWER_CAP: 6.05},
            )
        )
    return board


def test_the_daemons_registry_renders_identically() -> None:
    registry = build_registry(_board(8), DaemonInfo.current("nvml"))
    encoder = TextEncoder()
    for _ in range(3):  # the memos must not change anything on later scrapes
        ours = encoder.encode(registry)
        assert _without_durations(ours) == _without_durations(generate_latest(registry))
    assert b'gpuwatchd_gpu_throttle_active{gpu="0",reason="sw_power_cap",uuid="GPU-0"} 1.0' in ours


@pytest.mark.parametrize(
    "value", [0.0, -0.0, 1.0, -1.5, 1e-9, 1234567.0, 1e21, math.inf, -math.inf, math.nan, 7, True]
)
def test_values_are_formatted_like_the_library(value: float) -> None:
    family = GaugeMetricFamily("g", "help", labels=("a",))
    family.add_metric(["x"], value)
    family.add_metric(["y"], 0.0)  # a zero after the value: no memo may confuse -0.0 and 0.0
    family.add_metric(["z"], value)
    registry = _registry(family)
    encoder = TextEncoder()
    assert encoder.encode(registry) == generate_latest(registry)
    assert encoder.encode(registry) == generate_latest(registry)


def test_labels_help_types_and_timestamps_match() -> None:
    gauge = GaugeMetricFamily("g", 'help with \\ and\nnewline and "quotes"', labels=("b", "a"))
    gauge.add_metric(['quote " here', "back\\slash\nnewline"], 1.0, timestamp=1700000000.123)
    gauge.add_metric(["", "ünïcode"], 2.0)
    counter = CounterMetricFamily("c", "counter", labels=("k",), created=1600000000.0)
    counter.add_metric(["v"], 3.0, created=1600000000.5)
    info = InfoMetricFamily("i", "info", value={"version": "1.2.3"})
    stateset = StateSetMetricFamily("s", "states", value={"on": True, "off": False})
    plain = Metric("u", "untyped", "unknown")
    plain.add_sample("u", {}, 4.0)
    registry = _registry(gauge, counter, info, stateset, plain)
    assert TextEncoder().encode(registry) == generate_latest(registry)


def test_an_unusual_name_is_left_to_the_library() -> None:
    family = Metric("name.with.dots", "utf-8 metric name", "gauge")
    family.add_sample("name.with.dots", {"label.dot": "v"}, 1.0)
    registry = _registry(family)
    assert TextEncoder().encode(registry) == generate_latest(registry)


@pytest.mark.parametrize(("value", "error"), [(None, TypeError), ("", ValueError)])
def test_a_value_that_is_no_number_raises_as_in_the_library(value: object, error: type) -> None:
    family = Metric("g", "help", "gauge")
    family.add_sample("g", {}, value)  # type: ignore[arg-type]
    registry = _registry(family)
    with pytest.raises(error):
        generate_latest(registry)
    with pytest.raises(error):  # not "g 0.0": that would look like a real reading
        TextEncoder().encode(registry)


def test_readings_that_change_every_scrape_do_not_grow_the_memory_held() -> None:
    """A power reading is new at every poll: its spellings are not kept without bound."""
    encoder = TextEncoder()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for scrape in range(20):
            gauge = GaugeMetricFamily("gpu_power_watts", "power", labels=["gpu"])
            for gpu in range(1000):
                gauge.add_metric([str(gpu)], 100.0 + scrape + gpu / 1000 + 1e-7)
            registry = CollectorRegistry()
            registry.register(_Fixed(gauge))
            assert encoder.encode(registry) == generate_latest(registry)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 1 << 20, held  # 20,000 spellings kept would be over 2 MiB


@pytest.mark.parametrize(("name", "label"), [("g\n", "a"), ("g", "a\n")])
def test_a_name_ending_in_a_newline_is_left_to_the_library(name: str, label: str) -> None:
    """Issue 26, finding 10: ``$`` let ``"name\\n"`` pass a name check meant to be whole."""
    family = Metric(name, "help", "gauge")
    family.add_sample(name, {label: "v"}, 1.0)
    registry = _registry(family)
    assert TextEncoder().encode(registry) == generate_latest(registry)
