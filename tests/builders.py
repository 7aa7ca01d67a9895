"""What many test files build: GPUs on a state board, a seeded store, a wait, a free port.

One home for each, so that a test states only what it varies. The fixtures that use
them (the exporter's HTTP server over a module's ``board``) are in ``conftest.py``.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, TypeVar

from slow_fields import slow_fields

from gpuwatchd.exporter import DaemonInfo
from gpuwatchd.gate import GateDecision, GateState
from gpuwatchd.monitor.board import GpuSnapshot, PollHealth, StateBoard
from gpuwatchd.store import SessionMeta, SqlStore
from gpuwatchd.telemetry.types import DeviceInfo, MigDevice, Sample, ThrottleReason
from gpuwatchd.tuning.types import (
    CandidateStats,
    Regime,
    RegimeResult,
    SessionStatus,
    Versions,
    Workload,
)

T = TypeVar("T")

#: The daemon the exporter and JSON tests describe.
DAEMON_INFO = DaemonInfo("9.9.9", "sim", "3.11.7")
#: Wall-clock time of the fully populated GPU's last good poll.
NOW_UNIX = 1_750_000_000.0

# -- GPUs on a state board ---------------------------------------------------------------------


def h200(index: int = 0, uuid: str = "GPU-aaaa", **changes: Any) -> DeviceInfo:
    """An H200's static facts as the gate reads them (max clock, power limit, slowdown)."""
    info = DeviceInfo(
        index,
        uuid,
        "NVIDIA H200",
        max_sm_clock_mhz=1980.0,
        power_limit_w=700.0,
        slowdown_temp_c=87.0,
    )
    return replace(info, **changes)


def idle(t: float, **changes: Any) -> Sample:
    """An idle H200 reading (40 C, 125 W, full clock, no throttle reasons) of GPU 0."""
    sample = Sample(
        0, t=t, temp_c=40.0, power_w=125.0, sm_clock_mhz=1980.0, reasons=ThrottleReason(0)
    )
    return replace(sample, **changes)


def capped(gpu: int = 0, t: float = 12.5, **changes: Any) -> Sample:
    """An H200 reading under a matmul at its power cap: 61 C, 693.5 W, 1440 MHz, 97% busy."""
    sample = Sample(
        gpu,
        t=t,
        temp_c=61.0,
        power_w=693.5,
        sm_clock_mhz=1440.0,
        reasons=ThrottleReason.SW_POWER_CAP,
        util_gpu=0.97,
        procs=(4242,),
    )
    return replace(sample, **changes)


def judged(
    index: int,
    info: DeviceInfo | None,
    sample: Sample | None,
    state: GateState,
    why: tuple[str, ...] = (),
    *,
    t: float = 12.5,
    since: float = 2.5,
    **changes: Any,
) -> GpuSnapshot:
    """What the poller puts on the board: the gate's ``state`` at ``t`` (held since
    ``since``) and a good poll at ``t`` (unix 1000); ``changes`` replace any field."""
    snap = GpuSnapshot(
        index=index,
        info=info,
        sample=sample,
        gate=GateDecision(state, why, t=t, since=since),
        health=PollHealth(True, 0.001, last_success_t=t, last_success_unix=1000.0),
    )
    return replace(snap, **changes)


def full_h200() -> GpuSnapshot:
    """GPU 0: an H200 under a power-capped matmul with every field the exporter exports."""
    info = h200(
        uuid="GPU-00000000-aaaa",
        driver_version="580.159.04",
        pci_bus_id="00000000:19:00.0",
        max_mem_clock_mhz=3201.0,
        shutdown_temp_c=92.0,
    )
    sample = capped(
        t=160.0,
        mem_clock_mhz=2619.0,
        util_gpu=1.0,
        util_mem=0.45,
        procs=(4242, 4243),
        mem_temp_c=55.0,
        pstate=0,
        enc_util=0.25,
        **slow_fields(),
    )
    return judged(
        0,
        info,
        sample,
        GateState.THROTTLED,
        ("reason sw_power_cap",),
        t=160.0,
        since=100.0,
        health=PollHealth(success=True, duration_s=0.0011, last_success_unix=NOW_UNIX),
        energy_j=123456.5,
        throttle_seconds={ThrottleReason.SW_POWER_CAP: 60.0, ThrottleReason.GPU_IDLE: 5.25},
    )


def board_of(*snapshots: GpuSnapshot) -> StateBoard:
    """A state board holding ``snapshots``, as the poller would have left it."""
    board = StateBoard()
    for snap in snapshots:
        board.put(snap)
    return board


def mig_h200_board() -> StateBoard:
    """An H200 with every field, in MIG mode with one MIG device."""
    full = full_h200()
    assert full.sample is not None and full.sample.slow is not None
    mig = (MigDevice("MIG-x", 1, 0, "1g.18gb", 1, 2, 0.5),)
    sample = replace(full.sample, slow=replace(full.sample.slow, mig=mig))
    return board_of(replace(full, sample=sample))


# -- a store with sessions, results and winners ------------------------------------------------

U, S = Regime.UNTHROTTLED, Regime.SUSTAINED
#: The GEMM the H200 measurements are about.
GEMM_8192 = Workload(
    "gemm", "matmul", {"m": 8192, "n": 8192, "k": 8192}, "bf16", ("triton.matmul",)
)
STACK = Versions(driver="580.159.04", cuda="12.8", torch="2.11.0", triton="3.5.0")


def candidate(name: str, regime: Regime, median_s: float | None, **changes: Any) -> CandidateStats:
    """One candidate's measured statistics; the family follows the name (``triton[...]``)."""
    stats = CandidateStats(
        name=name,
        family="triton.matmul" if name.startswith("triton") else "torch.matmul",
        regime=regime,
        median_s=median_s,
        spread=0.004,
        samples=12,
        rejected=0,
        sm_clock_hz=1.98e9,
        power_w=690.0,
        temp_c=55.0,
        energy_j_per_call=1.2,
        reasons=0,
        meta={"kernels": [f"kernel_of_{name}"]},
    )
    return replace(stats, **changes)


def session_meta(**changes: Any) -> SessionMeta:
    """A session of the 8192³ GEMM in both regimes on an H200 (GPU-aaaa), host ``box``."""
    meta = SessionMeta(
        gpu_uuid="GPU-aaaa",
        gpu_index=0,
        gpu_model="NVIDIA H200",
        backend="nvml",
        workloads=(GEMM_8192,),
        regimes=(U, S),
        versions=STACK,
        host="box",
    )
    return replace(meta, **changes)


def seed_session(
    store: SqlStore,
    meta: SessionMeta,
    results: Iterable[RegimeResult],
    status: SessionStatus = SessionStatus.COMPLETED,
    *,
    tick: Callable[[], object] | None = None,
) -> int:
    """Record a session as the runner does (start, one row per result, finish); its id.

    ``tick`` runs before each write after the start: a test's clock moving on.
    """
    sid = store.start_session(meta)
    for result in results:
        if tick is not None:
            tick()
        store.record_result(sid, result)
    if tick is not None:
        tick()
    store.finish_session(sid, status)
    return sid


class SettableClock:
    """A unix clock a test sets or moves by hand (the store's ``now``)."""

    def __init__(self, t: float = NOW_UNIX) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


# -- waiting and ports ---------------------------------------------------------------------------


def wait_until(
    probe: Callable[[], T], timeout: float = 15.0, what: str | None = None, interval: float = 0.01
) -> T:
    """The first truthy result of ``probe`` within ``timeout`` seconds, else its last one
    (the default is generous: a loaded CI machine is slow, and a met condition returns at once).

    With ``what`` a timeout is an AssertionError naming what was awaited.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result or time.monotonic() >= deadline:
            break
        time.sleep(interval)
    if not result and what is not None:
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
    return result


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (just now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def closed_url() -> str:
    """An http URL where nothing answers: connections are refused."""
    return f"http://127.0.0.1:{free_port()}"
