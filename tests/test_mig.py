"""MIG devices: read through NVML's MIG handles (the fake NVML), exported per device with
their pod, and a GPU in MIG mode kept shut by the gate."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from types import MappingProxyType

import pytest
from builders import DAEMON_INFO, board_of, full_h200, h200, idle
from fakes_nvml import FakeGpu, FakeMig, FakeNvml
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuwatchd.exporter import build_registry
from gpuwatchd.gate import MIG_REASON, GateConfig, GateDecision, GateState, evaluate
from gpuwatchd.telemetry.clocks import ManualClock
from gpuwatchd.telemetry.nvml import NvmlBackend
from gpuwatchd.telemetry.nvml_mig import profile_of
from gpuwatchd.telemetry.types import DeviceInfo, MigDevice, PodRef, Sample, SlowReading

SLICES = (FakeMig(1, 0, "3g.71gb", util=40), None, FakeMig(2, 0, "1g.18gb"))


@pytest.fixture
def backend() -> Iterator[tuple[NvmlBackend, FakeNvml]]:
    """GPU 0 in MIG mode (two devices, an empty slot between), GPU 1 MIG-capable but off,
    GPU 2 without MIG."""
    fake = FakeNvml([FakeGpu(mig_mode=1, mig_devices=SLICES), FakeGpu(mig_mode=0), FakeGpu()])
    nvml = NvmlBackend(clock=ManualClock(100.0), nvml=fake, xid_wait_s=0.02)
    try:
        yield nvml, fake
    finally:
        nvml.close()


def test_mig_devices_are_read_through_the_mig_handles(
    backend: tuple[NvmlBackend, FakeNvml],
) -> None:
    nvml, fake = backend
    readings = []
    for gpu in range(3):
        nvml.read_energy(gpu)
        slow = nvml.read(gpu).slow
        assert slow is not None
        readings.append(slow.mig)
    assert readings[0] == (
        MigDevice("MIG-fake-0-1-0", 1, 0, "3g.71gb", 1_048_576_000, 18_253_611_008, 0.4),
        MigDevice("MIG-fake-0-2-0", 2, 0, "1g.18gb", 1_048_576_000, 18_253_611_008, None),
    )
    assert readings[1] is None and readings[2] is None  # MIG off; no MIG at all
    assert nvml.read(0).field_errors == {}  # the empty slot is neither an error nor a loss
    nvml.read_energy(2)  # a GPU without MIG is asked once, then known unsupported
    assert fake.count("nvmlDeviceGetMigMode", gpu=2) == 1
    assert not {n for n in fake.called_names() if "Set" in n and "Event" not in n}


def test_profile_names() -> None:
    assert profile_of("NVIDIA H200 MIG 1g.18gb") == "1g.18gb"
    assert profile_of("NVIDIA H200") == "NVIDIA H200"


class _Pods:
    """A pod map holding one MIG device (the device plugin hands out MIG UUIDs)."""

    up = True
    pods = MappingProxyType({"fake-0-1-0": PodRef("ml", "trainer-0", "pytorch")})

    def lookup(self, uuid: str) -> PodRef | None:
        return self.pods.get(uuid.lower().removeprefix("mig-"))


def _mig_board() -> object:
    full = full_h200()
    mig = (
        MigDevice("MIG-fake-0-1-0", 1, 0, "3g.71gb", 2**30, 2**34, 0.4),
        MigDevice("MIG-fake-0-2-0", 2, 0, "1g.18gb", None, None, None),
    )
    slow = replace(full.sample.slow or SlowReading(t=1.0), mig=mig)
    return board_of(replace(full, sample=replace(full.sample, slow=slow)))


def _series(text: str, prefix: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith(prefix)
    ]


def test_mig_devices_are_exported_with_their_pod() -> None:
    text = generate_latest(build_registry(_mig_board(), DAEMON_INFO, pods=_Pods())).decode()
    series = _series(text, "gpuwatchd_mig_")
    names = {name for name, _, _ in series}
    assert names == {
        "gpuwatchd_mig_device_info",
        "gpuwatchd_mig_memory_used_bytes",
        "gpuwatchd_mig_memory_total_bytes",
        "gpuwatchd_mig_utilization_ratio",
    }
    used = {lab["gpu_instance_id"]: (lab, v) for n, lab, v in series if n.endswith("used_bytes")}
    assert list(used) == ["1"]  # the second device's memory is unknown: absent, never 0
    labels, value = used["1"]
    assert value == 2**30
    assert labels == {
        "gpu": "0", "uuid": "GPU-00000000-aaaa", "gpu_instance_id": "1",
        "compute_instance_id": "0", "profile": "3g.71gb",
        "namespace": "ml", "pod": "trainer-0", "container": "pytorch",
    }  # fmt: skip
    infos = [lab for n, lab, _ in series if n == "gpuwatchd_mig_device_info"]
    assert {(i["mig_uuid"], i["pod"]) for i in infos} == {
        ("MIG-fake-0-1-0", "trainer-0"),
        ("MIG-fake-0-2-0", ""),
    }


def test_without_mig_there_are_no_mig_series() -> None:
    text = generate_latest(build_registry(board_of(full_h200()), DAEMON_INFO)).decode()
    assert not _series(text, "gpuwatchd_mig_")


def test_the_gate_keeps_a_gpu_in_mig_mode_shut_with_one_reason() -> None:
    """15 s of quiet open the gate; the same quiet on a GPU in MIG mode keeps it shut."""
    cfg = GateConfig()

    def last_decision(info: DeviceInfo) -> GateDecision:
        window: deque[Sample] = deque(maxlen=200)
        prev = None
        for i in range(151):
            window.append(idle(i / 10))
            prev = evaluate(window, info, cfg, prev)
        assert prev is not None
        return prev

    assert last_decision(h200(mig_mode=False)).state is GateState.COOL_STABLE
    decision = last_decision(h200(mig_mode=True))
    assert decision.state is GateState.UNAVAILABLE
    assert decision.reasons == (MIG_REASON,)


def test_mig_mode_is_a_static_fact_read_before_any_poll(
    backend: tuple[NvmlBackend, FakeNvml],
) -> None:
    nvml, _ = backend
    assert [nvml.device_info(g).mig_mode for g in range(3)] == [True, False, None]
