"""The NVML backend: the only module in gpuwatchd that talks to pynvml.

(:mod:`~gpuwatchd.telemetry.nvml_slow` says what the slow fields are and
:mod:`~gpuwatchd.telemetry.nvml_xid` counts XID events, both through functions bound here.)

Choices, and why:

- pynvml is imported in the constructor, so importing this module never fails on a
  host without it; a missing library or driver becomes one :class:`BackendUnavailable`
  line that points at ``--backend sim``.
- Which fields ``read`` asks for, through which pynvml functions, and how each raw value
  becomes a :class:`Sample` value is :data:`~gpuwatchd.telemetry.fields.FIELDS`; every
  pynvml function and constant is bound once at construction, so ``read`` (10 Hz per
  GPU) does no attribute lookups on pynvml and no exception-class lookups.
- A field NVML refuses (NotSupported, NoPermission, FunctionNotFound) is ``None`` and is
  remembered per GPU, so later polls skip the call; ``device_info(gpu, refresh=True)``
  forgets that memory and retries every field.
- Fields fail one at a time: any other error of one field (Unknown, Timeout, ...) makes
  only that field ``None`` in this sample, counts it in ``Sample.field_errors`` and is
  logged once per failure streak; the next poll asks again. Only a read whose every
  field failed raises :class:`TelemetryError` (then nothing about the GPU is known).
- ``device_info(gpu)`` is cached: the first call reads the static facts (the max clocks
  are slow calls), later calls return the cache; ``refresh=True`` re-reads.
- ``read_energy`` is the slow path (the poller calls it every energy period, off the
  hot path): besides the energy counter (a slow call) it reads memory
  temperature (a field value only), memory use, ECC and row-remapping state, PCIe and
  NVLink counters, fan speed and per-process memory into a ``SlowReading``; each later
  ``read`` carries the latest in ``Sample.slow`` and ``Sample.mem_temp_c`` (``None``
  until the first ``read_energy``). They move slowly; the hot path stays lean. The two
  PCIe throughput samples block for NVML's sampling window each (GIL released); the
  costs are in bench/RESULTS.md, "NVML health fields: cost and support".
- XID errors arrive as NVML events: one thread (started by the first ``read_energy``,
  so a tuning worker's backend never starts it) counts them per GPU and code.
- A lost GPU (GPU_IS_LOST, GPU_NOT_FOUND, NOT_FOUND) raises :class:`GpuLost`; the other
  GPUs keep going. Later calls re-acquire its handle by UUID (else PCI bus id, else
  index) at most once per ``reprobe_interval_s``, without blocking other threads, and
  the GPU is back as soon as it answers.
- Any other NVML error of a static fact becomes :class:`TelemetryError` naming the GPU
  and the field, so no caller ever sees a pynvml exception.
- Thread safety: pynvml calls are thread safe; per-GPU caches are replaced by single
  reference assignments (writers take the GPU's lock), so ``read`` never takes a lock.
- It only reads. No NVML function that changes GPU state is ever bound or called (the
  XID event subscription changes no setting).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, ModuleType
from typing import Any

from gpuwatchd.telemetry.backend import (
    BackendUnavailable,
    Clock,
    GpuLost,
    MonotonicClock,
    TelemetryError,
)
from gpuwatchd.telemetry.fields import (
    SAMPLE_FIELD_ATTRS,
    field_values,
    getter_of,
    getters,
    sample_slot,
)
from gpuwatchd.telemetry.nvml_mig import MIG, MigReader
from gpuwatchd.telemetry.nvml_read import FastCall, compile_read
from gpuwatchd.telemetry.nvml_slow import (
    FAN,
    MEMORY,
    PCIE_RX,
    PCIE_TX,
    PROCESS_MEMORY,
    REMAPPED_ROWS,
    FieldSpec,
    PcieCounter,
    build_reading,
    field_specs,
    field_value,
    throughput_bps,
    top_processes,
)
from gpuwatchd.telemetry.nvml_xid import XidApi, XidCounter
from gpuwatchd.telemetry.types import DeviceInfo, Sample, SlowReading
from gpuwatchd.validate import one_line

log = logging.getLogger(__name__)

_SIM_HINT = "Use --backend sim to run on a simulated GPU"

#: The energy counter's key: the unit of "NVML does not support this on this GPU".
ENERGY = "energy"

#: Fast fields' keys in the order ``read`` calls their getters.
FAST_FIELDS = tuple(getter.key for getter, _ in getters())

#: (Sample slot, field-value key, converter) of each Sample field read on the slow path.
_SLOW_SLOTS = tuple((sample_slot(f.attr), spec.key, f.convert) for spec, f in field_values())
#: The slow fields' values before the first slow read and after a loss.
_NO_CARRIED: tuple[float | None, ...] = (None,) * len(_SLOW_SLOTS)

# NVML_ERROR_* codes, fixed by the NVML ABI; bound here so they work with old bindings.
_ERR_NOT_SUPPORTED = 3
_ERR_NO_PERMISSION = 4
_ERR_NOT_FOUND = 6
_ERR_DRIVER_NOT_LOADED = 9
_ERR_TIMEOUT = 10
_ERR_LIBRARY_NOT_FOUND = 12
_ERR_FUNCTION_NOT_FOUND = 13
_ERR_GPU_IS_LOST = 15
_ERR_GPU_NOT_FOUND = 28
_UNSUPPORTED_CODES = frozenset({_ERR_NOT_SUPPORTED, _ERR_NO_PERMISSION, _ERR_FUNCTION_NOT_FOUND})
_LOST_CODES = frozenset({_ERR_GPU_IS_LOST, _ERR_GPU_NOT_FOUND, _ERR_NOT_FOUND})


def _text(value: str | bytes) -> str:
    """Old bindings return ``bytes`` for NVML strings; new ones return ``str``."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _handle_key(handle: Any) -> Hashable:
    """The device address behind a handle: an event's handle is a new ctypes object."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle  # not a ctypes pointer (a fake's handle): equal handles are equal


@dataclass(slots=True, eq=False)
class _Gpu:
    """What the backend remembers about one GPU. Replaced field by field, never mutated."""

    index: int
    handle: Any = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    info: DeviceInfo | None = None
    unsupported: frozenset[str] = frozenset()
    carried: tuple[float | None, ...] = _NO_CARRIED  # the slow fields' values, _SLOW_SLOTS order
    slow: SlowReading | None = None
    pcie: PcieCounter = field(default_factory=PcieCounter)
    field_errors: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    failing: frozenset[str] = frozenset()  # fields whose latest read failed (logged once)
    lost: str | None = None  # why, while the GPU does not answer
    next_probe_t: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)  # writers of caches
    probe_lock: threading.Lock = field(default_factory=threading.Lock)  # one re-probe at a time


class _FirstAvailable:
    """Calls the newest of several variants of one NVML function that the driver has.

    New bindings on an old driver raise FunctionNotFound (or, for unversioned names,
    NVMLLibraryMismatchError) for the newer symbol; that variant is dropped for good,
    since it is a property of the library, not of a GPU.
    """

    __slots__ = ("_catch", "_fns", "_is_missing", "_lock")

    def __init__(
        self,
        fns: Sequence[Callable[..., Any]],
        catch: tuple[type[BaseException], ...],
        is_missing: Callable[[BaseException], bool],
    ) -> None:
        self._fns = tuple(fns)
        self._catch = catch
        self._is_missing = is_missing
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        while True:
            fns = self._fns
            try:
                return fns[0](*args)
            except self._catch as exc:
                if len(fns) == 1 or not self._is_missing(exc):
                    raise
                with self._lock:
                    if self._fns is fns:
                        self._fns = fns[1:]


def _import_pynvml() -> ModuleType:
    try:
        import pynvml  # type: ignore[import-untyped]
    except ImportError:
        raise BackendUnavailable(
            f"NVML is not available (the pynvml module is missing: pip install nvidia-ml-py). "
            f"{_SIM_HINT}"
        ) from None
    return pynvml


def driver_version() -> str | None:
    """The NVIDIA driver version for a process without a backend (a job's); None without
    pynvml or a working NVML."""
    try:
        nv = _import_pynvml()
        nv.nvmlInit()
        try:
            return _text(nv.nvmlSystemGetDriverVersion())
        finally:
            nv.nvmlShutdown()
    except Exception:  # NVML missing or broken: the caller goes without the driver
        return None


def _unavailable_message(exc: BaseException) -> str:
    code = getattr(exc, "value", None)
    if code == _ERR_LIBRARY_NOT_FOUND:
        cause = "(libnvidia-ml.so.1 not found): no NVIDIA driver on this host?"
    elif code == _ERR_DRIVER_NOT_LOADED:
        cause = "(the NVIDIA kernel driver is not loaded): is nvidia.ko loaded?"
    else:
        cause = f"({one_line(exc).rstrip('.')})."
    return f"NVML is not available {cause} {_SIM_HINT}"


class NvmlBackend:
    """Telemetry from real NVIDIA GPUs through pynvml. Read-only."""

    name = "nvml"

    #: The fast fields of :data:`~gpuwatchd.telemetry.fields.FIELDS` (with the slow ones
    #: of the latest ``read_energy``), one NVML call per getter; an unsupported one is
    #: skipped and ``None``. A field that fails (Unknown, Timeout, ...) is ``None`` in this
    #: sample only; if every field asked failed, :class:`TelemetryError` names the first.
    #: Compiled at construction (:mod:`~gpuwatchd.telemetry.nvml_read`).
    read: Callable[[int], Sample]

    def __init__(
        self,
        clock: Clock | None = None,
        nvml: ModuleType | None = None,
        *,
        reprobe_interval_s: float = 1.0,
        xid_wait_s: float = 5.0,
    ) -> None:
        """Start NVML and open every GPU.

        ``nvml`` replaces the pynvml module (tests pass a fake). ``reprobe_interval_s``
        is the least time between two attempts to re-acquire a lost GPU; ``xid_wait_s``
        the XID thread's wait timeout (each wait costs driver CPU however long it lasts, so
        it is not short); ``close`` does not wait it out.
        """
        if not reprobe_interval_s >= 0:
            raise ValueError(f"reprobe_interval_s must be >= 0, got {reprobe_interval_s!r}")
        if not 0 < xid_wait_s <= 60:
            raise ValueError(f"xid_wait_s must be in (0, 60], got {xid_wait_s!r}")
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        self._reprobe_interval_s = reprobe_interval_s
        nv = nvml if nvml is not None else _import_pynvml()
        self._bind(nv)
        self._xids = XidCounter(self._xid_api, xid_wait_s)
        self._xids_started = False
        self._xids_lock = threading.Lock()
        try:
            nv.nvmlInit()
        except self._catch as exc:
            raise BackendUnavailable(_unavailable_message(exc)) from None
        self._closed = False
        self._close_lock = threading.Lock()
        try:
            count = nv.nvmlDeviceGetCount()
        except self._catch as exc:
            self.close()
            raise BackendUnavailable(_unavailable_message(exc)) from None
        if count <= 0:
            self.close()
            raise BackendUnavailable(f"NVML found no GPU on this host. {_SIM_HINT}")
        self._gpus: dict[int, _Gpu] = {i: self._open(i) for i in range(count)}
        self.read = compile_read(
            self._fast,
            len(SAMPLE_FIELD_ATTRS),
            [slot for slot, _, _ in _SLOW_SLOTS],
            {
                "gpus_get": self._gpus.get,
                "live": self._live,  # raises ValueError or GpuLost
                "now": self.clock.now,
                "catch": self._catch,
                "field_error": self._field_error,
                "fast_failures": self._fast_failures,
            },
        )

    # -- binding ---------------------------------------------------------------------

    def _bind(self, nv: ModuleType) -> None:
        """Bind every pynvml function and constant used later, once."""
        mismatch = getattr(nv, "NVMLLibraryMismatchError", None)
        self._nvml_error: type[BaseException] = nv.NVMLError
        self._catch: tuple[type[BaseException], ...] = (
            (nv.NVMLError, mismatch) if mismatch else (nv.NVMLError,)
        )

        def fn(*names: str) -> Callable[..., Any]:
            found = [getattr(nv, n) for n in names if hasattr(nv, n)]
            if not found:
                return self._missing
            if len(found) == 1:
                return found[0]
            return _FirstAvailable(found, self._catch, self._is_function_missing)

        self._shutdown = nv.nvmlShutdown
        self._by_index = nv.nvmlDeviceGetHandleByIndex
        self._by_uuid = fn("nvmlDeviceGetHandleByUUID")
        self._by_pci = fn("nvmlDeviceGetHandleByPciBusId")
        self._get_uuid = nv.nvmlDeviceGetUUID
        self._get_name = fn("nvmlDeviceGetName")
        self._get_pci = fn("nvmlDeviceGetPciInfo")
        self._get_memory = fn("nvmlDeviceGetMemoryInfo")
        self._get_max_clock = fn("nvmlDeviceGetMaxClockInfo")
        self._get_power_limit = fn("nvmlDeviceGetEnforcedPowerLimit")
        self._get_threshold = fn("nvmlDeviceGetTemperatureThreshold")
        self._get_cc = fn("nvmlDeviceGetCudaComputeCapability")
        self._get_mig_mode = fn("nvmlDeviceGetMigMode")  # [current, pending]; read only
        self._get_driver = fn("nvmlSystemGetDriverVersion")
        self._get_energy = fn("nvmlDeviceGetTotalEnergyConsumption")
        self._get_field_values = fn("nvmlDeviceGetFieldValues")
        self._field_specs: tuple[FieldSpec, ...] = field_specs(nv)
        self._clock_sm = nv.NVML_CLOCK_SM
        self._clock_mem = nv.NVML_CLOCK_MEM
        self._threshold_slowdown = nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        self._threshold_shutdown = nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
        self._xid_api = XidApi(
            create=fn("nvmlEventSetCreate"),
            supported=fn("nvmlDeviceGetSupportedEventTypes"),
            register=fn("nvmlDeviceRegisterEvents"),
            wait=fn("nvmlEventSetWait_v2", "nvmlEventSetWait"),
            free=fn("nvmlEventSetFree"),
            errors=self._catch,
            is_timeout=lambda exc: getattr(exc, "value", None) == _ERR_TIMEOUT,
            key=_handle_key,
        )

        # The fast getters as ``read`` calls them: (key, bound function, constant
        # arguments, (Sample slot, converter) of each field the call fills).
        self._fast: tuple[FastCall, ...] = tuple(
            (
                getter.key,
                fn(*getter.functions),
                tuple(int(getattr(nv, name, default)) for name, default in getter.args),
                tuple((sample_slot(f.attr), f.convert) for f in fields),
            )
            for getter, fields in getters()
        )
        procs = fn(*getter_of("procs").functions)  # the slow path lists their memory
        pcie = fn("nvmlDeviceGetPcieThroughput")
        tx = getattr(nv, "NVML_PCIE_UTIL_TX_BYTES", 0)
        rx = getattr(nv, "NVML_PCIE_UTIL_RX_BYTES", 1)
        self._slow_calls: tuple[tuple[str, Callable[[Any], Any]], ...] = (
            (MEMORY, fn("nvmlDeviceGetMemoryInfo")),
            (REMAPPED_ROWS, fn("nvmlDeviceGetRemappedRows")),
            (FAN, fn("nvmlDeviceGetFanSpeed")),
            (PROCESS_MEMORY, lambda h: top_processes(procs(h))),
            (PCIE_TX, lambda h: throughput_bps(pcie(h, tx))),  # blocks for NVML's sampling window
            (PCIE_RX, lambda h: throughput_bps(pcie(h, rx))),
            (MIG, MigReader(fn, self._catch)),  # read only: MIG mode is never changed
        )

    def _missing(self, *_args: Any) -> Any:
        """Stands in for a function these bindings lack: the field reads as unsupported."""
        raise self._nvml_error(_ERR_FUNCTION_NOT_FOUND)

    # -- error classification (error paths only) --------------------------------------

    # NVMLLibraryMismatchError (pynvml's wrapper of FunctionNotFound) carries no code.

    @staticmethod
    def _is_function_missing(exc: BaseException) -> bool:
        code = getattr(exc, "value", None)
        return code is None or code == _ERR_FUNCTION_NOT_FOUND

    @staticmethod
    def _is_unsupported(exc: BaseException) -> bool:
        code = getattr(exc, "value", None)
        return code is None or code in _UNSUPPORTED_CODES

    def _raise_for(self, g: _Gpu, what: str, exc: BaseException) -> None:
        """Raise GpuLost for a lost GPU, TelemetryError for anything else."""
        detail = one_line(exc)
        if getattr(exc, "value", None) in _LOST_CODES:
            self._mark_lost(g, detail)
            raise GpuLost(g.index, detail) from exc
        raise TelemetryError(f"GPU {g.index}: NVML read of {what} failed: {detail}") from exc

    def _field_failed(self, g: _Gpu, key: str, exc: BaseException) -> bool:
        """Classify one field's error: False for unsupported (remembered, the next polls
        skip it), True for a transient failure (the caller counts it); GpuLost if lost."""
        code = getattr(exc, "value", None)
        if code in _LOST_CODES:
            detail = one_line(exc)
            self._mark_lost(g, detail)
            raise GpuLost(g.index, detail) from exc
        if self._is_unsupported(exc):
            with g.lock:
                g.unsupported = g.unsupported | {key}
            return False
        if key not in g.failing:
            log.warning(
                "GPU %d: NVML read of %s failed: %s; only that field is absent until it "
                "reads again",
                g.index,
                key,
                one_line(exc),
            )
        return True

    def _count_failures(self, g: _Gpu, failed: Iterable[str], ok: Iterable[str]) -> None:
        """Count transient field failures; log the fields that read again after failing."""
        failed = frozenset(failed)
        back = g.failing.intersection(ok)
        if not failed and not back:
            return
        for key in sorted(back):
            log.info("GPU %d: NVML read of %s works again", g.index, key)
        with g.lock:
            if failed:
                counts = dict(g.field_errors)
                for key in failed:
                    counts[key] = counts.get(key, 0) + 1
                g.field_errors = MappingProxyType(counts)
            g.failing = (g.failing - back) | failed

    # -- GPUs: open, lose, re-acquire --------------------------------------------------

    def _open(self, index: int) -> _Gpu:
        g = _Gpu(index=index)
        try:
            g.handle = self._acquire(g)
        except self._catch as exc:
            # Counted by NVML but not answering: served as lost, re-probed like one.
            self._mark_lost(g, one_line(exc))
            g.next_probe_t = 0.0
        return g

    def _acquire(self, g: _Gpu) -> Any:
        """A fresh handle by the most stable identity known: UUID, PCI bus id, index."""
        if g.uuid is not None:
            return self._by_uuid(g.uuid)
        handle = self._by_pci(g.pci_bus_id) if g.pci_bus_id else self._by_index(g.index)
        g.uuid = _text(self._get_uuid(handle))
        if g.pci_bus_id is None:
            with contextlib.suppress(*self._catch):  # only a re-probe key; UUID suffices
                g.pci_bus_id = _text(self._get_pci(handle).busId)
        return handle

    def _mark_lost(self, g: _Gpu, detail: str) -> None:
        g.lost = detail
        g.carried = _NO_CARRIED  # no stale reading survives a loss
        g.slow = None
        g.pcie = g.pcie.gap()
        g.next_probe_t = self.clock.now() + self._reprobe_interval_s

    def _live(self, gpu: int) -> _Gpu:
        """The GPU's state, re-probing it first if it is lost; GpuLost if it still is."""
        g = self._gpus.get(gpu)
        if g is None:
            raise ValueError(f"gpu: no GPU with index {gpu!r} (this host has {sorted(self._gpus)})")
        if g.lost is not None:
            self._reprobe(g)
        return g

    def _reprobe(self, g: _Gpu) -> None:
        if not g.probe_lock.acquire(blocking=False):
            raise GpuLost(g.index, g.lost or "")  # another thread is probing it now
        try:
            if g.lost is None:
                return
            if self.clock.now() < g.next_probe_t:
                raise GpuLost(g.index, g.lost)
            try:
                handle = self._acquire(g)
            except self._catch as exc:
                self._mark_lost(g, one_line(exc))
                raise GpuLost(g.index, g.lost) from exc
            g.handle = handle
            g.lost = None
            log.info("GPU %d answers again", g.index)
            if self._xids_started:
                self._xids.watch(g.index, handle)  # events follow the new handle
        finally:
            g.probe_lock.release()

    # -- Backend protocol ----------------------------------------------------------------

    def devices(self) -> list[int]:
        return list(self._gpus)

    def _field_error(
        self, g: _Gpu, key: str, exc: BaseException, failed: list[tuple[str, BaseException]]
    ) -> None:
        """One fast field failed: remember it if unsupported, else count it (error path)."""
        if self._field_failed(g, key, exc):
            failed.append((key, exc))

    def _fast_failures(self, g: _Gpu, failed: list[tuple[str, BaseException]]) -> None:
        """Count this read's failed fields; raise if no supported field read (error path)."""
        asked = [key for key in FAST_FIELDS if key not in g.unsupported]
        keys = [key for key, _ in failed]
        self._count_failures(g, keys, (k for k in asked if k not in keys))
        if failed and len(failed) == len(asked):
            key, exc = failed[0]
            raise TelemetryError(
                f"GPU {g.index}: every NVML field failed, first {key}: {one_line(exc)}"
            ) from exc

    def read_energy(self, gpu: int) -> float | None:
        """Total energy in joules since the driver loaded (a slow call), or None.

        The slow path: it also reads the slow fields (memory temperature, memory use,
        ECC, row remapping, PCIe and NVLink counters, fan, per-process memory) that
        later samples carry, each failing on its own, and starts the XID thread once.
        """
        g = self._live(gpu)
        self._start_xids()
        failed: list[str] = []
        ok: list[str] = []
        fields = self._read_field_values(g, failed, ok)
        calls = {key: self._slow_call(g, key, call, failed, ok) for key, call in self._slow_calls}
        millijoules = self._slow_call(g, ENERGY, self._get_energy, failed, ok)
        if failed or g.failing:
            self._count_failures(g, failed, ok)
        t = self.clock.now()
        g.carried = tuple(
            [
                None if (v := fields.get(key)) is None else convert(v)
                for _, key, convert in _SLOW_SLOTS
            ]
        )
        g.pcie = g.pcie.add(t, calls[PCIE_TX], calls[PCIE_RX])
        g.slow = build_reading(t, fields, calls, g.pcie, self._xids.counts(gpu))
        return None if millijoules is None else millijoules / 1000.0

    def _slow_call(
        self,
        g: _Gpu,
        key: str,
        call: Callable[[Any], Any],
        failed: list[str],
        ok: list[str],
    ) -> Any:
        """One slow getter: its value, or None (unsupported, or failed this time)."""
        if key in g.unsupported:
            return None
        try:
            value = call(g.handle)
        except self._catch as exc:
            if self._field_failed(g, key, exc):
                failed.append(key)
            return None
        ok.append(key)
        return value

    def _read_field_values(self, g: _Gpu, failed: list[str], ok: list[str]) -> dict[str, float]:
        """Every supported field value in one NVML call; each field succeeds on its own."""
        specs = [spec for spec in self._field_specs if spec.key not in g.unsupported]
        if not specs:
            return {}
        try:
            raw = self._get_field_values(g.handle, [spec.request for spec in specs])
        except self._catch as exc:  # the whole call failed: every field shares its fate
            for spec in specs:
                if self._field_failed(g, spec.key, exc):
                    failed.append(spec.key)
            return {}
        out: dict[str, float] = {}
        for spec, value in zip(specs, raw, strict=False):
            if value.nvmlReturn != 0:
                if self._field_failed(g, spec.key, self._nvml_error(value.nvmlReturn)):
                    failed.append(spec.key)
                continue
            try:
                number = field_value(value)
            except ValueError as exc:
                if spec.key not in g.failing:
                    log.warning("GPU %d: NVML field %s: %s", g.index, spec.key, exc)
                failed.append(spec.key)
                continue
            ok.append(spec.key)
            if number is not None:
                out[spec.key] = number
        return out

    def _start_xids(self) -> None:
        """Start counting XID events on every GPU that answers, once."""
        if self._xids_started:
            return
        with self._xids_lock:
            if self._xids_started or self._closed:
                return
            self._xids_started = True
            self._xids.start({g.index: g.handle for g in self._gpus.values() if g.lost is None})

    def device_info(self, gpu: int, refresh: bool = False) -> DeviceInfo:
        """Static facts, cached after the first call (the max clocks are slow calls).

        ``refresh=True`` re-reads them and forgets which fast fields were unsupported,
        so the next ``read`` tries every field again (after a driver or firmware update).
        """
        g = self._live(gpu)
        info = g.info
        if info is not None and not refresh:
            return info
        info = self._read_info(g)
        with g.lock:
            g.info = info
            if refresh:
                g.unsupported = frozenset()
        return info

    def _static(self, g: _Gpu, what: str, call: Callable[..., Any], *args: Any) -> Any:
        """One static NVML read: ``None`` if unsupported, GpuLost/TelemetryError otherwise."""
        try:
            return call(g.handle, *args)
        except self._catch as exc:
            if not self._is_unsupported(exc):
                self._raise_for(g, what, exc)
            return None

    def _read_info(self, g: _Gpu) -> DeviceInfo:
        name = self._static(g, "name", self._get_name)
        uuid = self._static(g, "uuid", self._get_uuid)
        pci = self._static(g, "pci info", self._get_pci)
        memory = self._static(g, "memory info", self._get_memory)
        max_sm = self._static(g, "max SM clock", self._get_max_clock, self._clock_sm)
        max_mem = self._static(g, "max memory clock", self._get_max_clock, self._clock_mem)
        limit_mw = self._static(g, "enforced power limit", self._get_power_limit)
        slowdown = self._static(
            g, "slowdown temperature", self._get_threshold, self._threshold_slowdown
        )
        shutdown = self._static(
            g, "shutdown temperature", self._get_threshold, self._threshold_shutdown
        )
        cc = self._static(g, "cuda capability", self._get_cc)
        mig = self._static(g, "MIG mode", self._get_mig_mode)
        try:
            driver: str | None = _text(self._get_driver())
        except self._catch as exc:
            if not self._is_unsupported(exc):
                raise TelemetryError(
                    f"NVML read of driver version failed: {one_line(exc)}"
                ) from exc
            driver = None
        return DeviceInfo(
            index=g.index,
            uuid=_text(uuid) if uuid is not None else (g.uuid or ""),
            name=_text(name) if name is not None else "unknown",
            driver_version=driver,
            pci_bus_id=_text(pci.busId) if pci is not None else g.pci_bus_id,
            memory_total_bytes=int(memory.total) if memory is not None else None,
            max_sm_clock_mhz=float(max_sm) if max_sm is not None else None,
            max_mem_clock_mhz=float(max_mem) if max_mem is not None else None,
            power_limit_w=limit_mw / 1000.0 if limit_mw is not None else None,
            slowdown_temp_c=float(slowdown) if slowdown is not None else None,
            shutdown_temp_c=float(shutdown) if shutdown is not None else None,
            cuda_capability=f"{cc[0]}.{cc[1]}" if cc is not None else None,
            mig_mode=None if mig is None else int(mig[0]) == 1,
        )

    def close(self) -> None:
        """Shut NVML down once; later calls do nothing. Returns within about a second.

        The XID thread may sit in a wait of ``xid_wait_s``: NVML is then shut down by that
        thread once the wait returns, never under it (a stopping daemon exits first).
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        with self._xids_lock:
            if self._xids_started:
                self._xids.close(then=self._shutdown_nvml)
                return
        self._shutdown_nvml()

    def _shutdown_nvml(self) -> None:
        try:
            self._shutdown()
        except self._catch as exc:
            log.warning("nvmlShutdown failed: %s", one_line(exc))
