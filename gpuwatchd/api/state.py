"""The read-only JSON view of the state board served at ``/api/v1/state``.

Field names carry their units (``_c``, ``_w``, ``_mhz``, ``_s``, ``_ratio``); a field the
GPU does not support is ``null``. Unlike the metrics, the JSON keeps the last sample of
a lost or stalled GPU, with ``poll`` saying how stale it is, because a human debugging a
lost GPU wants to see the last thing it said.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from gpuwatchd.exporter.collectors.gpu import ALL_REASONS, DaemonInfo
from gpuwatchd.gate import GateDecision
from gpuwatchd.monitor.board import GpuSnapshot, PollHealth, StateBoard
from gpuwatchd.telemetry.types import DeviceInfo, Sample

#: Identifies the document shape; bump on an incompatible change.
STATE_FORMAT = "gpuwatchd-state/1"

JsonDict = dict[str, Any]


def _num(value: float | None) -> float | None:
    """JSON has no NaN/Infinity: a non-finite reading is reported as unknown (null)."""
    if value is None or not math.isfinite(value):
        return None
    return value


def _info_json(info: DeviceInfo) -> JsonDict:
    return {
        "name": info.name,
        "uuid": info.uuid,
        "driver_version": info.driver_version,
        "pci_bus_id": info.pci_bus_id,
        "memory_total_bytes": info.memory_total_bytes,
        "max_sm_clock_mhz": _num(info.max_sm_clock_mhz),
        "max_mem_clock_mhz": _num(info.max_mem_clock_mhz),
        "power_limit_w": _num(info.power_limit_w),
        "slowdown_temp_c": _num(info.slowdown_temp_c),
        "shutdown_temp_c": _num(info.shutdown_temp_c),
        "cuda_capability": info.cuda_capability,
    }


def _sample_json(sample: Sample) -> JsonDict:
    return {
        "t_s": _num(sample.t),
        "temp_c": _num(sample.temp_c),
        "mem_temp_c": _num(sample.mem_temp_c),
        "power_w": _num(sample.power_w),
        "sm_clock_mhz": _num(sample.sm_clock_mhz),
        "mem_clock_mhz": _num(sample.mem_clock_mhz),
        "util_gpu_ratio": _num(sample.util_gpu),
        "util_mem_ratio": _num(sample.util_mem),
        "throttle_reasons": None if sample.reasons is None else sample.reasons.names(),
        "compute_pids": None if sample.procs is None else list(sample.procs),
        "pstate": sample.pstate,
        "extra": {key: _num(value) for key, value in sample.extra.items()},
    }


def _gate_json(gate: GateDecision) -> JsonDict:
    return {
        "state": gate.state.value,
        "open": gate.open,
        "reasons": list(gate.reasons),
        "t_s": _num(gate.t),
        "since_s": _num(gate.since),
        "in_state_s": _num(max(0.0, gate.t - gate.since)),
        "disturbed_at_s": _num(gate.disturbed_at),
    }


def _poll_json(health: PollHealth, now_unix: float) -> JsonDict:
    last = health.last_success_unix
    return {
        "success": health.success,
        "duration_s": _num(health.duration_s),
        "stalled": health.stalled,
        "lost": health.lost,
        "error": health.error,
        "last_success_t_s": _num(health.last_success_t),
        "last_success_unix": _num(last),
        "last_success_age_s": None if last is None else _num(max(0.0, now_unix - last)),
    }


def snapshot_json(snap: GpuSnapshot, now_unix: float) -> JsonDict:
    """One GPU's entry; times ending ``_t_s``/``t_s`` are on the backend's clock."""
    return {
        "gpu": snap.index,
        "uuid": None if snap.info is None else snap.info.uuid,
        "info": None if snap.info is None else _info_json(snap.info),
        "sample": None if snap.sample is None else _sample_json(snap.sample),
        "energy_j": _num(snap.energy_j),
        "throttle_seconds": {r.label: snap.throttle_seconds.get(r, 0.0) for r in ALL_REASONS},
        "gate": None if snap.gate is None else _gate_json(snap.gate),
        "poll": _poll_json(snap.health, now_unix),
    }


def build_state_json(
    board: StateBoard,
    daemon: DaemonInfo | None = None,
    now: Callable[[], float] = time.time,
) -> JsonDict:
    """The whole document: format tag, generation time, optional daemon facts, GPUs."""
    now_unix = now()
    doc: JsonDict = {"format": STATE_FORMAT, "generated_unix": now_unix}
    if daemon is not None:
        doc["daemon"] = {
            "version": daemon.version,
            "backend": daemon.backend,
            "python_version": daemon.python_version,
        }
    doc["gpus"] = [snapshot_json(snap, now_unix) for snap in board.all()]
    return doc
