"""The ``pods`` sub-collector: ``gpuwatchd_pod_resources_up``, whether pod labels are current.

Present only on a Kubernetes node (where the kubelet's pod-resources socket exists), so
empty pod labels can be told apart: 1 and empty means no single container holds the
GPU; 0 means the kubelet is not answering, or this uid may not connect to its socket.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric


class PodsUp(Protocol):
    """What this collector reads of the pod attribution."""

    @property
    def up(self) -> bool: ...


class PodsCollector:
    """``gpuwatchd_pod_resources_up`` from the attribution's ``up`` flag: no I/O."""

    name = "pods"
    families = ("gpuwatchd_pod_resources_up",)
    runs_inline = True
    timeless = True  # made from up alone

    def __init__(self, pods: PodsUp) -> None:
        self._pods = pods

    def version(self) -> object:
        return self._pods.up

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "gpuwatchd_pod_resources_up",
            "1 if the kubelet's pod-resources API answered the last ask (pod labels are "
            "current), else 0 (not answering, or this uid may not connect to its socket).",
            value=1.0 if self._pods.up else 0.0,
        )
