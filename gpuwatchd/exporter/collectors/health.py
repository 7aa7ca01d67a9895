"""The ``gpu_health`` sub-collector: what a dcgm-exporter user watches besides clocks.

Memory use, XID errors, ECC and row remapping, PCIe and NVLink traffic, fan speed,
memory per process and fields that failed to read. They come from the slow reading
each sample carries (``Sample.slow``, as old as the energy period), so a scrape still
never calls NVML. Like the ``gpu`` collector, a lost, stalled or failing GPU exports
none of them (only its static memory size), and a field the GPU does not support is
absent, never 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuwatchd.exporter.collectors.gpu import (
    GPU_LABELS,
    POD_LABELS,
    BoardCollector,
    Labels,
    add_per_gpu,
    live_sample,
    pod_of,
)
from gpuwatchd.monitor.board import GpuSnapshot
from gpuwatchd.telemetry.pod_resources import PodSource
from gpuwatchd.telemetry.types import ECC_SCOPES, ECC_TYPES, SlowReading

Readings = Sequence[tuple[GpuSnapshot, SlowReading | None]]


@dataclass(frozen=True, slots=True)
class _Value:
    """One per-GPU series read from a field of the slow reading."""

    name: str
    help: str
    unit: str
    counter: bool
    value: Callable[[SlowReading], float | None]


def _flag(value: bool | None) -> float | None:
    return None if value is None else float(value)


_VALUES: tuple[_Value, ...] = (
    _Value(
        "gpuwatchd_gpu_memory_used_bytes",
        "Device (framebuffer) memory in use in bytes, driver reservations included.",
        "bytes",
        False,
        lambda r: r.memory_used_bytes,
    ),
    _Value(
        "gpuwatchd_gpu_memory_free_bytes",
        "Device (framebuffer) memory free in bytes.",
        "bytes",
        False,
        lambda r: r.memory_free_bytes,
    ),
    _Value(
        "gpuwatchd_gpu_row_remap_pending",
        "1 if an HBM row remap waits for the next GPU reset (schedule one), else 0.",
        "",
        False,
        lambda r: None if r.remapped_rows is None else _flag(r.remapped_rows.pending),
    ),
    _Value(
        "gpuwatchd_gpu_row_remap_failed",
        "1 if an HBM row remap failed (the GPU needs service), else 0.",
        "",
        False,
        lambda r: None if r.remapped_rows is None else _flag(r.remapped_rows.failed),
    ),
    _Value(
        "gpuwatchd_gpu_pcie_tx_bytes",
        "Bytes the GPU sent over PCIe, estimated from NVML's 20 ms throughput sample at "
        "each slow read; rate() gives the samples' average bytes/s.",
        "bytes",
        True,
        lambda r: r.pcie_tx_bytes,
    ),
    _Value(
        "gpuwatchd_gpu_pcie_rx_bytes",
        "Bytes the GPU received over PCIe, estimated from NVML's 20 ms throughput sample at "
        "each slow read; rate() gives the samples' average bytes/s.",
        "bytes",
        True,
        lambda r: r.pcie_rx_bytes,
    ),
    _Value(
        "gpuwatchd_gpu_pcie_replay_errors",
        "PCIe packets replayed after a link error; a steady rise means a bad link or riser.",
        "",
        True,
        lambda r: r.pcie_replay_errors,
    ),
    _Value(
        "gpuwatchd_gpu_nvlink_tx_bytes",
        "Data bytes the GPU sent over all its NVLinks; use rate() for bytes/s.",
        "bytes",
        True,
        lambda r: r.nvlink_tx_bytes,
    ),
    _Value(
        "gpuwatchd_gpu_nvlink_rx_bytes",
        "Data bytes the GPU received over all its NVLinks; use rate() for bytes/s.",
        "bytes",
        True,
        lambda r: r.nvlink_rx_bytes,
    ),
    _Value(
        "gpuwatchd_gpu_xid_events",
        "XID errors of any code the driver reported for the GPU since gpuwatchd started: "
        "0 from the first slow read on every GPU whose XIDs are watched, so an alert on "
        "increase() has a series before the first XID (by code: gpuwatchd_gpu_xid_errors).",
        "",
        True,
        lambda r: None if r.xid_errors is None else sum(r.xid_errors.values()),
    ),
    _Value(
        "gpuwatchd_gpu_fan_speed_ratio",
        "Fan speed as a fraction of its maximum (0-1), on GPUs with their own fan.",
        "ratio",
        False,
        lambda r: r.fan_speed_ratio,
    ),
)


def _slow(snap: GpuSnapshot) -> SlowReading | None:
    sample = live_sample(snap)
    return None if sample is None else sample.slow


class HealthCollector(BoardCollector):
    """GPU health families from the state board's samples; never calls NVML.

    Each process's series always carries the namespace, pod and container holding its
    GPU (empty where none is known), as it did before every series could.
    """

    name = "gpu_health"
    families = (
        "gpuwatchd_gpu_memory_total_bytes",
        *(v.name + ("_total" if v.counter else "") for v in _VALUES),
        "gpuwatchd_gpu_xid_errors_total",
        "gpuwatchd_gpu_ecc_errors_total",
        "gpuwatchd_gpu_remapped_rows",
        "gpuwatchd_gpu_process_memory_bytes",
        "gpuwatchd_gpu_field_errors_total",
    )

    def version(self) -> object:
        """What these families read of each GPU: its facts, and the live sample's slow
        reading and error counts (new objects only at a slow read or a failure), and
        the pod map (a new object only when it changed)."""
        out: list[object] = [None if self._pods is None else self._pods.pods]
        for snap in self._board.all():
            sample = live_sample(snap)
            if sample is None:
                out.append((snap.index, snap.info, None, None))
            else:
                out.append((snap.index, snap.info, sample.slow, sample.field_errors))
        return tuple(out)

    def _families(self) -> Iterator[Metric]:
        snaps = self._board.all()
        readings = [(snap, _slow(snap)) for snap in snaps]
        labels = self._label_values(snaps)
        yield self._memory_total(snaps, labels)
        for spec in _VALUES:
            yield self._fill(spec, readings, labels)
        yield self._xids(readings, labels)
        yield self._ecc(readings, labels)
        yield self._remapped_rows(readings, labels)
        yield self._process_memory(readings, self._pods)
        yield self._field_errors(snaps, labels)

    @staticmethod
    def _fill(spec: _Value, readings: Readings, labels: Labels) -> Metric:
        family_type = CounterMetricFamily if spec.counter else GaugeMetricFamily
        family = family_type(spec.name, spec.help, labels=labels.names, unit=spec.unit)
        add_per_gpu(family, readings, spec.value, labels)
        return family

    @staticmethod
    def _memory_total(snaps: Sequence[GpuSnapshot], labels: Labels) -> GaugeMetricFamily:
        family = GaugeMetricFamily(
            "gpuwatchd_gpu_memory_total_bytes",
            "Device (framebuffer) memory size in bytes.",
            labels=labels.names,
            unit="bytes",
        )
        for snap in snaps:
            reading = _slow(snap)
            total = reading.memory_total_bytes if reading is not None else None
            if total is None and snap.info is not None:
                total = snap.info.memory_total_bytes  # a static fact, like the power limit
            if total is not None:
                family.add_metric(labels[snap.index], float(total))
        return family

    @staticmethod
    def _xids(readings: Readings, labels: Labels) -> Metric:
        family = CounterMetricFamily(
            "gpuwatchd_gpu_xid_errors",
            "XID errors the driver reported for the GPU since gpuwatchd started, per XID "
            "code (48: uncorrectable ECC, 63/64: row remapping, 79: fell off the bus).",
            labels=(*labels.names, "xid"),
        )
        for snap, reading in readings:
            if reading is None or reading.xid_errors is None:
                continue
            values = labels[snap.index]
            for code, count in sorted(reading.xid_errors.items()):
                family.add_metric([*values, str(code)], float(count))
        return family

    @staticmethod
    def _ecc(readings: Readings, labels: Labels) -> Metric:
        family = CounterMetricFamily(
            "gpuwatchd_gpu_ecc_errors",
            "ECC errors in GPU memory: scope volatile counts since the driver loaded, "
            "aggregate over the GPU's life (don't sum the two); type corrected (single-bit) "
            "or uncorrected (double-bit).",
            labels=(*labels.names, "scope", "type"),
        )
        for snap, reading in readings:
            if reading is None or reading.ecc_errors is None:
                continue
            values = labels[snap.index]
            for scope in ECC_SCOPES:
                for kind in ECC_TYPES:
                    count = reading.ecc_errors.get((scope, kind))
                    if count is not None:
                        family.add_metric([*values, scope, kind], float(count))
        return family

    @staticmethod
    def _remapped_rows(readings: Readings, labels: Labels) -> Metric:
        family = GaugeMetricFamily(
            "gpuwatchd_gpu_remapped_rows",
            "HBM rows remapped over the GPU's life, by the kind of error that caused it.",
            labels=(*labels.names, "cause"),
        )
        for snap, reading in readings:
            rows = None if reading is None else reading.remapped_rows
            if rows is None:
                continue
            values = labels[snap.index]
            family.add_metric([*values, "correctable"], float(rows.correctable))
            family.add_metric([*values, "uncorrectable"], float(rows.uncorrectable))
        return family

    @staticmethod
    def _process_memory(readings: Readings, pods: PodSource | None) -> Metric:
        family = GaugeMetricFamily(
            "gpuwatchd_gpu_process_memory_bytes",
            "Device memory held by each of the (at most 8) compute processes using the most, "
            "in bytes; namespace, pod and container: the Kubernetes container holding the "
            "GPU (kubelet pod-resources), empty where unknown.",
            labels=(*GPU_LABELS, "pid", *POD_LABELS),
            unit="bytes",
        )
        for snap, reading in readings:
            if reading is None or reading.processes is None:
                continue
            gpu = [str(snap.index), snap.info.uuid if snap.info is not None else ""]
            where = pod_of(pods, gpu[1])
            for proc in reading.processes:
                family.add_metric([*gpu, str(proc.pid), *where], float(proc.used_bytes))
        return family

    @staticmethod
    def _field_errors(snaps: Sequence[GpuSnapshot], labels: Labels) -> Metric:
        family = CounterMetricFamily(
            "gpuwatchd_gpu_field_errors",
            "NVML reads of one field that failed (Unknown, Timeout, ...) since gpuwatchd "
            "started; only that field's series was missing from those polls.",
            labels=(*labels.names, "field"),
        )
        for snap in snaps:
            sample = live_sample(snap)
            if sample is None:
                continue
            values = labels[snap.index]
            for key, count in sorted(sample.field_errors.items()):
                family.add_metric([*values, key], float(count))
        return family
