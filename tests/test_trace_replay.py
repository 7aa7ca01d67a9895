"""The gpuwatchd-trace/1 reader/writer and the replay backend, on the real H200 recording."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.telemetry.backend import Backend, BackendUnavailable, GpuLost
from gpuwatchd.telemetry.clocks import ManualClock, ScaledClock
from gpuwatchd.telemetry.replay import ReplayBackend
from gpuwatchd.telemetry.trace import (
    SYNTHETIC_PID_BASE,
    TraceError,
    TraceEvent,
    TraceWriter,
    load_trace,
)
from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason

H200_TRACE = Path(__file__).parent / "data" / "h200-matmul-burn.jsonl"

HEADER: dict[str, Any] = {
    "format": "gpuwatchd-trace/1",
    "device": {"index": 0, "name": "Test GPU", "uuid": "GPU-test", "power_limit_w": 300.0},
    "sample_period_s": 1.0,
    "events": [],
    "fields": {"t": "seconds"},
}


def _sample(t: float, **kw: Any) -> dict[str, Any]:
    base = {"t": t, "gpu": 0, "temp_c": 40, "power_w": 100.0, "sm_clock_mhz": 1500, "reasons": 0}
    return {**base, **kw}


def _write(path: Path, header: dict[str, Any] | None, *samples: dict[str, Any]) -> Path:
    lines = [] if header is None else [json.dumps(header)]
    lines += [json.dumps(s) for s in samples]
    path.write_text("".join(line + "\n" for line in lines))
    return path


# ----------------------------------------------------------------------------- reader


def test_reads_the_recorded_h200_trace() -> None:
    tr = load_trace(H200_TRACE)
    info = tr.devices[0]
    assert (info.name, info.driver_version) == ("NVIDIA H200", "580.159.04")
    assert (info.max_sm_clock_mhz, info.power_limit_w) == (1980.0, 700.0)
    assert (info.slowdown_temp_c, info.shutdown_temp_c, info.max_mem_clock_mhz) == (89, 95, 3201)
    assert tr.period_s == 0.05
    assert [e.t for e in tr.events] == [4.796, 64.828, 109.925]
    samples = tr.samples[0]
    assert len(samples) == 2176
    assert all(a.t <= b.t for a, b in itertools.pairwise(samples))
    assert samples[0].reasons == ThrottleReason.GPU_IDLE and samples[0].sm_clock_mhz == 885
    capped = [s for s in samples if s.reasons and ThrottleReason.SW_POWER_CAP in s.reasons]
    assert capped[0].t == 5.0474 and len(capped) == 1204
    assert all(s.util_gpu is None and s.procs is None for s in samples)


def test_optional_keys_map_onto_sample(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "t.jsonl",
        HEADER,
        _sample(0.0, util=37, mem_temp_c=51.5, procs=2, mem_util=12.5, pstate=0, reasons=5),
        _sample(1.0, procs=0, temp_c=None, power_w=None),
    )
    first, second = load_trace(path).samples[0]
    assert first.util_gpu == pytest.approx(0.37) and first.util_mem == pytest.approx(0.125)
    assert first.mem_temp_c == 51.5 and first.pstate == 0
    assert first.reasons == ThrottleReason.GPU_IDLE | ThrottleReason.SW_POWER_CAP
    assert first.procs == (SYNTHETIC_PID_BASE, SYNTHETIC_PID_BASE + 1)
    assert second.procs == () and second.temp_c is None and second.power_w is None


def test_unknown_key_is_accepted_when_fields_declares_it(tmp_path: Path) -> None:
    header = {**HEADER, "fields": {"fan_pct": "fan speed, %", "note": "free text"}}
    path = _write(tmp_path / "t.jsonl", header, _sample(0.0, fan_pct=55, note="hot aisle"))
    (s,) = load_trace(path).samples[0]
    assert s.extra == {"fan_pct": 55.0}


def test_samples_are_grouped_per_gpu(tmp_path: Path) -> None:
    devices = [
        {"index": 0, "name": "A", "uuid": "GPU-a"},
        {"index": 1, "name": "B", "uuid": "GPU-b", "slowdown_temp_c": 87},
    ]
    path = _write(
        tmp_path / "t.jsonl",
        {**HEADER, "device": devices},
        _sample(0.0),
        _sample(0.0, gpu=1),
        _sample(1.0, gpu=1, temp_c=45),
        _sample(1.5),
    )
    tr = load_trace(path)
    assert tr.devices[1].slowdown_temp_c == 87
    assert [s.t for s in tr.samples[0]] == [0.0, 1.5]
    assert [s.temp_c for s in tr.samples[1]] == [40.0, 45.0]


BAD_INPUTS = [
    ("not JSON", [HEADER, "{not json"], 2, "not valid JSON"),
    ("wrong format", [{**HEADER, "format": "gpuwatchd-trace/2"}, _sample(0)], 1, "'format'"),
    ("missing t", [HEADER, {k: v for k, v in _sample(0).items() if k != "t"}], 2, "'t': missing"),
    ("text temperature", [HEADER, _sample(0, temp_c="hot")], 2, "'temp_c': expected a number"),
    ("bool temperature", [HEADER, _sample(0, temp_c=True)], 2, "'temp_c'"),
    ("NaN power", [HEADER, _sample(0), _sample(1, power_w=float("nan"))], 3, "'power_w'"),
    ("time backwards", [HEADER, _sample(2.0), _sample(1.0)], 3, "'t': time goes backwards"),
    ("unknown key", [HEADER, _sample(0, fan_pct=50)], 2, "'fan_pct': unknown key"),
    ("unknown gpu", [HEADER, _sample(0, gpu=3)], 2, "'gpu': GPU 3 is not in the header"),
    ("util over 100", [HEADER, _sample(0, util=140)], 2, "'util': must be <= 100"),
    ("negative reasons", [HEADER, _sample(0, reasons=-4)], 2, "'reasons': must be >= 0"),
    ("float reasons", [HEADER, _sample(0, reasons=4.5)], 2, "'reasons': expected a whole"),
    ("no device", [{k: v for k, v in HEADER.items() if k != "device"}], 1, "'device': missing"),
    ("device uuid", [{**HEADER, "device": {"name": "x"}}, _sample(0)], 1, "'device.uuid'"),
    ("bad period", [{**HEADER, "sample_period_s": 0}, _sample(0)], 1, "'sample_period_s'"),
    ("bad event", [{**HEADER, "events": [{"t": "soon"}]}, _sample(0)], 1, "'events[0].t'"),
    ("header only", [HEADER], 1, "no samples for GPU 0"),
    ("not an object", [HEADER, [1, 2]], 2, "expected a JSON object"),
]


@pytest.mark.parametrize(
    ("lines", "lineno", "needle"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_input_is_one_line_naming_file_line_and_field(
    tmp_path: Path, lines: list[Any], lineno: int, needle: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    with pytest.raises(TraceError) as err:
        load_trace(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:{lineno}: "), msg
    assert needle in msg and "\n" not in msg
    assert err.value.line == lineno
    assert isinstance(err.value, BackendUnavailable)


def test_empty_and_missing_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(TraceError, match=r"empty\.jsonl:1: empty file"):
        load_trace(empty)
    with pytest.raises(TraceError, match=r"nope\.jsonl: cannot read"):
        load_trace(tmp_path / "nope.jsonl")


# ----------------------------------------------------------------------------- writer

DEVS = [
    DeviceInfo(0, "GPU-a", "NVIDIA H200", driver_version="580.159.04", max_sm_clock_mhz=1980.0,
               max_mem_clock_mhz=3201.0, power_limit_w=700.0, slowdown_temp_c=89.0,
               shutdown_temp_c=95.0, pci_bus_id="0000:18:00.0", memory_total_bytes=150 << 30),
    DeviceInfo(1, "GPU-b", "NVIDIA L4"),
]  # fmt: skip


def test_writer_round_trips_through_the_reader(tmp_path: Path) -> None:
    written = [
        Sample(0, 0.0, 40.0, 125.5, 1980.0, reasons=ThrottleReason(0)),
        Sample(1, 0.0, None, None, None, reasons=None),
        Sample(0, 0.05, 61.0, 692.25, 1440.0, mem_clock_mhz=3201.0, util_mem=0.25, pstate=0,
               reasons=ThrottleReason.SW_POWER_CAP | ThrottleReason.HW_SLOWDOWN, util_gpu=0.5,
               procs=(4242, 77), mem_temp_c=55.0, extra={"fan_pct": 30.0}),
        Sample(1, 0.07, 33.0, 16.0, 210.0, reasons=ThrottleReason.GPU_IDLE, procs=()),
    ]  # fmt: skip
    path = tmp_path / "rt.jsonl"
    events: list[TraceEvent | dict[str, object]] = [
        TraceEvent(0.05, "load starts"),
        {"t": 0.0, "what": "idle"},  # the header's own spelling is accepted too
    ]
    with TraceWriter(path, DEVS, 0.05, events, extra_fields={"fan_pct": "fan, %"}) as w:
        for s in written:
            w.write(s)
    tr = load_trace(path)
    assert tr.devices == {0: DEVS[0], 1: DEVS[1]}
    assert tr.period_s == 0.05
    assert tr.events == (TraceEvent(0.0, "idle"), TraceEvent(0.05, "load starts"))
    got = [*tr.samples[0], *tr.samples[1]]
    want = [written[0], written[2], written[1], written[3]]
    for g, w_ in zip(got, want, strict=True):
        # procs come back as a count (synthetic PIDs); util goes through percent.
        assert (g.procs is None) == (w_.procs is None)
        assert g.procs is None or len(g.procs) == len(w_.procs or ())
        assert g.util_gpu == pytest.approx(w_.util_gpu)
        assert g.util_mem == pytest.approx(w_.util_mem)
        same = dataclasses.replace(w_, procs=g.procs, util_gpu=g.util_gpu, util_mem=g.util_mem)
        assert g == same and g.extra == w_.extra


def test_writer_rejects_what_the_reader_would(tmp_path: Path) -> None:
    with TraceWriter(tmp_path / "w.jsonl", DEVS, 0.1) as w:
        w.write(Sample(0, 1.0, 40.0))
        with pytest.raises(ValueError, match=r"sample\.t"):
            w.write(Sample(0, 0.5, 40.0))
        with pytest.raises(ValueError, match=r"sample\.gpu"):
            w.write(Sample(7, 2.0, 40.0))
        with pytest.raises(ValueError, match="fan_pct"):
            w.write(Sample(0, 2.0, 40.0, extra={"fan_pct": 1.0}))
        w.write(Sample(1, 9.0, 40.0), t=0.5)  # the recorder rebases time this way
    tr = load_trace(tmp_path / "w.jsonl")
    assert [s.t for s in tr.samples[1]] == [0.5]
    with pytest.raises(ValueError, match=r"events\[0\]\.what"):
        TraceWriter(tmp_path / "e.jsonl", DEVS, 0.1, [{"t": 1.0}])
    with pytest.raises(ValueError, match="period"):
        TraceWriter(tmp_path / "p.jsonl", DEVS, 0.0)


# ----------------------------------------------------------------------------- replay


class SetClock:
    """A clock tests can set anywhere, backwards included (reads are random access)."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)


def _latest_at(samples: tuple[Sample, ...], t: float) -> Sample:
    times = [s.t for s in samples]
    return samples[bisect.bisect_right(times, t) - 1]


def test_replay_is_a_backend_with_header_facts() -> None:
    b = ReplayBackend(H200_TRACE, clock=ManualClock())
    assert isinstance(b, Backend) and b.name == "replay"
    assert b.devices() == [0]
    assert b.device_info(0).power_limit_w == 700.0
    with pytest.raises(GpuLost):
        b.read(3)
    b.close()
    with pytest.raises(BackendUnavailable, match="closed"):
        b.read(0)


def test_read_returns_latest_sample_rebased_to_the_clock() -> None:
    tr = load_trace(H200_TRACE)
    clock = SetClock(1000.0)
    b = ReplayBackend(H200_TRACE, clock=clock)
    s = b.read(0)
    assert s.t == 1000.0 and s.sm_clock_mhz == 885 and s.reasons == ThrottleReason.GPU_IDLE
    clock.t = 1005.05
    s = b.read(0)
    assert s.reasons == ThrottleReason.SW_POWER_CAP and s.t == pytest.approx(1005.0474)
    rng = random.Random(7)
    for _ in range(300):
        x = rng.uniform(0.0, tr.end)
        clock.t = 1000.0 + x  # jump anywhere: reads are random access
        want = _latest_at(tr.samples[0], x)
        got = b.read(0)
        assert got.t == pytest.approx(1000.0 + want.t)
        assert (got.temp_c, got.power_w, got.sm_clock_mhz, got.reasons) == (
            want.temp_c, want.power_w, want.sm_clock_mhz, want.reasons
        )  # fmt: skip


def test_looping_keeps_time_increasing() -> None:
    tr = load_trace(H200_TRACE)
    clock = SetClock()
    b = ReplayBackend(H200_TRACE, clock=clock)
    assert b.loop_s == pytest.approx(tr.end + tr.period_s)
    clock.t = b.loop_s * 2 + 5.05
    s = b.read(0)
    assert s.reasons == ThrottleReason.SW_POWER_CAP
    assert s.t == pytest.approx(2 * b.loop_s + 5.0474)
    clock.t = 0.0
    ts = []
    for _ in range(3000):  # 3 loops at 0.1 s steps
        clock.sleep(0.1)
        ts.append(b.read(0).t)
    assert all(a <= b_ for a, b_ in itertools.pairwise(ts))
    assert ts[-1] > 2 * b.loop_s and not b.finished


def test_without_loop_the_last_sample_repeats_and_finished_turns_true() -> None:
    tr = load_trace(H200_TRACE)
    clock = ManualClock()
    b = ReplayBackend(H200_TRACE, loop=False, clock=clock)
    clock.advance(tr.end)
    assert not b.finished and b.read(0).t == tr.end
    clock.advance(tr.period_s)
    assert b.finished
    clock.advance(500.0)
    last = b.read(0)
    assert b.finished and last.t == tr.end and last == tr.samples[0][-1]


def test_speed_applies_to_the_default_clock_only() -> None:
    b = ReplayBackend(H200_TRACE, speed=4.0)
    assert isinstance(b.clock, ScaledClock) and b.clock.speed == 4.0
    with pytest.raises(ValueError, match="speed"):
        ReplayBackend(H200_TRACE, speed=4.0, clock=ManualClock())
    with pytest.raises(ValueError, match="speed"):
        ReplayBackend(H200_TRACE, speed=0.0)


def test_bad_trace_makes_the_backend_unavailable(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.jsonl", HEADER, _sample(0, temp_c="hot"))
    with pytest.raises(BackendUnavailable, match=r"bad\.jsonl:2: field 'temp_c'"):
        ReplayBackend(path, clock=ManualClock())


def test_energy_is_the_exact_trapezoid_and_monotonic(tmp_path: Path) -> None:
    # Power 100 W at t=0, 200 W at t=1, period 1 s: a loop is 2 s, wrapping 200 -> 100 W.
    path = _write(
        tmp_path / "e.jsonl", HEADER, _sample(0.0, power_w=100), _sample(1.0, power_w=200)
    )
    clock = SetClock()
    b = ReplayBackend(path, clock=clock)
    expected = {0.0: 0.0, 0.5: 62.5, 1.0: 150.0, 1.5: 237.5, 2.0: 300.0, 2.5: 362.5, 7.0: 1050.0}
    for t, joules in expected.items():
        clock.t = t
        assert b.read_energy(0) == pytest.approx(joules), t
    once_clock = ManualClock()
    once = ReplayBackend(path, loop=False, clock=once_clock)
    once_clock.advance(10.0)
    assert once.read_energy(0) == pytest.approx(150.0)  # the recording is over: holds


def test_energy_on_the_h200_trace_matches_a_direct_integral() -> None:
    samples = load_trace(H200_TRACE).samples[0]
    clock = SetClock()
    b = ReplayBackend(H200_TRACE, clock=clock)
    points = [(s.t, s.power_w or 0.0) for s in samples]
    direct = sum(0.5 * (p0 + p1) * (t1 - t0) for (t0, p0), (t1, p1) in itertools.pairwise(points))
    clock.t = samples[-1].t
    assert b.read_energy(0) == pytest.approx(direct, rel=1e-12)
    # ~60 s at ~690 W plus ~50 s at ~125 W.
    assert 45_000 < direct < 50_000
    last = -1.0
    clock.t = 0.0
    for _ in range(2400):  # two loops at 0.1 s steps: never decreases across the wrap
        clock.sleep(0.1)
        e = b.read_energy(0)
        assert e is not None and e >= last
        last = e
    assert last > 2 * direct


def test_energy_is_none_without_power(tmp_path: Path) -> None:
    path = _write(tmp_path / "n.jsonl", HEADER, _sample(0.0), _sample(1.0, power_w=None))
    assert ReplayBackend(path, clock=ManualClock()).read_energy(0) is None


def test_gpu_starting_late_in_the_trace(tmp_path: Path) -> None:
    devices = [{"index": 0, "name": "A", "uuid": "a"}, {"index": 1, "name": "B", "uuid": "b"}]
    path = _write(
        tmp_path / "late.jsonl",
        {**HEADER, "device": devices},
        _sample(0.0),
        _sample(1.0),
        _sample(2.0, gpu=1, temp_c=70),
        _sample(3.0),
    )
    clock = SetClock()
    b = ReplayBackend(path, clock=clock)  # loop_s = 3 + 1 = 4
    with pytest.raises(GpuLost):
        b.read(1)  # no reading for GPU 1 yet
    assert b.read_energy(1) == 0.0
    clock.t = 4.5  # second loop, before GPU 1's first sample: the previous loop's last
    s = b.read(1)
    assert s.temp_c == 70 and s.t == 2.0
    clock.t = 6.0
    assert b.read(1).t == 6.0
