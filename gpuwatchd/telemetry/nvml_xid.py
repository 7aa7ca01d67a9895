"""XID errors: NVML's critical-error events, read on one thread, counted per GPU and code.

An XID is the driver's report of a GPU fault (48: uncorrectable ECC error, 63/64: row
remapping, 79: fallen off the bus, ...). NVML delivers them only as events, through an
event set a thread waits on; there is no counter to poll. ``nvmlEventSetWait`` blocks in
C with the GIL released for up to its timeout (seconds: each wait costs CPU in the driver),
so :meth:`XidCounter.close` does not wait that out: it gives the thread a moment, and if
the thread is still inside the wait it leaves the event set, and whatever must follow its
freeing (``nvmlShutdown``), to the thread on its way out. A daemon stopping exits first.

GPUs are registered on that thread, between waits, never while it waits: the driver makes
``nvmlDeviceRegisterEvents`` on a set that another thread is waiting on spin on a core
until the wait returns (a whole wait timeout of CPU per registration; bench/RESULTS.md,
"The daemon on a real GPU beside nvitop-exporter and nvidia-smi"). The GPUs known at
start are registered before the first wait; one re-acquired later is registered when the
current wait ends.
Subscribing to events changes no GPU setting. The NVML functions are injected (bound by
:mod:`gpuwatchd.telemetry.nvml`), so this module never imports pynvml.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from gpuwatchd.validate import one_line

log = logging.getLogger(__name__)

#: nvmlEventTypeXidCriticalError, fixed by the NVML ABI.
XID_EVENT = 0x8
#: Seconds :meth:`XidCounter.close` waits for the thread to leave its wait.
CLOSE_WAIT_S = 0.5


@dataclass(frozen=True, slots=True)
class XidApi:
    """The NVML event functions :class:`XidCounter` calls, bound by the NVML backend.

    ``wait`` returns an event (``device``, ``eventType``, ``eventData``) or raises;
    ``is_timeout`` tells a plain timeout from a real error; ``key`` maps a device
    handle to something hashable that is equal for equal handles.
    """

    create: Callable[[], Any]
    supported: Callable[[Any], int]
    register: Callable[[Any, int, Any], None]
    wait: Callable[[Any, int], Any]
    free: Callable[[Any], None]
    errors: tuple[type[BaseException], ...]
    is_timeout: Callable[[BaseException], bool]
    key: Callable[[Any], Hashable]


class XidCounter:
    """Counts XID events per GPU from one NVML event set, on its own daemon thread."""

    def __init__(self, api: XidApi, wait_s: float = 1.0) -> None:
        if not 0 < wait_s <= 60:
            raise ValueError(f"wait_s must be in (0, 60], got {wait_s!r}")
        self._api = api
        self._wait_ms = max(1, round(wait_s * 1000))
        self._set: Any = None
        self._to_register: list[tuple[int, Any]] = []  # (gpu, handle), for the thread (under _lock)
        self._gpu_of: dict[Hashable, int] = {}
        self._counts: dict[int, Mapping[int, int]] = {}  # only GPUs that are watched
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self._exited = False  # the thread has left its loop (under _lock)
        self._left_to_thread = False  # close() left the freeing to the thread (under _lock)
        self._then: Callable[[], None] | None = None  # what close() asked to follow it

    def start(self, gpus: Mapping[int, Any] | None = None) -> bool:
        """Create the event set, watch ``gpus`` (index -> handle), start the thread.

        False if this NVML has no events. The thread registers ``gpus`` before it first
        waits.
        """
        try:
            self._set = self._api.create()
        except self._api.errors as exc:
            log.info("XID events unavailable (%s); no gpuwatchd_gpu_xid_* series", exc)
            return False
        for gpu, handle in (gpus or {}).items():
            self.watch(gpu, handle)
        self._thread = threading.Thread(target=self._run, name="gpuwatchd-xid", daemon=True)
        self._thread.start()
        return True

    def watch(self, gpu: int, handle: Any) -> bool:
        """Subscribe to ``gpu``'s XID events (again after a re-acquired handle).

        The event thread registers it before its next wait. False if the GPU does not
        report XIDs; its count then stays absent.
        """
        if self._set is None:
            return False
        try:
            if not self._api.supported(handle) & XID_EVENT:
                return False
        except self._api.errors as exc:
            log.info("GPU %d: XID events unavailable: %s", gpu, one_line(exc))
            return False
        with self._lock:
            self._to_register.append((gpu, handle))
            self._counts.setdefault(gpu, MappingProxyType({}))
        return True

    def _register_waiting(self) -> None:
        """Register the GPUs :meth:`watch` queued; on the event thread, between waits."""
        with self._lock:
            queued, self._to_register = self._to_register, []
        for gpu, handle in queued:
            try:
                self._api.register(handle, XID_EVENT, self._set)
            except self._api.errors as exc:
                log.info("GPU %d: XID events unavailable: %s", gpu, one_line(exc))
                with self._lock:
                    if gpu not in self._gpu_of.values():  # never registered: no count
                        self._counts.pop(gpu, None)
                continue
            with self._lock:
                self._gpu_of[self._api.key(handle)] = gpu

    def counts(self, gpu: int) -> Mapping[int, int] | None:
        """XID code -> events seen since start; None if the GPU's XIDs are not watched."""
        return self._counts.get(gpu)

    def close(self, then: Callable[[], None] | None = None, wait_s: float = CLOSE_WAIT_S) -> bool:
        """Stop the thread, free the event set, then call ``then``; True if done here.

        Waits at most ``wait_s`` for the thread to leave ``nvmlEventSetWait``. A thread
        still inside it (a wait lasts up to its timeout) is a daemon thread: the set stays
        allocated while it may use it, and the thread frees it and calls ``then`` when
        the wait returns (if the process still runs). False then.
        """
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(wait_s)
            with self._lock:
                if not self._exited:
                    self._left_to_thread, self._then = True, then
                    return False
        self._release(then)
        return True

    def _release(self, then: Callable[[], None] | None) -> None:
        if self._set is not None:
            try:
                self._api.free(self._set)
            except self._api.errors as exc:
                log.debug("nvmlEventSetFree failed: %s", one_line(exc))
            self._set = None
        if then is not None:
            then()

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            with self._lock:
                self._exited = True
                left, then = self._left_to_thread, self._then
            if left:  # close() returned while this thread was waiting
                self._release(then)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._register_waiting()
            try:
                event = self._api.wait(self._set, self._wait_ms)
            except self._api.errors as exc:
                if self._api.is_timeout(exc):
                    continue
                if not self._failing:
                    self._failing = True
                    log.warning("waiting for XID events failed: %s", one_line(exc))
                self._stop.wait(self._wait_ms / 1000.0)  # don't spin on a broken set
                continue
            self._failing = False
            if int(event.eventType) & XID_EVENT:
                self._count(event)

    def _count(self, event: Any) -> None:
        code = int(event.eventData)
        with self._lock:
            gpu = self._gpu_of.get(self._api.key(event.device))
            counts = None if gpu is None else self._counts.get(gpu)
            if gpu is None or counts is None:
                return
            new = dict(counts)
            new[code] = new.get(code, 0) + 1
            self._counts[gpu] = MappingProxyType(new)  # readers see old or new
        log.warning("GPU %d: XID %d reported by the driver", gpu, code)
