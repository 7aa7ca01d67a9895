"""A scriptable in-memory telemetry backend for poller and daemon tests."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from gpuwatchd.telemetry.backend import GpuLost, MonotonicClock
from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason


class FakeBackend:
    """Idle, cool GPUs; tests make one hang (``hang[gpu]`` is cleared to block) or lose it."""

    name = "fake"

    def __init__(self, gpus: int = 2) -> None:
        self.clock = MonotonicClock()
        self._gpus = list(range(gpus))
        self.release = {g: threading.Event() for g in self._gpus}
        for ev in self.release.values():
            ev.set()
        self.lost: set[int] = set()
        self.reasons: dict[int, ThrottleReason] = {g: ThrottleReason.GPU_IDLE for g in self._gpus}
        self.reads = dict.fromkeys(self._gpus, 0)
        self.energy_calls = dict.fromkeys(self._gpus, 0)
        self.closed = False

    def devices(self) -> list[int]:
        return list(self._gpus)

    def device_info(self, gpu: int, refresh: bool = False) -> DeviceInfo:
        return DeviceInfo(
            index=gpu,
            uuid=f"GPU-fake-{gpu}",
            name="Fake GPU",
            driver_version="1.0",
            max_sm_clock_mhz=1980.0,
            power_limit_w=700.0,
            slowdown_temp_c=89.0,
            shutdown_temp_c=95.0,
        )

    def hang(self, gpu: int) -> None:
        """Make the next read of ``gpu`` block until :meth:`unhang`."""
        self.release[gpu].clear()

    def unhang(self, gpu: int) -> None:
        self.release[gpu].set()

    def read(self, gpu: int) -> Sample:
        self.release[gpu].wait(30.0)  # a read that blocks like a wedged driver call
        if gpu in self.lost:
            raise GpuLost(gpu)
        self.reads[gpu] += 1
        return Sample(
            gpu=gpu,
            t=time.monotonic(),
            temp_c=40.0,
            power_w=120.0,
            sm_clock_mhz=1980.0,
            mem_clock_mhz=3201.0,
            reasons=self.reasons[gpu],
            util_gpu=0.0,
            util_mem=0.0,
            procs=(),
        )

    def read_energy(self, gpu: int) -> float | None:
        self.energy_calls[gpu] += 1
        return 1000.0 + gpu

    def close(self) -> None:
        self.closed = True


def shifted(sample: Sample, dt: float) -> Sample:
    return replace(sample, t=sample.t + dt)
