"""The ``gpu_mig`` sub-collector: one series per MIG device of each GPU in MIG mode.

Read from the slow reading (``SlowReading.mig``, as old as the energy period), so a
scrape never calls NVML. A MIG device is named by its GPU (``gpu``, ``uuid``), its GPU
and compute instance ids and its profile; ``gpuwatchd_mig_device_info`` adds its own
``MIG-...`` UUID. On a Kubernetes node each series carries the pod holding that MIG
device (the device plugin hands out MIG UUIDs). At most seven MIG devices per GPU. A GPU
out of MIG mode has none of these series; its own series stay as they are.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric

from gpuwatchd.exporter.collectors.gpu import (
    GPU_LABELS,
    POD_LABELS,
    BoardCollector,
    gpu_labels,
    live_sample,
    pod_of,
)
from gpuwatchd.monitor.board import GpuSnapshot
from gpuwatchd.telemetry.types import MigDevice

#: Labels naming one MIG device.
MIG_LABELS: tuple[str, ...] = (*GPU_LABELS, "gpu_instance_id", "compute_instance_id", "profile")


class MigCollector(BoardCollector):
    """MIG devices' identity, memory and utilization, from the state board only."""

    name = "gpu_mig"
    families = (
        "gpuwatchd_mig_device_info",
        "gpuwatchd_mig_memory_used_bytes",
        "gpuwatchd_mig_memory_total_bytes",
        "gpuwatchd_mig_utilization_ratio",
    )

    def _families(self) -> Iterator[Metric]:
        names = (*MIG_LABELS, *POD_LABELS) if self._pods is not None else MIG_LABELS
        info = InfoMetricFamily(
            "gpuwatchd_mig_device",
            "One MIG device of a GPU in MIG mode; always 1. mig_uuid is its own UUID "
            "(what the device plugin hands a pod).",
            labels=names,
        )
        used = GaugeMetricFamily(
            "gpuwatchd_mig_memory_used_bytes",
            "Device memory in use in the MIG device's GPU instance, in bytes.",
            labels=names,
            unit="bytes",
        )
        total = GaugeMetricFamily(
            "gpuwatchd_mig_memory_total_bytes",
            "Device memory of the MIG device's GPU instance, in bytes.",
            labels=names,
            unit="bytes",
        )
        util = GaugeMetricFamily(
            "gpuwatchd_mig_utilization_ratio",
            "Fraction of the last sample period a kernel ran on the MIG device; absent where "
            "NVML does not give it for MIG devices (most drivers).",
            labels=names,
            unit="ratio",
        )
        for snap, device in self._devices(self._board.all()):
            values = [
                *gpu_labels(snap),
                str(device.gpu_instance_id),
                str(device.compute_instance_id),
                device.profile,
            ]
            if self._pods is not None:
                values += pod_of(self._pods, device.uuid)
            info.add_metric(values, {"mig_uuid": device.uuid})
            for family, value in (
                (used, device.memory_used_bytes),
                (total, device.memory_total_bytes),
                (util, device.util_gpu),
            ):
                if value is not None:
                    family.add_metric(values, float(value))
        yield info
        yield used
        yield total
        yield util

    @staticmethod
    def _devices(snaps: Sequence[GpuSnapshot]) -> Iterator[tuple[GpuSnapshot, MigDevice]]:
        for snap in snaps:
            sample = live_sample(snap)
            reading = None if sample is None else sample.slow
            if reading is not None and reading.mig:
                for device in reading.mig:
                    yield snap, device
