"""The exporter's private registry: build info, then every sub-collector under the aggregator."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.registry import CollectorRegistry

from gpuwatchd.exporter.collectors.base import GpuwatchdCollector, SubCollector
from gpuwatchd.exporter.collectors.build_info import BuildInfoCollector, DaemonInfo
from gpuwatchd.exporter.collectors.gpu import GpuCollector
from gpuwatchd.exporter.collectors.health import HealthCollector
from gpuwatchd.monitor.board import StateBoard


def build_registry(
    board: StateBoard, info: DaemonInfo, extra: Sequence[SubCollector] = ()
) -> CollectorRegistry:
    """A private registry (never the global one) holding gpuwatchd's collectors.

    ``extra`` sub-collectors (the daemon adds "tuning", "drift" and "fleet") are scraped
    after "gpu" and "gpu_health".
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BuildInfoCollector(info))
    registry.register(GpuwatchdCollector([GpuCollector(board), HealthCollector(board), *extra]))
    return registry
