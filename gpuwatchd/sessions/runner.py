"""The daemon side of a tuning session: spawn the worker, watch it, record what it sends.

:class:`TuneRunner` starts a session row in the store, runs ``python -P -m
gpuwatchd.tuning.worker`` pinned to one GPU, apart from the daemon's working directory
and environment (:mod:`gpuwatchd.tuning.worker_isolation`), stores the versions from
its ``hello`` and each ``result`` as it arrives, and ends the session ``completed``,
``failed`` (crash, hang, garbage output, a missing result) or ``preempted``
(``should_preempt`` gave a reason, or :meth:`TuneRunner.cancel`), then tells
``on_finished`` with a :class:`~gpuwatchd.sessions.events.SessionFinished`. The worker
runs in its own process group so a kill also reaches its children (Triton's compilers);
every wait is bounded, every child is reaped, and nothing here imports torch. A session's
end is tried again while the store is busy (a lock another host holds); one the store
cannot take waits in :class:`~gpuwatchd.sessions.pending_ends.PendingEnds` (with any result
it was too busy to take) until :meth:`TuneRunner.record_endings` records it.

Sessions resume: results that preempted sessions of the same GPU recorded recently, under
the same conditions and stack (:mod:`gpuwatchd.sessions.resume` has the rule), are
copied into the new session, and the worker measures only the (workload, regime) pairs
still missing; a regime interrupted half way is measured again from the start. With
nothing left to measure no worker reports the stack, so the results' versions are
compared (:func:`~gpuwatchd.tuning.versions.changed_versions`) with those installed now,
as the injected ``versions_now`` reads them.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import gpuwatchd
from gpuwatchd.sessions.events import SessionListener
from gpuwatchd.sessions.pending_ends import PendingEnd, PendingEnds, record, record_waiting
from gpuwatchd.sessions.resume import (
    Pair,
    check_max_age,
    describe_reuse,
    pair_text,
    remaining_spec,
    reusable_results,
)
from gpuwatchd.sessions.worker_process import Eof, Invalid, WorkerProcess, exit_text
from gpuwatchd.store import SessionMeta, SqlStore, StoredResult, StoreError
from gpuwatchd.store.errors import StoreBusy, StoreUnavailable
from gpuwatchd.telemetry.types import DeviceInfo, Sample
from gpuwatchd.tuning.session_spec import (
    ErrorMessage,
    Hello,
    Message,
    Progress,
    ResultMessage,
    SessionSpec,
)
from gpuwatchd.tuning.settings import DEFAULT_RESUME_MAX_AGE_S
from gpuwatchd.tuning.types import Regime, RegimeResult, SessionStatus, Versions
from gpuwatchd.tuning.versions import VersionsNow, changed_versions
from gpuwatchd.tuning.worker_isolation import (
    PYTHON_FLAGS,
    resolve_worker_user,
    switch_user,
    worker_environment,
)
from gpuwatchd.validate import describe

log = logging.getLogger("gpuwatchd.sessions.runner")

WORKER_MODULE = "gpuwatchd.tuning.worker"
#: Directory holding the ``gpuwatchd`` package: put on the worker's PYTHONPATH so it runs
#: the same code as the daemon, installed or not.
_PACKAGE_ROOT = str(Path(gpuwatchd.__file__).resolve().parent.parent)

ShouldPreempt = Callable[[], "str | None"]
OnProgress = Callable[[dict[str, Any]], None]
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class SessionOutcome:
    """How a session ended, and its results (also in the store), in the spec's order:
    those the worker delivered and those ``reused_from`` earlier sessions (pair -> id)."""

    status: SessionStatus
    why: str | None
    session_id: int
    results: tuple[RegimeResult, ...]
    reused_from: dict[Pair, int] = field(default_factory=dict)
    #: The store became unreachable mid-session and cut it off: not the tuning's fault.
    store_cut: bool = False


class RunnerBusy(RuntimeError):
    """A session is already running on this runner (one at a time per instance)."""


# -- the runner ------------------------------------------------------------------------------


class TuneRunner:
    """Runs tuning sessions in worker subprocesses and records them in ``store``.

    ``python -P`` runs the worker in ``/`` (:mod:`gpuwatchd.tuning.worker_isolation`);
    ``env`` is its environment (default: the minimal one taken from this process's),
    to which the runner adds ``CUDA_VISIBLE_DEVICES`` (the GPU's UUID for a ``cuda``
    job, empty otherwise), ``PYTHONPATH`` and ``PYTHONUNBUFFERED``. ``worker_user``
    (``[tuning] worker_user``) is who a root runner starts it as ("" : its own user).
    ``worker_cmd`` replaces the whole command (tests use small fake workers). ``term_grace_s`` is
    how long a SIGTERM'd worker gets before SIGKILL; ``poll_s`` how often
    ``should_preempt`` is asked; ``exit_wait_s`` how long an exited worker's pipes, or
    a worker that reported an error, may linger before its group is killed.
    ``on_finished`` is told about every session this runner ends, once the store holds
    its final status (the daemon passes :meth:`SessionEvents.notify`).
    ``resume_max_age_s`` is how old a preempted session's result may be and still be
    reused (0: never reuse, measure every pair); ``now`` is the clock it is judged on,
    the store's (unix seconds). ``versions_now`` reads the stack installed now, to
    check a spec whose every pair was measured already; without it such a spec is
    measured again.
    """

    def __init__(
        self,
        store: SqlStore,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        *,
        worker_cmd: Sequence[str] | None = None,
        term_grace_s: float = 0.5,
        poll_s: float = 0.05,
        exit_wait_s: float = 1.0,
        reap_timeout_s: float = 5.0,
        on_finished: SessionListener | None = None,
        resume_max_age_s: float = DEFAULT_RESUME_MAX_AGE_S,
        now: Callable[[], float] = time.time,
        versions_now: VersionsNow | None = None,
        worker_user: str = "",
        pending: PendingEnds | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.resume_max_age_s = check_max_age(resume_max_age_s)
        self._user = switch_user(resolve_worker_user(worker_user))
        self._now = now
        self._versions_now = versions_now
        for name, value in (
            ("term_grace_s", term_grace_s),
            ("poll_s", poll_s),
            ("exit_wait_s", exit_wait_s),
            ("reap_timeout_s", reap_timeout_s),
        ):
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s!r}")
        self.store = store
        self.python = python
        self._env = env
        default_cmd = [python, *PYTHON_FLAGS, "-m", WORKER_MODULE]
        self._cmd = list(worker_cmd) if worker_cmd is not None else default_cmd
        if not self._cmd:
            raise ValueError("worker_cmd must not be empty")
        self.term_grace_s = term_grace_s
        self.poll_s = poll_s
        self.exit_wait_s = exit_wait_s
        self.reap_timeout_s = reap_timeout_s
        self._on_finished = on_finished
        self._lock = threading.Lock()
        self._active = False
        self._worker: WorkerProcess | None = None
        self._hello_pid: int | None = None
        self._cancel: str | None = None
        #: Session ends the store could not take yet (the daemon's: one file for all).
        self.pending = pending if pending is not None else PendingEnds()
        self._sleep = sleep  # between tries while the store is busy

    # -- public ----------------------------------------------------------------------

    def pids(self) -> frozenset[int]:
        """PIDs of the live worker (the gate counts them as ours, not a foreign process)."""
        with self._lock:
            w = self._worker
            if w is None or w.proc.returncode is not None:
                return frozenset()
            return frozenset(p for p in (w.pid, self._hello_pid) if p is not None)

    def cancel(self, reason: str) -> bool:
        """Stop the running session (daemon shutdown); it ends ``preempted`` with
        ``cancelled: <reason>``, so it is retried later. False if none was running."""
        with self._lock:
            if not self._active:
                return False
            self._cancel = reason or "cancelled"
            return True

    def reusable(
        self, spec: SessionSpec, meta: SessionMeta, fresh_after: Mapping[str, float] | None = None
    ) -> dict[Pair, StoredResult]:
        """What earlier preempted sessions measured of ``spec`` that a session with
        ``meta`` may reuse (the stack is checked later, at the worker's hello);
        ``fresh_after`` as :meth:`run_session` takes it."""
        if self.resume_max_age_s <= 0:
            return {}
        since = self._now() - self.resume_max_age_s
        return reusable_results(self.store, spec, meta, since=since, fresh_after=fresh_after)

    def stack_now_differs(self, versions: Versions, info: DeviceInfo) -> str | None:
        """Why results measured on ``versions`` may not stand for the stack installed now
        for the GPU ``info``, or None when it is the same."""
        if self._versions_now is None:
            return "this runner cannot read the versions installed now"
        try:
            changed = changed_versions(versions, self._versions_now(info))
        except Exception as e:  # a broken lookup: measure rather than trust
            return f"reading the versions installed now failed: {describe(e)}"
        return f"{', '.join(changed)} changed since" if changed else None

    def run_session(
        self,
        spec: SessionSpec,
        info: DeviceInfo,
        backend_name: str,
        should_preempt: ShouldPreempt,
        on_progress: OnProgress | None = None,
        timeout_s: float = 3600.0,
        *,
        sample: Sample | None = None,
        fresh_after: Mapping[str, float] | None = None,
    ) -> SessionOutcome:
        """Run ``spec`` on the GPU ``info`` in a worker and record the session.

        Returns once the worker is gone: normally, killed after ``timeout_s``, killed
        for invalid output, or stopped within about ``poll_s + term_grace_s`` of
        ``should_preempt`` returning a reason. ``sample`` (the GPU's latest reading)
        is stored as its state at the start. Raises :class:`RunnerBusy` if a session
        is running already, ``ValueError`` for a spec that is not for ``info``, and
        :class:`~gpuwatchd.store.StoreError` if the session cannot even be started.

        Pairs that preempted sessions already measured are reused (see the module's
        docstring); when none is left to measure, and the stack installed now is the
        one they were measured on, the session completes without a worker.
        ``fresh_after`` maps workloads requested for a fresh measurement to when they
        were requested (unix seconds, the store's clock): their results from before
        that are never reused.
        """
        if not isinstance(timeout_s, int | float) or not math.isfinite(timeout_s):
            raise ValueError(f"timeout_s must be a finite number, got {timeout_s!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if spec.gpu_uuid != info.uuid or spec.gpu_index != info.index:
            raise ValueError(
                f"spec is for GPU {spec.gpu_index} ({spec.gpu_uuid}) but info is GPU "
                f"{info.index} ({info.uuid})"
            )
        fresh = _check_fresh_after(fresh_after)
        with self._claim():
            self.record_endings()
            meta = SessionMeta.for_device(
                info,
                backend=backend_name,
                workloads=spec.workloads,
                regimes=spec.regimes,
                sample=sample,
            )
            meta = _with_extra(meta, spec)
            sid = self.store.start_session(meta)
            log.info("tuning session %d on GPU %d (%s) started", sid, info.index, info.uuid)
            session = _Session(
                self, spec, info, sid, should_preempt, on_progress, timeout_s, meta, fresh
            )
            try:
                status, why = session.run()
            except BaseException as e:  # KeyboardInterrupt, a bug: never leave it running
                session.kill()
                why = f"runner interrupted: {describe(e)}"
                self._finish(sid, info, SessionStatus.FAILED, why, spec, session.unrecorded)
                raise
            self._finish(sid, info, status, why, spec, session.unrecorded)
            log.info("tuning session %d ended %s%s", sid, status.value, f": {why}" if why else "")
            reused = {p: s.session_id for p, s in session.carried.items()}
            return SessionOutcome(
                status, why, sid, session.ordered_results(), reused, session.store_cut
            )

    def record_endings(self) -> int:
        """Record the session ends the store could not take when they happened (their
        rows still say running); returns how many still wait for the store."""
        return record_waiting(self.store, self.pending, self._notify)

    # -- internals -------------------------------------------------------------------

    @contextmanager
    def _claim(self) -> Iterator[None]:
        with self._lock:
            if self._active:
                raise RunnerBusy("a tuning session is already running on this runner")
            self._active, self._cancel, self._hello_pid = True, None, None
        try:
            yield
        finally:
            with self._lock:
                self._active, self._worker, self._hello_pid = False, None, None

    def _finish(
        self,
        sid: int,
        info: DeviceInfo,
        status: SessionStatus,
        why: str | None,
        spec: SessionSpec,
        unrecorded: Sequence[RegimeResult] = (),
    ) -> None:
        """Record the session's end, its ``unrecorded`` results first; what the store
        cannot take now (after a few tries while busy) waits in :attr:`pending`."""
        names = tuple(w.name for w in spec.workloads)
        end = PendingEnd(
            sid, info.index, info.uuid, info.name, status, why, self._now(), names,
            tuple(unrecorded),
        )  # fmt: skip
        got = record(self.store, end, sleep=self._sleep)
        if got is False:
            self.pending.add(end)
            log.warning("tuning session %d ended %s; the store cannot take it now, so it is"
                        " kept in the state directory and recorded when it can", sid,
                        status.value)  # fmt: skip
        elif got:
            self._notify(end)

    def _notify(self, end: PendingEnd) -> None:
        """Tell ``on_finished`` that the store holds ``end``."""
        if self._on_finished is None:
            return
        try:
            self._on_finished(end.finished())
        except Exception:  # a listener's bug must not fail the session that ended fine
            log.exception("on_finished failed for tuning session %d", end.session_id)

    def _command_env(self, spec: SessionSpec) -> dict[str, str]:
        if self._env is None:
            env = worker_environment(os.environ, _PACKAGE_ROOT, self._user)
        else:
            env = dict(self._env)
            path = env.get("PYTHONPATH")
            env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + path if path else "")
        env["CUDA_VISIBLE_DEVICES"] = spec.gpu_uuid if spec.device == "cuda" else ""
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _spawn(self, spec: SessionSpec) -> WorkerProcess:
        worker = WorkerProcess(
            self._cmd, self._command_env(spec), spec.dumps().encode(), user=self._user
        )
        with self._lock:
            self._worker = worker
        return worker

    def _set_hello_pid(self, pid: int | None) -> None:
        with self._lock:
            self._hello_pid = pid

    def _cancel_reason(self) -> str | None:
        with self._lock:
            return None if self._cancel is None else f"cancelled: {self._cancel}"


class _Failed(Exception):
    """Ends the watch loop: the session failed for the reason given."""


class _Busy(_Failed):
    """A write the store was too busy to take (a lock held past its timeout): the
    session fails unless the caller keeps what was to be written for later."""


class _Session:
    """One session's watch loop: events in, verdict out. Owned by one run_session call."""

    def __init__(
        self,
        runner: TuneRunner,
        spec: SessionSpec,
        info: DeviceInfo,
        sid: int,
        should_preempt: ShouldPreempt,
        on_progress: OnProgress | None,
        timeout_s: float,
        meta: SessionMeta,
        fresh_after: Mapping[str, float],
    ) -> None:
        self.r = runner
        self.spec = spec
        self.info = info
        self.sid = sid
        self.should_preempt = should_preempt
        self.on_progress = on_progress
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.work = spec  # what the worker is asked to measure: the spec less what is reused
        self.expected = set(spec.pairs())
        self.results: dict[tuple[str, Regime], RegimeResult] = {}
        self.hello: Hello | None = None
        self.error: str | None = None
        self.worker: WorkerProcess | None = None
        self.meta = meta
        #: Reusable results, carried into the session once the worker's stack matches.
        self.reuse: dict[Pair, StoredResult] = {}
        self.carried: dict[Pair, StoredResult] = {}
        self.stack_changed = False  # the hello showed another stack than ``reuse``'s
        #: Workloads requested for a fresh measurement, and when (see run_session).
        self.fresh_after = fresh_after
        self.store_cut = False  # a write found the store unreachable
        #: Results the store was too busy to take: recorded with the session's end.
        self.unrecorded: list[RegimeResult] = []

    def run(self) -> tuple[SessionStatus, str | None]:
        self.deadline = time.monotonic() + self.timeout_s
        try:
            self.reuse = self.r.reusable(self.spec, self.meta, self.fresh_after)
        except StoreError as e:  # resuming saves time; without it the session still runs
            log.warning("session %d: cannot look for results to reuse: %s", self.sid, e)
        work = remaining_spec(self.spec, self.reuse) if self.reuse else self.spec
        if work is None:  # every pair measured: no worker will report the stack
            why = self.r.stack_now_differs(next(iter(self.reuse.values())).versions, self.info)
            if why is None:
                return self._complete_from_reuse()
            log.info(
                "session %d: every pair was measured by preempted sessions, but %s;"
                " measuring every pair again",
                self.sid,
                why,
            )
            self.reuse, work = {}, self.spec
        if self.reuse:
            log.info(
                "session %d: %d of %d pairs measured by preempted sessions; measuring %s",
                self.sid,
                len(self.reuse),
                len(self.spec.pairs()),
                ", ".join(pair_text(p) for p in work.pairs()),
            )
            verdict = self._run_worker(work)
            if not self.stack_changed:
                return verdict
            self.reuse, self.stack_changed, self.hello, self.error = {}, False, None, None
            self.results = {}
            self.r._set_hello_pid(None)
        return self._run_worker(self.spec)

    def ordered_results(self) -> tuple[RegimeResult, ...]:
        """Measured and carried results, in the spec's (workload, regime) order."""
        return tuple(self.results[p] for p in self.spec.pairs() if p in self.results)

    def _run_worker(self, work: SessionSpec) -> tuple[SessionStatus, str | None]:
        self.work, self.expected = work, set(work.pairs())
        try:
            self.worker = self.r._spawn(work)
        except OSError as e:
            return SessionStatus.FAILED, f"cannot start the worker: {describe(e)}"
        worker = self.worker
        try:
            verdict = self._watch(worker)
        except _Failed as e:
            worker.stop(0)
            verdict = (SessionStatus.FAILED, str(e))
        rc = worker.reap(self.r.reap_timeout_s)
        self._drain(worker)
        return verdict or self._judge(worker, rc)

    def _complete_from_reuse(self) -> tuple[SessionStatus, str | None]:
        """Every pair was measured already, on the stack installed now: no worker; the
        session takes the stack the results were measured on."""
        versions = next(iter(self.reuse.values())).versions
        try:
            self._store(lambda: self.r.store.set_session_versions(self.sid, versions))
            self._carry()
        except _Failed as e:
            return SessionStatus.FAILED, str(e)
        return SessionStatus.COMPLETED, None

    def _carry(self) -> None:
        """Copy the reusable results into this session (one transaction in the store)."""
        reuse, self.reuse = self.reuse, {}
        rows = list(reuse.values())
        n = self._store(lambda: self.r.store.carry_results(self.sid, rows))
        if n != len(rows):
            raise _Failed(f"store error: {n} of {len(rows)} earlier results carried")
        self.carried = reuse
        self.results.update({p: s.result for p, s in reuse.items()})
        log.info("session %d reuses %s", self.sid, describe_reuse(reuse))

    def _check_stack(self, versions: Versions) -> None:
        """At hello: carry the reusable results if they were measured on this stack."""
        if not self.reuse:
            return
        was = next(iter(self.reuse.values())).versions
        if was.key() == versions.key():
            self._carry()
            return
        log.info(
            "session %d: the stack changed since the preempted sessions (%s, now %s);"
            " measuring every pair again",
            self.sid,
            was.key(),
            versions.key(),
        )
        self.stack_changed = True

    def kill(self) -> None:
        if self.worker is not None:
            self.worker.stop(0)
            self.worker.reap(self.r.reap_timeout_s)

    def _watch(self, worker: WorkerProcess) -> tuple[SessionStatus, str] | None:
        """Until the worker is done; a verdict when the runner ended it, else None."""
        deadline = self.deadline
        eof = False
        exited_at: float | None = None
        error_at: float | None = None
        while True:
            reason = self._preempt_reason()
            if reason is not None:
                worker.stop(self.r.term_grace_s)
                return SessionStatus.PREEMPTED, reason
            now = time.monotonic()
            if now >= deadline:
                worker.stop(0)
                return SessionStatus.FAILED, f"worker timed out after {self.timeout_s:g} s"
            try:
                event = worker.events.get(timeout=min(self.r.poll_s, deadline - now))
            except queue.Empty:
                event = None
            if isinstance(event, Eof):
                eof = True
            elif isinstance(event, Invalid):
                raise _Failed(f"worker sent invalid output: {event.why}")
            elif event is not None:
                self._handle(event)
                if self.stack_changed:  # the run() that called us starts the whole spec
                    worker.stop(0)
                    return None
                if isinstance(event, ErrorMessage) and error_at is None:
                    error_at = time.monotonic()
            if worker.exited():
                exited_at = exited_at or time.monotonic()
                if eof:
                    return None
            # Exited but a grandchild still holds stdout, or reported an error and hangs.
            marks = [t for t in (exited_at, error_at) if t is not None]
            if marks and time.monotonic() - min(marks) > self.r.exit_wait_s:
                return None

    def _drain(self, worker: WorkerProcess) -> None:
        """Handle what the worker sent before it went, once its pipes are closed."""
        while True:
            try:
                event = worker.events.get_nowait()
            except queue.Empty:
                return
            if isinstance(event, Invalid) and self.error is None:
                self.error = f"invalid output: {event.why}"
            elif not isinstance(event, Invalid | Eof):
                try:
                    self._handle(event)
                except _Failed as e:
                    self.error = self.error or str(e)

    def _preempt_reason(self) -> str | None:
        cancelled = self.r._cancel_reason()
        if cancelled is not None:
            return cancelled
        try:
            reason = self.should_preempt()
        except Exception as e:  # a broken callback must not leave the GPU loaded
            return f"preempted: should_preempt failed: {describe(e)}"
        return reason if reason else None

    def _handle(self, msg: Message) -> None:
        if self.stack_changed:
            return  # this worker measures a spec that is no longer wanted
        if isinstance(msg, Hello):
            if self.hello is not None:
                raise _Failed("worker sent invalid output: a second hello")
            self.hello = msg
            self.r._set_hello_pid(msg.pid)
            versions = Versions(driver=self.info.driver_version).merge(msg.versions)
            self._store(lambda: self.r.store.set_session_versions(self.sid, versions))
            self._check_stack(versions)
            return
        if isinstance(msg, ErrorMessage):  # may come first: opening the device can fail
            self.error = self.error or msg.message
            return
        if self.hello is None:
            raise _Failed(f"worker sent invalid output: {type(msg).__name__} before hello")
        if isinstance(msg, Progress):
            self._check_pair(msg.workload, msg.regime, "progress")
            if self.on_progress is not None:
                payload = msg.to_json()
                payload["session_id"] = self.sid
                payload["done"] += len(self.carried)  # of the whole spec, reused pairs included
                payload["total"] += len(self.carried)
                try:
                    self.on_progress(payload)
                except Exception:
                    log.exception("on_progress callback failed; tuning goes on")
        elif isinstance(msg, ResultMessage):
            res = msg.result
            key = (res.workload, res.regime)
            self._check_pair(res.workload, res.regime, "result")
            if key in self.results:
                raise _Failed(f"worker sent invalid output: a second result for {pair_text(key)}")
            try:
                self._store(lambda: self.r.store.record_result(self.sid, res))
            except _Busy:
                self.unrecorded.append(res)  # the session goes on; its end records it
            self.results[key] = res

    def _check_pair(self, workload: str, regime: Regime, what: str) -> None:
        if (workload, regime) not in self.expected:
            raise _Failed(
                f"worker sent invalid output: {what} for {pair_text((workload, regime))},"
                " which is not in the spec"
            )

    def _store(self, write: Callable[[], _T]) -> _T:
        try:
            return write()
        except StoreBusy as e:
            raise _Busy(f"store error: {e}") from None
        except StoreError as e:
            self.store_cut = self.store_cut or isinstance(e, StoreUnavailable)
            raise _Failed(f"store error: {e}") from None

    def _judge(self, worker: WorkerProcess, rc: int | None) -> tuple[SessionStatus, str | None]:
        """The verdict for a worker that ended on its own."""
        if self.error is not None:
            return SessionStatus.FAILED, f"worker error: {self.error}"
        if rc is None:
            return SessionStatus.FAILED, "worker would not exit"
        if rc != 0:
            why = f"worker crashed: {exit_text(rc)}"
            last = worker.last_stderr_line()
            return SessionStatus.FAILED, f"{why}: {last}" if last else why
        if self.hello is None:
            return SessionStatus.FAILED, "worker sent invalid output: it exited without a hello"
        missing = [p for p in self.work.pairs() if p not in self.results]
        if missing:
            text = ", ".join(pair_text(p) for p in missing)
            return SessionStatus.FAILED, f"worker finished without a result for {text}"
        return SessionStatus.COMPLETED, None


def _check_fresh_after(value: Mapping[str, float] | None) -> dict[str, float]:
    """``fresh_after`` as a dict of workload name -> finite unix time; ValueError naming
    the bad entry otherwise."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"fresh_after must be a mapping, got {type(value).__name__}")
    out: dict[str, float] = {}
    for name, t in value.items():
        ok = isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t)
        if not isinstance(name, str) or not name or not ok:
            raise ValueError(
                f"fresh_after[{name!r}]: expected a workload name and a finite time, got {t!r}"
            )
        out[name] = float(t)
    return out


def _with_extra(meta: SessionMeta, spec: SessionSpec) -> SessionMeta:
    """Keep what the worker was asked to do with the session (device, budget, protocol)."""
    wire = spec.to_json()
    extra = {
        "device": spec.device,
        "time_budget_s": spec.time_budget_s,
        "protocol": wire["protocol"],
        **({"sim": wire["sim"]} if spec.sim is not None else {}),
    }
    return replace(meta, extra={**meta.extra, **extra})
