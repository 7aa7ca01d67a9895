"""``/api/v1/state``: the read-only JSON view of the state board, produced and parsed here.

Field names carry their units (``_c``, ``_w``, ``_mhz``, ``_s``, ``_ratio``); a field the
GPU does not support is ``null``. Unlike the metrics, the JSON keeps the last sample of
a lost or stalled GPU, with ``poll`` saying how stale it is, because a human debugging a
lost GPU wants to see the last thing it said.

Each GPU lists its compute ``processes`` (PID, user, device memory where NVML reported
it, and the Kubernetes pod the GPU is assigned to where that is known), largest first.

The daemon adds two sections of its own: ``gate_config`` (its gate thresholds, so a job
can re-run the gate) and ``tuning`` (what the tuner is doing). :func:`parse_state` reads
the whole document for ``gpuwatchd status`` and the job-side client alike.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gpuwatchd.api.document import DocReader
from gpuwatchd.api.errors import GpuwatchdError
from gpuwatchd.api.gpu_state import GpuState, ProcessState
from gpuwatchd.gate import GateConfig, GateDecision
from gpuwatchd.monitor.board import GpuSnapshot, PollHealth, StateBoard
from gpuwatchd.telemetry.types import DeviceInfo, PodRef, Sample, ThrottleReason

#: Where the daemon serves the document.
STATE_PATH = "/api/v1/state"

#: Identifies the document shape; bump on an incompatible change.
STATE_FORMAT = "gpuwatchd-state/1"

JsonDict = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ProcessLookup:
    """What the producer adds to a GPU's PIDs: each one's user, the GPU's pod (by UUID)."""

    user: Callable[[int], str | None] = lambda _pid: None
    pod: Callable[[str], PodRef | None] = lambda _uuid: None


class DaemonFacts(Protocol):
    """What the producer needs to know about the daemon (``DaemonInfo`` has it)."""

    @property
    def version(self) -> str: ...

    @property
    def backend(self) -> str: ...

    @property
    def python_version(self) -> str: ...


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


def _processes_json(snap: GpuSnapshot, lookup: ProcessLookup) -> list[JsonDict] | None:
    """The GPU's compute processes, those holding the most memory first; None: unknown."""
    sample = snap.sample
    if sample is None:
        return None
    slow = sample.slow.processes if sample.slow is not None else None
    if sample.procs is None and slow is None:
        return None
    memory = {p.pid: p.used_bytes for p in slow or ()}
    pids = list(memory) + [pid for pid in sample.procs or () if pid not in memory]
    pod = lookup.pod(snap.info.uuid) if snap.info is not None else None
    return [
        {
            "pid": pid,
            "user": lookup.user(pid),
            "used_memory_bytes": memory.get(pid),
            "namespace": None if pod is None else pod.namespace,
            "pod": None if pod is None else pod.pod,
            "container": None if pod is None else pod.container,
        }
        for pid in pids
    ]


def snapshot_json(
    snap: GpuSnapshot, now_unix: float, lookup: ProcessLookup | None = None
) -> JsonDict:
    """One GPU's entry; times ending ``_t_s``/``t_s`` are on the backend's clock."""
    return {
        "gpu": snap.index,
        "uuid": None if snap.info is None else snap.info.uuid,
        "info": None if snap.info is None else _info_json(snap.info),
        "sample": None if snap.sample is None else _sample_json(snap.sample),
        "energy_j": _num(snap.energy_j),
        "throttle_seconds": {r.label: snap.throttle_seconds.get(r, 0.0) for r in ThrottleReason},
        "gate": None if snap.gate is None else _gate_json(snap.gate),
        "poll": _poll_json(snap.health, now_unix),
        "processes": _processes_json(snap, lookup or ProcessLookup()),
    }


def build_state_json(
    board: StateBoard,
    daemon: DaemonFacts | None = None,
    now: Callable[[], float] = time.time,
    lookup: ProcessLookup | None = None,
) -> JsonDict:
    """The whole document: format tag, generation time, optional daemon facts, GPUs;
    ``lookup`` names each process's user and pod (none without it)."""
    now_unix = now()
    doc: JsonDict = {"format": STATE_FORMAT, "generated_unix": now_unix}
    if daemon is not None:
        doc["daemon"] = {
            "version": daemon.version,
            "backend": daemon.backend,
            "python_version": daemon.python_version,
        }
    doc["gpus"] = [snapshot_json(snap, now_unix, lookup) for snap in board.all()]
    return doc


# -- reading the document ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DaemonSection:
    """The ``daemon`` section: which gpuwatchd on which backend produced the document."""

    version: str | None
    backend: str | None
    python_version: str | None


@dataclass(frozen=True, slots=True)
class TuningSection:
    """The ``tuning`` section: whether tuning is on, where it runs, what is waiting.

    ``pending`` maps a GPU index, spelled as the JSON key, to the workloads queued on it.
    ``ready_reason`` is ``gpuwatchd_tuning_ready``'s reason (``no_torch``: the worker's
    Python lacks torch); None from a daemon that does not say.
    """

    enabled: bool
    running_gpus: tuple[int, ...]
    pending: dict[str, tuple[str, ...]]
    last_completed_unix: float | None
    ready: bool = True
    ready_reason: str | None = None


@dataclass(frozen=True, slots=True)
class StateDocument:
    """A parsed ``/api/v1/state`` document from ``source``.

    ``gate_config`` is kept as sent and checked by :meth:`gate` only when a job re-runs
    the gate, so a newer daemon's extra threshold never breaks ``status``.
    """

    source: str
    gpus: tuple[GpuState, ...]
    daemon: DaemonSection | None
    tuning: TuningSection | None
    gate_config: Mapping[str, Any] | None

    def gate(self) -> GateConfig:
        """The daemon's gate thresholds when it publishes them, else the defaults."""
        if self.gate_config is None:
            return GateConfig()
        try:
            return GateConfig.from_mapping(self.gate_config)
        except ValueError as e:
            raise GpuwatchdError(f"{self.source}: bad state document: {e}") from None


def parse_state(doc: Any, source: str = "state") -> StateDocument:
    """A whole ``/api/v1/state`` document; GpuwatchdError naming the bad field."""
    if not isinstance(doc, dict) or not isinstance(doc.get("gpus"), list):
        raise GpuwatchdError(f"{source}: not a gpuwatchd state document")
    d = DocReader(source, "state")
    fmt = doc.get("format", STATE_FORMAT)
    if fmt != STATE_FORMAT:
        raise d.bad("format", repr(STATE_FORMAT), fmt)
    tuning = _tuning_section(d, doc)
    running = tuning.running_gpus if tuning is not None else ()
    gate_config = doc.get("gate_config")
    if gate_config is not None and not isinstance(gate_config, dict):
        raise d.bad("gate_config", "an object", gate_config)
    return StateDocument(
        source=source,
        gpus=tuple(parse_gpu_state(entry, running, source) for entry in doc["gpus"]),
        daemon=_daemon_section(d, doc),
        tuning=tuning,
        gate_config=gate_config,
    )


def parse_gpu_state(entry: Any, running: Iterable[int] = (), source: str = "state") -> GpuState:
    """One ``gpus[i]`` entry; ``running`` lists the GPUs the daemon is tuning on."""
    d = DocReader(source, "state")
    if not isinstance(entry, dict):
        raise d.bad("gpus[]", "an object", entry)
    gpu = d.integer(entry, "gpu", "gpus[]")
    where = f"gpus[gpu={gpu}]"
    info = d.obj(entry, "info", where, optional=True)
    sample = d.obj(entry, "sample", where, optional=True)
    gate = d.obj(entry, "gate", where, optional=True)
    poll = d.obj(entry, "poll", where, optional=True)
    if gate:
        state = d.text(gate, "state", f"{where}.gate")
        is_open = d.flag(gate, "open", f"{where}.gate")
        reasons = d.texts(gate, "reasons", f"{where}.gate") or ()
        in_state = d.num(gate, "in_state_s", f"{where}.gate")
    else:
        state, is_open, reasons, in_state = "unavailable", False, ("no gate decision yet",), None
    uuid = entry.get("uuid")
    return GpuState(
        gpu=gpu,
        uuid=uuid if isinstance(uuid, str) else None,
        name=d.text(info, "name", f"{where}.info", optional=True) or None,
        state=state,
        open=is_open,
        reasons=reasons,
        in_state_s=in_state,
        t_s=d.num(sample, "t_s", f"{where}.sample"),
        temp_c=d.num(sample, "temp_c", f"{where}.sample"),
        power_w=d.num(sample, "power_w", f"{where}.sample"),
        sm_clock_mhz=d.num(sample, "sm_clock_mhz", f"{where}.sample"),
        util_gpu_ratio=d.num(sample, "util_gpu_ratio", f"{where}.sample"),
        throttle_reasons=d.texts(sample, "throttle_reasons", f"{where}.sample"),
        compute_pids=d.ints(sample, "compute_pids", f"{where}.sample"),
        max_sm_clock_mhz=d.num(info, "max_sm_clock_mhz", f"{where}.info"),
        power_limit_w=d.num(info, "power_limit_w", f"{where}.info"),
        slowdown_temp_c=d.num(info, "slowdown_temp_c", f"{where}.info"),
        stalled=d.flag(poll, "stalled", f"{where}.poll"),
        lost=d.flag(poll, "lost", f"{where}.poll"),
        sample_age_s=d.num(poll, "last_success_age_s", f"{where}.poll"),
        tuning=gpu in set(running),
        poll_ok=d.flag(poll, "success", f"{where}.poll"),
        processes=_processes(d, entry, where),
    )


def _processes(d: DocReader, entry: Mapping[str, Any], where: str) -> tuple[ProcessState, ...]:
    raw = entry.get("processes")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise d.bad(f"{where}.processes", "a list", raw)
    out = []
    for item in raw:
        if not isinstance(item, dict):
            raise d.bad(f"{where}.processes[]", "an object", item)
        at = f"{where}.processes[]"
        used = d.num(item, "used_memory_bytes", at)
        out.append(
            ProcessState(
                pid=d.integer(item, "pid", at),
                user=d.text(item, "user", at, optional=True) or None,
                used_memory_bytes=None if used is None else int(used),
                namespace=d.text(item, "namespace", at, optional=True) or None,
                pod=d.text(item, "pod", at, optional=True) or None,
                container=d.text(item, "container", at, optional=True) or None,
            )
        )
    return tuple(out)


def _daemon_section(d: DocReader, doc: Mapping[str, Any]) -> DaemonSection | None:
    section = d.obj(doc, "daemon", "", optional=True)
    if not section:
        return None
    return DaemonSection(
        version=d.text(section, "version", "daemon", optional=True) or None,
        backend=d.text(section, "backend", "daemon", optional=True) or None,
        python_version=d.text(section, "python_version", "daemon", optional=True) or None,
    )


def _tuning_section(d: DocReader, doc: Mapping[str, Any]) -> TuningSection | None:
    if doc.get("tuning") is None:
        return None
    section = d.obj(doc, "tuning", "")
    raw_pending = d.obj(section, "pending", "tuning", optional=True)
    pending = {gpu: d.texts(raw_pending, gpu, "tuning.pending") or () for gpu in raw_pending}
    return TuningSection(
        enabled=d.flag(section, "enabled", "tuning", default=True),
        running_gpus=d.ints(section, "running_gpus", "tuning") or (),
        pending=pending,
        last_completed_unix=d.num(section, "last_completed_unix", "tuning"),
        ready=d.flag(section, "ready", "tuning", default=True),
        ready_reason=d.text(section, "ready_reason", "tuning", optional=True) or None,
    )
