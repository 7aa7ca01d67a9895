"""A GPU's gate judged for one job: the job's own processes left out, the history kept.

A job that holds a CUDA context is a compute process on its GPU, so the daemon's gate
says ``busy`` because of the very job waiting for it. ``register_job`` tells the daemon
which processes are the job's (:mod:`gpuwatchd.daemon.jobs`); ``job_gate`` then replays
the daemon's recent samples of the GPU (:mod:`gpuwatchd.daemon.history`) through a
gate of the job's own that does not count those processes, so a GPU that was quiet
before the job asked opens at once instead of after a fresh ``settle_s``. On the wire::

    {"op": "register_job"}
        -> {"ok": true, "job": "4242-1234567", "pid": 4242, "pids": [4242, 4250]}
    {"op": "job_gate", "gpu": 0 | "GPU-uuid", "job": "4242-1234567"}
        -> {"ok": true, "job": ..., "excluded_pids": [...], "judged_by": "daemon_for_job",
            "gpu": {...the GPU's /api/v1/state entry, its gate judged for the job...}}

Without ``job``, ``job_gate`` registers the caller (who must be the job itself). The
daemon's own tuning is untouched: for it the job stays foreign, and comes first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from gpuwatchd.api.state import snapshot_json
from gpuwatchd.control.wire import JOB_GATE, JUDGED_FOR_JOB, REGISTER_JOB
from gpuwatchd.daemon.history import SampleHistory
from gpuwatchd.daemon.jobs import Job, JobError, JobRegistry
from gpuwatchd.daemon.ops import Op, Request, Response
from gpuwatchd.gate import GateConfig, GateDecision, GateState
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.monitor.watch import GpuWatch
from gpuwatchd.serve.control import PeerCred, RequestError
from gpuwatchd.telemetry.types import normalize_uuid

JUDGED_BY = JUDGED_FOR_JOB
#: Gates kept per (job, GPU); the oldest is dropped beyond this.
MAX_GATES = 512


@dataclass(slots=True)
class _JobWatch:
    """A job's gate of one GPU, fed up to ``last_t`` with the job's PIDs left out."""

    pids: frozenset[int]
    watch: GpuWatch
    last_t: float | None = None


class JobGates:
    """Judges GPUs for registered jobs from the daemon's sample history. Thread-safe."""

    def __init__(
        self,
        registry: JobRegistry,
        history: SampleHistory,
        board: StateBoard,
        gate_cfg: Callable[[], GateConfig],
    ) -> None:
        self.registry = registry
        self._history = history
        self.board = board
        self._gate_cfg = gate_cfg
        self._watches: dict[tuple[str, int], _JobWatch] = {}
        self._lock = threading.Lock()

    def judge(self, job: Job, gpu: int) -> tuple[GateDecision | None, frozenset[int]]:
        """The GPU's gate for ``job`` (None before any sample) and the PIDs left out."""
        snap = self.board.get(gpu)
        pids = self.registry.pids(job)
        cfg = self._gate_cfg()
        with self._lock:
            jw = self._watches.get((job.id, gpu))
            if jw is None or jw.pids != pids or jw.watch.cfg != cfg:
                frozen = pids
                jw = _JobWatch(pids, GpuWatch(cfg, lambda: frozen))
                self._watches[(job.id, gpu)] = jw
                self._trim(job.id)
            info = snap.info if snap is not None else None
            for sample in self._history.samples(gpu, after=jw.last_t):
                jw.watch.add(sample)
                jw.watch.judge(info)
                jw.last_t = sample.t
            decision = jw.watch.decision
        if snap is not None and snap.gate is not None and snap.gate.state is GateState.UNAVAILABLE:
            decision = snap.gate  # no fresh reading: nobody can vouch for the GPU
        return decision, pids

    def _trim(self, keep_job: str) -> None:
        live = {j.id for j in self.registry.jobs()} | {keep_job}
        for key in [k for k in self._watches if k[0] not in live]:
            del self._watches[key]
        while len(self._watches) > MAX_GATES:
            del self._watches[next(iter(self._watches))]


def parse_job_gate(doc: Request) -> Request:
    """``{"op": "job_gate", "gpu": index | uuid, "job": id | None}``."""
    gpu = doc.get("gpu")
    if (
        isinstance(gpu, bool)
        or not isinstance(gpu, int | str)
        or gpu == ""
        or (isinstance(gpu, int) and gpu < 0)
    ):
        raise RequestError(f"gpu: expected a GPU index >= 0 or a GPU UUID, got {gpu!r}")
    job = doc.get("job")
    if job is not None and (not isinstance(job, str) or not job):
        raise RequestError(f"job: expected a job id from register_job, got {job!r}")
    return {"op": JOB_GATE, "gpu": gpu, "job": job}


def job_ops(gates: JobGates) -> tuple[Op, Op]:
    """The ``register_job`` and ``job_gate`` ops, to register on the daemon's op table."""
    registry = gates.registry

    def register(_request: Request, peer: PeerCred) -> Response:
        job = _register(registry, peer)
        return {"ok": True, "job": job.id, "pid": job.pid, "pids": sorted(registry.pids(job))}

    def job_gate(request: Request, peer: PeerCred) -> Response:
        try:
            job = registry.get(request["job"]) if request["job"] else _register(registry, peer)
        except JobError as e:
            raise RequestError(str(e)) from None
        gpu = _gpu_index(gates, request["gpu"])
        snap = gates.board.get(gpu)
        assert snap is not None
        decision, pids = gates.judge(job, gpu)
        entry: dict[str, Any] = snapshot_json(replace(snap, gate=decision), time.time())
        return {
            "ok": True,
            "job": job.id,
            "excluded_pids": sorted(pids),
            "judged_by": JUDGED_BY,
            "gpu": entry,
        }

    return (
        Op(REGISTER_JOB, register),
        Op(JOB_GATE, job_gate, parse_job_gate),
    )


def _register(registry: JobRegistry, peer: PeerCred) -> Job:
    try:
        return registry.register(peer.pid, peer.uid)
    except JobError as e:
        raise RequestError(str(e)) from None


def _gpu_index(gates: JobGates, gpu: int | str) -> int:
    snaps = gates.board.all()
    for snap in snaps:
        if isinstance(gpu, int) and snap.index == gpu:
            return gpu
        uuid = snap.info.uuid if snap.info is not None else None
        if isinstance(gpu, str) and uuid and normalize_uuid(uuid) == normalize_uuid(gpu):
            return snap.index
    known = ", ".join(str(s.index) for s in snaps) or "none polled yet"
    raise RequestError(f"gpu: no GPU {gpu!r} watched by this daemon (GPUs: {known})")
