"""The ``tuning`` sub-collector: sessions, deferrals, winners per regime.

Reads only the scheduler's published :class:`TuningSnapshot` (refreshed after each
decision and session), never the database, so a scrape costs no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuwatchd.gate import GateState
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.sessions.scheduler import TuningSnapshot
from gpuwatchd.tuning.types import Regime, SessionStatus
from gpuwatchd.tuning.winners import clear_winner, winners_differ

#: Why the scheduler may not start pending work: the gate states that keep it shut, and
#: its own reasons (see TuneScheduler._blocker).
DEFERRAL_REASONS = (
    *(s.value for s in GateState if s is not GateState.COOL_STABLE),
    "outside_window",
    "another_session",
    "retry_backoff",
)

FINAL = [s.value for s in SessionStatus if s not in (SessionStatus.RUNNING, SessionStatus.DEFERRED)]


class TuningCollector:
    name = "tuning"

    def __init__(self, board: StateBoard, snapshot: Callable[[], TuningSnapshot]) -> None:
        self._board = board
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        sessions = CounterMetricFamily(
            "gpuwatchd_tune_sessions",
            "Tuning sessions ended, by final status (kept in the store across restarts).",
            labels=["status"],
        )
        for status in FINAL:
            sessions.add_metric([status], float(snap.sessions_total.get(status, 0)))
        yield sessions

        deferred = CounterMetricFamily(
            "gpuwatchd_tune_deferred",
            "Scheduler checks that found tuning work pending but did not start it, by reason "
            "(the gate state, outside_window, another_session, retry_backoff, unavailable).",
            labels=["reason"],
        )
        # Every reason from the start, so rate()/increase() see the first deferral.
        counts = dict.fromkeys(DEFERRAL_REASONS, 0) | snap.deferred_total
        for reason, n in sorted(counts.items()):
            deferred.add_metric([reason], float(n))
        yield deferred

        running = GaugeMetricFamily(
            "gpuwatchd_tune_running",
            "1 while a tuning worker runs on this GPU.",
            labels=["gpu", "uuid"],
        )
        pending = GaugeMetricFamily(
            "gpuwatchd_tune_pending_workloads",
            "Workloads waiting for this GPU's gate to open.",
            labels=["gpu", "uuid"],
        )
        for gpu in self._board.all():
            labels = [str(gpu.index), gpu.info.uuid if gpu.info else ""]
            running.add_metric(labels, 1.0 if gpu.index in snap.running else 0.0)
            pending.add_metric(labels, float(len(snap.pending.get(gpu.index, ()))))
        yield running
        yield pending

        info = GaugeMetricFamily(
            "gpuwatchd_winner_info",
            "The fastest candidate per workload and regime for the stack tuned last "
            '(tie="true": within noise of the runner-up).',
            labels=["gpu_model", "workload", "regime", "candidate", "tie"],
        )
        seconds = GaugeMetricFamily(
            "gpuwatchd_winner_seconds",
            "Median time per call of the winning candidate.",
            labels=["gpu_model", "workload", "regime"],
            unit="seconds",
        )
        by_key: dict[tuple[str, str], dict[Regime, tuple[str, bool]]] = {}
        for w in snap.winners:
            info.add_metric(
                [w.gpu_model, w.workload, w.regime.value, w.candidate, str(w.tie).lower()], 1.0
            )
            if w.median_s is not None:
                seconds.add_metric([w.gpu_model, w.workload, w.regime.value], w.median_s)
            by_key.setdefault((w.gpu_model, w.workload), {})[w.regime] = (w.candidate, w.tie)
        yield info
        yield seconds

        differ = GaugeMetricFamily(
            "gpuwatchd_regime_winners_differ",
            "1 when the unthrottled and sustained winners are different kernels (neither a tie).",
            labels=["gpu_model", "workload"],
        )
        for (model, workload), regimes in sorted(by_key.items()):
            cool, hot = regimes.get(Regime.UNTHROTTLED), regimes.get(Regime.SUSTAINED)
            if cool is None or hot is None:
                continue
            flips = winners_differ(clear_winner(*cool), clear_winner(*hot))
            differ.add_metric([model, workload], 1.0 if flips else 0.0)
        yield differ

        if snap.last_tune_unix is not None:
            yield GaugeMetricFamily(
                "gpuwatchd_last_tune_timestamp_seconds",
                "Unix time the last completed tuning session ended.",
                value=snap.last_tune_unix,
            )
