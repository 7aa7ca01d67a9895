"""Prometheus exporter over the daemon's state board: collectors, registry, formats.

The servers that put it on the wire live in :mod:`gpuwatchd.serve`. The names below are
imported on first use, so loading ``[exporter]`` settings (:mod:`.settings`) with the
configuration loads neither prometheus_client nor the collectors.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuwatchd.api.state import build_state_json
    from gpuwatchd.exporter.collectors.base import GpuwatchdCollector, SubCollector
    from gpuwatchd.exporter.collectors.build_info import DaemonInfo
    from gpuwatchd.exporter.collectors.gpu import GpuCollector
    from gpuwatchd.exporter.registry import build_registry

_WHERE = {
    "build_state_json": "gpuwatchd.api.state",
    "GpuwatchdCollector": "gpuwatchd.exporter.collectors.base",
    "SubCollector": "gpuwatchd.exporter.collectors.base",
    "DaemonInfo": "gpuwatchd.exporter.collectors.build_info",
    "GpuCollector": "gpuwatchd.exporter.collectors.gpu",
    "build_registry": "gpuwatchd.exporter.registry",
}
__all__ = [
    "DaemonInfo",
    "GpuCollector",
    "GpuwatchdCollector",
    "SubCollector",
    "build_registry",
    "build_state_json",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
