"""The ``gpu`` sub-collector: per-GPU telemetry, throttle reasons, gate and poll health.

A scrape reads only immutable snapshots (``StateBoard.all()`` is lock-free), so it never
calls NVML and never waits behind a slow GPU read. Every series carries the ``gpu``
index and ``uuid`` labels and, where the kubelet's pod-resources API is read (a
Kubernetes node), the ``namespace``, ``pod`` and ``container`` holding the GPU, empty
for a GPU no single container holds: as dcgm-exporter labels its per-GPU series, so
"power per pod" needs no join. At most one pod per GPU at a time: the series count
does not grow with pods, a new pod starts new series. The per-field series are those
of the telemetry field table (:data:`~gpuwatchd.telemetry.fields.FIELDS`), in its order.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from gpuwatchd.exporter.rows import CounterRows, GaugeRows
from gpuwatchd.gate import GateState
from gpuwatchd.monitor.board import GpuSnapshot, StateBoard
from gpuwatchd.telemetry.fields import BY_ATTR, FIELDS, Field, mhz_to_hz
from gpuwatchd.telemetry.pod_resources import PodSource
from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason

#: Labels naming a GPU: carried by every per-GPU series.
GPU_LABELS: tuple[str, str] = ("gpu", "uuid")
#: The Kubernetes container a GPU (or MIG device) is assigned to, on a node whose kubelet
#: pod-resources API is read; empty values where no single container holds it.
POD_LABELS: tuple[str, str, str] = ("namespace", "pod", "container")
_NO_POD = ("", "", "")


class Labels(dict[int, list[str]]):
    """Each GPU's series' label values by GPU index, and their ``names``."""

    def __init__(self, names: tuple[str, ...], values: dict[int, list[str]]) -> None:
        super().__init__(values)
        self.names = names


#: Every decoded NVML throttle reason, in bit order: each gets its own series.
ALL_REASONS: tuple[ThrottleReason, ...] = tuple(ThrottleReason)
#: (reason, its label value), looked up once: an enum's properties cost per access.
_REASON_LABELS: tuple[tuple[ThrottleReason, str], ...] = tuple((r, r.label) for r in ALL_REASONS)
_GATE_STATES: tuple[tuple[GateState, str], ...] = tuple((m, m.value) for m in GateState)

T = TypeVar("T")


def gpu_labels(snap: GpuSnapshot) -> list[str]:
    """The :data:`GPU_LABELS` values of one GPU (uuid empty until its facts are read)."""
    return [str(snap.index), snap.info.uuid if snap.info is not None else ""]


def live_sample(snap: GpuSnapshot) -> Sample | None:
    """The sample if it is current, else None.

    A lost, stalled or failing GPU exports no readings at all: repeating the last
    good value would show a healthy flat line on a dashboard while the GPU is gone.
    Poll health and ``gpuwatchd_last_poll_timestamp_seconds`` tell that story instead.
    """
    health = snap.health
    if health.lost or health.stalled or not health.success:
        return None
    return snap.sample


@dataclass(frozen=True, slots=True)
class _Gauge(Generic[T]):
    """One per-GPU gauge read from a field of a sample or of the static device facts."""

    name: str
    help: str
    unit: str
    value: Callable[[T], float | None]


def _mhz_to_hz(mhz: float | None) -> float | None:
    return None if mhz is None else mhz_to_hz(mhz)


def _sample_value(f: Field) -> Callable[[Sample], float | None]:
    """The exported number of ``f`` in a sample (None: absent), built once."""
    get = attrgetter(f.attr)
    convert = f.metric.value
    if convert is None:
        return get  # type: ignore[no-any-return]

    def value(sample: Sample) -> float | None:
        v = get(sample)
        return None if v is None else convert(v)

    return value


#: One series per GPU for every field of the table without labels of its own.
_SAMPLE_GAUGES: tuple[tuple[_Gauge[Sample], bool], ...] = tuple(
    (
        _Gauge(f.metric.name, f.metric.help, f.metric.unit, _sample_value(f)),
        f.metric.type == "counter",
    )
    for f in FIELDS
    if not f.metric.labels
)
#: The reasons field's metric: one series per GPU and reason.
_THROTTLE = BY_ATTR["reasons"].metric

_INFO_GAUGES: tuple[_Gauge[DeviceInfo], ...] = (
    _Gauge(
        "gpuwatchd_gpu_slowdown_temperature_celsius",
        "Temperature in degrees Celsius at which the GPU starts thermal slowdown.",
        "celsius",
        lambda i: i.slowdown_temp_c,
    ),
    _Gauge(
        "gpuwatchd_gpu_shutdown_temperature_celsius",
        "Temperature in degrees Celsius at which the GPU shuts down to protect itself.",
        "celsius",
        lambda i: i.shutdown_temp_c,
    ),
    _Gauge(
        "gpuwatchd_gpu_power_limit_watts",
        "Enforced board power limit in watts; power draw at this value means SW power cap.",
        "watts",
        lambda i: i.power_limit_w,
    ),
    _Gauge(
        "gpuwatchd_gpu_max_sm_clock_hertz",
        "Maximum SM (graphics) clock in hertz the GPU can reach.",
        "hertz",
        lambda i: _mhz_to_hz(i.max_sm_clock_mhz),
    ),
    _Gauge(
        "gpuwatchd_gpu_max_memory_clock_hertz",
        "Maximum memory clock in hertz the GPU can reach.",
        "hertz",
        lambda i: _mhz_to_hz(i.max_mem_clock_mhz),
    ),
)


def pod_of(pods: PodSource | None, uuid: str) -> tuple[str, str, str]:
    """The :data:`POD_LABELS` values of a GPU or MIG device (empty where none holds it)."""
    pod = pods.lookup(uuid) if pods is not None and uuid else None
    return _NO_POD if pod is None else (pod.namespace, pod.pod, pod.container)


def _fill(
    spec: _Gauge[T],
    snaps: Sequence[GpuSnapshot],
    source: Callable[[GpuSnapshot], T | None],
    labels: Labels,
    counter: bool = False,
) -> GaugeRows | CounterRows:
    """One family with a series for every GPU whose source has the field (None: absent)."""
    rows = CounterRows if counter else GaugeRows
    family = rows(spec.name, spec.help, labels=labels.names, unit=spec.unit)
    add_per_gpu(family, ((snap, source(snap)) for snap in snaps), spec.value, labels)
    return family


def add_per_gpu(
    family: GaugeMetricFamily | CounterMetricFamily,
    sources: Iterable[tuple[GpuSnapshot, T | None]],
    value: Callable[[T], float | int | None],
    labels: Labels,
) -> None:
    """Add a series to ``family`` for every GPU whose source has the field (None: absent)."""
    for snap, obj in sources:
        v = None if obj is None else value(obj)
        if v is not None:
            family.add_metric(labels[snap.index], float(v))


def exposed_name(family: Metric) -> str:
    """The name a family's series are exposed under (as docs/metrics.md lists them)."""
    return family.name + _SUFFIX.get(family.type, "")


_SUFFIX = {"counter": "_total", "info": "_info"}


def has_series(family: Metric) -> bool:
    """Whether a family has any series (a rows family answers without making samples)."""
    rows = getattr(family, "rows", None)
    return bool(rows) if rows is not None else bool(family.samples)


def _info_of(snap: GpuSnapshot) -> DeviceInfo | None:
    return snap.info


class BoardCollector:
    """A sub-collector that reads the state board (and the pod map) only, and drops
    families without series and those ``fields`` leaves out.

    Like client_golang: a field no GPU supports should not leave a bare HELP/TYPE
    header behind. ``families`` declares every family name it can yield (the names
    ``[exporter] fields`` chooses from; a test checks them both ways). With ``pods``
    every series carries :data:`POD_LABELS` after :data:`GPU_LABELS`.
    """

    name: str
    families: tuple[str, ...]
    #: Reads immutable snapshots only: runs in the scrape's thread (see collectors.base).
    runs_inline = True
    #: Its families are made from the board's snapshots alone (see collectors.base).
    timeless = True

    def __init__(
        self,
        board: StateBoard,
        pods: PodSource | None = None,
        fields: Collection[str] = (),
    ) -> None:
        self._board = board
        self._pods = pods
        self._keep = frozenset(fields) & frozenset(self.families) if fields else None
        #: The labels of a per-GPU series.
        self.labels: tuple[str, ...] = (*GPU_LABELS, *POD_LABELS) if pods else GPU_LABELS

    def version(self) -> object:
        """Changes with every snapshot put on the board, and with the pod map."""
        return self._board.version, None if self._pods is None else self._pods.pods

    def collect(self) -> Iterator[Metric]:
        keep = self._keep
        return (
            family
            for family in self._families()
            if (keep is None or exposed_name(family) in keep) and has_series(family)
        )

    def _label_values(self, snaps: Sequence[GpuSnapshot]) -> Labels:
        """Each GPU's series' label values, by index: its :data:`GPU_LABELS`, then its pod."""
        pods = self._pods
        if pods is None:
            return Labels(self.labels, {snap.index: gpu_labels(snap) for snap in snaps})
        return Labels(
            self.labels,
            {
                s.index: [*gpu_labels(s), *pod_of(pods, s.info.uuid if s.info else "")]
                for s in snaps
            },
        )

    def _families(self) -> Iterator[Metric]:
        raise NotImplementedError


class GpuCollector(BoardCollector):
    """Per-GPU telemetry, gate and poll-health families, read from the state board only."""

    name = "gpu"

    families = (
        "gpuwatchd_gpu_info",
        *(g.name for g in _INFO_GAUGES),
        *(g.name + ("_total" if counter else "") for g, counter in _SAMPLE_GAUGES),
        "gpuwatchd_gpu_energy_joules_total",
        _THROTTLE.name,
        "gpuwatchd_gpu_throttle_seconds_total",
        "gpuwatchd_gate_state",
        "gpuwatchd_gate_open",
        "gpuwatchd_gate_state_duration_seconds",
        "gpuwatchd_poll_success",
        "gpuwatchd_poll_duration_seconds",
        "gpuwatchd_poll_stalled",
        "gpuwatchd_gpu_lost",
        "gpuwatchd_last_poll_timestamp_seconds",
    )

    def _families(self) -> Iterator[Metric]:
        snaps = self._board.all()
        labels = self._label_values(snaps)
        yield self._gpu_info(snaps, labels)
        for info_spec in _INFO_GAUGES:
            yield _fill(info_spec, snaps, _info_of, labels)
        for sample_spec, counter in _SAMPLE_GAUGES:
            yield _fill(sample_spec, snaps, live_sample, labels, counter)
        yield self._energy(snaps, labels)
        yield from self._throttle(snaps, labels)
        yield from self._gate(snaps, labels)
        yield from self._health(snaps, labels)

    @staticmethod
    def _gpu_info(snaps: Sequence[GpuSnapshot], labels: Labels) -> InfoMetricFamily:
        family = InfoMetricFamily(
            "gpuwatchd_gpu",
            "Identity of each GPU; always 1. Join on gpu/uuid to name other series.",
            labels=labels.names,
        )
        for snap in snaps:
            info = snap.info
            if info is None:
                continue
            family.add_metric(
                labels[snap.index],
                {
                    "name": info.name,
                    "driver_version": info.driver_version or "",
                    "pci_bus_id": info.pci_bus_id or "",
                },
            )
        return family

    @staticmethod
    def _energy(snaps: Sequence[GpuSnapshot], labels: Labels) -> CounterRows:
        family = CounterRows(
            "gpuwatchd_gpu_energy_joules",
            "Energy consumed by the GPU in joules since the driver loaded (read at a lower "
            "rate than the other fields); use rate() for average watts.",
            labels=labels.names,
            unit="joules",
        )
        for snap in snaps:
            if snap.energy_j is not None and live_sample(snap) is not None:
                family.add_metric(labels[snap.index], snap.energy_j)
        return family

    @staticmethod
    def _throttle(snaps: Sequence[GpuSnapshot], labels: Labels) -> Iterator[Metric]:
        active = GaugeRows(
            _THROTTLE.name, _THROTTLE.help, labels=(*labels.names, *_THROTTLE.labels)
        )
        seconds = CounterRows(
            "gpuwatchd_gpu_throttle_seconds",
            "Seconds the daemon observed each throttle reason active since it started.",
            labels=(*labels.names, "reason"),
            unit="seconds",
        )
        for snap in snaps:
            values = labels[snap.index]
            sample = live_sample(snap)
            if sample is not None and sample.reasons is not None:
                mask = sample.reasons._value_
                for reason, label in _REASON_LABELS:
                    active.add_metric([*values, label], 1.0 if mask & reason._value_ else 0.0)
            # Accumulated seconds are the daemon's own count, still true while the GPU
            # is lost; they exist once reasons were ever readable on this GPU.
            reasons_known = snap.sample is not None and snap.sample.reasons is not None
            if snap.throttle_seconds or reasons_known:
                spent = snap.throttle_seconds
                for reason, label in _REASON_LABELS:
                    seconds.add_metric([*values, label], spent.get(reason, 0.0))
        yield active
        yield seconds

    @staticmethod
    def _gate(snaps: Sequence[GpuSnapshot], labels: Labels) -> Iterator[Metric]:
        state = GaugeRows(
            "gpuwatchd_gate_state",
            "Tuning gate state of each GPU, one-hot: exactly one state is 1. Only cool_stable "
            "lets gated tuning run.",
            labels=(*labels.names, "state"),
        )
        is_open = GaugeRows(
            "gpuwatchd_gate_open",
            "1 if the GPU is idle, cool and stable enough for gated tuning (cool_stable), else 0.",
            labels=labels.names,
        )
        duration = GaugeRows(
            "gpuwatchd_gate_state_duration_seconds",
            "Seconds the GPU had spent in its current gate state at the last gate decision; "
            "alert on a gate that stays shut for hours.",
            labels=labels.names,
            unit="seconds",
        )
        for snap in snaps:
            gate = snap.gate
            if gate is None:
                continue
            values = labels[snap.index]
            for member, value in _GATE_STATES:
                state.add_metric([*values, value], 1.0 if gate.state is member else 0.0)
            is_open.add_metric(values, float(gate.open))
            duration.add_metric(values, max(0.0, gate.t - gate.since))
        yield state
        yield is_open
        yield duration

    @staticmethod
    def _health(snaps: Sequence[GpuSnapshot], labels: Labels) -> Iterator[Metric]:
        success = GaugeRows(
            "gpuwatchd_poll_success",
            "1 if the latest poll of the GPU succeeded, else 0.",
            labels=labels.names,
        )
        duration = GaugeRows(
            "gpuwatchd_poll_duration_seconds",
            "Wall time in seconds of the last completed telemetry read of the GPU.",
            labels=labels.names,
            unit="seconds",
        )
        stalled = GaugeRows(
            "gpuwatchd_poll_stalled",
            "1 if a telemetry read of the GPU has been in flight for more than two poll "
            "periods (a hung driver call), else 0.",
            labels=labels.names,
        )
        lost = GaugeRows(
            "gpuwatchd_gpu_lost",
            "1 if the GPU stopped answering (fell off the bus), else 0.",
            labels=labels.names,
        )
        last = GaugeRows(
            "gpuwatchd_last_poll_timestamp_seconds",
            "Unix time of the last successful poll of the GPU; time() minus this is staleness.",
            labels=labels.names,
            unit="seconds",
        )
        for snap in snaps:
            values = labels[snap.index]
            health = snap.health
            success.add_metric(values, float(health.success))
            duration.add_metric(values, health.duration_s)
            stalled.add_metric(values, float(health.stalled))
            lost.add_metric(values, float(health.lost))
            if health.last_success_unix is not None:
                last.add_metric(values, health.last_success_unix)
        yield success
        yield duration
        yield stalled
        yield lost
        yield last
