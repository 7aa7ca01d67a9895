"""The exporter's private registry: build info, then every sub-collector under the aggregator."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.registry import Collector, CollectorRegistry

from gpuwatchd.exporter.collectors.base import GpuwatchdCollector, SubCollector
from gpuwatchd.exporter.collectors.build_info import BuildInfoCollector, DaemonInfo
from gpuwatchd.exporter.collectors.gpu import GpuCollector
from gpuwatchd.exporter.collectors.health import HealthCollector
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.telemetry.pod_resources import PodSource


class ExporterRegistry(CollectorRegistry):
    """A registry that also lists its collectors in order, so a renderer can encode each
    on its own and reuse the text of those that did not change (prometheus_client keeps
    that list private)."""

    def __init__(self) -> None:
        super().__init__(auto_describe=False)
        self.parts: list[Collector] = []

    def register(self, collector: Collector) -> None:
        super().register(collector)
        self.parts.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        self.parts.remove(collector)


def build_registry(
    board: StateBoard,
    info: DaemonInfo,
    extra: Sequence[SubCollector] = (),
    pods: PodSource | None = None,
) -> ExporterRegistry:
    """A private registry (never the global one) holding gpuwatchd's collectors.

    ``extra`` sub-collectors (the daemon adds "tuning", "drift" and "fleet") are scraped
    after "gpu" and "gpu_health"; ``pods`` labels per-process series with their pod.
    """
    registry = ExporterRegistry()
    registry.register(BuildInfoCollector(info))
    health = HealthCollector(board, pods)
    registry.register(GpuwatchdCollector([GpuCollector(board), health, *extra]))
    return registry
