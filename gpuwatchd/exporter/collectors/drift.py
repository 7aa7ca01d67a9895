"""The ``drift`` sub-collector: signed sustained-clock drift and pending re-tunes per GPU.

Reads only the detector's published view (replaced whole on each evaluate), so a
scrape takes no lock and does no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from gpuwatchd.drift.detector import GpuDriftView, RetuneReason
from gpuwatchd.exporter.collectors.gpu import GPU_LABELS

ALL_RETUNE_REASONS: tuple[RetuneReason, ...] = tuple(RetuneReason)


class DriftCollector:
    """``gpuwatchd_clock_drift_ratio`` and ``gpuwatchd_retune_pending`` for every tracked GPU."""

    name = "drift"
    runs_inline = True  # the published view is replaced whole, never changed
    timeless = True  # made from that view alone

    def __init__(self, view: Callable[[], dict[int, GpuDriftView]]) -> None:
        self._view = view

    def version(self) -> object:
        return self._view()

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        ratio = GaugeMetricFamily(
            "gpuwatchd_clock_drift_ratio",
            "Signed relative difference between the learned sustained-load SM clock and the "
            "clock the GPU's winners were measured at; absent while either is unknown.",
            labels=GPU_LABELS,
            unit="ratio",
        )
        pending = GaugeMetricFamily(
            "gpuwatchd_retune_pending",
            "1 while a re-tune of the GPU is pending for this reason (cleared when new winners "
            "are measured), else 0.",
            labels=(*GPU_LABELS, "reason"),
        )
        for gpu, v in sorted(view.items()):
            labels = [str(gpu), v.uuid]
            if v.ratio is not None:
                ratio.add_metric(labels, v.ratio)
            for reason in ALL_RETUNE_REASONS:
                pending.add_metric([*labels, reason.value], float(reason in v.pending))
        if ratio.samples:
            yield ratio
        if pending.samples:
            yield pending
