"""The telemetry field table: every per-sample GPU field, declared once.

Each :class:`Field` says how the field is read from NVML (a getter or a field id, at the
fast or the slow cadence, and how the raw value becomes the :class:`Sample` value), its
``Sample`` attribute, the metric it is exported as, whether the simulated GPU reports it
and its key in ``gpuwatchd-trace/1`` files. The NVML backend's read loop, the trace
reader and writer, the ``gpu`` collector's per-field gauges and ``docs/fields.md`` are
all driven from :data:`FIELDS` (a dcgm-exporter counters CSV, as Python).

Adding a field: one :class:`Field` here and its typed attribute on :class:`Sample`
(a test holds the two together); see docs/contributing.md.

The slow health fields (memory, ECC, PCIe, NVLink, XIDs: :class:`SlowReading`) are
structured readings with their own collector and are not in this table.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from gpuwatchd.telemetry.types import Sample, ThrottleReason

#: How often a field is read: every poll, or on the energy counter's slower period.
Cadence = Literal["fast", "slow"]

_PSTATE_UNKNOWN = 32  # NVML_PSTATE_UNKNOWN
_MHZ = 1e6


@dataclass(frozen=True, slots=True)
class Getter:
    """An NVML getter called with the device handle (and constant arguments).

    ``key`` names the read in ``Sample.field_errors`` (the ``field`` label of
    ``gpuwatchd_gpu_field_errors_total``) and is the unit of "unsupported on this
    GPU". ``functions`` are pynvml names, newest first: the first the bindings and the
    driver have is used. ``args`` are pynvml constants passed after the handle, each
    with its NVML ABI value for bindings that lack the name. Fields that share one
    ``Getter`` share one call.
    """

    key: str
    functions: tuple[str, ...]
    args: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class FieldValue:
    """An ``nvmlDeviceGetFieldValues`` entry (read on the slow path, in one call with
    the others): its key, pynvml's name for the field id and the id's ABI value."""

    key: str
    field_id: str
    default_id: int


@dataclass(frozen=True, slots=True)
class Metric:
    """How a field is exported: name (without ``_total``), help, unit, type and the labels
    beyond ``gpu``/``uuid``. ``value`` turns the Sample value into the exported number
    (e.g. MHz into Hz); ``None`` exports it as it is."""

    name: str
    help: str
    unit: str = ""
    type: Literal["gauge", "counter"] = "gauge"
    labels: tuple[str, ...] = ()
    value: Callable[[Any], float | None] | None = None


@dataclass(frozen=True, slots=True)
class TraceKey:
    """A field's key in a ``gpuwatchd-trace/1`` sample line.

    ``required`` keys are on every line (``null`` where unsupported); optional ones only
    where known. ``integer`` keys must be whole numbers. ``encode`` turns the Sample value
    into the written one and ``decode`` back (both ``None``: written as it is).
    """

    key: str
    doc: str
    required: bool = False
    integer: bool = False
    minimum: float | None = None
    maximum: float | None = None
    encode: Callable[[Any], Any] | None = None
    decode: Callable[[Any], Any] | None = None


@dataclass(frozen=True, slots=True)
class Field:
    """One telemetry field: how it is read, where it lives, how it is exported.

    ``convert`` turns the raw NVML value (a getter's result, or a field value as a
    float) into the Sample value. ``sim`` says whether the simulated
    GPU reports it; ``trace`` is ``None`` for a field traces do not carry.
    """

    attr: str
    read: Getter | FieldValue
    convert: Callable[[Any], Any]
    metric: Metric
    sim: bool
    trace: TraceKey | None = None

    @property
    def cadence(self) -> Cadence:
        """Getters are read at every poll; field values on the slow path."""
        return "fast" if isinstance(self.read, Getter) else "slow"


def _milli(value: float) -> float:
    return value / 1000.0


def _percent_to_ratio(value: float) -> float:
    return value / 100.0


def _ratio_to_percent(value: float) -> float:
    return value * 100.0


def _percent(key: str, doc: str) -> TraceKey:
    """A ratio field written as a percent (0-100), as NVML reports it."""
    return TraceKey(
        key, doc, minimum=0, maximum=100, encode=_ratio_to_percent, decode=_percent_to_ratio
    )


def _pstate(value: int) -> int | None:
    return None if value == _PSTATE_UNKNOWN else int(value)


def _pids(procs: Any) -> tuple[int, ...]:
    return tuple([p.pid for p in procs])


def _count(items: tuple[int, ...]) -> float:
    return float(len(items))


def mhz_to_hz(mhz: float) -> float:
    """NVML's MHz as the hertz Prometheus exports."""
    return mhz * _MHZ


#: Linux PIDs are below 2**22 (PID_MAX_LIMIT); a trace's synthetic PIDs start there.
SYNTHETIC_PID_BASE = 1 << 22

#: Largest process count a trace may give (each becomes a synthetic PID in memory).
MAX_PROCS = 4096


def synthetic_pids(count: int) -> tuple[int, ...]:
    """``count`` PIDs that no real process can have: a trace records how many compute
    processes there were, since its PIDs mean nothing on replay, and a recorded process
    must never be mistaken for a live one (e.g. the daemon's own worker)."""
    return tuple(range(SYNTHETIC_PID_BASE, SYNTHETIC_PID_BASE + count))


#: Raw NVML mask -> decoded reasons, cached: a GPU shows few distinct masks.
decode_reasons = functools.lru_cache(maxsize=512)(ThrottleReason.decode)

_UTIL = Getter("util", ("nvmlDeviceGetUtilizationRates",))
_CLOCK = "nvmlDeviceGetClockInfo"

#: Every field, in the order the collector exports them and ``read`` calls their getters.
FIELDS: tuple[Field, ...] = (
    Field(
        "temp_c",
        Getter(
            "temp",
            ("nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV"),
            (("NVML_TEMPERATURE_GPU", 0),),
        ),
        float,
        Metric(
            "gpuwatchd_gpu_temperature_celsius",
            "GPU core temperature in degrees Celsius, from the latest poll.",
            "celsius",
        ),
        sim=True,
        trace=TraceKey("temp_c", "GPU die temperature, Celsius", required=True),
    ),
    Field(
        "mem_temp_c",
        FieldValue("mem_temp", "NVML_FI_DEV_MEMORY_TEMP", 82),
        float,
        Metric(
            "gpuwatchd_gpu_memory_temperature_celsius",
            "GPU memory (HBM) temperature in degrees Celsius, from the latest poll.",
            "celsius",
        ),
        sim=False,
        trace=TraceKey("mem_temp_c", "memory temperature, Celsius"),
    ),
    Field(
        "power_w",
        Getter("power", ("nvmlDeviceGetPowerUsage",)),
        _milli,
        Metric(
            "gpuwatchd_gpu_power_watts",
            "GPU board power draw in watts, from the latest poll.",
            "watts",
        ),
        sim=True,
        trace=TraceKey("power_w", "board power, watts", required=True, minimum=0),
    ),
    Field(
        "sm_clock_mhz",
        Getter("sm_clock", (_CLOCK,), (("NVML_CLOCK_SM", 1),)),
        float,
        Metric(
            "gpuwatchd_gpu_sm_clock_hertz",
            "Current SM (graphics) clock in hertz; below the max while throttled.",
            "hertz",
            value=mhz_to_hz,
        ),
        sim=True,
        trace=TraceKey("sm_clock_mhz", "SM clock, MHz", required=True, minimum=0),
    ),
    Field(
        "mem_clock_mhz",
        Getter("mem_clock", (_CLOCK,), (("NVML_CLOCK_MEM", 2),)),
        float,
        Metric(
            "gpuwatchd_gpu_memory_clock_hertz",
            "Current memory clock in hertz.",
            "hertz",
            value=mhz_to_hz,
        ),
        sim=True,
        trace=TraceKey("mem_clock_mhz", "memory clock, MHz", minimum=0),
    ),
    Field(
        "reasons",
        Getter(
            "reasons",
            ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
        ),
        decode_reasons,
        Metric(
            "gpuwatchd_gpu_throttle_active",
            "1 if NVML reports this clocks-event (throttle) reason in the latest poll, else 0. "
            "sw_power_cap means the workload hit the power limit; *_thermal_slowdown means heat.",
            labels=("reason",),
        ),
        sim=True,
        trace=TraceKey(
            "reasons",
            "NVML clocks event (throttle) reasons bitmask: 0x1 idle, 0x4 SW power cap, ...",
            required=True,
            integer=True,
            encode=int,
            decode=ThrottleReason.decode,
        ),
    ),
    Field(
        "util_gpu",
        _UTIL,
        lambda u: u.gpu / 100.0,
        Metric(
            "gpuwatchd_gpu_utilization_ratio",
            "Fraction (0-1) of the last sample period during which a kernel ran on the GPU.",
            "ratio",
        ),
        sim=True,
        trace=_percent("util", "GPU utilization, percent"),
    ),
    Field(
        "util_mem",
        _UTIL,
        lambda u: u.memory / 100.0,
        Metric(
            "gpuwatchd_gpu_memory_utilization_ratio",
            "Fraction (0-1) of the last sample period during which device memory was read or "
            "written.",
            "ratio",
        ),
        sim=True,
        trace=_percent("mem_util", "memory controller utilization, percent"),
    ),
    Field(
        "procs",
        Getter(
            "procs",
            (
                "nvmlDeviceGetComputeRunningProcesses_v3",
                "nvmlDeviceGetComputeRunningProcesses_v2",
                "nvmlDeviceGetComputeRunningProcesses",
            ),
        ),
        _pids,
        Metric(
            "gpuwatchd_gpu_compute_processes",
            "Number of compute processes running on the GPU.",
            value=_count,
        ),
        sim=True,
        trace=TraceKey(
            "procs",
            "number of compute processes",
            integer=True,
            maximum=MAX_PROCS,
            encode=len,
            decode=synthetic_pids,
        ),
    ),
    Field(
        "pstate",
        Getter("pstate", ("nvmlDeviceGetPerformanceState",)),
        _pstate,
        Metric(
            "gpuwatchd_gpu_performance_state",
            "Current performance state (P-state): 0 is maximum performance, 15 minimum.",
        ),
        sim=True,
        trace=TraceKey("pstate", "performance state (0 = fastest)", integer=True),
    ),
    Field(
        "enc_util",
        Getter("enc_util", ("nvmlDeviceGetEncoderUtilization",)),
        lambda u: u[0] / 100.0,  # [percent, sampling period in µs]
        Metric(
            "gpuwatchd_gpu_encoder_utilization_ratio",
            "Fraction (0-1) of the encoder's last sampling period during which the GPU's video "
            "encoder (NVENC) was busy.",
            "ratio",
        ),
        sim=False,
        trace=_percent("enc_util", "video encoder utilization, percent"),
    ),
)

#: The Sample attributes that hold field values, in Sample's order (gpu, t and the
#: bookkeeping attributes are not fields).
SAMPLE_FIELD_ATTRS: tuple[str, ...] = tuple(
    f.name
    for f in dataclasses.fields(Sample)
    if f.name not in ("gpu", "t", "extra", "slow", "field_errors")
)

#: Field by its Sample attribute.
BY_ATTR: dict[str, Field] = {f.attr: f for f in FIELDS}


def getters() -> tuple[tuple[Getter, tuple[Field, ...]], ...]:
    """Each fast getter once, in table order, with the fields it fills."""
    out: dict[Getter, list[Field]] = {}
    for f in FIELDS:
        if isinstance(f.read, Getter):
            out.setdefault(f.read, []).append(f)
    return tuple((getter, tuple(fields)) for getter, fields in out.items())


def getter_of(attr: str) -> Getter:
    """The NVML getter of the fast field ``attr``."""
    read = BY_ATTR[attr].read
    if not isinstance(read, Getter):
        raise TypeError(f"{attr} is not read by a getter")
    return read


def field_values() -> tuple[tuple[FieldValue, Field], ...]:
    """Each slow field value with its field, in table order."""
    return tuple((f.read, f) for f in FIELDS if isinstance(f.read, FieldValue))


def sample_slot(attr: str) -> int:
    """The position of ``attr`` among :data:`SAMPLE_FIELD_ATTRS` (Sample's order)."""
    return SAMPLE_FIELD_ATTRS.index(attr)
