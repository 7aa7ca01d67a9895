"""The ``sim`` telemetry backend: N simulated GPUs playing a scripted scenario.

It serves the daemon without hardware (demos, CI, the tuning engine's CPU path) and
lets tests run hours of GPU life on a :class:`ManualClock`. Samples are deterministic
for a seed: same seed, same read times and same ``set_load`` calls give identical
samples. Like NVML, ``read_energy`` is the slow path: it also computes the health
fields (memory, ECC, row remapping, PCIe/NVLink, XIDs) that later samples carry.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import uuid

from gpuwatchd.telemetry.backend import BackendUnavailable, Clock, GpuLost
from gpuwatchd.telemetry.clocks import OffsetClock, ScaledClock
from gpuwatchd.telemetry.sim.health import XidEvent, slow_reading
from gpuwatchd.telemetry.sim.model import GpuModel, Load, ModelState
from gpuwatchd.telemetry.sim.scenarios import SCENARIOS, Scenario
from gpuwatchd.telemetry.sim.sensor import Sensor
from gpuwatchd.telemetry.types import DeviceInfo, Sample, SlowReading, ThrottleReason

#: PCI bus numbers of the eight GPUs of an HGX/DGX H200 board.
_HGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)


class SimGpuView:
    """Live, noise-free view of one simulated GPU, for simulated kernels.

    Every property first brings the model up to the backend clock's ``now``, so a
    kernel can scale its run time by ``max_sm_clock_mhz / sm_clock_mhz``.
    """

    def __init__(self, backend: SimBackend, gpu: int) -> None:
        self._backend = backend
        self._gpu = gpu

    @property
    def max_sm_clock_mhz(self) -> float:
        return self._backend.scenario.preset.max_sm_clock_mhz

    @property
    def sm_clock_mhz(self) -> float:
        return self._backend._exact_state(self._gpu).sm_clock_mhz

    @property
    def temp_c(self) -> float:
        return self._backend._exact_state(self._gpu).temp_c

    @property
    def power_w(self) -> float:
        """Instantaneous board power (not the 1 s average NVML reports)."""
        return self._backend._exact_state(self._gpu).power_w

    @property
    def reasons(self) -> ThrottleReason:
        return self._backend._exact_state(self._gpu).reasons


class SimBackend:
    """Simulated GPUs behind the :class:`~gpuwatchd.telemetry.backend.Backend` protocol.

    ``start_s`` is the scenario time the GPUs start at (a fan-failure GPU already hours
    into its decline): the constructor plays the scenario up to it, so the first poll
    does not stall.
    """

    name = "sim"

    def __init__(
        self,
        gpus: int = 1,
        scenario: str = "idle",
        seed: int = 0,
        clock: Clock | None = None,
        start_s: float = 0.0,
    ) -> None:
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise ValueError(f"gpus must be an integer >= 1, got {gpus!r}")
        if scenario not in SCENARIOS:
            valid = ", ".join(SCENARIOS)
            raise ValueError(f"scenario: unknown {scenario!r}; valid scenarios: {valid}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if (
            isinstance(start_s, bool)
            or not isinstance(start_s, int | float)
            or not (0 <= start_s < math.inf)
        ):
            raise ValueError(f"start_s must be a finite number >= 0, got {start_s!r}")
        base: Clock = clock if clock is not None else ScaledClock(1.0)
        # Started part-way into the scenario, the clock reads scenario time, as a backend
        # started at 0 does: a sim tuning worker given ``clock.now()`` as its start time
        # simulates the same point of the scenario.
        self.clock: Clock = OffsetClock(base, start_s) if start_s else base
        self.scenario: Scenario = SCENARIOS[scenario]
        self.seed = seed
        self.start_s = float(start_s)
        self._origin = self.clock.now() - self.start_s
        preset = self.scenario.preset
        self._models = [GpuModel(preset, self.scenario.source(i)) for i in range(gpus)]
        for model in self._models if self.start_s else ():
            model.advance(self.start_s)  # play the scenario up to the start now, not in a poll
        self._sensors = [
            Sensor(i, preset, random.Random(f"gpuwatchd-sim:{seed}:{i}")) for i in range(gpus)
        ]
        self._locks = [threading.Lock() for _ in range(gpus)]
        self._infos = [self._make_info(i) for i in range(gpus)]
        self._xids = [[x for x in self.scenario.xids if x.gpu == i] for i in range(gpus)]
        self._slow: list[SlowReading | None] = [None] * gpus
        self._closed = False

    # ------------------------------------------------------------ Backend protocol

    def devices(self) -> list[int]:
        return list(range(len(self._models)))

    def device_info(self, gpu: int, refresh: bool = False) -> DeviceInfo:
        """Static facts; a simulated GPU's never change, so ``refresh`` reads the same."""
        self._check(gpu, self.clock.now())
        return self._infos[gpu]

    def read(self, gpu: int) -> Sample:
        now = self.clock.now()
        self._check(gpu, now)
        model = self._models[gpu]
        with self._locks[gpu]:
            model.advance(now - self._origin)
            return self._sensors[gpu].sample(now, model.state(), self._slow[gpu])

    def read_energy(self, gpu: int) -> float:
        """Exact integral of the model's power since the backend started, in joules.

        Also refreshes the slow health fields that later samples carry.
        """
        now = self.clock.now()
        self._check(gpu, now)
        model = self._models[gpu]
        with self._locks[gpu]:
            model.advance(now - self._origin)
            state = model.state()
            self._slow[gpu] = slow_reading(now, state, model.preset, self._xids[gpu])
            return state.energy_j

    def close(self) -> None:
        self._closed = True

    # ------------------------------------------------------------ simulation control

    def set_load(
        self,
        gpu: int,
        util: float,
        dynamic_power_w: float,
        pid: int | None = None,
        memory_bytes: int = 0,
    ) -> None:
        """Run a simulated kernel load on ``gpu`` from now on, on top of the scenario's.

        ``dynamic_power_w`` is what it would draw above idle at full util and maximum
        clock; the power cap and the thermal controller decide what it really gets.
        Memory utilisation is reported as half of ``util``, as for a compute-bound
        kernel; ``memory_bytes`` is the device memory its process holds. Replaces any
        earlier external load on that GPU.
        """
        self._check_index(gpu)
        load = Load(util, dynamic_power_w, pid, mem_util=util * 0.5, memory_bytes=memory_bytes)
        with self._locks[gpu]:
            self._models[gpu].advance(self.clock.now() - self._origin)
            self._models[gpu].set_external_load(load)

    def clear_load(self, gpu: int) -> None:
        """Remove the external load of ``gpu`` (no-op when there is none)."""
        self._check_index(gpu)
        with self._locks[gpu]:
            self._models[gpu].advance(self.clock.now() - self._origin)
            self._models[gpu].set_external_load(None)

    def mirror_load(
        self,
        gpu: int,
        power_w: float,
        sm_clock_mhz: float | None = None,
        pid: int | None = None,
    ) -> None:
        """Run on ``gpu`` a load that draws ``power_w`` at ``sm_clock_mhz`` (max if None).

        The model's power law solved for the load at the GPU's current temperature: told
        what a sim tuning worker's copy of this GPU draws, this GPU then heats, and hits
        its power cap, as the worker's did. Replaces any earlier external load.
        """
        self._check_index(gpu)
        if not math.isfinite(power_w) or power_w < 0:
            raise ValueError(f"power_w must be finite and >= 0, got {power_w!r}")
        p = self.scenario.preset
        clock = p.max_sm_clock_mhz if sm_clock_mhz is None else sm_clock_mhz
        if not math.isfinite(clock):
            raise ValueError(f"sm_clock_mhz must be finite, got {sm_clock_mhz!r}")
        share = min(max(clock, p.min_sm_clock_mhz), p.max_sm_clock_mhz) / p.max_sm_clock_mhz
        with self._locks[gpu]:
            model = self._models[gpu]
            model.advance(self.clock.now() - self._origin)
            static_w = p.idle_power_w + p.leakage_w_per_c * (model.state().temp_c - p.ref_temp_c)
            dynamic_w = max(0.0, power_w - static_w) / share**p.power_exponent
            model.set_external_load(Load(1.0, dynamic_w, pid, mem_util=0.5))

    def session_progress(
        self,
        gpu: int,
        power_w: float | None,
        sm_clock_mhz: float | None,
        pids: frozenset[int],
    ) -> None:
        """A sim tuning session on ``gpu`` reports its GPU's power and clock: feel it here.

        The load carries one of the worker's ``pids``, so the gate counts it as ours; a
        report without power, or from a worker that is gone, changes nothing.
        """
        if power_w is not None and pids:
            self.mirror_load(gpu, power_w, sm_clock_mhz, min(pids))

    def session_ended(self, gpu: int) -> None:
        """The tuning session on ``gpu`` ended: its load goes."""
        self.clear_load(gpu)

    def inject_xid(self, gpu: int, code: int) -> None:
        """``gpu`` reports XID ``code`` now (48: uncorrectable ECC, 63: row remap pending)."""
        self._check_index(gpu)
        event = XidEvent(max(0.0, self.clock.now() - self._origin), code, gpu)
        with self._locks[gpu]:
            self._xids[gpu] = [*self._xids[gpu], event]

    def model(self, gpu: int) -> SimGpuView:
        """A live, noise-free view of ``gpu`` (clock, max clock, temperature, power)."""
        self._check_index(gpu)
        return SimGpuView(self, gpu)

    # ------------------------------------------------------------ internals

    def _exact_state(self, gpu: int) -> ModelState:
        with self._locks[gpu]:
            self._models[gpu].advance(self.clock.now() - self._origin)
            return self._models[gpu].state()

    def _check_index(self, gpu: int) -> None:
        if not 0 <= gpu < len(self._models):
            raise ValueError(f"gpu: no simulated GPU {gpu!r} (have 0-{len(self._models) - 1})")

    def _check(self, gpu: int, now: float) -> None:
        if self._closed:
            raise BackendUnavailable("sim backend is closed")
        self._check_index(gpu)
        lost = self.scenario.lost
        if gpu == 0 and lost is not None and lost.covers(now - self._origin):
            self._slow[0] = None  # no stale reading survives a loss, as with NVML
            raise GpuLost(0, f"simulated: off the bus since t={lost.start_s:g}s")

    def _make_info(self, index: int) -> DeviceInfo:
        preset = self.scenario.preset
        digest = hashlib.sha256(f"gpuwatchd-sim:{self.seed}:{index}".encode()).digest()
        bus = _HGX_BUSES[index % len(_HGX_BUSES)]
        return DeviceInfo(
            index=index,
            uuid=f"GPU-sim-{uuid.UUID(bytes=digest[:16])}",
            name=f"{preset.name} (simulated)",
            driver_version="sim",
            pci_bus_id=f"{index // len(_HGX_BUSES):08X}:{bus:02X}:00.0",
            memory_total_bytes=preset.memory_total_bytes,
            max_sm_clock_mhz=preset.max_sm_clock_mhz,
            max_mem_clock_mhz=preset.mem_clock_mhz,
            power_limit_w=preset.power_limit_w,
            slowdown_temp_c=preset.slowdown_temp_c,
            shutdown_temp_c=preset.shutdown_temp_c,
            cuda_capability=preset.cuda_capability,
        )
