"""The telemetry field table drives the NVML read, the sim, traces, the collector and docs.

Each test runs over every field of the table, so a new field is checked by all of them
without a line here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from builders import DAEMON_INFO, board_of, h200, judged
from fakes_nvml import FakeNvml
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.exporter import build_registry
from gpuwatchd.gate import GateState
from gpuwatchd.monitor.board import PollHealth
from gpuwatchd.telemetry.clocks import ManualClock
from gpuwatchd.telemetry.fields import BY_ATTR, FIELDS, SAMPLE_FIELD_ATTRS, FieldValue, Getter
from gpuwatchd.telemetry.nvml import NvmlBackend
from gpuwatchd.telemetry.sim import SimBackend
from gpuwatchd.telemetry.trace import TraceWriter, load_trace
from gpuwatchd.telemetry.types import Sample

ROOT = Path(__file__).resolve().parent.parent


def _nvml_sample() -> Sample:
    """A sample of a fake H200 whose every field reads, slow ones included."""
    backend = NvmlBackend(clock=ManualClock(5.0), nvml=FakeNvml(1), xid_wait_s=0.02)
    try:
        backend.read_energy(0)
        return backend.read(0)
    finally:
        backend.close()


def test_every_sample_field_is_declared_once_in_the_table() -> None:
    assert sorted(BY_ATTR) == sorted(SAMPLE_FIELD_ATTRS)
    assert len(BY_ATTR) == len(FIELDS)
    names = [f.metric.name for f in FIELDS]
    assert len(set(names)) == len(names)
    keys = [f.trace.key for f in FIELDS if f.trace is not None]
    assert len(set(keys)) == len(keys)
    reads = {f.read for f in FIELDS}
    read_keys = [r.key for r in reads]
    assert len(set(read_keys)) == len(read_keys), "two reads share a key"
    # The field values Sample carries sit between t and the bookkeeping attributes, so
    # the NVML backend can build a sample from them positionally.
    order = [f.name for f in dataclasses.fields(Sample)]
    assert order[2 : 2 + len(SAMPLE_FIELD_ATTRS)] == list(SAMPLE_FIELD_ATTRS)


def test_every_declared_nvml_function_is_a_getter() -> None:
    for f in FIELDS:
        if isinstance(f.read, Getter):
            assert all(n.startswith("nvmlDeviceGet") for n in f.read.functions), f.attr
        else:
            assert isinstance(f.read, FieldValue) and f.read.field_id.startswith("NVML_FI_")


def test_the_nvml_backend_reads_every_field() -> None:
    sample = _nvml_sample()
    missing = [f.attr for f in FIELDS if getattr(sample, f.attr) is None]
    assert missing == []


def test_a_slow_field_is_none_until_the_slow_path_ran() -> None:
    backend = NvmlBackend(clock=ManualClock(5.0), nvml=FakeNvml(1), xid_wait_s=0.02)
    try:
        before = backend.read(0)
    finally:
        backend.close()
    for f in FIELDS:
        assert (getattr(before, f.attr) is None) == (f.cadence == "slow"), f.attr


def test_the_sim_reports_exactly_the_fields_declared_sim() -> None:
    backend = SimBackend(gpus=1, scenario="power-cap", clock=ManualClock())
    backend.read_energy(0)
    sample = backend.read(0)
    for f in FIELDS:
        assert (getattr(sample, f.attr) is not None) == f.sim, f.attr


def test_every_traced_field_round_trips_through_a_trace(tmp_path: Path) -> None:
    sample = dataclasses.replace(_nvml_sample(), t=0.0, slow=None)
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, [h200()], 0.1) as writer:
        writer.write(sample)
    (back,) = load_trace(path).samples[0]
    for f in FIELDS:
        if f.trace is None:
            assert getattr(back, f.attr) is None, f.attr
        elif f.attr == "procs":  # a count on disk: the same number of synthetic PIDs
            assert len(back.procs or ()) == len(sample.procs or ())
        else:
            assert getattr(back, f.attr) == getattr(sample, f.attr), f.attr


def test_the_collector_exports_every_field_under_its_declared_name() -> None:
    health = PollHealth(success=True, duration_s=0.001, last_success_unix=1.0)
    snap = judged(0, h200(), _nvml_sample(), GateState.BUSY, health=health)
    text = generate_latest(build_registry(board_of(snap), DAEMON_INFO)).decode()
    exposed = {
        family.name: {label for s in family.samples for label in s.labels}
        for family in text_string_to_metric_families(text)
    }
    for f in FIELDS:
        assert f.metric.name in exposed, f.metric.name
        assert exposed[f.metric.name] == {"gpu", "uuid", *f.metric.labels}, f.metric.name


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.attr)
def test_every_field_has_help_and_a_base_unit(field: Any) -> None:
    assert field.metric.help.endswith(".")
    assert field.metric.unit in ("", "celsius", "watts", "hertz", "ratio", "bytes", "seconds")
    assert field.metric.name.endswith(f"_{field.metric.unit}") or not field.metric.unit


def test_encoder_utilization_is_a_ratio_recorded_as_percent(tmp_path: Path) -> None:
    sample = dataclasses.replace(_nvml_sample(), t=0.0, slow=None)
    assert sample.enc_util == 0.12  # the fake's encoder is 12 % busy
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, [h200()], 0.1) as writer:
        writer.write(sample)
    line = json.loads(path.read_text().splitlines()[1])
    assert line["enc_util"] == 12.0
    assert load_trace(path).samples[0][0].enc_util == 0.12
