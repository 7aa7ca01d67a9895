"""Pod labels from the kubelet's pod-resources API, against a fake kubelet.

The fake is a real gRPC server on a Unix socket in tmp serving ``PodResourcesLister/
List`` with two pods holding one GPU each (plus a CPU-only container and a GPU shared by
two pods, which gets no pod). Without the socket the daemon imports neither grpc nor
protobuf.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from builders import DAEMON_INFO, board_of, free_port, full_h200, h200, judged, wait_until
from daemon_helpers import http_get, start_daemon, wait_http
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

grpc = pytest.importorskip("grpc")
kubelet_pb = pytest.importorskip("gpuwatchd.telemetry.kubelet_pb")

from gpuwatchd.exporter import build_registry  # noqa: E402
from gpuwatchd.exporter.collectors.gpu import GpuCollector  # noqa: E402
from gpuwatchd.exporter.collectors.health import HealthCollector  # noqa: E402
from gpuwatchd.gate import GateState  # noqa: E402
from gpuwatchd.telemetry.pod_resources import (  # noqa: E402
    PodAttribution,
    pods_by_gpu,
    start_pod_attribution,
)
from gpuwatchd.telemetry.sim import SimBackend  # noqa: E402
from gpuwatchd.telemetry.types import PodRef, ProcessMemory, Sample, SlowReading  # noqa: E402

TRAINER = PodRef("ml", "trainer-0", "pytorch")
SERVER = PodRef("serving", "infer-7f9c", "triton")


def pods_response(gpu_a: str, gpu_b: str) -> Any:
    """Two pods with a GPU each, a CPU-only container, and a time-sliced GPU two share."""
    resp = kubelet_pb.ListPodResourcesResponse()
    for ref, gpu in ((TRAINER, gpu_a), (SERVER, gpu_b)):
        pod = resp.pod_resources.add(name=ref.pod, namespace=ref.namespace)
        container = pod.containers.add(name=ref.container)
        container.devices.add(resource_name="nvidia.com/gpu", device_ids=[gpu])
        container.devices.add(resource_name="example.com/nic", device_ids=["GPU-not-a-gpu"])
        pod.containers.add(name="sidecar")  # no devices
    for n in (0, 1):
        shared = resp.pod_resources.add(name=f"shared-{n}", namespace="ml")
        shared.containers.add(name="c").devices.add(
            resource_name="nvidia.com/gpu", device_ids=[f"GPU-sliced::{n}"]
        )
    return resp


class FakeKubelet:
    """A gRPC server on ``path`` answering List with ``response`` (replaceable)."""

    def __init__(self, path: Path, response: Any) -> None:
        self.path = path
        self.response = response
        self.calls = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        method = grpc.unary_unary_rpc_method_handler(
            self._list,
            request_deserializer=kubelet_pb.ListPodResourcesRequest.FromString,
            response_serializer=kubelet_pb.ListPodResourcesResponse.SerializeToString,
        )
        handler = grpc.method_handlers_generic_handler("v1.PodResourcesLister", {"List": method})
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"unix://{path}")
        self.server.start()

    def _list(self, _request: Any, _context: Any) -> Any:
        self.calls += 1
        return self.response

    def stop(self) -> None:
        self.server.stop(None).wait(5)


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(tmp_path / "kubelet.sock", pods_response("GPU-aaa", "GPU-bbb"))
    yield fake
    fake.stop()


def test_pods_by_gpu_keeps_nvidia_devices_held_by_one_container() -> None:
    pods = pods_by_gpu(pods_response("GPU-AAA", "MIG-bbb"))
    assert dict(pods) == {"aaa": TRAINER, "bbb": SERVER}  # the sliced GPU is ambiguous


def test_attribution_reads_the_fake_kubelet_and_keeps_the_last_map(
    kubelet: FakeKubelet, caplog: pytest.LogCaptureFixture
) -> None:
    attribution = start_pod_attribution(str(kubelet.path), refresh_s=3600.0)  # asks once
    assert attribution is not None
    try:
        assert wait_until(lambda: attribution.lookup("GPU-aaa") is not None, 10)
        assert attribution.lookup("gpu-AAA") == TRAINER  # any spelling of the UUID
        assert attribution.lookup("GPU-bbb") == SERVER
        assert attribution.lookup("GPU-sliced") is None
        before = attribution.pods
        assert attribution.refresh() and kubelet.calls == 2
        assert attribution.pods is before  # unchanged answers keep the same map object
        kubelet.stop()
        with caplog.at_level("WARNING", logger="gpuwatchd.telemetry.pod_resources"):
            assert not attribution.refresh()
            assert not attribution.refresh()
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "kubelet pod-resources at" in warnings[0].getMessage()
        assert attribution.lookup("GPU-aaa") == TRAINER  # the last answer stays
    finally:
        attribution.close()


def test_no_socket_no_attribution(tmp_path: Path) -> None:
    plain = tmp_path / "kubelet.sock"
    plain.write_text("")  # a file, not a socket
    assert start_pod_attribution(str(plain)) is None
    assert start_pod_attribution(str(tmp_path / "missing.sock")) is None
    assert start_pod_attribution("") is None


def _scrape(pods: PodAttribution | None) -> str:
    slow = SlowReading(t=1.0, processes=(ProcessMemory(77, 2**30),))
    sample = Sample(0, t=1.0, temp_c=40.0, procs=(77,), slow=slow)
    board = board_of(judged(0, h200(uuid="GPU-aaa"), sample, GateState.BUSY, ("busy",)))
    return generate_latest(build_registry(board, DAEMON_INFO, pods=pods)).decode()


def _process_labels(text: str) -> list[dict[str, str]]:
    return [
        s.labels
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gpuwatchd_gpu_process_memory_bytes"
    ]


def test_per_process_series_carry_the_pod(kubelet: FakeKubelet) -> None:
    attribution = start_pod_attribution(str(kubelet.path), refresh_s=3600.0)
    assert attribution is not None
    try:
        assert wait_until(lambda: attribution.lookup("GPU-aaa") is not None, 10)
        text = _scrape(attribution)
    finally:
        attribution.close()
    (labels,) = _process_labels(text)
    assert labels == {
        "gpu": "0", "uuid": "GPU-aaa", "pid": "77",
        "namespace": "ml", "pod": "trainer-0", "container": "pytorch",
    }  # fmt: skip
    if shutil.which("promtool"):
        out = subprocess.run(["promtool", "check", "metrics"], input=text, text=True,
                             capture_output=True)  # fmt: skip
        assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def test_without_pods_the_labels_are_empty() -> None:
    (labels,) = _process_labels(_scrape(None))
    assert (labels["namespace"], labels["pod"], labels["container"]) == ("", "", "")


def test_a_daemon_on_a_node_labels_processes_with_their_pod(tmp_path: Path) -> None:
    """A sim daemon (scenario busy: pid 4242/4243 on each GPU) beside a fake kubelet."""
    sim = SimBackend(gpus=2, scenario="busy")
    uuids = [sim.device_info(g).uuid for g in range(2)]
    sim.close()
    kubelet = FakeKubelet(tmp_path / "kubelet.sock", pods_response(*uuids))
    port = free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[daemon]\nbackend = "sim"\nlisten = "127.0.0.1:{port}"\npoll_interval_s = 0.1\n'
        f'energy_interval_s = 0.5\nstate_dir = "{tmp_path / "state"}"\n'
        f'control_socket = "{tmp_path / "c.sock"}"\n'
        f'pod_resources_socket = "{kubelet.path}"\n'
        '[sim]\nscenario = "busy"\ngpus = 2\nspeed = 30.0\n[tuning]\nenabled = false\n'
    )
    proc = start_daemon(["--config", str(cfg)])
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/metrics")

        def labelled() -> list[dict[str, str]]:
            return [lab for lab in _process_labels(http_get(f"{base}/metrics")) if lab["pod"]]

        assert wait_until(lambda: len(labelled()) == 2, 30), http_get(f"{base}/metrics")
        assert {(lab["gpu"], lab["pod"]) for lab in labelled()} == {
            ("0", "trainer-0"),
            ("1", "infer-7f9c"),
        }
        state = json.loads(http_get(f"{base}/api/v1/state"))
        pods = {g["gpu"]: [p["pod"] for p in g["processes"]] for g in state["gpus"]}
        assert pods == {0: ["trainer-0"], 1: ["infer-7f9c"]}
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
        kubelet.stop()
    assert "pod labels from the kubelet's pod-resources API" in out


#: Builds the daemon as `gpuwatchd run` does and says which heavy modules it loaded.
_IMPORTS = """
import sys
from gpuwatchd.config import load_config
from gpuwatchd.daemon.process import Daemon
d = Daemon(load_config(sys.argv[1]))
print(d.pods is None, "grpc" in sys.modules, "google.protobuf" in sys.modules)
d.store.close()
"""


def test_without_the_socket_grpc_and_protobuf_are_not_imported(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[daemon]\nbackend = "sim"\nstate_dir = "{tmp_path}"\n'
        f'pod_resources_socket = "{tmp_path / "absent.sock"}"\n'
    )
    out = subprocess.run(
        [sys.executable, "-c", _IMPORTS, str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False"]


# -- pod labels on every per-GPU series ------------------------------------------------

_POD = ("namespace", "pod", "container")


def _two_gpus() -> object:
    """GPU 0 (GPU-aaa, held by TRAINER) with every field, GPU 1 (GPU-free) held by no pod."""
    full = full_h200()
    held = replace(full, info=replace(full.info, uuid="GPU-aaa"))
    free = replace(full, index=1, info=replace(full.info, index=1, uuid="GPU-free"))
    return board_of(held, free)


def test_every_per_gpu_series_carries_the_pod(kubelet: FakeKubelet) -> None:
    attribution = start_pod_attribution(str(kubelet.path), refresh_s=3600.0)
    assert attribution is not None
    try:
        assert wait_until(lambda: attribution.up, 10)
        text = generate_latest(build_registry(_two_gpus(), DAEMON_INFO, pods=attribution))
    finally:
        attribution.close()
    per_gpu = {*GpuCollector.families, *HealthCollector.families}
    seen: dict[str, set[tuple[str, ...]]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name == "gpuwatchd_pod_resources_up":
                assert sample.value == 1.0
            if sample.name not in per_gpu:
                continue
            where = tuple(sample.labels[k] for k in _POD)  # every series has all three
            seen.setdefault(sample.labels["gpu"], set()).add(where)
            seen.setdefault(sample.name, set()).add(where)
    assert seen["0"] == {("ml", "trainer-0", "pytorch")}
    assert seen["1"] == {("", "", "")}  # held by no pod: the same labels, empty
    assert seen["gpuwatchd_gpu_power_watts"] == {("ml", "trainer-0", "pytorch"), ("", "", "")}
    assert {"gpuwatchd_gpu_temperature_celsius", "gpuwatchd_gpu_sm_clock_hertz"} <= seen.keys()
    assert "gpuwatchd_gpu_utilization_ratio" in seen


def test_off_kubernetes_per_gpu_series_have_no_pod_labels() -> None:
    text = generate_latest(build_registry(_two_gpus(), DAEMON_INFO)).decode()
    (power,) = [
        f for f in text_string_to_metric_families(text) if f.name == "gpuwatchd_gpu_power_watts"
    ]
    assert all(set(s.labels) == {"gpu", "uuid"} for s in power.samples)
    assert "gpuwatchd_pod_resources_up" not in text


# -- the DaemonSet's own uid ---------------------------------------------------------------

#: The DaemonSet's uid (deploy/kubernetes/base/daemonset.yaml) and a group for the socket.
DAEMONSET_UID = 9844
SOCKET_GID = 4242
#: Imports as root (the interpreter lives under /root), then drops to the DaemonSet's uid
#: and groups, asks the kubelet once as the daemon would, and renders /metrics for a
#: board whose GPU 0 is GPU-aaa: which pod gpuwatchd_gpu_power_watts names.
_AS_DAEMONSET = """
import json, logging, os, sys
sys.path.insert(0, sys.argv[3])
import grpc
from builders import DAEMON_INFO, board_of, full_h200
from dataclasses import replace
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from gpuwatchd.exporter import build_registry
from gpuwatchd.telemetry import kubelet_pb
from gpuwatchd.telemetry.pod_resources import start_pod_attribution
full = full_h200()
board = board_of(replace(full, info=replace(full.info, uuid="GPU-aaa")))
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
ch = grpc.insecure_channel("unix:///nonexistent")  # grpc imports some modules on first use
try:
    ch.unary_unary(kubelet_pb.LIST_METHOD)(b"", timeout=0.1)
except grpc.RpcError:
    pass
ch.close()
os.setgroups([int(g) for g in sys.argv[2].split(",") if g])
os.setgid(9844)
os.setuid(9844)
a = start_pod_attribution(sys.argv[1], refresh_s=3600.0)
up = a.refresh()
text = generate_latest(build_registry(board, DAEMON_INFO, pods=a)).decode()
(power,) = [
    s for f in text_string_to_metric_families(text) for s in f.samples
    if s.name == "gpuwatchd_gpu_power_watts"
]
print(json.dumps({"up": up, "pod": power.labels["pod"]}))
a.close()
"""


@pytest.fixture
def shared_kubelet() -> Iterator[FakeKubelet]:
    """A fake kubelet whose socket's directory the DaemonSet's uid may search."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to the DaemonSet's uid")
    where = Path(tempfile.mkdtemp(prefix="gpuwatchd-kubelet-"))
    where.chmod(0o755)
    fake = FakeKubelet(where / "kubelet.sock", pods_response("GPU-aaa", "GPU-bbb"))
    try:
        yield fake
    finally:
        fake.stop()
        shutil.rmtree(where)


def _as_daemonset(socket: Path, groups: str) -> tuple[dict[str, object], str]:
    tests = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", _AS_DAEMONSET, str(socket), groups, tests],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


def test_as_the_daemonset_uid_a_root_only_socket_is_one_clear_warning(
    shared_kubelet: FakeKubelet,
) -> None:
    os.chmod(shared_kubelet.path, 0o755)  # the kubelet's own: srwxr-xr-x root:root
    result, log = _as_daemonset(shared_kubelet.path, "")
    assert result == {"up": False, "pod": ""}
    warnings = [line for line in log.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, log
    assert "uid 9844" in warnings[0] and "may not connect" in warnings[0]
    assert "supplementalGroups" in warnings[0] and "srwxr-xr-x" in warnings[0]


@pytest.mark.parametrize(
    ("gid", "groups"),
    [(DAEMONSET_UID, ""), (SOCKET_GID, str(SOCKET_GID))],
    ids=["runAsGroup", "supplementalGroups"],
)
def test_as_the_daemonset_uid_group_access_gives_pod_labels(
    shared_kubelet: FakeKubelet, gid: int, groups: str
) -> None:
    """The documented fixes: the socket's group is the DaemonSet's gid, or a gid in its
    supplementalGroups, with rw."""
    os.chown(shared_kubelet.path, 0, gid)
    os.chmod(shared_kubelet.path, 0o660)
    result, log = _as_daemonset(shared_kubelet.path, groups)
    assert result == {"up": True, "pod": "trainer-0"}, log  # on gpuwatchd_gpu_power_watts
    assert "WARNING" not in log and "pod labels from the kubelet" in log
