"""A fake pynvml module for tests: configurable GPUs, injected errors, counted calls.

It raises pynvml's own exception classes (``pynvml.NVMLError(code)`` maps a code to its
``NVMLError_*`` subclass), so code under test sees exactly what real NVML would raise.
It implements getters only: there is no setter to call by mistake.

Usage::

    fake = FakeNvml([FakeGpu(power_mw=None), FakeGpu()])   # GPU 0 has no power sensor
    fake.fail("nvmlDeviceGetTemperature", pynvml.NVML_ERROR_UNKNOWN, gpu=1, times=1)
    fake.lose(1); ...; fake.recover(1)                     # GPU 1 falls off the bus
    fake.count("nvmlDeviceGetPowerUsage", gpu=0)           # how often it was asked
    fake.fail_field(pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER, pynvml.NVML_ERROR_UNKNOWN)
    release = fake.hang("nvmlDeviceGetUtilizationRates", gpu=1)  # blocks until release.set()
    fake.xid(0, 48)                                        # GPU 0 reports XID 48
    FakeNvml([FakeGpu(mig_mode=1, mig_devices=(FakeMig(1, 0, "1g.18gb"), ...))])  # MIG on
    costed = FakeNvml(8, costs=REAL_CALL_COSTS)   # each call takes what a real one does
    paced = FakeNvml(8, costs=DAEMON_PACE_CALL_COSTS)  # ... when made at 10 Hz

Field values (``nvmlDeviceGetFieldValues``) take field ids or ``(id, scope)`` pairs like
pynvml; a field the GPU's ``fields`` lacks answers NOT_SUPPORTED in its own entry.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import pynvml  # type: ignore[import-untyped]


@dataclass(frozen=True)
class CallCost:
    """What one real pynvml call costs: wall time, and how much of it is CPU time.

    The CPU part is spent busy (the GIL released for parts over 50 µs, as ctypes releases
    it around a real call); the rest is slept, as a real call waits in the driver.
    """

    wall_us: float
    cpu_us: float

    def __post_init__(self) -> None:
        if not 0 <= self.cpu_us <= self.wall_us:
            raise ValueError(f"CallCost: need 0 <= cpu_us <= wall_us, got {self}")


def _fast(us: float) -> CallCost:
    return CallCost(us, us)


#: Measured costs of real pynvml calls in a hot loop (the driver's caches warm). Fast
#: fields, energy, max clock and the memory temperature field: H200,
#: ``bench/data/h200-nvml-poll-cost.json`` (median of 5 runs); health fields, PCIe
#: throughput and XID events: H100, bench/RESULTS.md "NVML health fields". Static facts
#: not measured alone: the 1-3 µs of a plain getter. CPU shares: every getter is all CPU
#: but the PCIe throughput sample (4%) and the event wait, which sleeps its timeout and
#: then costs ~165 µs of CPU (``bench/data/h100-nvml-call-cpu.json``).
REAL_CALL_COSTS: dict[str, CallCost] = {
    "nvmlDeviceGetTemperature": _fast(1.83),
    "nvmlDeviceGetPowerUsage": _fast(1.65),
    "nvmlDeviceGetClockInfo": _fast(2.0),
    "nvmlDeviceGetCurrentClocksEventReasons": _fast(1.66),
    "nvmlDeviceGetCurrentClocksThrottleReasons": _fast(1.66),
    "nvmlDeviceGetUtilizationRates": _fast(1.56),
    "nvmlDeviceGetComputeRunningProcesses_v3": _fast(8.96),
    "nvmlDeviceGetComputeRunningProcesses_v2": _fast(8.96),
    "nvmlDeviceGetComputeRunningProcesses": _fast(8.96),
    "nvmlDeviceGetPerformanceState": _fast(1.54),
    "nvmlDeviceGetTotalEnergyConsumption": _fast(3996.0),
    "nvmlDeviceGetMaxClockInfo": _fast(1315.0),
    "nvmlDeviceGetTemperatureThreshold": _fast(140.0),
    "nvmlDeviceGetFieldValues": _fast(815.0),
    "nvmlDeviceGetMemoryInfo": _fast(8.0),
    "nvmlDeviceGetRemappedRows": _fast(3.0),
    "nvmlDeviceGetFanSpeed": _fast(2.0),
    "nvmlDeviceGetPcieThroughput": CallCost(20909.0, 784.0),
    "nvmlDeviceRegisterEvents": _fast(837.0),
    "nvmlEventSetCreate": _fast(10.0),
    "nvmlEventSetWait_v2": _fast(165.0),  # after the timeout it waits (a sleep)
}
#: The fast getters at a daemon's pace: CPU µs of each call in the poll's order, the
#: sequence run 0.1 s after the last (10 Hz), median of 20 rounds on an H100
#: (``bench/nvml_cold_cost.py``, ``bench/data/h100-nvml-cold-cost.json``). The first call
#: of a poll pays for cold caches (52 µs), the process list is 75 µs: 176 µs a GPU, 7x
#: the hot loop. Every GPU of a fake pays it, so for several GPUs this bounds the cost
#: from above (a real host's second GPU follows the first with warmer caches).
DAEMON_PACE_CALL_COSTS: dict[str, CallCost] = {
    **REAL_CALL_COSTS,
    "nvmlDeviceGetTemperature": _fast(51.8),
    "nvmlDeviceGetPowerUsage": _fast(12.7),
    "nvmlDeviceGetClockInfo": _fast(6.3),  # SM 8.9, memory 3.6
    "nvmlDeviceGetCurrentClocksEventReasons": _fast(9.2),
    "nvmlDeviceGetCurrentClocksThrottleReasons": _fast(9.2),
    "nvmlDeviceGetUtilizationRates": _fast(7.0),
    "nvmlDeviceGetComputeRunningProcesses_v3": _fast(75.5),
    "nvmlDeviceGetComputeRunningProcesses_v2": _fast(75.5),
    "nvmlDeviceGetComputeRunningProcesses": _fast(75.5),
    "nvmlDeviceGetPerformanceState": _fast(5.8),
    "nvmlDeviceGetTotalEnergyConsumption": _fast(3516.0),
    "nvmlDeviceGetMaxClockInfo": _fast(1626.0),
}
#: A getter the table does not name.
DEFAULT_CALL_COST = _fast(2.0)
_GIL_FREE_BURN_US = 50.0  # CPU parts longer than this are burnt with the GIL released
_BURN_BLOCK = bytes(16384)


def _spend(started: float, cost: CallCost) -> None:
    """Make a call that began at ``started`` (perf_counter) last as long as ``cost`` says."""
    cpu_end = started + cost.cpu_us * 1e-6
    now = time.perf_counter
    if cost.cpu_us > _GIL_FREE_BURN_US:
        while now() < cpu_end:  # hashlib releases the GIL while it hashes a block
            hashlib.sha256(_BURN_BLOCK).digest()
    else:
        while now() < cpu_end:
            pass
    rest = started + cost.wall_us * 1e-6 - now()
    if rest > 0:
        time.sleep(rest)


@dataclass
class FakeMig:
    """One MIG device of a fake GPU in MIG mode (in ``FakeGpu.mig_devices``, by slot)."""

    gpu_instance_id: int
    compute_instance_id: int
    profile: str = "1g.18gb"
    memory_total: int = 18_253_611_008
    memory_used: int = 1_048_576_000
    util: int | None = None  # percent; None: NotSupported, as most drivers answer


@dataclass(frozen=True)
class FakeMigHandle:
    """A MIG device's handle: its GPU and slot."""

    gpu: int
    slot: int


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
    enc_util: int | None = 12  # percent
    energy_mj: int | None = 1_000_000
    mem_temp: int | None = 35
    memory_used: int | None = 1_048_576_000  # with memory_total; free is the rest
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # corr, unc, pending, fail
    fan_percent: int | None = None  # passively cooled, like an SXM board
    pcie_kbps: tuple[int, int] | None = (1564, 2000)  # throughput sample: TX, RX in KB/s
    process_memory: dict[int, int | None] | None = None  # pid -> bytes; default: none known
    #: Field values by NVML field id (scope-less), the memory temperature excepted.
    fields: dict[int, int] | None = None  # default: an H200's (ECC, PCIe, NVLink)
    xid_events: bool = True
    lost: bool = False
    #: ``nvmlDeviceGetMigMode``'s current mode (0 off, 1 on); None: no MIG (NotSupported).
    mig_mode: int | None = None
    mig_devices: tuple[FakeMig | None, ...] = ()  # by slot; None: an empty slot
    max_mig_devices: int = 7

    def __post_init__(self) -> None:
        if self.fields is None:
            self.fields = {
                pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: 3,
                pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: 0,
                pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL: 17,
                pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL: 1,
                pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER: 2,
                pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: 1000,  # KiB, all links
                pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: 2000,
            }


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
    ``costs`` (e.g. :data:`REAL_CALL_COSTS`) makes every call take what the real one
    takes (:data:`DEFAULT_CALL_COST` for one it does not name), so the daemon's CPU use
    can be measured without a GPU; the fake's own Python counts inside that time, so a
    costed call skips the bookkeeping while no fault is injected, and a costed fake does
    not count calls (:meth:`count` refuses).
    """

    def __init__(
        self,
        gpus: int | Sequence[FakeGpu] = 1,
        *,
        init_error: int | None = None,
        legacy: bool = False,
        missing: Iterable[str] = (),
        driver_version: str = "580.159.04",
        costs: Mapping[str, CallCost] | None = None,
    ) -> None:
        super().__init__("fake_pynvml")
        self.costs = costs
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
        self._field_errors: dict[tuple[int, int | None], int] = {}
        self._hangs: dict[tuple[str, int | None], threading.Event] = {}
        self._events: queue.Queue[SimpleNamespace] = queue.Queue()
        self._registered: dict[int, int] = {}  # gpu -> event mask
        self._lock = threading.Lock()
        for key, value in vars(pynvml).items():
            if key.startswith(("NVML_", "NVMLError", "nvmlEventType")) or key in (
                "NVMLLibraryMismatchError",
            ):
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

    def fail_field(self, field_id: int, code: int | None, gpu: int | None = None) -> None:
        """Make one field value answer ``code`` in its entry (``None`` clears it)."""
        with self._lock:
            if code is None:
                self._field_errors.pop((field_id, gpu), None)
            else:
                self._field_errors[(field_id, gpu)] = code

    def hang(self, func: str, gpu: int | None = None) -> threading.Event:
        """Make ``func`` block (a stuck driver call) until the returned event is set."""
        release = threading.Event()
        with self._lock:
            self._hangs[(func, gpu)] = release
        return release

    def xid(self, gpu: int, code: int) -> None:
        """GPU ``gpu`` reports XID ``code``: an event for every set it is registered with."""
        if self._registered.get(gpu, 0) & pynvml.nvmlEventTypeXidCriticalError:
            event = SimpleNamespace(
                device=FakeHandle(gpu, self._generation[gpu]),
                eventType=pynvml.nvmlEventTypeXidCriticalError,
                eventData=code,
                gpuInstanceId=0,
                computeInstanceId=0,
            )
            self._events.put(event)

    def lose(self, gpu: int) -> None:
        """The GPU falls off the bus: every call on it raises GPU_IS_LOST."""
        self.gpus[gpu].lost = True

    def recover(self, gpu: int) -> None:
        """The GPU answers again; handles taken before the loss stay dead."""
        self.gpus[gpu].lost = False
        self._generation[gpu] += 1

    def count(self, func: str, gpu: int | None = None) -> int:
        """Calls of ``func``: on one GPU, or (``gpu=None``) in total (not on a costed fake)."""
        self._check_counted()
        if gpu is not None:
            return self.calls[(func, gpu)]
        return sum(n for (name, _), n in self.calls.items() if name == func)

    def called_names(self) -> set[str]:
        self._check_counted()
        return {name for name, _ in self.calls}

    # -- plumbing ------------------------------------------------------------------------

    def _check_counted(self) -> None:
        if self.costs is not None:
            raise ValueError("a costed FakeNvml (a bench's) does not count its calls")

    def _raise(self, code: int) -> None:
        raise pynvml.NVMLError(code)

    def _wrap(self, name: str, impl: Callable[..., Any]) -> Callable[..., Any]:
        if self.costs is None:
            return self._checked(name, impl)
        checked = self._checked(name, impl)
        cost = self.costs.get(name, DEFAULT_CALL_COST)
        clock = time.perf_counter

        def costed(*args: Any) -> Any:
            started = clock()
            try:
                if self._errors or self._hangs or not self.initialized:
                    return checked(*args)
                # Nothing injected: skip the bookkeeping, so the fake's own Python stays
                # inside the call's cost (it was ~6 µs a call, 3x a real getter).
                return impl(*args)
            finally:
                _spend(started, cost)

        costed.__name__ = name
        return costed

    def _checked(self, name: str, impl: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            gpu = args[0].index if args and isinstance(args[0], FakeHandle) else None
            with self._lock:
                self.calls[(name, gpu)] += 1
                injected = self._errors.get((name, gpu)) or self._errors.get((name, None))
                if injected is not None and injected.times is not None:
                    injected.times -= 1
                    if injected.times <= 0:
                        self._errors = {k: v for k, v in self._errors.items() if v is not injected}
                hung = self._hangs.get((name, gpu)) or self._hangs.get((name, None))
            if hung is not None:
                hung.wait()
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
            g = gpu(h)
            memory = g.process_memory or {}
            return [SimpleNamespace(pid=p, usedGpuMemory=memory.get(p)) for p in v(g.pids)]

        def field_values(h: FakeHandle, ids: list[int | tuple[int, int]]) -> list[SimpleNamespace]:
            g = gpu(h)
            known = {**(g.fields or {}), pynvml.NVML_FI_DEV_MEMORY_TEMP: g.mem_temp}
            out = []
            for request in ids:
                fid, scope = request if isinstance(request, tuple) else (request, 0)
                value = known.get(fid)
                code = self._field_errors.get((fid, h.index), self._field_errors.get((fid, None)))
                if code is None:
                    code = (
                        pynvml.NVML_SUCCESS
                        if value is not None
                        else pynvml.NVML_ERROR_NOT_SUPPORTED
                    )
                out.append(
                    SimpleNamespace(
                        fieldId=fid,
                        scopeId=scope,
                        nvmlReturn=code,
                        valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
                        value=SimpleNamespace(ullVal=value if code == pynvml.NVML_SUCCESS else 0),
                    )
                )
            return out

        def pcie_throughput(h: FakeHandle, counter: int) -> int:
            kbps = v(gpu(h).pcie_kbps)
            return kbps[0] if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else kbps[1]

        def event_set_create() -> SimpleNamespace:
            return SimpleNamespace(freed=False)

        def supported_events(h: FakeHandle) -> int:
            g = gpu(h)
            return pynvml.nvmlEventTypeXidCriticalError if g.xid_events else 0

        def register_events(h: FakeHandle, mask: int, event_set: SimpleNamespace) -> None:
            if not mask & supported_events(h):
                self._raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
            self._registered[h.index] = mask

        def event_wait(event_set: SimpleNamespace, timeout_ms: int) -> SimpleNamespace:
            try:
                return self._events.get(timeout=timeout_ms / 1000.0)
            except queue.Empty:
                self._raise(pynvml.NVML_ERROR_TIMEOUT)
                raise AssertionError("unreachable") from None

        def event_free(event_set: SimpleNamespace) -> None:
            event_set.freed = True

        def mig(h: FakeMigHandle) -> FakeMig:
            g = gpu(FakeHandle(h.gpu, self._generation[h.gpu]))
            if g.mig_mode != 1 or h.slot >= len(g.mig_devices):
                self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            device = g.mig_devices[h.slot]
            if device is None:
                self._raise(pynvml.NVML_ERROR_NOT_FOUND)
            assert device is not None
            return device

        def mig_mode(h: FakeHandle) -> list[int]:
            mode = v(gpu(h).mig_mode)
            return [mode, mode]

        def mig_handle(h: FakeHandle, slot: int) -> FakeMigHandle:
            g = gpu(h)
            if g.mig_mode != 1:
                self._raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if slot >= len(g.mig_devices) or g.mig_devices[slot] is None:
                self._raise(pynvml.NVML_ERROR_NOT_FOUND)
            return FakeMigHandle(h.index, slot)

        def mig_uuid(h: FakeMigHandle) -> str | bytes:
            m = mig(h)
            return s(f"MIG-fake-{h.gpu}-{m.gpu_instance_id}-{m.compute_instance_id}")

        def either(
            on_gpu: Callable[[FakeHandle], Any], on_mig: Callable[[FakeMigHandle], Any]
        ) -> Callable[[Any], Any]:
            return lambda h: on_mig(h) if isinstance(h, FakeMigHandle) else on_gpu(h)

        def mig_memory(h: FakeMigHandle) -> SimpleNamespace:
            m = mig(h)
            return SimpleNamespace(
                total=m.memory_total, free=m.memory_total - m.memory_used, used=m.memory_used
            )

        def mig_util(h: FakeMigHandle) -> SimpleNamespace:
            return SimpleNamespace(gpu=v(mig(h).util), memory=0)

        def pci(h: FakeHandle) -> SimpleNamespace:
            return SimpleNamespace(busId=str(gpu(h).pci_bus_id).encode())  # ctypes char array

        def memory(h: FakeHandle) -> SimpleNamespace:
            g = gpu(h)
            total, used = v(g.memory_total), v(g.memory_used)
            return SimpleNamespace(total=total, free=total - used, used=used)

        return {
            "nvmlInit": init,
            "nvmlShutdown": shutdown,
            "nvmlDeviceGetCount": lambda: len(self.gpus),
            "nvmlSystemGetDriverVersion": lambda: s(self.driver_version),
            "nvmlDeviceGetHandleByIndex": by_index,
            "nvmlDeviceGetHandleByUUID": by_key("uuid"),
            "nvmlDeviceGetHandleByPciBusId": by_key("pci_bus_id"),
            "nvmlDeviceGetUUID": either(lambda h: s(gpu(h).uuid), mig_uuid),
            "nvmlDeviceGetName": either(
                lambda h: s(gpu(h).name),
                lambda h: s(f"{self.gpus[h.gpu].name} MIG {mig(h).profile}"),
            ),
            "nvmlDeviceGetPciInfo": pci,
            "nvmlDeviceGetMemoryInfo": either(memory, mig_memory),
            "nvmlDeviceGetMaxClockInfo": max_clock,
            "nvmlDeviceGetEnforcedPowerLimit": lambda h: v(gpu(h).power_limit_mw),
            "nvmlDeviceGetTemperatureThreshold": threshold,
            "nvmlDeviceGetCudaComputeCapability": lambda h: v(gpu(h).cuda_capability),
            "nvmlDeviceGetTemperature": temperature,
            "nvmlDeviceGetPowerUsage": lambda h: v(gpu(h).power_mw),
            "nvmlDeviceGetClockInfo": clock,
            "nvmlDeviceGetCurrentClocksEventReasons": lambda h: v(gpu(h).reasons),
            "nvmlDeviceGetCurrentClocksThrottleReasons": lambda h: v(gpu(h).reasons),
            "nvmlDeviceGetUtilizationRates": either(util, mig_util),
            "nvmlDeviceGetMigMode": mig_mode,
            "nvmlDeviceGetMaxMigDeviceCount": lambda h: gpu(h).max_mig_devices,
            "nvmlDeviceGetMigDeviceHandleByIndex": mig_handle,
            "nvmlDeviceGetGpuInstanceId": lambda h: mig(h).gpu_instance_id,
            "nvmlDeviceGetComputeInstanceId": lambda h: mig(h).compute_instance_id,
            "nvmlDeviceGetComputeRunningProcesses_v3": procs,
            "nvmlDeviceGetComputeRunningProcesses_v2": procs,
            "nvmlDeviceGetComputeRunningProcesses": procs,
            "nvmlDeviceGetPerformanceState": lambda h: v(gpu(h).pstate),
            "nvmlDeviceGetEncoderUtilization": lambda h: [v(gpu(h).enc_util), 167000],
            "nvmlDeviceGetTotalEnergyConsumption": lambda h: v(gpu(h).energy_mj),
            "nvmlDeviceGetFieldValues": field_values,
            "nvmlDeviceGetRemappedRows": lambda h: v(gpu(h).remapped_rows),
            "nvmlDeviceGetFanSpeed": lambda h: v(gpu(h).fan_percent),
            "nvmlDeviceGetPcieThroughput": pcie_throughput,
            "nvmlEventSetCreate": event_set_create,
            "nvmlDeviceGetSupportedEventTypes": supported_events,
            "nvmlDeviceRegisterEvents": register_events,
            "nvmlEventSetWait_v2": event_wait,
            "nvmlEventSetFree": event_free,
        }
