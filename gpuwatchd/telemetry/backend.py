"""The one interface every telemetry source implements, and its errors.

The rest of gpuwatchd sees only this module and :mod:`gpuwatchd.telemetry.types`;
pynvml stays inside :mod:`gpuwatchd.telemetry.nvml`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol, runtime_checkable

from gpuwatchd.telemetry.types import DeviceInfo, Sample


class TelemetryError(Exception):
    """Base class for telemetry failures."""


class BackendUnavailable(TelemetryError):
    """The backend cannot start at all (no NVML library, bad trace file, ...)."""


class TraceError(BackendUnavailable):
    """A trace file that cannot be read; the message is one line: ``file:line: problem``.

    Declared with the backend errors so that catching it loads no trace reader."""

    def __init__(self, path: str | Path, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}" if line > 0 else f"{path}: {message}")
        self.path = str(path)
        self.line = line


class GpuLost(TelemetryError):
    """The GPU fell off the bus or stopped answering; it may come back later."""

    def __init__(self, gpu: int, detail: str = "") -> None:
        super().__init__(f"GPU {gpu} is lost{': ' + detail if detail else ''}")
        self.gpu = gpu


class Clock(Protocol):
    """Time source. Real time for NVML; simulated time for sim and replay."""

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """Wall-clock monotonic time."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


@runtime_checkable
class Backend(Protocol):
    """A source of GPU telemetry.

    ``read`` must be cheap (the fast fields only); ``read_energy`` may be slow (milliseconds
    on real GPUs) and is called at a lower rate, off the hot path: it is the slow
    path, where a backend also refreshes the slow health fields (``Sample.slow``) that
    later samples carry. ``device_info`` may be slow and is cached by callers.
    ``read``/``read_energy``/``device_info`` raise :class:`GpuLost` for a GPU that
    stopped answering.
    """

    name: str
    clock: Clock

    def devices(self) -> list[int]:
        """GPU indices this backend serves."""
        ...

    def device_info(self, gpu: int, refresh: bool = False) -> DeviceInfo:
        """Static facts, cached; ``refresh=True`` re-reads them (power limit may change)."""
        ...

    def read(self, gpu: int) -> Sample: ...

    def read_energy(self, gpu: int) -> float | None:
        """Total energy in joules since an arbitrary origin, or None if unsupported."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class FeelsSessionLoad(Protocol):
    """A backend whose GPUs are told what a tuning session's worker reports (the simulated
    GPU: the worker simulates its own copy, and the daemon's must heat up with it)."""

    def session_progress(
        self,
        gpu: int,
        power_w: float | None,
        sm_clock_mhz: float | None,
        pids: frozenset[int],
    ) -> None:
        """The worker's latest power and clock on ``gpu``; ``pids`` are its processes."""
        ...

    def session_ended(self, gpu: int) -> None: ...
