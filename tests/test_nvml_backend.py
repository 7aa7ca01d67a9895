"""NvmlBackend against a fake pynvml (tests/fakes_nvml.py) and, where safe, the real one."""

from __future__ import annotations

import ctypes
import logging
import queue
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pynvml  # type: ignore[import-untyped]
import pytest
from fakes_nvml import FakeGpu, FakeNvml

from gpuwatchd.gate import GateConfig
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.monitor.poller import Poller
from gpuwatchd.telemetry import fields as fields_module
from gpuwatchd.telemetry import nvml as nvml_module
from gpuwatchd.telemetry import nvml_xid
from gpuwatchd.telemetry.backend import Backend, BackendUnavailable, GpuLost, TelemetryError
from gpuwatchd.telemetry.clocks import ManualClock
from gpuwatchd.telemetry.nvml import NvmlBackend
from gpuwatchd.telemetry.types import DeviceInfo, ProcessMemory, RemappedRows, ThrottleReason

FAST_CALLS = (
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetPerformanceState",
)
SLOW_CALLS = (
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetMaxClockInfo",
    "nvmlDeviceGetTemperatureThreshold",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetFanSpeed",
)
#: How each fast field's failure is injected: NVML function, and the Sample field it fills.
FAST_FIELD_CALLS = (
    ("nvmlDeviceGetTemperature", "temp_c"),
    ("nvmlDeviceGetPowerUsage", "power_w"),
    ("nvmlDeviceGetCurrentClocksEventReasons", "reasons"),
    ("nvmlDeviceGetUtilizationRates", "util_gpu"),
    ("nvmlDeviceGetComputeRunningProcesses_v3", "procs"),
    ("nvmlDeviceGetPerformanceState", "pstate"),
)


def make(
    gpus: int | list[FakeGpu] = 2, interval: float = 0.0, **fake_kw: object
) -> tuple[NvmlBackend, FakeNvml, ManualClock]:
    fake = FakeNvml(gpus, **fake_kw)  # type: ignore[arg-type]
    clock = ManualClock(100.0)
    backend = NvmlBackend(clock=clock, nvml=fake, reprobe_interval_s=interval, xid_wait_s=0.02)
    _OPEN.append(backend)
    return backend, fake, clock


_OPEN: list[NvmlBackend] = []


@pytest.fixture(autouse=True)
def _close_backends() -> object:
    """Stop every XID thread a test started, so none outlives it."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def xids_after_slow_read(backend: NvmlBackend, gpu: int) -> dict[int, int] | None:
    """The XID counts a sample carries right after a slow read."""
    backend.read_energy(gpu)
    slow = backend.read(gpu).slow
    return None if slow is None or slow.xid_errors is None else dict(slow.xid_errors)


def xid_threads() -> int:
    return sum(t.name == "gpuwatchd-xid" for t in threading.enumerate())


def wait_for(predicate: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# -- import and start-up -----------------------------------------------------------------


def test_importing_the_module_does_not_import_pynvml() -> None:
    code = "import sys, gpuwatchd.telemetry.nvml; print('pynvml' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_library_not_found_is_one_line_that_suggests_sim() -> None:
    with pytest.raises(BackendUnavailable) as err:
        make(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    msg = str(err.value)
    assert "\n" not in msg
    assert "libnvidia-ml.so.1 not found" in msg
    assert "--backend sim" in msg


def test_driver_not_loaded_suggests_sim() -> None:
    with pytest.raises(BackendUnavailable, match=r"driver is not loaded.*--backend sim"):
        make(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)


def _has_nvml_library() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_has_nvml_library(), reason="this host has a real NVML library")
def test_real_pynvml_without_a_driver_is_unavailable() -> None:
    with pytest.raises(BackendUnavailable, match=r"libnvidia-ml\.so\.1 not found.*--backend sim"):
        NvmlBackend()


def test_no_gpu_is_unavailable_and_shuts_nvml_down() -> None:
    fake = FakeNvml(0)
    with pytest.raises(BackendUnavailable, match=r"no GPU.*--backend sim"):
        NvmlBackend(nvml=fake)
    assert fake.count("nvmlShutdown") == 1
    assert fake.initialized == 0


def test_is_a_backend_named_nvml() -> None:
    backend, _, _ = make()
    assert isinstance(backend, Backend)
    assert backend.name == "nvml"
    assert backend.devices() == [0, 1]


def test_bad_reprobe_interval_is_rejected() -> None:
    with pytest.raises(ValueError, match="reprobe_interval_s"):
        NvmlBackend(nvml=FakeNvml(1), reprobe_interval_s=-1)


def test_unknown_gpu_index_names_the_field() -> None:
    backend, _, _ = make(2)
    with pytest.raises(ValueError, match=r"gpu: no GPU with index 5"):
        backend.read(5)
    with pytest.raises(ValueError, match=r"gpu: no GPU with index -1"):
        backend.device_info(-1)


# -- read ------------------------------------------------------------------------------


def test_read_converts_units_and_decodes_reasons() -> None:
    gpu = FakeGpu(
        temp=61, power_mw=693_500, sm_clock=1440, mem_clock=3201, reasons=0x4 | 0x800,
        util=(97, 41), pids=(4242, 77), pstate=0,
    )  # fmt: skip
    backend, _, clock = make([gpu])
    clock.advance(2.5)
    s = backend.read(0)
    assert s.gpu == 0
    assert s.t == 102.5
    assert s.temp_c == 61.0
    assert s.power_w == pytest.approx(693.5)
    assert (s.sm_clock_mhz, s.mem_clock_mhz) == (1440.0, 3201.0)
    assert s.reasons == ThrottleReason.SW_POWER_CAP  # unknown bit 0x800 dropped
    assert isinstance(s.reasons, ThrottleReason)
    assert (s.util_gpu, s.util_mem) == (pytest.approx(0.97), pytest.approx(0.41))
    assert s.procs == (4242, 77)
    assert s.pstate == 0
    assert s.mem_temp_c is None  # only read on the slow path


def test_unknown_pstate_reads_as_none() -> None:
    backend, _, _ = make([FakeGpu(pstate=pynvml.NVML_PSTATE_UNKNOWN)])
    assert backend.read(0).pstate is None


def test_read_makes_only_fast_calls() -> None:
    backend, fake, _ = make(1)
    backend.read(0)
    for name in FAST_CALLS:
        assert fake.count(name, gpu=0) >= 1, name
    for name in SLOW_CALLS:
        assert fake.count(name) == 0, name
    assert fake.count("nvmlDeviceGetClockInfo", gpu=0) == 2  # SM and memory


@pytest.mark.parametrize(
    "code",
    [
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    ],
)
def test_unsupported_field_is_none_and_not_asked_again(code: int) -> None:
    backend, fake, _ = make(2)
    fake.fail("nvmlDeviceGetPowerUsage", code, gpu=1)
    for _ in range(5):
        s0, s1 = backend.read(0), backend.read(1)
    assert s1.power_w is None
    assert s1.temp_c == 40.0 and s1.sm_clock_mhz == 1980.0  # the others are kept
    assert s0.power_w == 125.0  # the other GPU is untouched
    assert fake.count("nvmlDeviceGetPowerUsage", gpu=1) == 1
    assert fake.count("nvmlDeviceGetPowerUsage", gpu=0) == 5


def test_refreshing_device_info_retries_unsupported_fields() -> None:
    backend, fake, _ = make(1)
    fake.fail("nvmlDeviceGetUtilizationRates", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=0)
    backend.read(0)
    backend.device_info(0)  # a cached read is not a refresh
    assert backend.read(0).util_gpu is None
    assert fake.count("nvmlDeviceGetUtilizationRates", gpu=0) == 1
    fake.clear("nvmlDeviceGetUtilizationRates", gpu=0)  # e.g. a driver update
    backend.device_info(0, refresh=True)
    assert backend.read(0).util_gpu == 0.0
    assert fake.count("nvmlDeviceGetUtilizationRates", gpu=0) == 2


def test_field_none_in_fake_config_is_unsupported() -> None:
    backend, _, _ = make([FakeGpu(temp=None, pids=None)])
    s = backend.read(0)
    assert s.temp_c is None and s.procs is None
    assert s.power_w == 125.0


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_UNKNOWN, pynvml.NVML_ERROR_TIMEOUT])
@pytest.mark.parametrize(("func", "attr"), FAST_FIELD_CALLS)
def test_a_failing_field_drops_only_that_field_for_that_read(
    func: str, attr: str, code: int
) -> None:
    backend, fake, _ = make(2)
    want = backend.read(0)
    fake.fail(func, code, gpu=0, times=1)
    s = backend.read(0)
    assert getattr(s, attr) is None
    for other in ("temp_c", "power_w", "sm_clock_mhz", "reasons", "util_gpu", "procs", "pstate"):
        if other != attr:
            assert getattr(s, other) == getattr(want, other), other
    assert dict(s.field_errors) == {nvml_module.FAST_FIELDS[_fast_index(func)]: 1}
    assert getattr(backend.read(0), attr) == getattr(want, attr)  # asked again: not remembered
    assert backend.read(1).field_errors == {}


def _fast_index(func: str) -> int:
    order = [f for f, _ in FAST_FIELD_CALLS]
    return {0: 0, 1: 1, 2: 4, 3: 5, 4: 6, 5: 7}[order.index(func)]


def test_one_failing_clock_call_keeps_the_other_clock() -> None:
    backend, fake, _ = make(1)
    fake.fail("nvmlDeviceGetClockInfo", pynvml.NVML_ERROR_UNKNOWN, gpu=0, times=1)
    s = backend.read(0)  # the SM clock call fails, the memory clock call reads
    assert s.sm_clock_mhz is None and s.mem_clock_mhz == 3201.0
    assert s.temp_c == 40.0 and s.power_w == 125.0
    assert dict(s.field_errors) == {"sm_clock": 1}


def test_utilization_timeout_on_every_gpu_keeps_temperatures_and_powers() -> None:
    backend, fake, _ = make(4)
    fake.fail("nvmlDeviceGetUtilizationRates", pynvml.NVML_ERROR_TIMEOUT)
    for _ in range(3):
        samples = [backend.read(i) for i in range(4)]
    for s in samples:
        assert s.util_gpu is None and s.util_mem is None
        assert (s.temp_c, s.power_w, s.sm_clock_mhz) == (40.0, 125.0, 1980.0)
        assert dict(s.field_errors) == {"util": 3}
    assert fake.count("nvmlDeviceGetUtilizationRates") == 12  # retried every poll


def test_field_failures_are_logged_once_per_streak(caplog: pytest.LogCaptureFixture) -> None:
    backend, fake, _ = make(1)
    caplog.set_level(logging.INFO, logger="gpuwatchd.telemetry.nvml")
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_UNKNOWN, gpu=0, times=3)
    for _ in range(5):
        backend.read(0)
    failed = [r for r in caplog.records if "power failed" in r.getMessage()]
    back = [r for r in caplog.records if "power works again" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.WARNING
    assert len(back) == 1
    assert backend.read(0).field_errors == {"power": 3}


def test_a_read_whose_every_field_fails_is_a_telemetry_error() -> None:
    backend, fake, _ = make([FakeGpu(temp=None, pids=None)])  # two fields unsupported
    calls = Counter(  # every other getter of the field table, once per call in a read
        getter.functions[0]
        for getter, _ in fields_module.getters()
        if getter.key not in ("temp", "procs")
    )
    for func, times in calls.items():
        fake.fail(func, pynvml.NVML_ERROR_UNKNOWN, gpu=0, times=times)
    with pytest.raises(TelemetryError, match=r"GPU 0: every NVML field failed, first power"):
        backend.read(0)
    assert backend.read(0).power_w == 125.0


def test_a_lost_error_on_one_field_loses_the_gpu_not_just_the_field() -> None:
    backend, fake, _ = make(2)
    fake.fail("nvmlDeviceGetUtilizationRates", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=1, times=1)
    with pytest.raises(GpuLost):
        backend.read(1)
    assert backend.read(0).util_gpu == 0.0


def test_clock_reasons_fall_back_when_the_driver_lacks_the_new_function() -> None:
    backend, fake, _ = make([FakeGpu(reasons=0x4)])
    fake.fail("nvmlDeviceGetCurrentClocksEventReasons", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    for _ in range(3):
        assert backend.read(0).reasons == ThrottleReason.SW_POWER_CAP
    assert fake.count("nvmlDeviceGetCurrentClocksEventReasons") == 1  # dropped for good
    assert fake.count("nvmlDeviceGetCurrentClocksThrottleReasons") == 3


def test_old_bindings_use_throttle_reasons_and_bytes_strings() -> None:
    backend, fake, _ = make([FakeGpu(reasons=0x20)], legacy=True)
    assert backend.read(0).reasons == ThrottleReason.SW_THERMAL_SLOWDOWN
    info = backend.device_info(0)
    assert (info.name, info.uuid, info.driver_version) == (
        "NVIDIA H200",
        "GPU-fake-0",
        "580.159.04",
    )
    assert info.pci_bus_id == "00000000:18:00.0"
    assert fake.count("nvmlDeviceGetCurrentClocksThrottleReasons") == 1


def test_process_list_falls_back_from_v3_to_v2() -> None:
    backend, fake, _ = make([FakeGpu(pids=(9,))])
    fake.fail("nvmlDeviceGetComputeRunningProcesses_v3", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    assert backend.read(0).procs == (9,)
    assert backend.read(0).procs == (9,)
    assert fake.count("nvmlDeviceGetComputeRunningProcesses_v3") == 1
    assert fake.count("nvmlDeviceGetComputeRunningProcesses_v2") == 2


def test_process_list_with_only_the_unversioned_function() -> None:
    missing = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2")
    backend, fake, _ = make([FakeGpu(pids=(5, 6))], missing=missing)
    assert backend.read(0).procs == (5, 6)
    assert fake.count("nvmlDeviceGetComputeRunningProcesses") == 1


def test_library_mismatch_error_reads_as_unsupported() -> None:
    missing = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2")
    fake = FakeNvml(1, missing=missing)
    calls = []

    def mismatched(handle: object) -> object:
        calls.append(handle)
        raise pynvml.NVMLLibraryMismatchError("use a versioned function")

    setattr(fake, "nvmlDeviceGetComputeRunningProcesses", mismatched)  # noqa: B010
    backend = NvmlBackend(nvml=fake)
    assert backend.read(0).procs is None
    assert backend.read(0).power_w == 125.0
    assert len(calls) == 1


# -- lost GPUs ---------------------------------------------------------------------------


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_GPU_NOT_FOUND])
def test_lost_error_on_any_call_raises_gpu_lost(code: int) -> None:
    backend, fake, _ = make(2)
    fake.fail("nvmlDeviceGetPerformanceState", code, gpu=1, times=1)
    with pytest.raises(GpuLost) as err:
        backend.read(1)
    assert err.value.gpu == 1
    assert backend.read(0).pstate == 0
    assert backend.read(1).pstate == 0  # answered on the next probe


def test_lost_gpu_is_reacquired_by_uuid_and_comes_back() -> None:
    backend, fake, _ = make(3)
    backend.read(1)
    fake.lose(1)
    for _ in range(3):
        with pytest.raises(GpuLost):
            backend.read(1)
        assert backend.read(0).power_w == 125.0
        assert backend.read(2).power_w == 125.0
    fake.recover(1)  # old handles stay dead: the backend must re-acquire
    s = backend.read(1)
    assert s.gpu == 1 and s.temp_c == 40.0
    assert fake.count("nvmlDeviceGetHandleByUUID") >= 1
    assert fake.count("nvmlDeviceGetHandleByIndex") == 3  # only at start-up


def test_lost_gpu_is_probed_at_most_once_per_interval() -> None:
    backend, fake, clock = make(2, interval=1.0)
    fake.lose(0)
    with pytest.raises(GpuLost):
        backend.read(0)
    calls_after_loss = sum(fake.calls.values())
    for _ in range(10):
        with pytest.raises(GpuLost):
            backend.read(0)
    assert sum(fake.calls.values()) == calls_after_loss  # no NVML call while waiting
    clock.advance(1.0)
    with pytest.raises(GpuLost):
        backend.read(0)
    assert fake.count("nvmlDeviceGetHandleByUUID") == 1
    fake.recover(0)
    with pytest.raises(GpuLost):
        backend.read(0)  # still inside the interval after the failed probe
    clock.advance(1.0)
    assert backend.read(0).temp_c == 40.0


def test_gpu_lost_at_start_up_is_served_as_lost_and_recovers_by_index() -> None:
    backend, fake, _ = make([FakeGpu(), FakeGpu(lost=True)])
    assert backend.devices() == [0, 1]
    with pytest.raises(GpuLost):
        backend.read(1)
    with pytest.raises(GpuLost):
        backend.device_info(1)
    fake.recover(1)
    assert backend.read(1).temp_c == 40.0
    assert backend.device_info(1).uuid == "GPU-fake-1"


def test_device_info_and_energy_raise_gpu_lost() -> None:
    backend, fake, _ = make(2)
    fake.fail("nvmlDeviceGetMaxClockInfo", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=0, times=1)
    with pytest.raises(GpuLost):
        backend.device_info(0)
    fake.fail("nvmlDeviceGetTotalEnergyConsumption", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=1)
    with pytest.raises(GpuLost):
        backend.read_energy(1)
    assert backend.device_info(0).max_sm_clock_mhz == 1980.0


# -- device_info -------------------------------------------------------------------------


def test_device_info_reads_static_facts_once() -> None:
    backend, fake, _ = make([FakeGpu(), FakeGpu(power_limit_mw=None)])
    info = backend.device_info(0)
    assert info == DeviceInfo(
        index=0,
        uuid="GPU-fake-0",
        name="NVIDIA H200",
        driver_version="580.159.04",
        pci_bus_id="00000000:18:00.0",
        memory_total_bytes=150_754_820_096,
        max_sm_clock_mhz=1980.0,
        max_mem_clock_mhz=3201.0,
        power_limit_w=700.0,
        slowdown_temp_c=89.0,
        shutdown_temp_c=95.0,
        cuda_capability="9.0",
    )
    assert backend.device_info(0) is info
    assert fake.count("nvmlDeviceGetMaxClockInfo", gpu=0) == 2
    assert backend.device_info(1).power_limit_w is None  # unsupported: absent, not 0
    fake.gpus[0].power_limit_mw = 600_000
    assert backend.device_info(0, refresh=True).power_limit_w == 600.0
    assert fake.count("nvmlDeviceGetMaxClockInfo", gpu=0) == 4


# -- read_energy and memory temperature --------------------------------------------------


def test_read_energy_in_joules_and_memory_temperature_reaches_samples() -> None:
    backend, fake, _ = make([FakeGpu(energy_mj=12_345_678, mem_temp=52)])
    assert backend.read(0).mem_temp_c is None
    assert backend.read_energy(0) == pytest.approx(12_345.678)
    assert backend.read(0).mem_temp_c == 52.0
    fake.gpus[0].mem_temp = 55
    assert backend.read(0).mem_temp_c == 52.0  # as old as the last read_energy
    backend.read_energy(0)
    assert backend.read(0).mem_temp_c == 55.0


def test_unsupported_energy_and_memory_temperature_are_none_and_skipped() -> None:
    backend, fake, _ = make([FakeGpu(energy_mj=None, mem_temp=None, fields={})])
    for _ in range(4):
        assert backend.read_energy(0) is None
    assert backend.read(0).mem_temp_c is None
    assert fake.count("nvmlDeviceGetTotalEnergyConsumption") == 1
    assert fake.count("nvmlDeviceGetFieldValues") == 1  # every field value unsupported


# -- the slow health fields ---------------------------------------------------------------


def test_slow_fields_reach_later_samples_in_base_units() -> None:
    gpu = FakeGpu(
        memory_used=40 * 2**30, remapped_rows=(2, 1, 1, 0), fan_percent=55, pids=(7, 8, 9),
        process_memory={7: 2**30, 8: 5 * 2**30, 9: None},
    )  # fmt: skip
    backend, _, clock = make([gpu])
    assert backend.read(0).slow is None  # nothing read on the fast path
    clock.advance(1.0)
    backend.read_energy(0)
    slow = backend.read(0).slow
    assert slow is not None and slow.t == 101.0
    assert slow.memory_total_bytes == 150_754_820_096
    assert slow.memory_used_bytes == 40 * 2**30
    assert slow.memory_free_bytes == 150_754_820_096 - 40 * 2**30
    assert dict(slow.ecc_errors or {}) == {
        ("volatile", "corrected"): 3,
        ("volatile", "uncorrected"): 0,
        ("aggregate", "corrected"): 17,
        ("aggregate", "uncorrected"): 1,
    }
    assert slow.remapped_rows == RemappedRows(2, 1, pending=True, failed=False)
    assert (slow.pcie_tx_bytes, slow.pcie_rx_bytes, slow.pcie_replay_errors) == (0.0, 0.0, 2)
    assert (slow.nvlink_tx_bytes, slow.nvlink_rx_bytes) == (1000 * 1024.0, 2000 * 1024.0)
    assert slow.fan_speed_ratio == pytest.approx(0.55)
    # Largest first; a process whose memory NVML cannot see is left out.
    assert slow.processes == (ProcessMemory(8, 5 * 2**30), ProcessMemory(7, 2**30))


def test_slow_fields_a_gpu_lacks_are_absent_not_zero() -> None:
    gpu = FakeGpu(
        memory_used=None, remapped_rows=None, fan_percent=None, pids=None, fields={},
        pcie_kbps=None,
    )  # fmt: skip
    backend, fake, _ = make([gpu])
    for _ in range(3):
        backend.read_energy(0)
    slow = backend.read(0).slow
    assert slow is not None
    for name in ("memory_used_bytes", "memory_free_bytes", "memory_total_bytes", "ecc_errors",
                 "remapped_rows", "pcie_tx_bytes", "pcie_rx_bytes", "pcie_replay_errors",
                 "nvlink_tx_bytes", "nvlink_rx_bytes", "fan_speed_ratio", "processes"):  # fmt: skip
        assert getattr(slow, name) is None, name
    for func in ("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetFanSpeed"):
        assert fake.count(func) == 1, func  # remembered as unsupported
    assert fake.count("nvmlDeviceGetPcieThroughput") == 2  # TX and RX, once each
    assert backend.read(0).field_errors == {}


def test_one_field_value_failing_drops_only_that_field() -> None:
    backend, fake, _ = make(2)
    fake.fail_field(pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER, pynvml.NVML_ERROR_UNKNOWN, gpu=0)
    backend.read_energy(0)
    backend.read_energy(1)
    s0, s1 = backend.read(0), backend.read(1)
    assert s0.slow is not None and s1.slow is not None
    assert s0.slow.pcie_replay_errors is None and s0.slow.nvlink_rx_bytes == 2048000
    assert s0.mem_temp_c == 35.0 and s0.slow.ecc_errors is not None
    assert dict(s0.field_errors) == {"pcie_replay": 1}
    assert s1.slow.pcie_replay_errors == 2
    fake.fail_field(pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER, None, gpu=0)
    backend.read_energy(0)
    slow = backend.read(0).slow
    assert slow is not None and slow.pcie_replay_errors == 2  # asked again: not remembered


def test_pcie_bytes_integrate_the_throughput_samples() -> None:
    backend, fake, clock = make(1)
    backend.read_energy(0)  # the first sample: nothing to integrate yet
    clock.advance(5.0)
    fake.gpus[0].pcie_kbps = (3564, 2000)
    backend.read_energy(0)
    slow = backend.read(0).slow
    assert slow is not None
    assert slow.pcie_tx_bytes == pytest.approx(0.5 * (1564 + 3564) * 1024 * 5.0)
    assert slow.pcie_rx_bytes == pytest.approx(2000 * 1024 * 5.0)
    # A failed TX sample: TX is absent that time and its gap adds nothing; RX goes on.
    fake.fail("nvmlDeviceGetPcieThroughput", pynvml.NVML_ERROR_UNKNOWN, times=1)
    clock.advance(5.0)
    backend.read_energy(0)
    gap = backend.read(0).slow
    assert gap is not None and gap.pcie_tx_bytes is None
    assert gap.pcie_rx_bytes == pytest.approx(2000 * 1024 * 10.0)
    clock.advance(5.0)
    backend.read_energy(0)
    after = backend.read(0).slow
    assert after is not None and after.pcie_tx_bytes == slow.pcie_tx_bytes  # kept, not reset


def test_a_field_value_unsupported_on_one_gpu_is_not_asked_again() -> None:
    backend, fake, _ = make(1)
    fake.fail_field(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_ERROR_NOT_SUPPORTED)
    asked: list[list[object]] = []
    real = fake.nvmlDeviceGetFieldValues

    def spy(handle: object, ids: list[object]) -> object:
        asked.append(list(ids))
        return real(handle, ids)

    setattr(fake, "nvmlDeviceGetFieldValues", spy)  # noqa: B010
    backend = NvmlBackend(nvml=fake, xid_wait_s=0.02)
    for _ in range(3):
        backend.read_energy(0)
    tx = (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0xFFFFFFFF)
    assert [tx in ids for ids in asked] == [True, False, False]
    assert (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 0xFFFFFFFF) in asked[-1]
    slow = backend.read(0).slow
    assert slow is not None and slow.nvlink_tx_bytes is None and slow.nvlink_rx_bytes == 2048000
    backend.close()


@pytest.mark.parametrize(
    ("func", "attr"),
    [
        ("nvmlDeviceGetMemoryInfo", "memory_used_bytes"),
        ("nvmlDeviceGetRemappedRows", "remapped_rows"),
        ("nvmlDeviceGetComputeRunningProcesses_v3", "processes"),
        ("nvmlDeviceGetTotalEnergyConsumption", None),
    ],
)
@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_UNKNOWN, pynvml.NVML_ERROR_TIMEOUT])
def test_a_failing_slow_call_drops_only_its_field(func: str, attr: str | None, code: int) -> None:
    backend, fake, _ = make([FakeGpu(pids=(5,), process_memory={5: 2**20})])
    fake.fail(func, code, gpu=0, times=1)
    energy = backend.read_energy(0)
    slow = backend.read(0).slow
    assert slow is not None
    if attr is None:
        assert energy is None
    else:
        assert getattr(slow, attr) is None
        assert energy == 1000.0
    assert slow.pcie_rx_bytes == 0.0 and slow.ecc_errors is not None
    assert sum(backend.read(0).field_errors.values()) == 1
    backend.read_energy(0)
    again = backend.read(0).slow
    assert again is not None and again.memory_used_bytes is not None and again.processes


def test_the_whole_field_values_call_failing_drops_those_fields_only() -> None:
    backend, fake, _ = make(1)
    fake.fail("nvmlDeviceGetFieldValues", pynvml.NVML_ERROR_TIMEOUT, gpu=0, times=1)
    assert backend.read_energy(0) == 1000.0
    s = backend.read(0)
    assert s.slow is not None and s.slow.memory_used_bytes == 1_048_576_000
    assert s.mem_temp_c is None and s.slow.pcie_replay_errors is None
    assert s.slow.pcie_tx_bytes == 0.0  # not a field value: read on its own
    assert s.field_errors["pcie_replay"] == 1 and s.field_errors["mem_temp"] == 1
    backend.read_energy(0)
    assert backend.read(0).mem_temp_c == 35.0


def test_gpu_lost_during_the_slow_read_forgets_the_slow_fields() -> None:
    backend, fake, _ = make(2)
    backend.read_energy(0)
    assert backend.read(0).slow is not None
    fake.fail("nvmlDeviceGetRemappedRows", pynvml.NVML_ERROR_GPU_IS_LOST, gpu=0, times=1)
    with pytest.raises(GpuLost):
        backend.read_energy(0)
    s = backend.read(0)  # answers again on the next probe
    assert s.slow is None and s.mem_temp_c is None  # no stale reading survives a loss


# -- XID events -----------------------------------------------------------------------------


def test_xid_events_are_counted_per_gpu_and_code() -> None:
    backend, fake, _ = make(2)
    backend.read_energy(0)  # the slow path starts the XID thread
    fake.xid(1, 48)
    fake.xid(1, 48)
    fake.xid(1, 79)
    fake.xid(0, 13)

    def counted() -> bool:
        backend.read_energy(1)
        slow = backend.read(1).slow
        return slow is not None and dict(slow.xid_errors or {}) == {48: 2, 79: 1}

    wait_for(counted)
    backend.read_energy(0)
    wait_for(lambda: xids_after_slow_read(backend, 0) == {13: 1})
    backend.close()
    assert fake.count("nvmlEventSetFree") == 1


def test_a_gpu_without_xid_events_has_no_xid_count() -> None:
    backend, _, _ = make([FakeGpu(), FakeGpu(xid_events=False)])
    backend.read_energy(0)
    backend.read_energy(1)
    slow0, slow1 = backend.read(0).slow, backend.read(1).slow
    assert slow0 is not None and slow0.xid_errors == {}  # watched, nothing seen yet
    assert slow1 is not None and slow1.xid_errors is None  # absent, not 0
    backend.close()


def test_bindings_without_events_have_no_xid_counts() -> None:
    missing = ("nvmlEventSetCreate",)
    backend, _, _ = make(1, missing=missing)
    backend.read_energy(0)
    slow = backend.read(0).slow
    assert slow is not None and slow.xid_errors is None
    assert slow.pcie_tx_bytes == 0.0
    backend.close()


def test_the_xid_thread_is_started_by_the_slow_path_only_and_stops_on_close() -> None:
    before = xid_threads()
    backend, fake, _ = make(1)
    backend.read(0)
    backend.device_info(0)
    assert xid_threads() == before
    assert fake.count("nvmlEventSetCreate") == 0  # a tuning worker never starts it
    backend.read_energy(0)
    backend.read_energy(0)
    assert xid_threads() == before + 1
    backend.close()
    assert xid_threads() == before


def test_a_reacquired_gpu_is_watched_again() -> None:
    backend, fake, _ = make(1)
    backend.read_energy(0)
    fake.lose(0)
    with pytest.raises(GpuLost):
        backend.read(0)
    fake.recover(0)
    backend.read(0)  # re-acquired: a new handle, registered by the XID thread between waits
    wait_for(lambda: fake.count("nvmlDeviceRegisterEvents") == 2)
    fake.xid(0, 94)
    wait_for(lambda: xids_after_slow_read(backend, 0) == {94: 1})
    backend.close()


def test_a_broken_event_set_is_logged_once_and_does_not_spin(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend, fake, _ = make(1)
    fake.fail("nvmlEventSetWait_v2", pynvml.NVML_ERROR_UNKNOWN)
    backend.read_energy(0)
    time.sleep(0.2)
    backend.close()
    assert fake.count("nvmlEventSetWait_v2") <= 15  # one try per wait period, not a spin
    failures = [r for r in caplog.records if "waiting for XID events failed" in r.getMessage()]
    assert len(failures) == 1


class _XidTimeout(Exception):
    """The fake event functions' error: str "timeout" for a wait that timed out."""


def _fake_xid_api(
    wait: Callable[[object, int], object],
    register: Callable[[object, int, object], None] = lambda h, mask, event_set: None,
    free: Callable[[object], None] = lambda event_set: None,
) -> nvml_xid.XidApi:
    """NVML's event functions for :class:`XidCounter`, handles being their own keys."""
    return nvml_xid.XidApi(
        create=object,
        supported=lambda h: nvml_xid.XID_EVENT,
        register=register,
        wait=wait,
        free=free,
        errors=(_XidTimeout,),
        is_timeout=lambda exc: str(exc) == "timeout",
        key=lambda h: h,
    )


def _slow_wait_api(calls: list[str], wait_s: float) -> nvml_xid.XidApi:
    """Event functions whose wait always lasts its whole timeout (no XID ever comes)."""

    def wait(event_set: object, timeout_ms: int) -> object:
        calls.append("wait")
        time.sleep(timeout_ms / 1000.0)
        calls.append("woke")
        raise _XidTimeout("timeout")

    return _fake_xid_api(wait, free=lambda event_set: calls.append("free"))


def test_gpus_are_registered_on_the_xid_thread_and_never_while_it_waits() -> None:
    """The driver spins the registering thread until a wait on the same set returns."""
    calls: list[tuple[str, str]] = []
    waiting = threading.Event()

    def wait(event_set: object, timeout_ms: int) -> object:
        waiting.set()
        time.sleep(timeout_ms / 1000.0)
        waiting.clear()
        raise _XidTimeout("timeout")

    def register(handle: object, mask: int, event_set: object) -> None:
        during_wait = "during a wait" if waiting.is_set() else ""
        calls.append((str(handle), threading.current_thread().name + during_wait))

    counter = nvml_xid.XidCounter(_fake_xid_api(wait, register), wait_s=0.05)
    assert counter.start({0: "h0", 1: "h1"})
    wait_for(lambda: len(calls) == 2)
    assert counter.watch(1, "h1-again")  # a re-acquired handle, while the thread waits
    wait_for(lambda: len(calls) == 3)
    counter.close()
    thread = "gpuwatchd-xid"
    assert calls == [("h0", thread), ("h1", thread), ("h1-again", thread)]
    assert counter.counts(0) == {} and counter.counts(1) == {}


def test_a_failed_reregistration_keeps_the_counts_and_the_thread() -> None:
    """A flapping GPU's second registration fails: its counts stay, every GPU still counts."""
    events: queue.Queue[object] = queue.Queue()
    failing = threading.Event()

    def register(handle: object, mask: int, event_set: object) -> None:
        if failing.is_set():
            raise _XidTimeout("NVML_ERROR_UNKNOWN")

    def wait(event_set: object, timeout_ms: int) -> object:
        try:
            return events.get(timeout=timeout_ms / 1000.0)
        except queue.Empty:
            raise _XidTimeout("timeout") from None

    def xid(handle: str, code: int) -> None:
        events.put(SimpleNamespace(device=handle, eventType=nvml_xid.XID_EVENT, eventData=code))

    counter = nvml_xid.XidCounter(_fake_xid_api(wait, register), wait_s=0.02)
    assert counter.start({0: "h0", 1: "h1"})
    xid("h0", 79)
    wait_for(lambda: counter.counts(0) == {79: 1})
    failing.set()
    counter.watch(0, "h0")  # re-acquired: NVML hands back the same device address
    time.sleep(0.1)
    xid("h0", 79)
    xid("h1", 48)
    wait_for(lambda: counter.counts(1) == {48: 1})
    assert counter.counts(0) == {79: 2}
    counter.close()


def test_close_does_not_wait_out_a_long_xid_wait() -> None:
    calls: list[str] = []
    counter = nvml_xid.XidCounter(_slow_wait_api(calls, 1.5), wait_s=1.5)
    assert counter.start()
    wait_for(lambda: "wait" in calls)
    started = time.monotonic()
    done_here = counter.close(then=lambda: calls.append("then"))
    assert time.monotonic() - started < nvml_xid.CLOSE_WAIT_S + 0.3
    assert not done_here
    assert "free" not in calls  # the thread is still inside the wait: the set stays
    wait_for(lambda: "then" in calls, timeout=3.0)
    assert calls[-3:] == ["woke", "free", "then"]  # freed once the wait returned, then `then`
    assert calls.count("wait") == 1  # no second wait after close


def test_close_frees_at_once_when_the_thread_leaves_in_time() -> None:
    calls: list[str] = []
    counter = nvml_xid.XidCounter(_slow_wait_api(calls, 0.05), wait_s=0.05)
    assert counter.start()
    wait_for(lambda: "wait" in calls)
    assert counter.close(then=lambda: calls.append("then"))
    assert calls[-2:] == ["free", "then"]
    assert calls.count("free") == 1


def test_an_nvml_backend_closes_within_a_second_and_shuts_down_after_the_wait() -> None:
    fake = FakeNvml(1)
    backend = NvmlBackend(nvml=fake, xid_wait_s=2.0)
    _OPEN.append(backend)
    backend.read_energy(0)  # starts the XID thread, which waits 2 s at a time
    wait_for(lambda: fake.count("nvmlEventSetWait_v2") == 1)
    started = time.monotonic()
    backend.close()
    assert time.monotonic() - started < 1.0
    assert fake.count("nvmlShutdown") == 0  # never under a wait in progress
    assert fake.count("nvmlEventSetFree") == 0
    wait_for(lambda: fake.count("nvmlShutdown") == 1, timeout=4.0)
    assert fake.count("nvmlEventSetFree") == 1
    assert fake.initialized == 0
    backend.close()
    assert fake.count("nvmlShutdown") == 1


def test_xid_wait_must_be_a_sane_timeout() -> None:
    with pytest.raises(ValueError, match="xid_wait_s"):
        NvmlBackend(nvml=FakeNvml(1), xid_wait_s=0)
    with pytest.raises(ValueError, match="wait_s"):
        nvml_xid.XidCounter(NvmlBackend(nvml=FakeNvml(1))._xid_api, wait_s=float("inf"))


# -- a hung NVML call: the poller quarantines that GPU ---------------------------------------


def test_a_hung_field_quarantines_only_that_gpu() -> None:
    fake = FakeNvml(2)
    backend = NvmlBackend(nvml=fake, xid_wait_s=0.02)
    board = StateBoard()
    poller = Poller(backend, board, GateConfig(), period_s=0.02, stall_periods=2.0)
    release = fake.hang("nvmlDeviceGetUtilizationRates", gpu=1)
    poller.start()
    try:
        wait_for(lambda: poller.longest_stall_s() > 0.1)
        assert poller.check_stalls() == [1]
        snap1 = board.get(1)
        assert snap1 is not None and snap1.health.stalled and not snap1.health.success
        polled = fake.count("nvmlDeviceGetTemperature", gpu=0)
        wait_for(lambda: fake.count("nvmlDeviceGetTemperature", gpu=0) > polled + 3)
        snap0 = board.get(0)
        assert snap0 is not None and snap0.health.success and snap0.sample is not None
        release.set()
        fake.clear("nvmlDeviceGetUtilizationRates")
        with fake._lock:
            fake._hangs.clear()
        wait_for(lambda: (board.get(1) or snap1).health.success)
        assert poller.check_stalls() == []
    finally:
        release.set()
        poller.stop()
        backend.close()


# -- safety and lifecycle ----------------------------------------------------------------


#: The XID event subscription: the only NVML calls that are not getters. They change no
#: GPU setting (an event set belongs to the process and dies with it).
EVENT_CALLS = frozenset(
    {
        "nvmlEventSetCreate",
        "nvmlDeviceRegisterEvents",
        "nvmlEventSetWait",
        "nvmlEventSetWait_v2",
        "nvmlEventSetFree",
    }
)


@pytest.mark.parametrize("module", [nvml_module, nvml_xid, fields_module])
def test_source_never_names_a_setter_or_reset(module: object) -> None:
    source = Path(module.__file__).read_text()  # type: ignore[attr-defined]
    names = set(re.findall(r"nvml[A-Za-z0-9_]*", source)) - EVENT_CALLS
    forbidden = [n for n in names if re.search(r"Set(?!s)|Reset|Clear|Register|Create", n)]
    assert forbidden == []
    assert "Reset" not in source
    assert re.search(r"\bSet[A-Z]", source) is None
    # Every NVML function it binds is a getter, init/shutdown or a handle lookup.
    bound = {n for n in names if re.fullmatch(r"nvml(Device|System)[A-Za-z0-9_]+", n)}
    assert all(re.match(r"nvml(Device|System)Get", n) for n in bound), bound


def test_every_nvml_call_made_is_a_read() -> None:
    backend, fake, _ = make([FakeGpu(), FakeGpu(lost=True)])
    backend.read(0)
    backend.read_energy(0)
    backend.device_info(0, refresh=True)
    fake.recover(1)
    backend.read(1)
    backend.read_energy(1)
    backend.close()
    allowed = re.compile(r"nvmlInit|nvmlShutdown|nvml(Device|System)Get\w+")
    called = fake.called_names()
    assert all(allowed.fullmatch(n) or n in EVENT_CALLS for n in called), called
    assert "nvmlDeviceRegisterEvents" in called  # the XID subscription did run


def test_close_shuts_nvml_down_once() -> None:
    backend, fake, _ = make(1)
    backend.close()
    backend.close()
    assert fake.count("nvmlShutdown") == 1
    assert fake.initialized == 0


def test_concurrent_reads_refreshes_and_energy_reads_stay_consistent() -> None:
    backend, fake, _ = make(4)
    fake.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=2)
    errors: list[BaseException] = []
    samples: dict[int, list] = {i: [] for i in range(4)}
    start = threading.Barrier(5)

    def poll(gpu: int) -> None:
        start.wait()
        try:
            for _ in range(300):
                samples[gpu].append(backend.read(gpu))
        except BaseException as exc:
            errors.append(exc)

    def slow() -> None:
        start.wait()
        try:
            for i in range(60):
                backend.device_info(i % 4, refresh=True)
                backend.read_energy(i % 4)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=poll, args=(i,)) for i in range(4)]
    threads.append(threading.Thread(target=slow))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for gpu, got in samples.items():
        assert len(got) == 300
        assert all(s.gpu == gpu and s.temp_c == 40.0 for s in got)
        powers = {s.power_w for s in got}
        assert powers == ({None} if gpu == 2 else {125.0})
    # Refreshes forget the unsupported field, so it is re-asked, but never every poll.
    assert 1 <= fake.count("nvmlDeviceGetPowerUsage", gpu=2) <= 16
