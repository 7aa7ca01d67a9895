"""Daemon-side planning of tuning work: which session specs to run, and when to stop one.

Never imports torch. Shared by the daemon's scheduler and ``gpuwatchd tune``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpuwatchd.gate import GateState
from gpuwatchd.monitor.board import GpuSnapshot
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.settings import TuningSetup
from gpuwatchd.tuning.types import Regime, Workload
from gpuwatchd.tuning.workloads import device_kind

if TYPE_CHECKING:  # specs are built when a session starts
    from gpuwatchd.tuning.session_spec import SessionSpec

#: Which worker devices each telemetry backend can serve when asked by name.
DEVICES_FOR_BACKEND: dict[str, tuple[str, ...]] = {
    "nvml": ("cuda", "cpu"),
    "sim": ("sim", "cpu"),
    "replay": ("cpu",),  # a recording has no GPU to run kernels on
}
#: What the daemon tunes by default: the GPU's own kind only (CPU workloads exist for
#: machines without a GPU and are tuned only when named).
DEFAULT_DEVICE_FOR_BACKEND: dict[str, str] = {"nvml": "cuda", "sim": "sim"}


class PlanError(ValueError):
    """The requested work cannot run here (one line naming the workload)."""


def runnable_workloads(cfg: TuningSetup, backend: str) -> tuple[Workload, ...]:
    """The daemon's default tuning set: ``tuning.workloads`` if given, else every
    configured workload for the backend's own kind of device."""
    if cfg.tuning.workloads:
        devices = DEVICES_FOR_BACKEND.get(backend, ())
        chosen = [cfg.workload(n) for n in cfg.tuning.workloads]
        return tuple(w for w in chosen if device_kind(w) in devices)
    kind = DEFAULT_DEVICE_FOR_BACKEND.get(backend)
    return tuple(w for w in cfg.workloads if device_kind(w) == kind)


def select_workloads(cfg: TuningSetup, backend: str, names: Sequence[str]) -> tuple[Workload, ...]:
    """Named workloads (all runnable ones when empty); PlanError for one that can't run."""
    if not names:
        found = runnable_workloads(cfg, backend)
        if not found:
            raise PlanError(f"no configured workload can run on the {backend} backend")
        return found
    devices = DEVICES_FOR_BACKEND.get(backend, ())
    out = []
    for name in names:
        try:
            w = cfg.workload(name)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        kind = device_kind(w)
        if kind not in devices:
            need = {"cuda": "a CUDA GPU (--backend nvml)", "sim": "--backend sim"}.get(kind, kind)
            raise PlanError(f"workload {name!r} needs {need}; backend is {backend}")
        out.append(w)
    return tuple(out)


def build_specs(
    cfg: TuningSetup,
    info: DeviceInfo,
    workloads: Sequence[Workload],
    regimes: Sequence[Regime],
    sim_start_t: float = 0.0,
    sim_speed: float | None = None,
) -> list[SessionSpec]:
    """One session spec per worker device kind, in a stable order (sim/cpu/cuda as they appear).

    ``sim_speed`` paces a sim worker's clock to the daemon's (see ``SimSpec.speed``)."""
    from gpuwatchd.tuning.session_spec import SessionSpec, SimSpec

    groups: dict[str, list[Workload]] = {}
    for w in workloads:
        groups.setdefault(device_kind(w), []).append(w)
    specs = []
    for kind, ws in groups.items():
        sim = None
        if kind == "sim":
            sim = SimSpec(
                scenario=cfg.sim.scenario,
                seed=cfg.sim.seed,
                gpus=cfg.sim.gpus,
                start_t=sim_start_t,
                speed=sim_speed,
            )
        specs.append(
            SessionSpec(
                gpu_index=info.index,
                gpu_uuid=info.uuid,
                device=kind,
                workloads=tuple(ws),
                regimes=tuple(regimes),
                protocol=cfg.tuning.protocol,
                time_budget_s=cfg.tuning.protocol.time_budget_s * len(ws) * len(regimes),
                sim=sim,
                allowed_modules=cfg.tuning.allowed_modules,
            )
        )
    return specs


def preempt_reason(snap: GpuSnapshot | None) -> str | None:
    """Why a running session must stop now, or None.

    Only a foreign job (gate ``busy``) or a GPU we can no longer see stops a session:
    ``throttled`` and ``warming`` are what our own sustained load looks like.
    """
    if snap is None or snap.gate is None:
        return None
    state = snap.gate.state
    if state is GateState.BUSY:
        return "another process wants the GPU: " + "; ".join(snap.gate.reasons)
    if state is GateState.UNAVAILABLE and (snap.health.lost or snap.health.stalled):
        return "GPU unavailable: " + "; ".join(snap.gate.reasons)
    return None
