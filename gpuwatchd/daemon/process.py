"""The long-running process: wires backend → poller → gate → tuning, drift, exporter, control.

Control flow is one loop that waits on an event with a timeout: each tick checks for
stalled reads and overdue periodic tasks, pings the systemd watchdog while both make
progress, and applies a pending config reload. Periodic work runs on
:class:`~gpuwatchd.daemon.periodic.Periodic` (the monotonic clock).
This module never imports torch; tuning runs in a worker process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from gpuwatchd import __version__
from gpuwatchd.api.state import ProcessLookup
from gpuwatchd.api.winners_cache import WinnersCache
from gpuwatchd.config import (
    Config,
    ConfigError,
    load_config,
    resolve_state_dir,
    spool_path,
    store_location,
    store_password_file,
)
from gpuwatchd.config.listen import parse_listen
from gpuwatchd.daemon.added_workloads import FILE_NAME as ADDED_FILE
from gpuwatchd.daemon.added_workloads import AddedWorkloads
from gpuwatchd.daemon.config_workloads import ConfiguredWorkloads
from gpuwatchd.daemon.fleet_sync import FleetSync, in_one_transaction
from gpuwatchd.daemon.history import SampleHistory
from gpuwatchd.daemon.host_identity import HostIdentity, HostNameTaken, lease_s
from gpuwatchd.daemon.job_gate import JobGates, job_ops
from gpuwatchd.daemon.jobs import JobRegistry
from gpuwatchd.daemon.ops import OpTable
from gpuwatchd.daemon.periodic import Periodic
from gpuwatchd.daemon.retune import MANUAL_REASON, retune_ops
from gpuwatchd.daemon.sdnotify import Notifier
from gpuwatchd.daemon.store_link import StoreLink
from gpuwatchd.daemon.user_ops import user_ops
from gpuwatchd.daemon.user_work import UserWork
from gpuwatchd.drift import (
    DriftDetector,
    DriftJob,
    ReferenceSync,
    RetuneReason,
    current_versions,
)
from gpuwatchd.drift.fleet import FleetSnapshot, clock_max_age_s
from gpuwatchd.exporter import DaemonInfo, build_registry, build_state_json
from gpuwatchd.exporter.collectors.store import PendingCounts
from gpuwatchd.exporter.registry import Sources
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.monitor.poller import Poller
from gpuwatchd.monitor.stop_signal import StopSignal
from gpuwatchd.serve import HttpServer
from gpuwatchd.serve.control import ControlServer, default_socket_path
from gpuwatchd.serve.loop import ServeLoop
from gpuwatchd.sessions.fleet import fleet_policy
from gpuwatchd.sessions.pending_ends import PENDING_FILE, PendingEnds, record_waiting
from gpuwatchd.sessions.plan import DEVICES_FOR_BACKEND, runnable_workloads
from gpuwatchd.sessions.readiness import WorkerProbe
from gpuwatchd.sessions.scheduler import RunnerFactory, TuneScheduler
from gpuwatchd.store import SqlStore, StoreError, is_postgres_url, open_store
from gpuwatchd.store.errors import StoreUnavailable
from gpuwatchd.store.retention import Pruner
from gpuwatchd.store.rows import host_name, machine_id
from gpuwatchd.telemetry.backend import Backend, FeelsSessionLoad, GpuLost
from gpuwatchd.telemetry.factory import open_backend
from gpuwatchd.telemetry.pod_resources import start_pod_attribution
from gpuwatchd.telemetry.proc_owner import process_user
from gpuwatchd.telemetry.types import PodRef
from gpuwatchd.tuning.types import Workload
from gpuwatchd.validate import describe

if TYPE_CHECKING:  # loaded only when a web config is set, a session starts
    from gpuwatchd.serve.web.config import WebConfig
    from gpuwatchd.sessions.events import SessionListener
    from gpuwatchd.sessions.runner import TuneRunner

log = logging.getLogger("gpuwatchd")

#: The id of the fleet sync's periodic task (rescheduled when a reload changes its interval).
FLEET_SYNC_JOB = "fleet-sync"
#: Work asked for for these reasons is tuned even when the fleet has fresh winners for it:
#: an operator asked, or something changed on this host's own GPU.
MEASURED_ANYWAY = (
    MANUAL_REASON,
    RetuneReason.CLOCK_DRIFT,
    RetuneReason.POWER_LIMIT_CHANGED,
    RetuneReason.MAX_CLOCK_CHANGED,
)
#: How often the spool is read again for requests jobs left while the daemon runs.
SPOOL_RESCAN_S = 60.0
#: The first pruning waits this long after start (at most an interval): a fleet that
#: restarts at once does not ask for the pruning lease all in its first seconds.
FIRST_PRUNE_S = 300.0
#: How often session ends the store could not take (a lock, an outage) are tried again.
RECORD_PENDING_S = 30.0
#: The main loop's longest sleep: a config reload (SIGHUP) waits at most this long, and
#: so does the next look at a store that is down (``StoreLink.poke``).
MAX_TICK_S = 1.0


def runner_factory(cfg: Config, pending: PendingEnds | None = None) -> RunnerFactory:
    """Each GPU's session runner: the configured worker interpreter and resume age (the
    runner's module loads with the first session); all keep the session ends the store
    cannot take yet in ``pending``."""

    def runner(store: SqlStore, *, on_finished: SessionListener) -> TuneRunner:
        from gpuwatchd.sessions.runner import TuneRunner

        return TuneRunner(
            store,
            on_finished=on_finished,
            python=cfg.tuning.worker_executable,
            worker_user=cfg.tuning.worker_user,
            resume_max_age_s=cfg.tuning.resume_max_age_s,
            versions_now=current_versions,  # a session resumed whole: is its stack still installed?
            pending=pending,
        )

    return runner


def _no_pod(_uuid: str) -> PodRef | None:
    return None


def keep_fleet_incumbents(store: SqlStore, cfg: Config) -> None:
    """A fleet winner another host disputes stays the fleet's only while the fleet would
    still use it (``[fleet] max_winner_age_s``)."""
    store.keep_incumbent_for_s = cfg.fleet.max_winner_age_s


def setup_logging(level: str) -> None:
    """Log to stderr; under systemd (JOURNAL_STREAM set) journald adds the timestamps."""
    fmt = "%(levelname)s %(name)s: %(message)s"
    if "JOURNAL_STREAM" not in os.environ:
        fmt = "%(asctime)s " + fmt
    logging.basicConfig(level=level.upper(), format=fmt, force=True)


def read_web_config(cfg: Config) -> WebConfig | None:
    """The TLS/basic-auth settings, or None for plain HTTP; ConfigError naming the file."""
    path = cfg.daemon.web_config
    if not path:
        return None
    from gpuwatchd.serve.web.config import load_web_config

    try:
        return load_web_config(path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def open_state_store(cfg: Config) -> SqlStore:
    """The configured tuning store (``[store] url``, else the SQLite file in the state
    directory), created or migrated if needed.

    A shared (PostgreSQL) store that cannot be reached now is opened later, in the
    background (:class:`StoreLink`): the daemon runs without it meanwhile. Raises
    StoreError for anything else (a bad URL, a database of a newer gpuwatchd). The tuning
    scheduler marks sessions a killed process left running.
    """
    location = store_location(cfg)
    later = is_postgres_url(location)
    # A shared store: opened in the background, one connection kept at rest (1,000
    # daemons, at most 1,000 server connections; fewer behind a pooler).
    shared: dict[str, Any] = {"connect_now": False, "keep_connections": 1}
    store = open_store(
        location,
        password_file=store_password_file(cfg),
        call_timeout_s=cfg.store.call_timeout_s,
        **(shared if later else {}),
    )
    log.info("tuning store: %s", store.where)  # a URL's password never shows
    if later:
        with contextlib.suppress(StoreUnavailable):  # logged; the link connects later
            store.probe()
    return store


class Daemon:
    """One gpuwatchd process. ``run`` blocks until SIGTERM/SIGINT or :meth:`request_stop`."""

    def __init__(
        self,
        cfg: Config,
        config_path: str | None = None,
        overrides: dict[str, dict[str, object]] | None = None,
        backend: Backend | None = None,
    ) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.overrides = overrides or {}
        self.backend = backend if backend is not None else open_backend(cfg.backend_spec())
        self.board = StateBoard()
        self.host = host_name()  # how this host is named in a store shared by a fleet
        self.machine = machine_id()  # and which machine holds that name
        self.store = open_state_store(cfg)
        keep_fleet_incumbents(self.store, cfg)
        # Can the worker's Python import torch (and Triton)? Asked once, off the hot path,
        # when some work needs them.
        worker_probe = WorkerProbe(cfg.tuning.worker_executable)
        # On a shared store this machine holds its host name; a twin is refused here,
        # before anything (the scheduler marking abandoned sessions) writes as this host.
        self.identity = (
            HostIdentity(self.store, self.host, self.machine, lease_s(cfg.fleet.sync_interval_s))
            if self.store.shared
            else None
        )
        self._fatal: str | None = None  # why the daemon stopped itself (run raises it)
        self._lease_error: str | None = None  # the last host-name renewal failure logged
        if self.identity is not None and self.store.up:
            with contextlib.suppress(StoreUnavailable):  # taken when the store is back
                self.identity.claim()
        # Session ends the store could not take (kept on disk): recorded before the
        # scheduler marks this host's sessions left running as abandoned.
        state_dir = resolve_state_dir(cfg.daemon.state_dir)
        self.pending_ends = PendingEnds(state_dir / PENDING_FILE)
        self.record_pending()
        self.tuner = TuneScheduler(
            cfg.tuning_setup(),
            self.board,
            self.store,
            self.backend.name,
            sim_time=self.backend.clock.now,
            # the worker imports users' kernels: it runs in their Python environment
            runner_factory=runner_factory(cfg, self.pending_ends),
            session_load=self.backend if isinstance(self.backend, FeelsSessionLoad) else None,
            # a shared store: skip what identical hosts tuned, claim the rest (else None)
            fleet=fleet_policy(
                self.store,
                cfg.fleet,
                versions_now=current_versions,
                measure_anyway=MEASURED_ANYWAY,
                host=self.host,
            ),
            fresh_reasons=MEASURED_ANYWAY,  # and reuses no preempted session's older results
            worker_probe=worker_probe,  # work the worker cannot import is not started
            host=self.host,  # its metrics: this host's own winners and sessions
        )
        # Users' own work (kernel tuning requests, captured workloads), kept across restarts.
        self.user_work = UserWork(
            self.tuner,
            models=self.gpu_models,
            devices=lambda: DEVICES_FOR_BACKEND.get(self.backend.name, ()),
            tuning=lambda: self.cfg.tuning,
            configured=lambda: self.cfg.workloads,
            spool_dir=spool_path(cfg.tuning.spool_dir, cfg.daemon.state_dir),
            added=AddedWorkloads(resolve_state_dir(cfg.daemon.state_dir) / ADDED_FILE),
            tuned=self.tuned_workloads,
        )
        # What /api/v1/winners serves: read per sync and after this host's sessions.
        self.winners = WinnersCache(self.store, host=self.host, models=self._gpu_models)
        self.tuner.events.add_listener(lambda _event: self.winners.refresh())
        self.tuner.events.add_skip_listener(lambda _event: self.winners.refresh())
        # The store reconnects in the background; its return releases what waited on it.
        self.store_link = StoreLink(self.store)
        self.store_link.add_listener(self._store_back)
        # Retention: one host of the fleet per interval (a lease in the store) prunes.
        self.pruner = Pruner(
            self.store,
            host=self.host,
            machine=self.machine,
            keep_sessions_s=cfg.store.keep_sessions_s,
            keep_clocks_s=cfg.store.keep_clocks_s,
            interval_s=cfg.store.prune_interval_s,
        )
        self.store_link.add_listener(self.winners.refresh)
        self.tuner.events.add_listener(self.user_work.session_finished)
        self.tuner.events.add_skip_listener(self.user_work.work_skipped)  # the fleet tuned it
        self.poller = Poller(
            self.backend,
            self.board,
            cfg.gate,
            period_s=cfg.daemon.poll_interval_s,
            energy_period_s=cfg.daemon.energy_interval_s,
            info_refresh_s=cfg.daemon.info_refresh_s,
            stall_periods=cfg.daemon.stall_periods,
            own_pids=self.tuner.own_pids,
        )
        # Jobs registered over the control socket get the gate judged without themselves,
        # from this history; the daemon's own gate (above) still counts them as foreign.
        self.history = SampleHistory(lambda: self.poller.gate_cfg)
        self.poller.add_listener(self.history.observe)
        self.job_gates = JobGates(
            JobRegistry(), self.history, self.board, lambda: self.poller.gate_cfg
        )
        # Re-tune triggers: the sustained clock learned from production load against the
        # clock the winners were measured at, power/max-clock/version changes, stale winners.
        self.drift = DriftDetector(cfg.drift, current_versions)
        self.poller.add_listener(self.drift.observe)
        # References from the winners this host serves (its own, else the fleet's).
        references = ReferenceSync(
            self.drift, self.store, host=self.host, versions_now=current_versions
        )
        self.tuner.events.add_listener(references.session_finished)  # re-read after a tune
        self.tuner.events.add_skip_listener(references.work_skipped)  # and after a fleet skip
        self.drift_job = DriftJob(
            self.drift,
            references,
            self.board,
            request=self.tuner.request,
            workloads=self.runnable,
        )
        # Workloads configured after a GPU was tuned (a reload, an edited file) are asked for.
        self.configured = ConfiguredWorkloads(
            self.runnable, self._tuned_gpus, self._tuned_or_raise, self.tuner.request
        )
        self.configured.added(w.name for w in self.runnable())
        # This host's learned sustained clocks to the store, the fleet's back (fleet views).
        self.fleet_sync = FleetSync(
            self.store,
            self.board,
            self.drift.view,
            max_age_s=clock_max_age_s(cfg.drift, cfg.fleet),
            winner_max_age_s=cfg.fleet.max_winner_age_s,
            interval_s=cfg.fleet.sync_interval_s,
            host=self.host,
        )
        self.info = DaemonInfo.current(self.backend.name)
        # Whose each GPU process is (read from /proc per request) and, on a Kubernetes
        # node, the pod holding its GPU (the kubelet's pod-resources API; else None).
        self.pods = start_pod_attribution(cfg.daemon.pod_resources_socket)
        self.processes = ProcessLookup(
            user=process_user, pod=self.pods.lookup if self.pods is not None else _no_pod
        )
        # Periodic work on the monotonic clock (a wall-clock step stalls none of it).
        self.scheduler = Periodic()
        # Every collector of exporter/registry.py whose source is given here.
        self.registry = build_registry(
            self.board,
            self.info,
            sources=Sources(
                self.board,
                pods=self.pods,
                fields=cfg.exporter.fields,
                tuning=lambda: self.tuner.snapshot,
                added=self.user_work.added_names,
                drift=self.drift.view,
                store=self.store,
                pending=self.pending_counts,
                fleet=self.fleet_snapshot,
                periodic=self.scheduler.overdue_counts,
                # Read at scrape time: scrapes begin once the control server exists.
                control=lambda: self.control.turned_away,
            ),
            certificates=lambda: self.http.certificates(),
        )
        # The HTTP server and the control socket share one event loop and its thread.
        self.serve_loop = ServeLoop()
        self.http = HttpServer(
            self.board,
            self.registry,
            parse_listen(cfg.daemon.listen),
            state_json=self.state_json,
            web_config=read_web_config(cfg),
            json_routes={"/api/v1/winners": self.winners.document},
            serve_loop=self.serve_loop,
        )
        # The only way to start GPU work from outside: a Unix socket with file permissions.
        # More operations are registered on control_ops; the server stays as it is.
        self.control_ops = OpTable(
            (
                *retune_ops(self.tuner, lambda: self.cfg, self.backend.devices, self.runnable),
                *user_ops(self.user_work, self.runnable),
                *job_ops(self.job_gates),
            )
        )
        self.control = ControlServer(
            cfg.daemon.control_socket or default_socket_path(),
            self.control_ops,
            allowed_group=cfg.daemon.control_group or None,
            serve_loop=self.serve_loop,
        )
        self.notifier = Notifier.from_env()
        self._stop = StopSignal()  # the main loop sleeps on it between turns
        self._reload = threading.Event()
        self._healthy = True

    # -- control -------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    def request_reload(self) -> None:
        self._reload.set()

    def install_signal_handlers(self) -> None:
        def on_term(signum: int, _frame: FrameType | None) -> None:
            log.info("received %s, stopping", signal.Signals(signum).name)
            self.request_stop()

        def on_hup(_signum: int, _frame: FrameType | None) -> None:
            self.request_reload()

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        signal.signal(signal.SIGHUP, on_hup)

    # -- lifecycle -----------------------------------------------------------------

    def _check_sampling(self) -> None:
        """Warn when the gate can never see enough samples (fast simulated time, slow polls)."""
        cfg = self.cfg
        speed = {"sim": cfg.sim.speed, "replay": cfg.replay.speed}.get(self.backend.name, 1.0)
        per_sample = cfg.daemon.poll_interval_s * speed  # backend seconds between samples
        # Samples d apart fill a window w with floor(w/d) + 1 of them.
        if per_sample * (cfg.gate.min_samples - 1) > cfg.gate.window_s:
            log.warning(
                "the gate can never open: one sample every %.3g backend seconds gives fewer "
                "than gate.min_samples=%d in gate.window_s=%g; poll faster or lower the speed",
                per_sample,
                cfg.gate.min_samples,
                cfg.gate.window_s,
            )

    def runnable(self) -> tuple[Workload, ...]:
        """What the daemon tunes on its own: the configured set plus users' added workloads."""
        configured = runnable_workloads(self.cfg.tuning_setup(), self.backend.name)
        names = {w.name for w in configured}
        return configured + tuple(w for w in self.user_work.added_runnable() if w.name not in names)

    def gpu_models(self) -> dict[int, str]:
        """Each GPU's model name (a user's request names the model it was made on)."""
        models: dict[int, str] = {}
        for gpu in self.backend.devices():
            try:
                models[gpu] = self.backend.device_info(gpu).name
            except GpuLost:
                continue
        return models

    def tuned_workloads(self, gpu_model: str) -> frozenset[str]:
        """Workloads with a recorded winner on ``gpu_model`` in every regime tuned (none
        while the store cannot say: the work is queued, the fleet's winners skip it)."""
        try:
            return self._tuned_or_raise(gpu_model)
        except StoreError:
            return frozenset()

    def _tuned_or_raise(self, gpu_model: str) -> frozenset[str]:
        """:meth:`tuned_workloads`, StoreError when the store cannot say."""
        regimes: dict[str, set[str]] = {}
        rows = self.store.winners(gpu_model=gpu_model, latest=True)
        for w in rows:
            regimes.setdefault(w.workload, set()).add(w.regime.value)
        wanted = set(self.cfg.tuning.regimes)
        return frozenset(name for name, seen in regimes.items() if wanted <= seen)

    def run(self) -> None:
        self._check_sampling()
        self.user_work.load()  # spooled requests and added workloads, before anyone asks
        self.http.start()
        self.control.start()
        self.poller.start()
        self.tuner.check_worker(self.runnable())
        self.scheduler.add("tune", self.tuning_tick, self.cfg.tuning.check_interval_s)
        self.scheduler.add("spool", self.user_work.rescan, SPOOL_RESCAN_S)
        if self.pruner.interval_s > 0:
            first = min(self.pruner.interval_s, FIRST_PRUNE_S)
            self.scheduler.add("prune", self.pruner, self.pruner.check_every_s, first_in_s=first)
        self.scheduler.add("pending-ends", self.record_pending, RECORD_PENDING_S)
        # first looks once the GPUs have been polled, not a whole interval later
        self.scheduler.add("drift", self.drift_tick, self.cfg.drift.check_interval_s, first_in_s=2)
        sync_s = self.cfg.fleet.sync_interval_s
        self.scheduler.add(FLEET_SYNC_JOB, self.fleet_tick, sync_s, first_in_s=3)
        self.scheduler.start()
        self.poller.dispatch_slow_reads()  # energy and static facts right away
        log.info(
            "gpuwatchd %s: backend %s, %d GPU(s), polling every %.3g s, serving on %s",
            __version__,
            self.backend.name,
            len(self.backend.devices()),
            self.cfg.daemon.poll_interval_s,
            self.http.url,
        )
        self.notifier.ready(f"polling {len(self.backend.devices())} GPU(s)")
        try:
            self._main_loop()
        finally:
            self.shutdown()
        if self._fatal is not None:
            raise HostNameTaken(self._fatal)

    def _main_loop(self) -> None:
        ping_every = self.notifier.watchdog_interval_s()
        last_ping = 0.0
        # Wake when a read in flight could have stalled, at most MAX_TICK_S apart (a
        # SIGHUP is applied and a down store looked at within that), not every poll
        # period: each wake-up costs CPU.
        while not self._stop.wait(
            min(self.poller.stall_check_due_in(), MAX_TICK_S, ping_every or MAX_TICK_S)
        ):
            self.poller.check_stalls()
            self.scheduler.check()
            self.store_link.poke()  # a thread only while the store is down or just back
            if self._reload.is_set():
                self._reload.clear()
                self.reload()
            due = ping_every is not None and time.monotonic() - last_ping >= ping_every
            if due and self.healthy():
                self.notifier.watchdog()
                last_ping = time.monotonic()

    def state_json(self) -> dict[str, object]:
        """/api/v1/state: the board plus what the tuner is doing."""
        doc = build_state_json(self.board, self.info, lookup=self.processes)
        snap = self.tuner.snapshot
        doc["gate_config"] = dataclasses.asdict(self.cfg.gate)
        doc["tuning"] = {
            "enabled": self.cfg.tuning.enabled,
            "running_gpus": sorted(snap.running),
            "pending": {str(g): list(w) for g, w in sorted(snap.pending.items())},
            "last_completed_unix": snap.last_tune_unix,
            "ready": snap.ready[0],
            "ready_reason": snap.ready[1],
        }
        return doc

    def fleet_snapshot(self) -> FleetSnapshot:
        """What the fleet collector shows: nothing while ``fleet.enabled`` is off."""
        return self.fleet_sync.snapshot if self.cfg.fleet.enabled else FleetSnapshot()

    def tuning_tick(self) -> None:
        """Periodic task: start pending tuning behind open gates (never blocks)."""
        self.tuner.tick()

    def fleet_tick(self) -> None:
        """Periodic task: this host's sustained clocks to the store, the fleet's clocks,
        disagreements and coverage back, and the winners /api/v1/winners serves (never
        raises: a store error marks them stale)."""
        # The host name's lease in its own transaction: a failing read must not undo it.
        self._hold_host_name()
        steps: list[Callable[[], object]] = [self.tuner.refresh_stored]
        undo: list[Callable[[str], None]] = []
        if self.cfg.fleet.enabled:
            steps.append(self.fleet_sync)
            undo.append(self.fleet_sync.rolled_back)
        steps.append(self.winners.refresh)
        in_one_transaction(self.store, steps, on_rollback=undo)

    def _hold_host_name(self) -> None:
        """Renew this machine's hold on its host name (an unreachable store: next sync)."""
        if self.identity is None or self._fatal is not None:
            return
        try:
            lifted = self.identity.claim()
        except HostNameTaken as exc:
            self._refuse(exc)
        except StoreUnavailable:
            pass  # logged once per outage by the store; the lease outlasts a few renewals
        except StoreError as exc:  # the store answered but refused: say why, once
            if str(exc) != self._lease_error:
                self._lease_error = str(exc)
                log.warning("renewing the hold on the host name failed: %s", exc)
        else:
            self._lease_error = None
            if lifted:  # another boot's lease lapsed: what waited for writes goes on
                self.tuner.store_back()

    def _refuse(self, exc: HostNameTaken) -> None:
        """Another live machine has this host name: stop, saying so in one line."""
        log.error("%s; stopping", exc)
        self._fatal = str(exc)
        self.request_stop()

    def _gpu_models(self) -> set[str]:
        """The models of this host's GPUs known so far (the winners it serves)."""
        return {s.info.name for s in self.board.all() if s.info is not None}

    def record_pending(self) -> None:
        """Periodic task (and at start, and when the store is back): record the session
        ends the store could not take when they happened; never raises."""
        if len(self.pending_ends) == 0 or self._fatal is not None:
            return
        tuner = getattr(self, "tuner", None)
        notify = None if tuner is None else lambda end: tuner.events.notify(end.finished())
        try:
            record_waiting(self.store, self.pending_ends, notify)
        except Exception:  # a bug here must not stop the other periodic tasks
            log.exception("recording the session ends waiting for the store failed")

    def pending_counts(self) -> PendingCounts:
        """What the store collector exports about the ends waiting for the store."""
        p = self.pending_ends
        return PendingCounts(len(p), p.recorded_late, p.dropped)

    def _store_back(self) -> None:
        """The store answers (again): hold the host name first, then let the scheduler
        record and resume what waited for the store. Raises StoreUnavailable when the
        store went away again (the link calls again once it is back)."""
        if self._fatal is not None:
            return
        if self.identity is not None:
            try:
                self.identity.claim()
            except HostNameTaken as exc:
                self._refuse(exc)
                return
        self.record_pending()
        self.tuner.store_back()

    def drift_tick(self) -> None:
        """Periodic task: decide what needs tuning — a GPU never tuned, clock drift,
        a power-limit/max-clock/version change, stale winners, workloads configured
        since it was tuned — and queue it."""
        if self.cfg.drift.enabled:
            self.drift_job()
            self.configured.check()

    def _tuned_gpus(self) -> list[tuple[int, str]]:
        """(index, model) of each GPU known and not waiting for its first tuning (the
        drift detector asks for everything there)."""
        view = self.drift.view()
        return [
            (snap.index, snap.info.name)
            for snap in self.board.all()
            if snap.info is not None
            and snap.index in view
            and RetuneReason.NO_WINNERS not in view[snap.index].pending
        ]

    def healthy(self) -> bool:
        """False once a GPU read, or a periodic task, is stuck past ``watchdog_stall_s``
        (beyond when it was due): let systemd restart us."""
        limit = self.cfg.daemon.watchdog_stall_s
        stuck = self.poller.longest_stall_s()
        tasks = self.scheduler.stalled(limit)
        ok = stuck <= limit and not tasks
        if not ok and self._healthy:
            what = f"periodic task(s) {', '.join(tasks)}" if tasks else "a telemetry read"
            log.error("%s stuck over %.0f s; withholding watchdog pings", what, limit)
        elif ok and not self._healthy:
            log.warning("telemetry reads and periodic tasks on time again; watchdog pings resume")
        self._healthy = ok
        return ok

    def reload(self) -> bool:
        """Re-read the config file (SIGHUP). A bad file is rejected and the old config kept."""
        self.notifier.reloading()
        try:
            new = load_config(self.config_path).with_overrides(**self.overrides)
            # re-read even when unchanged: renewed certificates must be picked up
            web = read_web_config(new)
        except Exception as exc:  # whatever the file holds, a reload never stops the daemon
            log.error(
                "config reload rejected, keeping the running config: %s",
                describe(exc, with_type=False),
            )
            self.notifier.ready("config reload rejected")
            return False
        restart_needed = [
            key
            for key in (
                "backend",
                "listen",
                "user",
                "state_dir",
                "control_socket",
                "control_group",
                "pod_resources_socket",
            )
            if getattr(new.daemon, key) != getattr(self.cfg.daemon, key)
        ]
        if new.sim != self.cfg.sim or new.replay != self.cfg.replay:
            restart_needed.append("[sim]/[replay]")
        if new.store != self.cfg.store:
            restart_needed.append("[store]")
        if new.exporter != self.cfg.exporter:
            restart_needed.append("[exporter]")
        restart_needed += [
            f"tuning.{key}"
            for key in ("worker_python", "worker_user", "spool_dir")
            if getattr(new.tuning, key) != getattr(self.cfg.tuning, key)
        ]
        if restart_needed:
            log.warning("config reload: %s change only on restart", ", ".join(restart_needed))
        self.http.reload_web_config(web)
        self.poller.reconfigure(new.gate, period_s=new.daemon.poll_interval_s)
        self.tuner.reconfigure(new.tuning_setup(), new.fleet)
        keep_fleet_incumbents(self.store, new)
        self.drift.reconfigure(new.drift)
        self._reconfigure_fleet_sync(new)
        logging.getLogger().setLevel(new.daemon.log_level.upper())
        before = {w.name for w in self.runnable()}
        self.cfg = new
        self.configured.added(w.name for w in self.runnable() if w.name not in before)
        self.tuner.check_worker(self.runnable())  # tuning switched on, or new workloads
        log.info("config reloaded from %s", self.config_path or "defaults")
        self.notifier.ready("config reloaded")
        return True

    def _reconfigure_fleet_sync(self, new: Config) -> None:
        """Apply a reloaded ``[fleet]``/``[drift]`` to the fleet sync and its periodic task."""
        self.fleet_sync.max_age_s = clock_max_age_s(new.drift, new.fleet)
        self.fleet_sync.winner_max_age_s = new.fleet.max_winner_age_s
        if new.fleet.sync_interval_s != self.fleet_sync.interval_s:
            self.fleet_sync.interval_s = new.fleet.sync_interval_s
            self.scheduler.reschedule(FLEET_SYNC_JOB, new.fleet.sync_interval_s)

    def shutdown(self) -> None:
        self.notifier.stopping()
        self.control.stop()
        self.scheduler.shutdown()
        self.user_work.close()  # the spool's directory descriptor
        self.tuner.shutdown(timeout=2.0)
        self.poller.stop(timeout=2.0)
        self.http.stop()
        try:
            self.backend.close()
        except Exception as exc:
            log.warning("closing backend %s failed: %s", self.backend.name, exc)
        if self.identity is not None and self._fatal is None:
            self.identity.release()
        self.store.close()
        if self.pods is not None:
            self.pods.close()
        log.info("stopped")
