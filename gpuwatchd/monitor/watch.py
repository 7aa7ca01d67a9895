"""One GPU's gate over time: a window of recent samples and the decision carried between polls.

:func:`gpuwatchd.gate.evaluate` is pure; judging a GPU *over time* needs state around
it: the samples of the last ``window_s``, the previous decision (hysteresis and the
settle timer), the PIDs that count as ours, and what to say when there is no fresh
reading. :class:`GpuWatch` is that state, and the one place that keeps it: the
daemon's poller holds one per GPU, ``gpuwatchd tune`` gets it through the poller, and
a job's client re-runs the daemon's gate through one with its own PIDs excluded.

Not thread-safe: each watch is fed by one thread (the poller's sweeper, the client).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from gpuwatchd import gate  # per call, so bench/history/poll_breakdown.py can time it
from gpuwatchd.gate import GateConfig, GateDecision, SampleWindow
from gpuwatchd.telemetry.types import DeviceInfo, Sample

OwnPids = Callable[[], frozenset[int]]
_NONE: frozenset[int] = frozenset()


class GpuWatch:
    """The gate state of one GPU: feed it readings with :meth:`add`, ask :meth:`judge`.

    ``own_pids`` is asked at every judgement for the processes that are ours (the
    tuning worker, a job's own process): they never make the GPU ``busy``. ``cfg`` may
    be replaced between judgements (a reloaded configuration).
    """

    __slots__ = ("_own_pids", "_window", "cfg", "decision")

    def __init__(self, cfg: GateConfig, own_pids: OwnPids = frozenset) -> None:
        self.cfg = cfg
        self._own_pids = own_pids
        self._window = SampleWindow()  # keeps its spans in order: the gate reads them in O(1)
        #: The last judgement (None before the first): the gate's hysteresis state.
        self.decision: GateDecision | None = None

    @property
    def window(self) -> tuple[Sample, ...]:
        """The samples of the last ``cfg.window_s`` seconds, oldest first (a copy)."""
        return tuple(self._window)

    @property
    def max_poll_s(self) -> float:
        """Poll at least this often, or the window never holds ``min_samples`` samples."""
        return self.cfg.window_s / (self.cfg.min_samples + 1)

    def add(self, sample: Sample) -> bool:
        """Take a fresh reading and forget those older than the window; True if it was new.

        A reading not newer than the latest one held is the same reading seen again (a
        recording polled faster than it was recorded, the daemon's latest sample read
        twice by a client): it is not more evidence, so it is ignored.
        """
        w = self._window
        if w and sample.t <= w[-1].t:
            return False
        w.advance(sample, sample.t - self.cfg.window_s)  # usually one in, one out
        return True

    def judge(
        self,
        info: DeviceInfo | None,
        *,
        lost: bool = False,
        why: str | None = None,
        age_s: float | None = None,
    ) -> GateDecision:
        """Run the gate over the window, remember the decision and return it.

        ``lost``: there is no fresh reading (the GPU is gone, a read stalled or
        failed), so the gate is ``unavailable``, for the reason ``why`` when given
        (else ``GPU lost``). ``age_s``: how old the latest reading is, when it comes
        from elsewhere (a client reading the daemon); older than ``stale_after_s``
        counts as lost.
        """
        cfg = self.cfg
        if age_s is not None and age_s > cfg.stale_after_s:
            lost = True
        w = self._window
        # Our PIDs matter only to a reading with processes or utilization: skip asking.
        latest = w[-1] if w and not lost else None
        asks = latest is not None and (latest.procs or latest.util_gpu)
        own = self._own_pids() if asks else _NONE
        d = gate.evaluate(w, info, cfg, self.decision, own, lost)
        if lost and why is not None:
            d = replace(d, reasons=(why,))
        self.decision = d
        return d
