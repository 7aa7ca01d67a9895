"""The ``tuning`` sub-collector: sessions, deferrals, winners per regime.

Reads only the scheduler's published :class:`TuningSnapshot` (refreshed after each
decision and session), never the database, so a scrape costs no I/O.

Label cardinality stays bounded: shipped and configured workloads get one winner series
each, but users' work can have any number of workloads (a kernel has one per key
value, a captured model hundreds of shapes), so users' kernels are summed up per kernel
(``gpuwatchd_user_kernel_keys``) and added workloads in total
(``gpuwatchd_added_workloads``); their winners are in ``/api/v1/winners`` and the report.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuwatchd.exporter.collectors.gpu import GPU_LABELS, gpu_labels
from gpuwatchd.gate import GateState
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.sessions.scheduler import WORKER_NOT_READY
from gpuwatchd.sessions.tuning_view import TuningSnapshot
from gpuwatchd.store.rows import WinnerRow
from gpuwatchd.tuning.submitted.kernels import FAMILY as USER_KERNEL_FAMILY
from gpuwatchd.tuning.types import Regime, SessionStatus
from gpuwatchd.tuning.winners import clear_winner, winners_differ

#: Why the scheduler may not start pending work: the gate states that keep it shut, and
#: its own reasons (see TuneScheduler._blocker).
DEFERRAL_REASONS = (
    *(s.value for s in GateState if s is not GateState.COOL_STABLE),
    "outside_window",
    "another_session",
    "retry_backoff",
    WORKER_NOT_READY,
    "store_unavailable",
)

FINAL = [s.value for s in SessionStatus if s not in (SessionStatus.RUNNING, SessionStatus.DEFERRED)]
_USER_PREFIX = USER_KERNEL_FAMILY + ":"


def user_kernel(workload: str) -> str | None:
    """``triton.user:mod.kernel@1a2b3c4d/n=4096`` -> ``mod.kernel@1a2b3c4d``; None for
    a workload that is not a user's kernel."""
    if not workload.startswith(_USER_PREFIX):
        return None
    return workload[len(_USER_PREFIX) :].split("/", 1)[0]


class TuningCollector:
    """Session and deferral counters, per-GPU running/pending gauges, winners per regime."""

    name = "tuning"
    runs_inline = True  # published snapshots only; ``added`` must not wait on a lock
    timeless = True  # made from what version() returns, no clock

    def __init__(
        self,
        board: StateBoard,
        snapshot: Callable[[], TuningSnapshot],
        added: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self._board = board
        self._snapshot = snapshot
        self._added = added  # names of users' added workloads: summed up, not itemised

    def version(self) -> object:
        """The scheduler's snapshot, the GPUs' facts (labels) and the added workloads'
        names: every object the families are made from."""
        return (
            self._snapshot(),
            tuple((s.index, s.info) for s in self._board.all()),
            self._added(),
        )

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        ready, reason = snap.ready
        tuning_ready = GaugeMetricFamily(
            "gpuwatchd_tuning_ready",
            "1 when the tuning worker's Python imports what the daemon's tuning work needs; "
            "else 0 and reason says why: no_torch or no_triton (install gpuwatchd[tune] "
            "there or set [tuning] worker_python; work needing it is not started), "
            "probe_failed, checking (the check at start has not answered yet), disabled.",
            labels=["reason"],
        )
        tuning_ready.add_metric([reason], 1.0 if ready else 0.0)
        yield tuning_ready
        sessions = CounterMetricFamily(
            "gpuwatchd_tune_sessions",
            "Tuning sessions this daemon ran that ended, by final status (since it started).",
            labels=["status"],
        )
        for status in FINAL:
            sessions.add_metric([status], float(snap.sessions_total.get(status, 0)))
        yield sessions

        deferred = CounterMetricFamily(
            "gpuwatchd_tune_deferred",
            "Scheduler checks that found tuning work pending but did not start it, by reason "
            "(the gate state, outside_window, another_session, retry_backoff, unavailable, "
            "worker_not_ready: the worker's Python lacks a module all of it needs).",
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
            labels=GPU_LABELS,
        )
        pending = GaugeMetricFamily(
            "gpuwatchd_tune_pending_workloads",
            "Workloads waiting for this GPU's gate to open.",
            labels=GPU_LABELS,
        )
        for gpu in self._board.all():
            labels = gpu_labels(gpu)
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
        added = frozenset(self._added())
        shipped = [w for w in snap.winners if user_kernel(w.workload) is None]
        shipped = [w for w in shipped if w.workload not in added]
        by_key: dict[tuple[str, str], dict[Regime, tuple[str, bool]]] = {}
        for w in shipped:
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
        yield from _user_work(snap, added)

        last = GaugeMetricFamily(
            "gpuwatchd_last_tune_timestamp_seconds",
            "Unix time the last completed tuning session on this GPU ended (absent: never).",
            labels=GPU_LABELS,
        )
        for gpu in self._board.all():
            ended = snap.last_tune_by_uuid.get(gpu.info.uuid) if gpu.info is not None else None
            if ended is not None:
                last.add_metric(gpu_labels(gpu), ended)
        if last.samples:
            yield last


def _user_work(snap: TuningSnapshot, added: frozenset[str]) -> Iterator[Metric]:
    """Per-kernel and total counts of users' work, tuned and waiting."""
    tuned: dict[str, set[str]] = {}
    flips: dict[str, set[str]] = {}
    by_key: dict[tuple[str, str], dict[Regime, WinnerRow]] = {}
    tuned_added: set[str] = set()
    for w in snap.winners:
        kernel = user_kernel(w.workload)
        if kernel is not None:
            tuned.setdefault(kernel, set()).add(w.workload)
            by_key.setdefault((w.gpu_model, w.workload), {})[w.regime] = w
        elif w.workload in added:
            tuned_added.add(w.workload)
    for (_, workload), regimes in by_key.items():
        cool, hot = regimes.get(Regime.UNTHROTTLED), regimes.get(Regime.SUSTAINED)
        if cool is None or hot is None:
            continue
        if winners_differ(
            clear_winner(cool.candidate, cool.tie), clear_winner(hot.candidate, hot.tie)
        ):
            flips.setdefault(user_kernel(workload) or "", set()).add(workload)
    waiting = {name for names in snap.pending.values() for name in names}
    pending: dict[str, set[str]] = {}
    for name in waiting:
        kernel = user_kernel(name)
        if kernel is not None:
            pending.setdefault(kernel, set()).add(name)

    keys = GaugeMetricFamily(
        "gpuwatchd_user_kernel_keys",
        "Key values of a user's Triton kernel: state=tuned have a winner (any GPU model), "
        "state=pending wait for a gate. One series per kernel, not per key.",
        labels=["kernel", "state"],
    )
    differ = GaugeMetricFamily(
        "gpuwatchd_user_kernel_regime_winners_differ_keys",
        "Key values of a user's kernel whose unthrottled and sustained winners differ.",
        labels=["kernel"],
    )
    for kernel in sorted(tuned.keys() | pending.keys()):
        keys.add_metric([kernel, "tuned"], float(len(tuned.get(kernel, ()))))
        keys.add_metric([kernel, "pending"], float(len(pending.get(kernel, ()))))
        differ.add_metric([kernel], float(len(flips.get(kernel, ()))))
    yield keys
    yield differ

    total = GaugeMetricFamily(
        "gpuwatchd_added_workloads",
        "Workloads users added (captured shapes): state=tuned have a winner, "
        "state=pending wait for a gate, state=defined are all of them.",
        labels=["state"],
    )
    total.add_metric(["defined"], float(len(added)))
    total.add_metric(["tuned"], float(len(tuned_added)))
    total.add_metric(["pending"], float(len(waiting & added)))
    yield total
