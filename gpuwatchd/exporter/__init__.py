"""Prometheus exporter over the daemon's state board: collectors, registry, formats.

The servers that put it on the wire live in :mod:`gpuwatchd.serve`.
"""

from __future__ import annotations

from gpuwatchd.api.state import build_state_json
from gpuwatchd.exporter.collectors.base import GpuwatchdCollector, SubCollector
from gpuwatchd.exporter.collectors.build_info import DaemonInfo
from gpuwatchd.exporter.collectors.gpu import GpuCollector
from gpuwatchd.exporter.registry import build_registry

__all__ = [
    "DaemonInfo",
    "GpuCollector",
    "GpuwatchdCollector",
    "SubCollector",
    "build_registry",
    "build_state_json",
]
