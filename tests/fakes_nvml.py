"""A fake pynvml module for tests: configurable GPUs, injected errors, counted calls.

It raises pynvml's own exception classes (``pynvml.NVMLError(code)`` maps a code to its
``NVMLError_*`` subclass), so code under test sees exactly what real NVML would raise.
It implements getters only: there is no setter to call by mistake.

Usage::

    fake = FakeNvml([FakeGpu(power_mw=None), FakeGpu()])   # GPU 0 has no power sensor
    fake.fail("nvmlDeviceGetTemperature", pynvml.NVML_ERROR_UNKNOWN, gpu=1, times=1)
    fake.lose(1); ...; fake.recover(1)                     # GPU 1 falls off the bus
    fake.count("nvmlDeviceGetPowerUsage", gpu=0)           # how often it was asked
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import pynvml  # type: ignore[import-untyped]


@dataclass
class FakeGpu:
    """One fake GPU. A reading set to ``None`` makes its NVML call raise NotSupported."""

    name: str = "NVIDIA H200"
    uuid: str | None = None  # default GPU-fake-<index>
    pci_bus_id: str | None = None  # default 00000000:<18+index>:00.0
    memory_total: int | None = 150_754_820_096
    max_sm_clock: int | None = 1980
    max_mem_clock: int | None = 3201
    power_limit_mw: int | None = 700_000
    slowdown_temp: int | None = 89
    shutdown_temp: int | None = 95
    cuda_capability: tuple[int, int] | None = (9, 0)
    temp: int | None = 40
    power_mw: int | None = 125_000
    sm_clock: int | None = 1980
    mem_clock: int | None = 3201
    reasons: int | None = 0x1
    util: tuple[int, int] | None = (0, 0)  # percent: gpu, memory
    pids: tuple[int, ...] | None = ()
    pstate: int | None = 0
    energy_mj: int | None = 1_000_000
    mem_temp: int | None = 35
    lost: bool = False


@dataclass(frozen=True)
class FakeHandle:
    index: int
    generation: int


@dataclass
class _Injected:
    code: int
    times: int | None  # None: until cleared


class FakeNvml(ModuleType):
    """A module object shaped like pynvml, for ``NvmlBackend(nvml=FakeNvml(...))``.

    ``legacy=True`` mimics old bindings: strings come back as ``bytes`` and
    ``nvmlDeviceGetCurrentClocksEventReasons`` does not exist. ``missing`` names more
    functions the module lacks. ``init_error`` is the NVML error code ``nvmlInit`` raises.
    """

    def __init__(
        self,
        gpus: int | Sequence[FakeGpu] = 1,
        *,
        init_error: int | None = None,
        legacy: bool = False,
        missing: Iterable[str] = (),
        driver_version: str = "580.159.04",
    ) -> None:
        super().__init__("fake_pynvml")
        self.gpus: list[FakeGpu] = (
            [FakeGpu() for _ in range(gpus)] if isinstance(gpus, int) else list(gpus)
        )
        for i, g in enumerate(self.gpus):
            g.uuid = g.uuid or f"GPU-fake-{i}"
            g.pci_bus_id = g.pci_bus_id or f"00000000:{0x18 + i:02X}:00.0"
        self.init_error = init_error
        self.legacy = legacy
        self.driver_version = driver_version
        self.calls: Counter[tuple[str, int | None]] = Counter()
        self.initialized = 0
        self._generation = [0] * len(self.gpus)
        self._errors: dict[tuple[str, int | None], _Injected] = {}
        self._lock = threading.Lock()
        for key, value in vars(pynvml).items():
            if key.startswith(("NVML_", "NVMLError")) or key == "NVMLLibraryMismatchError":
                setattr(self, key, value)
        hidden = set(missing)
        if legacy:
            hidden.add("nvmlDeviceGetCurrentClocksEventReasons")
        for name, impl in self._functions().items():
            if name not in hidden:
                setattr(self, name, self._wrap(name, impl))

    # -- test controls ---------------------------------------------------------------

    def fail(self, func: str, code: int, gpu: int | None = None, times: int | None = None) -> None:
        """Make ``func`` raise ``NVMLError(code)`` (for one GPU, or all), ``times`` times."""
        with self._lock:
            self._errors[(func, gpu)] = _Injected(code, times)

    def clear(self, func: str, gpu: int | None = None) -> None:
        with self._lock:
            self._errors.pop((func, gpu), None)

    def lose(self, gpu: int) -> None:
        """The GPU falls off the bus: every call on it raises GPU_IS_LOST."""
        self.gpus[gpu].lost = True

    def recover(self, gpu: int) -> None:
        """The GPU answers again; handles taken before the loss stay dead."""
        self.gpus[gpu].lost = False
        self._generation[gpu] += 1

    def count(self, func: str, gpu: int | None = None) -> int:
        """Calls of ``func``: on one GPU, or (``gpu=None``) in total."""
        if gpu is not None:
            return self.calls[(func, gpu)]
        return sum(n for (name, _), n in self.calls.items() if name == func)

    def called_names(self) -> set[str]:
        return {name for name, _ in self.calls}

    # -- plumbing ------------------------------------------------------------------------

    def _raise(self, code: int) -> None:
        raise pynvml.NVMLError(code)

    def _wrap(self, name: str, impl: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            gpu = args[0].index if args and isinstance(args[0], FakeHandle) else None
            with self._lock:
                self.calls[(name, gpu)] += 1
                injected = self._errors.get((name, gpu)) or self._errors.get((name, None))
                if injected is not None and injected.times is not None:
                    injected.times -= 1
                    if injected.times <= 0:
                        self._errors = {k: v for k, v in self._errors.items() if v is not injected}
            if injected is not None:
                self._raise(injected.code)
            if name not in ("nvmlInit", "nvmlShutdown") and not self.initialized:
                self._raise(pynvml.NVML_ERROR_UNINITIALIZED)
            return impl(*args)

        call.__name__ = name
        return call

    def _gpu(self, handle: FakeHandle) -> FakeGpu:
        g = self.gpus[handle.index]
        if g.lost or handle.generation != self._generation[handle.index]:
            self._raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        return g

    def _handle(self, index: int) -> FakeHandle:
        if self.gpus[index].lost:
            self._raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        return FakeHandle(index, self._generation[index])

    def _value(self, value: Any) -> Any:
        if value is None:
            self._raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def _str(self, value: str | None) -> str | bytes:
        text = self._value(value)
        return text.encode() if self.legacy else text

    def _functions(self) -> dict[str, Callable[..., Any]]:
        v, gpu, s = self._value, self._gpu, self._str

        def init() -> None:
            if self.init_error is not None:
                self._raise(self.init_error)
            self.initialized += 1

        def shutdown() -> None:
            if not self.initialized:
                self._raise(pynvml.NVML_ERROR_UNINITIALIZED)
            self.initialized -= 1

        def by_index(index: int) -> FakeHandle:
            if not 0 <= index < len(self.gpus):
                self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            return self._handle(index)

        def by_key(attr: str) -> Callable[[str | bytes], FakeHandle]:
            def lookup(key: str | bytes) -> FakeHandle:
                key = key.decode() if isinstance(key, bytes) else key
                for i, g in enumerate(self.gpus):
                    if getattr(g, attr) == key:
                        return self._handle(i)
                self._raise(pynvml.NVML_ERROR_NOT_FOUND)
                raise AssertionError("unreachable")

            return lookup

        def clock(h: FakeHandle, kind: int) -> int:
            g = gpu(h)
            return v(g.sm_clock if kind == pynvml.NVML_CLOCK_SM else g.mem_clock)

        def max_clock(h: FakeHandle, kind: int) -> int:
            g = gpu(h)
            return v(g.max_sm_clock if kind == pynvml.NVML_CLOCK_SM else g.max_mem_clock)

        def threshold(h: FakeHandle, kind: int) -> int:
            g = gpu(h)
            slow = kind == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
            return v(g.slowdown_temp if slow else g.shutdown_temp)

        def temperature(h: FakeHandle, sensor: int) -> int:
            assert sensor == pynvml.NVML_TEMPERATURE_GPU, sensor
            return v(gpu(h).temp)

        def util(h: FakeHandle) -> SimpleNamespace:
            u = v(gpu(h).util)
            return SimpleNamespace(gpu=u[0], memory=u[1])

        def procs(h: FakeHandle) -> list[SimpleNamespace]:
            return [SimpleNamespace(pid=p, usedGpuMemory=None) for p in v(gpu(h).pids)]

        def field_values(h: FakeHandle, ids: list[int]) -> list[SimpleNamespace]:
            g = gpu(h)
            out = []
            for fid in ids:
                ok = fid == pynvml.NVML_FI_DEV_MEMORY_TEMP and g.mem_temp is not None
                out.append(
                    SimpleNamespace(
                        fieldId=fid,
                        nvmlReturn=pynvml.NVML_SUCCESS if ok else pynvml.NVML_ERROR_NOT_SUPPORTED,
                        valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
                        value=SimpleNamespace(uiVal=g.mem_temp if ok else 0),
                    )
                )
            return out

        def pci(h: FakeHandle) -> SimpleNamespace:
            return SimpleNamespace(busId=str(gpu(h).pci_bus_id).encode())  # ctypes char array

        def memory(h: FakeHandle) -> SimpleNamespace:
            total = v(gpu(h).memory_total)
            return SimpleNamespace(total=total, free=total, used=0)

        return {
            "nvmlInit": init,
            "nvmlShutdown": shutdown,
            "nvmlDeviceGetCount": lambda: len(self.gpus),
            "nvmlSystemGetDriverVersion": lambda: s(self.driver_version),
            "nvmlDeviceGetHandleByIndex": by_index,
            "nvmlDeviceGetHandleByUUID": by_key("uuid"),
            "nvmlDeviceGetHandleByPciBusId": by_key("pci_bus_id"),
            "nvmlDeviceGetUUID": lambda h: s(gpu(h).uuid),
            "nvmlDeviceGetName": lambda h: s(gpu(h).name),
            "nvmlDeviceGetPciInfo": pci,
            "nvmlDeviceGetMemoryInfo": memory,
            "nvmlDeviceGetMaxClockInfo": max_clock,
            "nvmlDeviceGetEnforcedPowerLimit": lambda h: v(gpu(h).power_limit_mw),
            "nvmlDeviceGetTemperatureThreshold": threshold,
            "nvmlDeviceGetCudaComputeCapability": lambda h: v(gpu(h).cuda_capability),
            "nvmlDeviceGetTemperature": temperature,
            "nvmlDeviceGetPowerUsage": lambda h: v(gpu(h).power_mw),
            "nvmlDeviceGetClockInfo": clock,
            "nvmlDeviceGetCurrentClocksEventReasons": lambda h: v(gpu(h).reasons),
            "nvmlDeviceGetCurrentClocksThrottleReasons": lambda h: v(gpu(h).reasons),
            "nvmlDeviceGetUtilizationRates": util,
            "nvmlDeviceGetComputeRunningProcesses_v3": procs,
            "nvmlDeviceGetComputeRunningProcesses_v2": procs,
            "nvmlDeviceGetComputeRunningProcesses": procs,
            "nvmlDeviceGetPerformanceState": lambda h: v(gpu(h).pstate),
            "nvmlDeviceGetTotalEnergyConsumption": lambda h: v(gpu(h).energy_mj),
            "nvmlDeviceGetFieldValues": field_values,
        }
