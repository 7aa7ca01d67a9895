"""NvmlBackend against a fake pynvml (tests/fakes_nvml.py) and, where safe, the real one."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
import threading
from pathlib import Path

import pynvml  # type: ignore[import-untyped]
import pytest
from fakes_nvml import FakeGpu, FakeNvml

from gpuwatchd.telemetry import nvml as nvml_module
from gpuwatchd.telemetry.backend import Backend, BackendUnavailable, GpuLost, TelemetryError
from gpuwatchd.telemetry.clocks import ManualClock
from gpuwatchd.telemetry.nvml import NvmlBackend
from gpuwatchd.telemetry.types import DeviceInfo, ThrottleReason

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
)


def make(
    gpus: int | list[FakeGpu] = 2, interval: float = 0.0, **fake_kw: object
) -> tuple[NvmlBackend, FakeNvml, ManualClock]:
    fake = FakeNvml(gpus, **fake_kw)  # type: ignore[arg-type]
    clock = ManualClock(100.0)
    return NvmlBackend(clock=clock, nvml=fake, reprobe_interval_s=interval), fake, clock


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


def test_other_nvml_error_is_a_telemetry_error_and_is_retried() -> None:
    backend, fake, _ = make(2)
    fake.fail("nvmlDeviceGetClockInfo", pynvml.NVML_ERROR_UNKNOWN, gpu=0, times=1)
    with pytest.raises(TelemetryError, match=r"GPU 0: NVML read of sm_clock failed") as err:
        backend.read(0)
    assert not isinstance(err.value, GpuLost)
    assert backend.read(0).sm_clock_mhz == 1980.0  # not remembered as unsupported
    assert backend.read(1).sm_clock_mhz == 1980.0


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
    backend, fake, _ = make([FakeGpu(energy_mj=None, mem_temp=None)])
    for _ in range(4):
        assert backend.read_energy(0) is None
    assert backend.read(0).mem_temp_c is None
    assert fake.count("nvmlDeviceGetTotalEnergyConsumption") == 1
    assert fake.count("nvmlDeviceGetFieldValues") == 1


# -- safety and lifecycle ----------------------------------------------------------------


def test_source_never_names_a_setter_or_reset() -> None:
    source = Path(nvml_module.__file__).read_text()
    names = set(re.findall(r"nvml[A-Za-z0-9_]*", source))
    forbidden = [n for n in names if re.search(r"Set(?!s)|Reset|Clear|Register|Create", n)]
    assert forbidden == []
    assert "Reset" not in source
    assert re.search(r"\bSet[A-Z]", source) is None
    # Every NVML function it binds is a getter, init/shutdown or a handle lookup.
    bound = {n for n in names if re.fullmatch(r"nvml(Device|System)[A-Za-z0-9_]+", n)}
    assert bound and all(re.match(r"nvml(Device|System)Get", n) for n in bound), bound


def test_every_nvml_call_made_is_a_read() -> None:
    backend, fake, _ = make([FakeGpu(), FakeGpu(lost=True)])
    backend.read(0)
    backend.read_energy(0)
    backend.device_info(0, refresh=True)
    fake.recover(1)
    backend.read(1)
    backend.close()
    allowed = re.compile(r"nvmlInit|nvmlShutdown|nvml(Device|System)Get\w+")
    assert all(allowed.fullmatch(n) for n in fake.called_names()), fake.called_names()


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
