"""One GPU as a reader of ``/api/v1/state`` sees it: :class:`GpuState`.

Parsed by :func:`gpuwatchd.api.state.parse_gpu_state`; turned back into telemetry types
(:meth:`GpuState.to_sample`, :meth:`GpuState.to_info`) when a job re-runs the gate itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason

_REASON_BY_LABEL = {r.label: r for r in ThrottleReason}


@dataclass(frozen=True, slots=True)
class ProcessState:
    """One compute process on a GPU: who runs it, its device memory, its pod if known."""

    pid: int
    user: str | None = None
    used_memory_bytes: int | None = None
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None


@dataclass(frozen=True, slots=True)
class GpuState:
    """One GPU as the daemon sees it: the gate's verdict plus the latest reading.

    ``state`` is the gate state (``cool_stable``, ``warming``, ``throttled``, ``busy``,
    ``unavailable``); only ``cool_stable`` is ``open``. ``t_s`` is the sample's time on
    the daemon's clock. ``poll_ok`` is false when the daemon's last read of the GPU
    failed. ``judged_by`` is ``"client"`` when the job re-ran the gate with its own PIDs
    excluded (:meth:`gpuwatchd.client.Client.wait_until_stable`).
    """

    gpu: int
    uuid: str | None
    name: str | None
    state: str
    open: bool
    reasons: tuple[str, ...]
    in_state_s: float | None
    t_s: float | None
    temp_c: float | None
    power_w: float | None
    sm_clock_mhz: float | None
    util_gpu_ratio: float | None
    throttle_reasons: tuple[str, ...] | None
    compute_pids: tuple[int, ...] | None
    max_sm_clock_mhz: float | None
    power_limit_w: float | None
    slowdown_temp_c: float | None
    stalled: bool
    lost: bool
    sample_age_s: float | None
    tuning: bool  # the daemon is running a tuning session on this GPU
    poll_ok: bool = True
    judged_by: str = "daemon"
    processes: tuple[ProcessState, ...] = ()

    @property
    def ready(self) -> bool:
        """Gate open and the reading fresh: safe to run a first call that tunes."""
        return self.open and not self.stalled and not self.lost

    def describe(self) -> str:
        """One line: state, why, and the reading behind it."""
        facts = [
            f"{self.temp_c:.0f}C" if self.temp_c is not None else None,
            f"SM {self.sm_clock_mhz:.0f}MHz" if self.sm_clock_mhz is not None else None,
            f"{self.power_w:.0f}W" if self.power_w is not None else None,
        ]
        if self.throttle_reasons:
            facts.append("throttle " + "+".join(self.throttle_reasons))
        if self.lost or self.stalled:
            facts.append("GPU lost" if self.lost else "poll stalled")
        why = "; ".join(self.reasons) or "no reason given"
        shown = ", ".join(f for f in facts if f)
        return f"gpu {self.gpu} {self.state}: {why}" + (f" ({shown})" if shown else "")

    def to_sample(self) -> Sample | None:
        """The reading as a telemetry :class:`Sample` (None when there is none yet)."""
        if self.t_s is None:
            return None
        reasons = None
        if self.throttle_reasons is not None:
            reasons = ThrottleReason(0)
            for label in self.throttle_reasons:
                reasons |= _REASON_BY_LABEL.get(label, ThrottleReason(0))
        return Sample(
            gpu=self.gpu,
            t=self.t_s,
            temp_c=self.temp_c,
            power_w=self.power_w,
            sm_clock_mhz=self.sm_clock_mhz,
            reasons=reasons,
            util_gpu=self.util_gpu_ratio,
            procs=self.compute_pids,
        )

    def to_info(self) -> DeviceInfo:
        """The static facts the gate needs, as a :class:`DeviceInfo`."""
        return DeviceInfo(
            index=self.gpu,
            uuid=self.uuid or "",
            name=self.name or "",
            max_sm_clock_mhz=self.max_sm_clock_mhz,
            power_limit_w=self.power_limit_w,
            slowdown_temp_c=self.slowdown_temp_c,
        )
