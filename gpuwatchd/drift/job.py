"""The daemon's periodic drift check: refresh references, evaluate, request re-tunes.

Run as a periodic task every ``drift.check_interval_s``. It only reads the
store and queues work; the tuning scheduler starts a re-tune at the GPU's next open
gate, so the job never blocks on a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from gpuwatchd.drift.detector import DriftDetector, RetuneReason
from gpuwatchd.drift.seed import ReferenceSync
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.tuning.types import Workload

log = logging.getLogger(__name__)

#: ``TuneScheduler.request``'s shape: (gpu, workloads, reason).
RequestFn = Callable[[int, Sequence[Workload], str], None]


class DriftJob:
    """One call = one drift check; returns the reasons it raised, per GPU.

    ``workloads`` gives the workloads a re-tune covers (the daemon's runnable set);
    each raised reason becomes one ``request(gpu, workloads, reason)``, so the tuner
    logs and records why it tunes. Re-tunes use the whole set: a drifted clock or a
    new stack can change the winner of any workload.
    """

    def __init__(
        self,
        detector: DriftDetector,
        sync: ReferenceSync,
        board: StateBoard,
        request: RequestFn,
        workloads: Callable[[], Sequence[Workload]],
        now: Callable[[], float] = time.time,
    ) -> None:
        self._detector = detector
        self._sync = sync
        self._board = board
        self._request = request
        self._workloads = workloads
        self._now = now

    def __call__(self) -> dict[int, list[RetuneReason]]:
        self._sync.sync(s.info for s in self._board.all() if s.info is not None)
        raised = self._detector.evaluate(self._now())
        if not raised:
            return raised
        workloads = tuple(self._workloads())
        for gpu, reasons in sorted(raised.items()):
            if not workloads:
                log.warning(
                    "GPU %d: re-tune needed (%s) but no configured workload runs on this backend",
                    gpu,
                    ", ".join(reasons),
                )
                continue
            for reason in reasons:
                self._request(gpu, workloads, reason.value)
        return raised
