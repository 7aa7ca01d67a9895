"""The daemon's gate judged for the job, with the job's own processes left out.

A job that already holds a CUDA context is in NVML's compute-process list, so the
daemon's gate calls the GPU ``busy`` because of the very job that is waiting for it.
:meth:`gpuwatchd.client.Client.wait_until_stable` first asks the daemon to judge the GPU
for the job (:class:`_DaemonJobGate`: the daemon maps the job's host PIDs and keeps the
settle time already spent); with no control socket it re-runs the same gate logic here
on the daemon's samples, with the job's PIDs excluded (:class:`_OwnProcessGate`, which
needs the job's PIDs to be the ones NVML reports and starts its settle time afresh).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from gpuwatchd.api.gpu_state import GpuState
from gpuwatchd.api.state import parse_gpu_state
from gpuwatchd.client.control import Unreachable, ask_doc
from gpuwatchd.client.errors import GpuwatchdError
from gpuwatchd.control import wire
from gpuwatchd.gate import GateConfig
from gpuwatchd.monitor.watch import GpuWatch
from gpuwatchd.validate import one_line

#: ``GpuState.judged_by`` of a state the daemon judged for this job.
JUDGED_BY_DAEMON = wire.JUDGED_FOR_JOB


class _OwnProcessGate:
    """The daemon's gate re-run on the daemon's samples, with this process's PIDs excluded."""

    def __init__(self, cfg: GateConfig, own_pids: frozenset[int]) -> None:
        self._watch = GpuWatch(cfg, lambda: own_pids)

    @property
    def max_poll_s(self) -> float:
        """Poll at least this often, or the window never holds ``min_samples`` samples."""
        return self._watch.max_poll_s

    def judge(self, st: GpuState) -> GpuState:
        sample = st.to_sample()
        if sample is not None:
            self._watch.add(sample)  # the daemon's latest sample read again is ignored
        d = self._watch.judge(st.to_info(), lost=st.lost, age_s=st.sample_age_s)
        return replace(
            st,
            state=d.state.value,
            open=d.open,
            reasons=d.reasons,
            in_state_s=max(0.0, d.t - d.since),
            judged_by="client",
        )


class _DaemonJobGate:
    """The daemon's gate judged for this job, over the control socket.

    The job registers once (``register_job``: the daemon learns its host PIDs from the
    socket's credentials, which works across PID namespaces), then asks ``job_gate``:
    the daemon replays its own sample history without the job's processes, so the
    settle time already spent before the job asked counts. :meth:`judge` returns None
    when the daemon cannot do this (no socket, no permission, an older daemon); the
    caller then re-runs the gate itself. A daemon that stayed ``busy`` through the
    client's retries returns None too, with :attr:`busy` set: ask it again next time.
    """

    def __init__(self, socket_path: str | os.PathLike[str], timeout: float) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.job: str | None = None
        self.why_not: str | None = None  # why the daemon could not judge, once it could not
        self.busy = False  # the last ask found every slot taken: worth asking again

    def judge(self, gpu: int | str) -> GpuState | None:
        self.busy = False
        try:
            answer = self._ask_gate(gpu)
            if answer.get("ok") is not True and "no registered job" in str(answer.get("error")):
                self.job = None  # the daemon restarted: register again
                answer = self._ask_gate(gpu)
        except Unreachable as e:
            self.why_not = str(e)
            return None
        if answer.get("ok") is not True:
            self.why_not = one_line(answer.get("error", "refused"))
            self.busy = wire.is_busy(answer)
            return None
        try:
            st = parse_gpu_state(answer.get("gpu"), source=f"{self.socket_path} job_gate")
        except GpuwatchdError as e:
            self.why_not = str(e)
            return None
        return replace(st, judged_by=JUDGED_BY_DAEMON)

    def _ask_gate(self, gpu: int | str) -> dict[str, Any]:
        if self.job is None:
            answer = self._ask(wire.request(wire.REGISTER_JOB))
            if answer.get("ok") is not True or not isinstance(answer.get("job"), str):
                return answer
            self.job = answer["job"]
        return self._ask(wire.request(wire.JOB_GATE, gpu=gpu, job=self.job))

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """One answer; a busy daemon is asked again for at most ``timeout`` (the wait
        for the gate polls again, and asks again, in any case)."""
        return ask_doc(self.socket_path, request, self.timeout, patience_s=self.timeout)
