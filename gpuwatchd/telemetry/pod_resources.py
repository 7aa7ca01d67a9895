"""Which Kubernetes pod each GPU is assigned to, from the kubelet's pod-resources API.

As dcgm-exporter does: the kubelet serves ``PodResourcesLister/List`` (gRPC) on a Unix
socket, and each container's devices of an ``nvidia.com/...`` resource are the GPU (or
MIG) UUIDs the device plugin gave it. :class:`PodAttribution` asks every
:data:`REFRESH_S` seconds on its own thread, never on a scrape, and keeps the last
answer while the kubelet does not reply. A GPU shared by several containers (time
slicing) is ambiguous: it gets no pod.

grpcio and protobuf (``pip install gpuwatchd[k8s]``) are imported only by
:func:`start_pod_attribution` and only where the socket exists, so a daemon off
Kubernetes loads neither.

Connecting to a Unix socket needs write access to it, and most kubelets create it
root-owned (``srwxr-xr-x``): a daemon running as its own uid (the DaemonSet's 9844) is
then refused. :func:`start_pod_attribution` says so in one warning naming the owner,
mode and the fix (a group with access, in the pod's ``supplementalGroups``:
docs/threat-model.md), and ``up`` stays False (``gpuwatchd_pod_resources_up`` 0).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol

from gpuwatchd.telemetry.types import PodRef, normalize_uuid
from gpuwatchd.validate import one_line

log = logging.getLogger(__name__)

#: Where the kubelet serves the pod-resources API (mounted read-only in the DaemonSet).
DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
#: Seconds between two asks: pods come and go on the scale of the scheduler, not polls.
REFRESH_S = 10.0
#: Seconds one ask may take before it counts as failed.
TIMEOUT_S = 5.0
#: Device-plugin resources whose device ids are GPU or MIG UUIDs.
RESOURCE_PREFIX = "nvidia.com/"
#: The time-slicing device plugin names the n-th replica of a GPU ``<uuid>::<n>``.
REPLICA_SEP = "::"

PodMap = Mapping[str, PodRef]


class PodSource(Protocol):
    """What the exporter reads: the current map (replaced whole when it changes)."""

    @property
    def pods(self) -> PodMap: ...

    @property
    def up(self) -> bool: ...

    def lookup(self, uuid: str) -> PodRef | None: ...


def pods_by_gpu(response: Any) -> PodMap:
    """Normalised GPU UUID -> the one container holding it, from a List response."""
    holders: dict[str, set[PodRef]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            ref = PodRef(namespace=pod.namespace, pod=pod.name, container=container.name)
            for devices in container.devices:
                if not devices.resource_name.startswith(RESOURCE_PREFIX):
                    continue
                for device_id in devices.device_ids:
                    uuid = normalize_uuid(device_id.split(REPLICA_SEP, 1)[0])
                    holders.setdefault(uuid, set()).add(ref)
    return MappingProxyType({u: next(iter(refs)) for u, refs in holders.items() if len(refs) == 1})


class PodAttribution:
    """The GPU -> pod map, refreshed from the kubelet on its own daemon thread.

    ``list_pods`` makes one List call and returns the response (the gRPC stub, or a
    test's stand-in); :attr:`pods` is replaced whole after each successful call.
    """

    def __init__(
        self,
        socket_path: str,
        list_pods: Callable[[], Any],
        refresh_s: float = REFRESH_S,
        close: Callable[[], None] = lambda: None,
    ) -> None:
        self.socket_path = socket_path
        self._list = list_pods
        self._refresh_s = refresh_s
        self._close = close
        self._stop = threading.Event()
        self._failing = False
        #: Whether the kubelet answered the last ask (False until it first does).
        self.up = False
        self.pods: PodMap = MappingProxyType({})
        self._thread = threading.Thread(target=self._run, name="gpuwatchd-pods", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def lookup(self, uuid: str) -> PodRef | None:
        """The container a GPU (any UUID spelling) is assigned to, or None."""
        return self.pods.get(normalize_uuid(uuid))

    def refresh(self) -> bool:
        """Ask the kubelet once; True when it answered (its map is then current)."""
        try:
            pods = pods_by_gpu(self._list())
        except Exception as exc:  # a kubelet restart or a broken socket must not stop us
            if not self._failing:
                log.warning(
                    "kubelet pod-resources at %s: %s (pod labels stay as last read)",
                    self.socket_path,
                    one_line(exc),
                )
            self._failing = True
            self.up = False
            return False
        self.up = True
        if pods != self.pods:
            self.pods = pods  # a new object only on a change: the exporter keeps its text
        if self._failing:
            log.info("kubelet pod-resources at %s answers again", self.socket_path)
        self._failing = False
        return True

    def already_warned(self) -> None:
        """Failures until the kubelet first answers were already explained: no warning."""
        self._failing = True

    def close(self, timeout: float = 1.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self._refresh_s)


def _is_socket(path: str) -> bool:
    """Whether ``path`` is a socket; True where it cannot be looked at (a directory
    above denies search), so that :func:`access_problem` says why."""
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except PermissionError:
        return True
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return False


def access_problem(path: str) -> str | None:
    """Why this process may not connect to the socket at ``path``, or None if it may
    (connecting to a Unix socket needs write access to it)."""
    who = f"uid {os.geteuid()} (groups {','.join(map(str, sorted(set(os.getgroups()))))})"
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{who} cannot reach it: {exc.strerror or exc}"
    effective = os.access in os.supports_effective_ids
    if os.access(path, os.W_OK, effective_ids=effective):
        return None
    mode = stat.filemode(st.st_mode)
    return (
        f"{who} may not connect to it (owner {st.st_uid}:{st.st_gid} {mode}; connecting "
        "needs write access): give it a group with rw and add that gid to the pod's "
        "supplementalGroups (docs/threat-model.md)"
    )


def start_pod_attribution(
    socket_path: str = DEFAULT_SOCKET, refresh_s: float = REFRESH_S
) -> PodAttribution | None:
    """A running :class:`PodAttribution` where ``socket_path`` is a socket, else None.

    Only here are grpc and protobuf imported; without them (no ``[k8s]`` extra) one
    warning says what to install.
    """
    if not socket_path or not _is_socket(socket_path):
        return None
    try:
        import grpc

        from gpuwatchd.telemetry import kubelet_pb
    except ImportError as exc:
        log.warning(
            "kubelet pod-resources socket %s found but %s: pip install 'gpuwatchd[k8s]' "
            "for pod labels",
            socket_path,
            one_line(exc),
        )
        return None
    channel = grpc.insecure_channel(f"unix://{socket_path}")
    call = channel.unary_unary(
        kubelet_pb.LIST_METHOD,
        request_serializer=kubelet_pb.ListPodResourcesRequest.SerializeToString,
        response_deserializer=kubelet_pb.ListPodResourcesResponse.FromString,
    )
    request = kubelet_pb.ListPodResourcesRequest()
    attribution = PodAttribution(
        socket_path,
        lambda: call(request, timeout=TIMEOUT_S),
        refresh_s=refresh_s,
        close=channel.close,
    )
    problem = access_problem(socket_path)
    if problem is None:
        log.info("pod labels from the kubelet's pod-resources API at %s", socket_path)
    else:  # still asked: access granted later (a group on the socket) is picked up
        log.warning(
            "kubelet pod-resources socket %s: %s; pod labels stay empty", socket_path, problem
        )
        attribution.already_warned()
    attribution.start()
    return attribution
