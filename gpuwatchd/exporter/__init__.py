"""Prometheus exporter and read-only HTTP API over the daemon's state board."""

from __future__ import annotations

from gpuwatchd.api.state import build_state_json
from gpuwatchd.exporter.collectors.base import GpuwatchdCollector, SubCollector
from gpuwatchd.exporter.collectors.build_info import DaemonInfo
from gpuwatchd.exporter.collectors.gpu import GpuCollector
from gpuwatchd.exporter.http import HttpServer, Routes, parse_listen
from gpuwatchd.exporter.registry import build_registry

#: Default TCP port of the HTTP server. Not 9400 (dcgm-exporter) nor 9835
#: (nvidia_gpu_exporter), so gpuwatchd can run beside either.
DEFAULT_PORT = 9844

__all__ = [
    "DEFAULT_PORT",
    "DaemonInfo",
    "GpuCollector",
    "GpuwatchdCollector",
    "HttpServer",
    "Routes",
    "SubCollector",
    "build_registry",
    "build_state_json",
    "parse_listen",
]
