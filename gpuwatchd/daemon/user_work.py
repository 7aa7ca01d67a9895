"""Work users hand the daemon: their kernels' tuning requests and their captured workloads.

Both become ordinary workloads queued on the tuning scheduler, for every GPU that can
serve them; the first GPU of a model to tune one takes it off the others of that model
(winners are per GPU model). Both survive a restart:

- a user kernel's request (``tune_kernel``) is written into the spool, the folder jobs
  use when no daemon runs, and removed once a session tuned it, or once the scheduler
  skipped it because identical hosts of a fleet did (their winners are in the shared
  store); at start the spool is read and what is there is queued again;
- added workloads (``add_workloads``) are kept in :class:`AddedWorkloads` until removed,
  tuned like configured ones (drift re-tunes them, ``retune`` can name them); at start
  the ones with no winner yet on a GPU's model are queued, and requests that jobs
  spooled for them are taken in (their files removed; refused ones set aside).

The spool (:class:`~gpuwatchd.tuning.intake.spool.Spool`) is read at start and every rescan,
within a per-scan budget; a kernel request refused for now stays in it, not read again
until it changes or the tuning settings do.

Every refusal is a :class:`UserWorkError` of one line; nothing is imported here. Work
that names user code outside :mod:`gpuwatchd.tuning.submitted.trust`'s rule (or carries an
allow-list of its own) is refused as it arrives (:class:`TrustRefused`: not stored, not
queued); added workloads kept from before that fail it at start are set aside, not run.
The worker applies the rule again as it imports.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpuwatchd.daemon.added_workloads import AddedWorkloads
from gpuwatchd.sessions.events import SessionFinished, WorkSkipped
from gpuwatchd.tuning.intake.spool import KERNEL, WORKLOADS, Rejected, Spool, SpoolEntry
from gpuwatchd.tuning.intake.workload_requests import AddRequest
from gpuwatchd.tuning.settings import TuningConfig
from gpuwatchd.tuning.submitted.kernels import KernelRequest, KernelRequestError
from gpuwatchd.tuning.submitted.trust import TrustError, check_request, check_workload
from gpuwatchd.tuning.types import SessionStatus, Workload
from gpuwatchd.tuning.workloads import device_kind
from gpuwatchd.validate import one_line

log = logging.getLogger(__name__)

KERNEL_REASON = "user kernel request"
ADDED_REASON = "added workloads"
RETRY_REASON = "user kernel request, no winner yet"
#: A user kernel whose sessions failed this many times is dropped (and its file set aside).
MAX_FAILURES = 3
_NEEDS = {"cuda": "a CUDA GPU (backend nvml)", "sim": "the sim backend", "cpu": "a CPU worker"}


class UserWorkError(ValueError):
    """A user's request is refused; one line saying why."""


class TrustRefused(UserWorkError):
    """A request names user code outside the trust rule (logged with who asked)."""


class NotKept(UserWorkError):
    """Good work the daemon could not write down (a full disk): worth asking again."""


class Queue(Protocol):
    """What this needs of :class:`~gpuwatchd.sessions.scheduler.TuneScheduler`."""

    def request(self, gpu: int, workloads: Sequence[Workload], reason: str) -> None: ...

    def withdraw(self, names: Collection[str], gpus: Collection[int] | None = None) -> None: ...


@dataclass(slots=True)
class _Kernel:
    """A user kernel's request waiting to be tuned, and the spool file that keeps it."""

    request: KernelRequest
    workload: Workload
    entry: SpoolEntry[KernelRequest] | None
    failures: int = 0


class UserWork:
    """The daemon's user workloads. Thread-safe (control-socket and session threads).

    ``models`` maps each GPU index to its model name; ``devices`` lists the worker
    device kinds the backend can run; ``tuning`` and ``configured`` return the current
    ``[tuning]`` settings and configured workloads (a reload is seen); ``tuned(model)``
    names the workloads with a recorded winner in every tuned regime on that GPU model.
    """

    def __init__(
        self,
        queue: Queue,
        *,
        models: Callable[[], dict[int, str]],
        devices: Callable[[], Collection[str]],
        tuning: Callable[[], TuningConfig],
        configured: Callable[[], Sequence[Workload]],
        spool_dir: str | os.PathLike[str],
        added: AddedWorkloads,
        tuned: Callable[[str], Collection[str]] = lambda _model: (),
    ) -> None:
        self._queue = queue
        self._models = models
        self._devices = devices
        self._tuning = tuning
        self._configured = configured
        self.spool_dir = Path(spool_dir)
        self._spool = Spool(self.spool_dir)
        self._rules: tuple[bool, tuple[str, ...]] | None = None  # what refused held files
        self._added = added
        self._added_names: frozenset[str] = frozenset()  # replaced whole, under the lock
        self._tuned = tuned
        self._kernels: dict[str, _Kernel] = {}
        self._left: set[str] = set()  # spool problems told once (a file that cannot move)
        self._blocked: set[str] = set()  # added workloads refused by the trust rule, kept
        self._lock = threading.Lock()

    # -- user kernels ----------------------------------------------------------------

    def tune_kernel(self, request: KernelRequest) -> dict[str, Any]:
        """Check, keep and queue one kernel request; the answer's fields."""
        workload, gpus = self._check_kernel(request)
        entry, kept = self._keep(request)
        with self._lock:
            old = self._kernels.get(workload.name)
            if entry is None and old is not None:
                entry = old.entry  # the file written earlier still holds this request
            self._kernels[workload.name] = _Kernel(request, workload, entry)
        for gpu in gpus:
            self._queue.request(gpu, [workload], KERNEL_REASON)
        answer: dict[str, Any] = {
            "workload": workload.name,
            "queued": {str(g): [workload.name] for g in gpus},
            "persisted": kept is None,
        }
        if kept is not None:
            answer["warning"] = kept
        return answer

    def _check_kernel(self, request: KernelRequest) -> tuple[Workload, list[int]]:
        cfg = self._tuning()
        if not cfg.enabled:
            raise UserWorkError(
                "tuning is disabled in the config ([tuning] enabled = false): nothing would run"
            )
        try:
            check_request(request, cfg.allowed_modules)
        except (KernelRequestError, TrustError) as e:
            raise TrustRefused(one_line(e)) from None
        workload = request.to_workload()
        self._check_device(workload, "request")
        return workload, self._gpus_of(request.gpu_model)

    def _gpus_of(self, model: str) -> list[int]:
        models = self._models()
        gpus = sorted(g for g, m in models.items() if m == model)
        if not gpus:
            here = ", ".join(sorted(set(models.values()))) or "none known yet"
            raise UserWorkError(f"request.gpu_model: no {model!r} GPU on this host (GPUs: {here})")
        return gpus

    def _check_device(self, workload: Workload, where: str) -> None:
        kind = device_kind(workload)
        if kind not in self._devices():
            raise UserWorkError(
                f"{where}: {workload.name!r} needs {_NEEDS.get(kind, kind)}, "
                "which this daemon's backend cannot run"
            )

    def close(self) -> None:
        """Let go of the spool directory."""
        self._spool.close()

    def _keep(self, request: KernelRequest) -> tuple[SpoolEntry[KernelRequest] | None, str | None]:
        """Write the request into the spool: (its entry, None) or (None, why not)."""
        try:
            return self._spool.keep(request), None
        except OSError as e:
            why = f"not kept across a restart: cannot write {self.spool_dir}: {one_line(e)}"
            log.warning("user kernel %s: %s", request.workload_name, why)
            return None, why

    # -- added workloads -------------------------------------------------------------

    def add(self, request: AddRequest, *, queue: bool = True) -> dict[str, Any]:
        """Check, keep and queue added workloads (``queue`` False: the caller queues
        them); the answer's fields."""
        configured = {w.name for w in self._configured()}
        allowed = self._tuning().allowed_modules
        for i, w in enumerate(request.workloads):
            try:
                check_workload(w, allowed, f"workloads[{i}]")
            except TrustError as e:
                raise TrustRefused(one_line(e)) from None
            if w.name in configured:
                raise UserWorkError(
                    f"workloads[{i}].name: {w.name!r} is a configured workload; "
                    "rename it or change it in the config file"
                )
            self._check_device(w, f"workloads[{i}]")
        cap = self._tuning().max_added_workloads
        with self._lock:
            new = {w.name for w in request.workloads if w.name not in self._added}
            if len(self._added) + len(new) > cap:
                raise UserWorkError(
                    f"workloads: {len(new)} more would make {len(self._added) + len(new)}"
                    f" added workloads, over [tuning] max_added_workloads = {cap}; remove some "
                    "first (gpuwatchd workloads remove NAME...)"
                )
            try:
                replaced = self._added.add(request.workloads, request.source)
                self._blocked.difference_update(w.name for w in request.workloads)
            except OSError as e:
                raise NotKept(
                    f"cannot keep the workloads in {self._added.path}: {one_line(e)}"
                ) from None
            finally:
                self._publish_added()
        if queue:
            self._queue_everywhere(request.workloads, ADDED_REASON)
        names = [w.name for w in request.workloads]
        return {"added": [n for n in names if n not in replaced], "replaced": replaced}

    def remove(self, names: Sequence[str]) -> dict[str, Any]:
        """Remove added workloads or queued kernel requests by name (all or none)."""
        configured = {w.name for w in self._configured()}
        with self._lock:
            for i, name in enumerate(names):
                if name in self._added or name in self._kernels:
                    continue
                if name in configured:
                    raise UserWorkError(
                        f"names[{i}]: {name!r} is a configured workload; remove it from the "
                        "config file"
                    )
                raise UserWorkError(f"names[{i}]: no added workload or kernel request {name!r}")
            try:
                removed = self._added.remove(names)
            except OSError as e:
                raise UserWorkError(f"cannot update {self._added.path}: {one_line(e)}") from None
            finally:
                self._publish_added()
            for name in names:
                kernel = self._kernels.pop(name, None)
                if kernel is not None:
                    self._forget(kernel)
                    removed.append(name)
        self._queue.withdraw(names)
        return {"removed": removed}

    def listing(self, runnable: Iterable[Workload]) -> list[dict[str, Any]]:
        """Every workload the daemon tunes, with where it came from."""
        out = [{**_summary(w), "origin": "config"} for w in runnable]
        with self._lock:
            out += [{**_summary(a.workload), "origin": "added", "source": a.source}
                    for a in self._added.items()]  # fmt: skip
            out += [{**_summary(k.workload), "origin": "kernel"} for k in self._kernels.values()]
        return out

    def added_runnable(self) -> tuple[Workload, ...]:
        """Added workloads this backend can run: tuned like configured ones."""
        devices = self._devices()
        with self._lock:
            return tuple(
                w
                for w in self._added.workloads()
                if device_kind(w) in devices and w.name not in self._blocked
            )

    def added_names(self) -> frozenset[str]:
        """The added workloads' names, as last published: a read that never waits on the
        lock (a scrape reads it on the servers' event loop)."""
        return self._added_names

    def _publish_added(self) -> None:
        """Publish the added names after a change (lock held)."""
        self._added_names = self._added.names()

    # -- start-up --------------------------------------------------------------------

    def load(self) -> None:
        """At start: the added workloads, jobs' spooled requests, and what to queue."""
        with self._lock:
            try:
                self._added.load()
                self._set_aside_untrusted()
            finally:
                self._publish_added()
        self._take_spooled_workloads(queue=False)  # queued below, with the kept ones
        tuned: dict[str, Collection[str]] = {}
        waiting: list[Workload] = []
        for w in self.added_runnable():
            for gpu, model in self._models().items():
                done = tuned.setdefault(model, self._tuned(model))
                if w.name not in done:
                    self._queue.request(gpu, [w], ADDED_REASON)
                    waiting.append(w)
        self._take_spooled_kernels()
        if waiting:
            log.info("queued %d added workload(s) not tuned yet", len({w.name for w in waiting}))

    def _set_aside_untrusted(self) -> None:
        """Added workloads kept from before that fail the trust rule now: moved out of the
        list into the set-aside file with their reason, one log line each (lock held)."""
        allowed = self._tuning().allowed_modules
        bad: dict[str, str] = {}
        for a in self._added.items():
            try:
                check_workload(a.workload, allowed)
            except TrustError as e:
                bad[a.workload.name] = f"added workload {a.workload.name!r}: {one_line(e)}"
        if not bad:
            return
        try:
            self._added.set_aside(bad)
            where = f"set aside in {self._added.aside_path}"
        except OSError as e:  # kept in the list (nothing is lost), but never run
            self._blocked.update(bad)
            where = f"kept in {self._added.path} (cannot set it aside: {one_line(e)})"
        for why in bad.values():
            log.warning("%s; %s, not run", why, where)

    def _take_spooled_workloads(self, *, queue: bool = True) -> None:
        """Added workloads jobs spooled: taken (the file removed), or set aside with the
        reason (refused, over the cap); kept for the next scan when they cannot be
        written down."""
        for item in self._spool.scan(WORKLOADS):
            if isinstance(item, Rejected):
                self._tell_rejected(WORKLOADS.what, item)
                continue
            try:
                self.add(item.request, queue=queue)
            except NotKept as e:
                log.warning("spooled workloads %s left for the next scan: %s", item.name, e)
                continue
            except UserWorkError as e:
                self._tell_rejected(WORKLOADS.what, self._spool.reject(item, one_line(e)))
                continue
            self._spool.remove(item)

    def rescan(self) -> None:
        """Take what jobs spooled while the daemon runs (a request too long for one
        socket line, a job that could not reach the socket): a periodic job."""
        self._take_spooled_workloads()
        self._take_spooled_kernels()

    def _take_spooled_kernels(self) -> None:
        cfg = self._tuning()
        rules = (cfg.enabled, tuple(cfg.allowed_modules))
        if rules != self._rules:  # what refused the held files may allow them now
            self._rules = rules
            self._spool.release_all()
        taken = 0
        for item in self._spool.scan(KERNEL):
            if isinstance(item, Rejected):
                self._tell_rejected(KERNEL.what, item)
                continue
            self._spool.hold(item)  # queued, or refused for now: not read again unchanged
            try:
                workload, gpus = self._check_kernel(item.request)
            except UserWorkError as e:
                log.warning("spooled kernel request %s left in the spool: %s", item.name, e)
                continue
            with self._lock:
                self._kernels[workload.name] = _Kernel(item.request, workload, item)
            for gpu in gpus:
                self._queue.request(gpu, [workload], KERNEL_REASON)
            taken += 1
        if taken:
            log.info("took %d kernel request(s) from %s", taken, self.spool_dir)

    def _tell_rejected(self, what: str, bad: Rejected) -> None:
        """One line per bad spool entry; one left in place is told once, not every scan."""
        if bad.moved_to is not None:
            where = bad.moved_to.parent
            log.warning("spooled %s %s set aside in %s: %s", what, bad.name, where, bad.reason)
            return
        key = f"{what}\0{bad.name}\0{bad.reason}"
        if key not in self._left:
            self._left.add(key)
            log.warning("spooled %s %s left in place (cannot move it): %s", what, bad.name,
                        bad.reason)  # fmt: skip

    def _queue_everywhere(self, workloads: Sequence[Workload], reason: str) -> None:
        for gpu in sorted(self._models()):
            self._queue.request(gpu, workloads, reason)

    # -- sessions ending ---------------------------------------------------------------

    def session_finished(self, event: SessionFinished) -> None:
        """A session's end: user work with winners is done on that GPU model; a kernel
        request left without a winner in every regime, or in a failed session, is tried
        again (its session is retried by the scheduler) until it fails too often."""
        with self._lock:
            mine = [n for n in event.workloads if n in self._kernels or n in self._added]
        if not mine:
            return
        if event.status is SessionStatus.FAILED:
            self._count_failure(mine, event.why or "failed")
            return
        if event.status is not SessionStatus.COMPLETED:
            return  # preempted: still pending, retried at the next open gate
        tuned = set(self._tuned(event.gpu_model))
        done = [n for n in mine if n in tuned or n not in self._kernels]
        self._answered(event.gpu_index, event.gpu_model, done)
        missed = [n for n in mine if n not in done]
        kept = self._count_failure(missed, "the session recorded no winner in every regime")
        for name in kept:
            with self._lock:
                kernel = self._kernels.get(name)
            if kernel is not None:
                self._queue.request(event.gpu_index, [kernel.workload], RETRY_REASON)

    def work_skipped(self, event: WorkSkipped) -> None:
        """Skip listener: work the fleet answered (fresh winners in every regime, measured
        by identical hosts, in the shared store) is done on that GPU model, as if a session
        here had tuned it: no session will end for it on this host."""
        with self._lock:
            mine = [n for n in event.workloads if n in self._kernels or n in self._added]
        if mine:
            log.info("user work answered by the fleet (%s): %s", event.reason, ", ".join(mine))
            self._answered(event.gpu_index, event.gpu_model, mine)

    def _answered(self, gpu: int, gpu_model: str, names: Sequence[str]) -> None:
        """``names`` have winners on ``gpu_model``: kernel requests leave the spool, and
        the model's other GPUs stop waiting for them."""
        with self._lock:
            for name in names:
                kernel = self._kernels.pop(name, None)
                if kernel is not None:
                    self._forget(kernel)
        others = [g for g, m in self._models().items() if m == gpu_model and g != gpu]
        if others and names:
            self._queue.withdraw(names, others)

    def _count_failure(self, names: Sequence[str], why: str) -> list[str]:
        """One more failure for each named kernel request; the ones still kept."""
        dropped: list[str] = []
        kept: list[str] = []
        with self._lock:
            for name in names:
                kernel = self._kernels.get(name)
                if kernel is None:
                    continue
                kernel.failures += 1
                if kernel.failures >= MAX_FAILURES:
                    del self._kernels[name]
                    self._set_aside(kernel, f"{MAX_FAILURES} tuning sessions failed; last: {why}")
                    dropped.append(name)
                else:
                    kept.append(name)
        if dropped:
            log.error("dropped user kernel request(s) after %d failed sessions: %s (last: %s)",
                      MAX_FAILURES, ", ".join(dropped), why)  # fmt: skip
            self._queue.withdraw(dropped)
        return kept

    def _forget(self, kernel: _Kernel) -> None:
        """Remove a kernel request's spool file (only if still the one written or read)."""
        if kernel.entry is not None:
            self._spool.remove(kernel.entry)

    def _set_aside(self, kernel: _Kernel, why: str) -> None:
        """Move a kernel request's spool file into ``rejected/`` beside its reason."""
        if kernel.entry is not None:
            self._spool.reject(kernel.entry, why)


def _summary(w: Workload) -> dict[str, Any]:
    return {"name": w.name, "op": w.op, "dtype": w.dtype, "families": list(w.families),
            "shape": dict(w.shape)}  # fmt: skip
