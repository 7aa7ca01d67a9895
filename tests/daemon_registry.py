"""The daemon's /metrics registry as gpuwatchd/daemon/process.py builds it, with every
sub-collector populated: simulated GPUs polled (health after a slow read, an XID, ECC),
the tuner's snapshot (sessions, deferrals, winners, users' kernels), drift views and a
fleet snapshot. For encoder tests and bench/render_formats.py (which adds tests/ to
its path), so both measure what a daemon serves.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatchd.drift.detector import GpuDriftView, RetuneReason
from gpuwatchd.drift.fleet import ClockGroup, FleetSnapshot, OwnClock, group_clocks
from gpuwatchd.exporter import DaemonInfo, build_registry
from gpuwatchd.exporter.collectors.base import SubCollector, Versioned
from gpuwatchd.exporter.collectors.drift import DriftCollector
from gpuwatchd.exporter.collectors.fleet import FleetCollector
from gpuwatchd.exporter.collectors.tuning import TuningCollector
from gpuwatchd.exporter.registry import ExporterRegistry
from gpuwatchd.gate import GateConfig
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.monitor.poller import Poller
from gpuwatchd.sessions.tuning_view import TuningSnapshot
from gpuwatchd.store.rows import HostClock, WinnerRow
from gpuwatchd.telemetry.clocks import ManualClock
from gpuwatchd.telemetry.sim import SimBackend
from gpuwatchd.tuning.types import Regime, Versions

NOW_UNIX = 1_750_000_000.0
MODEL = "NVIDIA H200 (simulated)"
STACK = Versions(driver="580.159.04", cuda="12.8", torch="2.11.0", triton="3.5.0")
USER_KERNEL = "triton.user:mymod.attn_fwd@1a2b3c4d"


@dataclass
class DaemonRegistry:
    """A populated registry and what drives it: ``poll()`` is one poll of every GPU."""

    registry: ExporterRegistry
    #: The sub-collectors the daemon adds after "gpu" and "gpu_health", populated.
    extra: tuple[SubCollector, ...]
    board: StateBoard
    poller: Poller
    clock: ManualClock
    gpus: int

    def poll(self, dt: float = 0.1) -> None:
        self.clock.advance(dt)
        for gpu in range(self.gpus):
            self.poller.poll(gpu)


def _winners(gpus: int) -> tuple[WinnerRow, ...]:
    rows = []
    workloads = [f"gemm.bf16/m={n},n={n},k={n}" for n in (1024, 4096, 8192)]
    workloads += [f"{USER_KERNEL}/n={n}" for n in (2048, 4096)]
    for i, workload in enumerate(workloads):
        for regime in Regime:
            flips = regime is Regime.SUSTAINED and i % 2 == 0
            rows.append(
                WinnerRow(
                    gpu_model=MODEL,
                    versions=STACK,
                    workload=workload,
                    regime=regime,
                    candidate=f'triton[BLOCK_M={64 if flips else 128},"cfg"\\{i}]',
                    family="triton.matmul",
                    median_s=1.25e-3 * (i + 1) if i != 1 else None,
                    sm_clock_hz=1.755e9,
                    margin=0.031,
                    tie=i == 2,
                    session_id=i + 1,
                    gpu_uuid=f"GPU-sim-{i % gpus}",
                    measured_at=NOW_UNIX - 3600 * i,
                    host="box",
                )
            )
    return tuple(rows)


def _tuning(gpus: int, board: StateBoard) -> TuningSnapshot:
    return TuningSnapshot(
        sessions_total={"completed": 7, "failed": 1, "preempted": 2},
        deferred_total={"throttled": 41, "outside_window": 3},
        running=frozenset({0}),
        pending={1: ("gemm.bf16/m=2048,n=2048,k=2048", f"{USER_KERNEL}/n=8192")},
        last_tune_unix=NOW_UNIX - 60,
        winners=_winners(gpus),
        last_tune_by_uuid={s.info.uuid: NOW_UNIX - 60 for s in board.all() if s.info is not None},
        fleet_skipped_total={"fresh_fleet_winner": 5},
        fleet_verified_total=2,
        claimed_elsewhere_total=1,
    )


def _fleet(board: StateBoard) -> FleetSnapshot:
    group = ClockGroup.of(MODEL, 700.0)
    own = []
    rows = [
        HostClock(f"peer{i}", f"GPU-peer-{i}", MODEL, 700.0, 1.74e9 + i * 1e6, NOW_UNIX)
        for i in range(3)
    ]
    for snap in board.all():
        uuid = snap.info.uuid if snap.info is not None else ""
        own.append(OwnClock(snap.index, uuid, group, 1.7e9 + snap.index * 1e6))
        rows.append(HostClock("box", uuid, MODEL, 700.0, 1.7e9 + snap.index * 1e6, NOW_UNIX))
    return FleetSnapshot(
        own=tuple(own),
        groups=group_clocks(rows),
        disagreements={(MODEL, "gemm.bf16/m=4096,n=4096,k=4096", "sustained"): 2},
        coverage={(MODEL, "driver=580.159.04,cuda=12.8"): 5, ("NVIDIA H100", "unknown"): 1},
        synced_at=NOW_UNIX - 12.5,
        recent_disagreements={(MODEL, "gemm.bf16/m=4096,n=4096,k=4096", "sustained"): 1},
    )


def _drift(board: StateBoard) -> dict[int, GpuDriftView]:
    views = {}
    for snap in board.all():
        uuid = snap.info.uuid if snap.info is not None else ""
        pending = frozenset({RetuneReason.CLOCK_DRIFT}) if snap.index % 2 else frozenset()
        ratio = -0.0625 if snap.index % 2 else None
        views[snap.index] = GpuDriftView(uuid, ratio, 1.7e9, 1.8e9, pending)
    return views


def daemon_registry(gpus: int = 4) -> DaemonRegistry:
    """``gpus`` simulated GPUs (one reporting ECC errors and XIDs), polled twice around a
    slow read, and every sub-collector the daemon registers, populated."""
    clock = ManualClock()
    backend = SimBackend(gpus=gpus, scenario="ecc-error", clock=clock)
    clock.advance(25.0)
    backend.inject_xid(gpus - 1, 79)
    board = StateBoard()
    poller = Poller(backend, board, GateConfig())
    for gpu in range(gpus):
        poller.poll(gpu)
        # the slow path, as its thread runs it: energy, and health fields on the next sample
        poller._read_slow(poller._tracks[gpu])
        poller.poll(gpu)
    tuning = _tuning(gpus, board)
    fleet = _fleet(board)
    drift = _drift(board)
    extra: tuple[SubCollector, ...] = (
        TuningCollector(board, lambda: tuning, added=lambda: {"gemm.bf16/m=1024,n=1024,k=1024"}),
        DriftCollector(lambda: drift),
        Versioned(
            FleetCollector(lambda: fleet, lambda: tuning, now=lambda: NOW_UNIX),
            lambda: (fleet, tuning),
            runs_inline=True,
        ),
    )
    registry = build_registry(board, DaemonInfo("9.9.9", "sim", "3.11.7"), extra=extra)
    return DaemonRegistry(registry, extra, board, poller, clock, gpus)
