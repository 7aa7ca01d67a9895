"""A fleet of virtual hosts on one real PostgreSQL behind PgBouncer (transaction mode).

Each virtual host has 8 simulated GPUs and its own PostgreSQL store (its own client
connection to PgBouncer, as a daemon has) and drives the fleet's real code: the
:class:`~gpuwatchd.sessions.fleet.FleetPolicy` (plan, claim, plan again, renew, release,
in the order the scheduler's ``_choose`` runs them; a completed session answers the
host's other GPUs, as its ``_drop_answered_here`` does), session commits (start, one result
per workload and regime, finish), the daemon's listeners after each session and each
skip (a real :class:`~gpuwatchd.sessions.scheduler.TuneScheduler`'s, which read the store
again, and the winners cache's), the daemon's fleet tick (``HostIdentity.claim``,
:class:`~gpuwatchd.daemon.fleet_sync.FleetSync`, :class:`~gpuwatchd.api.winners_cache.
WinnersCache` refresh) and the :class:`~gpuwatchd.store.retention.Pruner` on its check
schedule. Tuning itself is simulated: a session holds its GPU for ``--session-s``
simulated seconds per workload and yields results. Time is one simulated clock given to
every ``now`` parameter; it advances by the scheduler's tick (``check_interval_s``) once
every host has done that tick's work, in a thread pool, against the real server. The
server is durable (fsync on: bench/durable_pg.py) and holds ``--history-days`` of history
(sessions, results, host winners and disagreements of an older stack) before the run.

Two phases: a steady state (keys measured, hosts syncing every ``sync_interval_s``, a
share of hosts restarting and asking for their workloads again, which they skip or
verify) and a rollout (a new software stack: every host wants every key at once, until
every GPU's pending work is measured or skipped). Per phase it reports transactions per
simulated second (PgBouncer's SHOW STATS and PostgreSQL's pg_stat_database), statements
(pg_stat_statements), client-side statement latency, each fleet sync's transaction time,
lock waits (pg_stat_activity sampled, and ``log_lock_waits``), server connections
(SHOW POOLS; busy ones from pg_stat_activity, and at the real pace by Little's law),
rows and bytes written per simulated day, each key's measurements, and the rollout as
PostgreSQL holds it (completed sessions, results, fleet winners of the new stack). Then
it times ``gpuwatchd report --fleet`` on the store.

Run: ``python3 bench/fleet_sim.py [--hosts 1000] [--steady-s 900]`` (needs PostgreSQL
and Debian's ``pgbouncer``; starts both in a scratch directory).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

import psycopg  # noqa: E402
from builders import candidate  # noqa: E402
from durable_pg import start_durable_server  # noqa: E402
from pg_bouncer import Bouncer, find_pgbouncer  # noqa: E402
from pg_server import PostgresServer  # noqa: E402

from gpuwatchd.api.winners_cache import WinnersCache  # noqa: E402
from gpuwatchd.config.loader import Config  # noqa: E402
from gpuwatchd.daemon.fleet_sync import FleetSync, in_one_transaction  # noqa: E402
from gpuwatchd.daemon.host_identity import HostIdentity, lease_s  # noqa: E402
from gpuwatchd.drift.detector import GpuDriftView  # noqa: E402
from gpuwatchd.drift.fleet import clock_max_age_s  # noqa: E402
from gpuwatchd.monitor.board import GpuSnapshot, PollHealth, StateBoard  # noqa: E402
from gpuwatchd.sessions.events import SessionFinished, WorkSkipped  # noqa: E402
from gpuwatchd.sessions.fleet import SKIP_REASON, FleetPolicy  # noqa: E402
from gpuwatchd.sessions.fleet_settings import FleetConfig  # noqa: E402
from gpuwatchd.sessions.scheduler import TuneScheduler  # noqa: E402
from gpuwatchd.store import SessionMeta, StoreError  # noqa: E402
from gpuwatchd.store.conn import Conn  # noqa: E402
from gpuwatchd.store.postgres import postgres_store  # noqa: E402
from gpuwatchd.store.retention import Pruner  # noqa: E402
from gpuwatchd.telemetry.types import DeviceInfo  # noqa: E402
from gpuwatchd.tuning.types import (  # noqa: E402
    Regime,
    RegimeResult,
    SessionStatus,
    Versions,
    Workload,
)
from gpuwatchd.tuning.workloads import DEFAULT_WORKLOADS  # noqa: E402

GPUS_PER_HOST = 8
MODELS = ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
POWER_W = {MODELS[0]: 700.0, MODELS[1]: 700.0}
STACK = Versions(driver="580.95.05", cuda="12.8", torch="2.9.0", triton="3.5.0")
NEW_STACK = replace(STACK, torch="2.10.0")
#: The default workloads a GPU host tunes (the simulated and CPU ones are for machines
#: without a GPU).
GPU_WORKLOADS = tuple(w for w in DEFAULT_WORKLOADS if w.op not in ("sim.gemm",) and not
                      w.name.startswith(("sim-", "cpu-")))  # fmt: skip
REGIMES = (Regime.UNTHROTTLED, Regime.SUSTAINED)
CANDIDATES = ("triton[128x256x64]", "triton[256x128x64]", "torch.default", "cublaslt[h]")
DAY_S = 86400.0
#: How often, on average, a host's daemon restarts in steady state and asks the fleet
#: for every workload of every GPU again (an upgrade, a node reboot): once a day.
RESTARTS_PER_DAY = 1.0


class SimClock:
    """The simulated unix time every host's ``now`` reads."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# -- statement timing (the bench's own hook on the store's connection class) --------------


class StatementTimes:
    """Client-side latency of every statement the store sends (through PgBouncer)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.samples: list[float] = []
        self._orig = Conn.execute

    @contextmanager
    def installed(self) -> Iterator[None]:
        orig = self._orig
        samples = self.samples

        def timed(conn: Conn, sql: str, args: Any = ()) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(conn, sql, args)
            finally:
                samples.append(time.perf_counter() - t0)  # list.append is atomic

        Conn.execute = timed  # type: ignore[method-assign]
        try:
            yield
        finally:
            Conn.execute = orig  # type: ignore[method-assign]

    def take(self) -> list[float]:
        out, self.samples[:] = list(self.samples), []
        return out


# -- the servers ---------------------------------------------------------------------------


def start_postgres() -> PostgresServer:
    """A durable server (fsync on: bench/durable_pg.py) with pg_stat_statements loaded
    and lock waits logged."""
    server = start_durable_server()
    conf = server.data / "postgresql.conf"
    with conf.open("a", encoding="utf-8") as f:
        f.write(
            "\nshared_preload_libraries = 'pg_stat_statements'\n"
            "pg_stat_statements.track = all\n"
            "log_lock_waits = on\n"
            "deadlock_timeout = '50ms'\n"
        )
    server.halt()
    server.resume()
    return server


# -- results a simulated session yields ---------------------------------------------------


def _digest(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


def regime_result(model: str, workload: str, regime: Regime, host: str) -> RegimeResult:
    """Candidates' times for one key: the same ranking on every host (the fleet agrees),
    each host's numbers within a fraction of a percent of the others'."""
    base = 1e-3 * (1 + _digest(model, workload, regime) % 1000 / 1000)
    jitter = 1 + (_digest(host, workload, regime) % 100) / 100_000
    cands = [
        candidate(name, regime, base * (1 + 0.05 * i) * jitter) for i, name in enumerate(CANDIDATES)
    ]
    return RegimeResult(workload, regime, tuple(cands), CANDIDATES[0], False, 0.05, 0.002)


# -- one virtual host ----------------------------------------------------------------------


@dataclass
class Session:
    gpu: int
    keys: dict[str, str]
    verify: frozenset[str]
    session_id: int
    ends_at: float
    renewed_at: float


@dataclass
class Pending:
    workloads: list[Workload]
    recheck_at: float = 0.0


class VirtualHost:
    """One daemon's fleet traffic: its store, policy, fleet sync, winners cache, pruner."""

    def __init__(self, index: int, url: str, clock: SimClock, cfg: Config, stats: SimStats):
        self.name = f"gpu-node-{index:04d}"
        self.model = MODELS[index % len(MODELS)]
        self.clock = clock
        self.cfg = cfg
        self.stats = stats
        self.stack = STACK
        self.gpus = [
            DeviceInfo(
                index=g, uuid=f"GPU-{index:04d}-{g}", name=self.model,
                driver_version=STACK.driver, power_limit_w=POWER_W[self.model],
                max_sm_clock_mhz=1980.0,
            )
            for g in range(GPUS_PER_HOST)
        ]  # fmt: skip
        self.store = postgres_store(url, now=clock, keep_connections=1)
        self.store.keep_incumbent_for_s = cfg.fleet.max_winner_age_s
        self.board = StateBoard()
        for info in self.gpus:
            self.board.put(GpuSnapshot(info.index, info, None, None, PollHealth(True, 0.0)))
        clock_hz = 1.755e9 + (index % 7) * 1e6
        self._drift = {
            info.index: GpuDriftView(info.uuid, 0.0, clock_hz, 1.755e9, frozenset())
            for info in self.gpus
        }
        self.policy = FleetPolicy(
            self.store, cfg.fleet, host=self.name, versions_now=lambda _info: self.stack,
            measure_anyway=(), now=clock,
        )  # fmt: skip
        self.sync = FleetSync(
            self.store, self.board, lambda: self._drift,
            max_age_s=clock_max_age_s(cfg.drift, cfg.fleet),
            winner_max_age_s=cfg.fleet.max_winner_age_s,
            interval_s=cfg.fleet.sync_interval_s, host=self.name, now=clock,
        )  # fmt: skip
        self.identity = HostIdentity(
            self.store, self.name, f"machine-{index:04d}", lease_s(cfg.fleet.sync_interval_s)
        )
        self.cache = WinnersCache(
            self.store, host=self.name, now=clock, models=lambda: {self.model}
        )
        # The daemon's scheduler, for what it reads after each session and skip (its
        # listeners, registered as the daemon registers them); the sessions themselves
        # are chosen below, as its ``_choose`` chooses them.
        self.tuner = TuneScheduler(
            cfg.tuning_setup(), self.board, self.store, "nvml", now=clock,
            fleet=self.policy, host=self.name,
        )  # fmt: skip
        self.tuner.events.add_listener(lambda _event: self.cache.refresh())
        self.tuner.events.add_skip_listener(lambda _event: self.cache.refresh())
        self.pruner = Pruner(
            self.store, host=self.name, machine=f"machine-{index:04d}",
            keep_sessions_s=cfg.store.keep_sessions_s, keep_clocks_s=cfg.store.keep_clocks_s,
            interval_s=cfg.store.prune_interval_s,
        )  # fmt: skip
        rng = random.Random(index)
        self.next_sync = clock() + rng.uniform(0, cfg.fleet.sync_interval_s)
        self.next_prune = clock() + rng.uniform(0, self.pruner.check_every_s)
        self.pending: dict[int, Pending] = {}
        self.running: Session | None = None
        self.restart_at: float | None = None

    # the daemon's jobs

    def request_all(self) -> None:
        """Every workload on every GPU (a daemon's start, a new stack)."""
        for info in self.gpus:
            self.pending[info.index] = Pending(list(GPU_WORKLOADS))

    def seed(self) -> None:
        """Measure every workload on GPU 0 now: the fleet's answers before the run."""
        info = self.gpus[0]
        for w in GPU_WORKLOADS:
            meta = SessionMeta.for_device(
                info, backend="nvml", workloads=(w,), regimes=REGIMES, versions=self.stack
            )
            sid = self.store.start_session(replace(meta, host=self.name))
            for regime in REGIMES:
                self.store.record_result(sid, regime_result(self.model, w.name, regime, self.name))
            self.store.finish_session(sid, SessionStatus.COMPLETED)

    def step(self) -> None:
        """One scheduler tick, and the fleet tick and the pruner when they are due."""
        now = self.clock()
        if self.restart_at is not None and now >= self.restart_at:
            self.restart_at = None
            self.request_all()
        if now >= self.next_sync:
            self.next_sync += self.cfg.fleet.sync_interval_s
            self.fleet_tick()
        if now >= self.next_prune:
            self.next_prune += self.pruner.check_every_s  # the daemon's schedule
            self.pruner()
        self.tuning_tick()

    def fleet_tick(self) -> None:
        """The daemon's ``fleet_tick``: the host name held (its own transaction), then the
        fleet synced and the winners read again in one (its ``refresh_stored`` step reads
        nothing while a host's GPUs stay the same, so it is left out here)."""
        self._hold_host_name()
        t0 = time.perf_counter()
        in_one_transaction(
            self.store, [self.sync, self.cache.refresh], on_rollback=[self.sync.rolled_back]
        )
        self.stats.synced(time.perf_counter() - t0)

    def _hold_host_name(self) -> None:
        try:
            self.identity.claim()
        except StoreError as e:
            self.stats.error(e)

    def tuning_tick(self) -> None:
        now = self.clock()
        s = self.running
        if s is not None:
            if now >= s.ends_at:
                self._finish(s)
            elif now - s.renewed_at >= self.cfg.fleet.renew_every_s:  # ClaimRenewer.due
                s.renewed_at = now
                try:
                    self.stats.lost_claims += len(self.policy.renew(self.gpus[s.gpu].uuid, s.keys))
                except StoreError as e:
                    self.stats.error(e)
            return
        for gpu in sorted(self.pending):  # one session at a time (max_concurrent = 1)
            p = self.pending[gpu]
            if now < p.recheck_at:
                continue
            self._choose(gpu, p)
            return  # the tick's one session thread was used

    def _choose(self, gpu: int, p: Pending) -> None:
        """What the scheduler's ``_choose`` does for one GPU with open gate."""
        info = self.gpus[gpu]
        policy = self.policy
        versions = policy.versions(info)
        try:
            plan = policy.plan(info, versions, p.workloads, REGIMES, {})
            self._drop(gpu, {w.name for w, _ in plan.skipped}, skipped=True)
            if not plan.run:
                return
            claimed = policy.claim(info, versions, plan.run, plan.verify)
            if claimed.elsewhere:
                p.recheck_at = self.clock() + policy.recheck_s
            if not claimed.keys:
                return
            held = [w for w in plan.run if w.name in claimed.keys]
            try:
                again = policy.plan(info, versions, held, REGIMES, {})
            except Exception:
                policy.release(info.uuid, claimed.keys.values())
                raise
            late = {w.name for w, _ in again.skipped}
            if late:
                policy.release(info.uuid, [claimed.keys[n] for n in sorted(late)])
                self._drop(gpu, late, skipped=True)
            keys = {n: k for n, k in claimed.keys.items() if n not in late}
            if not keys:
                return
            verify = again.verify & frozenset(keys)
            work = tuple(w for w in held if w.name in keys)
            meta = SessionMeta.for_device(
                info, backend="nvml", workloads=work, regimes=REGIMES, versions=versions
            )
            sid = self.store.start_session(replace(meta, host=self.name))
        except StoreError as e:
            self.stats.error(e)
            p.recheck_at = self.clock() + self.cfg.tuning.retry_failed_after_s
            return
        ends = self.clock() + self.stats.session_s * len(work)
        self.running = Session(gpu, keys, verify, sid, ends, self.clock())

    def _finish(self, s: Session) -> None:
        info = self.gpus[s.gpu]
        try:
            for name in s.keys:
                for regime in REGIMES:
                    self.store.record_result(
                        s.session_id, regime_result(self.model, name, regime, self.name)
                    )
            self.store.finish_session(s.session_id, SessionStatus.COMPLETED)
        except StoreError as e:
            self.stats.error(e)
        self.policy.release(info.uuid, s.keys.values())
        self.running = None
        self.stats.measured(self, s)
        # The daemon's listeners: the scheduler reads the store again, the winners cache too.
        self.tuner.events.notify(
            SessionFinished(s.session_id, info.index, info.uuid, info.name,
                            SessionStatus.COMPLETED, None, tuple(s.keys))
        )  # fmt: skip
        for gpu in list(self.pending):  # the scheduler's _drop_answered_here: every GPU
            self._drop(gpu, set(s.keys), skipped=gpu != s.gpu)  # of the host is answered

    def _drop(self, gpu: int, names: set[str], *, skipped: bool) -> None:
        p = self.pending.get(gpu)
        if p is None or not names:
            return
        dropped = tuple(w.name for w in p.workloads if w.name in names)
        p.workloads = [w for w in p.workloads if w.name not in names]
        if not p.workloads:
            del self.pending[gpu]
        if skipped and dropped:
            self.stats.skipped += len(dropped)
            info = self.gpus[gpu]  # the scheduler's _skip: its skip listeners read again
            self.tuner.events.notify_skipped(
                WorkSkipped(gpu, info.uuid, info.name, dropped, SKIP_REASON)
            )

    @property
    def busy(self) -> bool:
        return self.running is not None or bool(self.pending)


@dataclass
class SimStats:
    session_s: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    sessions: list[tuple[str, str, str, str, str, bool]] = field(default_factory=list)
    skipped: int = 0
    lost_claims: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    sync_s: list[float] = field(default_factory=list)  # each fleet sync's transaction

    def synced(self, seconds: float) -> None:
        self.sync_s.append(seconds)  # list.append is atomic

    def measured(self, host: VirtualHost, s: Session) -> None:
        with self.lock:
            for name in s.keys:
                self.sessions.append(
                    (host.model, host.stack.key(), name, host.name,
                     host.gpus[s.gpu].uuid, name in s.verify)
                )  # fmt: skip

    def error(self, e: Exception) -> None:
        with self.lock:
            self.errors[" ".join(str(e).split())[:160]] += 1


# -- what the server saw -------------------------------------------------------------------


class Sampler:
    """Samples lock waits and server connections every ``every_s`` (wall) in a thread."""

    def __init__(self, server: PostgresServer, bouncer: Bouncer, db: str, every_s: float):
        self._stop = threading.Event()
        self._server, self._bouncer, self._db, self._every = server, bouncer, db, every_s
        self.samples = 0
        self.lock_waiting: list[int] = []
        self.lock_wait_what: Counter[str] = Counter()
        self.server_conns: list[int] = []
        self.active_conns: list[int] = []
        self.cl_waiting: list[int] = []
        self._t: threading.Thread | None = None

    def run(self) -> None:
        with psycopg.connect(self._server.url(self._db), autocommit=True) as conn:
            while not self._stop.wait(self._every):
                rows = conn.execute(
                    """SELECT wait_event_type, wait_event, state, left(query, 60)
                       FROM pg_stat_activity
                       WHERE datname = %s AND backend_type = 'client backend'
                         AND pid <> pg_backend_pid()""",
                    (self._db,),
                ).fetchall()
                waiting = [r for r in rows if r[0] == "Lock"]
                self.lock_waiting.append(len(waiting))
                for r in waiting:
                    self.lock_wait_what[f"{r[1]}: {r[3]}"] += 1
                self.server_conns.append(len(rows))
                self.active_conns.append(sum(1 for r in rows if r[2] != "idle"))
                pools = [p for p in self._bouncer.admin("SHOW POOLS") if p["database"] == self._db]
                self.cl_waiting.append(sum(int(p["cl_waiting"]) for p in pools))
                self.samples += 1

    def __enter__(self) -> Sampler:
        self._t = threading.Thread(target=self.run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._t is not None:
            self._t.join()


def table_sizes(server: PostgresServer, db: str) -> dict[str, tuple[int, int]]:
    """Rows and bytes (with indexes and TOAST) of every table of the store."""
    out = {}
    for (name,) in server.sql(
        db, "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1"
    ):
        rows = server.sql(db, f'SELECT count(*) FROM "{name}"')[0][0]
        size = server.sql(db, "SELECT pg_total_relation_size(%s)", (name,))[0][0]
        out[str(name)] = (int(rows), int(size))  # type: ignore[call-overload]
    return out


def bouncer_totals(bouncer: Bouncer, db: str) -> dict[str, int]:
    for row in bouncer.admin("SHOW STATS"):
        if row["database"] == db:
            return {k: int(v) for k, v in row.items() if k.startswith("total_")}
    return {}


def statement_counts(server: PostgresServer, db: str) -> dict[str, tuple[int, float, float]]:
    """pg_stat_statements per statement text: calls, mean and max milliseconds."""
    rows = server.sql(
        db,
        """SELECT s.query, s.calls, s.mean_exec_time, s.max_exec_time
           FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
           WHERE d.datname = %s""",
        (db,),
    )
    return {str(q): (int(c), float(m), float(x)) for q, c, m, x in rows}  # type: ignore[arg-type]


def lock_wait_log_lines(server: PostgresServer) -> int:
    log = server.root / "log"
    try:
        return sum(
            "still waiting for" in line for line in log.read_text(errors="replace").splitlines()
        )
    except OSError:
        return 0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# -- the phases ----------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    sim_s: float = 0.0
    wall_s: float = 0.0
    xacts: int = 0
    queries: int = 0
    xact_us: int = 0  # PgBouncer's time in transactions (server connections held)
    client_wait_us: int = 0  # clients' time waiting for a server connection
    wal_bytes: int = 0  # what the server wrote to its log: the real write volume
    by_statement: dict[str, int] = field(default_factory=dict)
    #: The statements that took the server the longest: calls, mean and total ms.
    costliest: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    server_ms: float = 0.0  # every statement's execution time on the server, summed
    latency_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)
    lock_samples: int = 0
    lock_waiting_max: int = 0
    lock_waiting_samples: int = 0
    lock_wait_log: int = 0
    lock_wait_what: list[tuple[str, int]] = field(default_factory=list)
    server_conns_max: int = 0
    server_conns_p50: float = 0.0
    active_conns_max: int = 0
    active_conns_mean: float = 0.0
    pg_xacts: int = 0  # PostgreSQL's own count (pg_stat_database: commits and rollbacks)
    sync_ms: tuple[float, float, float, int] = (0.0, 0.0, 0.0, 0)  # p50, p99, mean, n
    pg_measured: dict[str, int] = field(default_factory=dict)
    cl_waiting_max: int = 0
    growth: dict[str, tuple[int, int]] = field(default_factory=dict)
    sessions: int = 0
    skipped: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    keys: dict[str, dict[str, Any]] = field(default_factory=dict)

    def per_s(self, n: float) -> float:
        return n / self.sim_s if self.sim_s else float("nan")


class Fleet:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.server = start_postgres()
        self.db = self.server.new_database()
        self.server.sql(self.db, "CREATE EXTENSION pg_stat_statements")
        binary = find_pgbouncer()
        if binary is None:
            raise SystemExit("fleet_sim: pgbouncer is not installed (apt-get install pgbouncer)")
        self.bouncer = Bouncer(self.server, self.db, pool_size=args.pool_size, reserve=args.reserve)
        self.bouncer.start(binary)
        self.clock = SimClock(1_800_000_000.0)
        cfg = Config()
        self.cfg = replace(cfg, fleet=replace(cfg.fleet, verify_fraction=args.verify_fraction))
        self.stats = SimStats(session_s=args.session_s)
        self.times = StatementTimes()
        self.hosts: list[VirtualHost] = []
        self.pool = ThreadPoolExecutor(max_workers=args.threads)

    def open_hosts(self) -> None:
        url = self.bouncer.url()
        t0 = time.monotonic()
        first = VirtualHost(0, url, self.clock, self.cfg, self.stats)  # creates the schema
        self.hosts = [
            first,
            *list(
                self.pool.map(
                    lambda i: VirtualHost(i, url, self.clock, self.cfg, self.stats),
                    range(1, self.args.hosts),
                )
            ),
        ]
        print(f"opened {len(self.hosts)} host stores in {time.monotonic() - t0:.1f} s", flush=True)

    def tick(self) -> None:
        list(self.pool.map(lambda h: h.step(), self.hosts))
        self.clock.t += self.cfg.tuning.check_interval_s

    @contextmanager
    def measured(self, phase: Phase) -> Iterator[None]:
        server, db = self.server, self.db
        sizes0 = table_sizes(server, db)
        server.sql(db, "SELECT pg_stat_statements_reset()")
        totals0 = bouncer_totals(self.bouncer, db)
        log0 = lock_wait_log_lines(server)
        wal0 = server.sql(db, "SELECT pg_current_wal_lsn()")[0][0]
        n0, skipped0 = len(self.stats.sessions), self.stats.skipped
        pg0 = self.pg_xacts()
        self.stats.sync_s[:] = []
        errors0 = Counter(self.stats.errors)
        self.times.take()
        t_sim, t_wall = self.clock(), time.monotonic()
        with Sampler(server, self.bouncer, db, self.args.sample_s) as sampler:
            yield
        phase.sim_s = self.clock() - t_sim
        phase.wall_s = time.monotonic() - t_wall
        totals = bouncer_totals(self.bouncer, db)
        phase.xacts = totals["total_xact_count"] - totals0["total_xact_count"]
        phase.queries = totals["total_query_count"] - totals0["total_query_count"]
        phase.xact_us = totals["total_xact_time"] - totals0["total_xact_time"]
        phase.client_wait_us = totals["total_wait_time"] - totals0["total_wait_time"]
        stmts = statement_counts(server, db)
        phase.by_statement = dict(
            sorted(((" ".join(q.split())[:110], c) for q, (c, _, _) in stmts.items()),
                   key=lambda kv: -kv[1])[:25]
        )  # fmt: skip
        phase.server_ms = sum(c * m for c, m, _ in stmts.values())
        phase.costliest = dict(
            sorted(((" ".join(q.split())[:110], (c, round(m, 3), round(c * m)))
                    for q, (c, m, _) in stmts.items()), key=lambda kv: -kv[1][2])[:12]
        )  # fmt: skip
        lat = self.times.take()
        phase.latency_ms = (pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3, len(lat))
        phase.lock_samples = sampler.samples
        phase.lock_waiting_max = max(sampler.lock_waiting, default=0)
        phase.lock_waiting_samples = sum(1 for n in sampler.lock_waiting if n)
        phase.lock_wait_what = sampler.lock_wait_what.most_common(5)
        phase.lock_wait_log = lock_wait_log_lines(server) - log0
        phase.server_conns_max = max(sampler.server_conns, default=0)
        phase.server_conns_p50 = statistics.median(sampler.server_conns or [0])
        phase.active_conns_max = max(sampler.active_conns, default=0)
        phase.active_conns_mean = statistics.fmean(sampler.active_conns or [0])
        phase.pg_xacts = self.pg_xacts() - pg0
        syncs = list(self.stats.sync_s)
        phase.sync_ms = (
            pct(syncs, 0.5) * 1e3, pct(syncs, 0.99) * 1e3,
            statistics.fmean(syncs or [0.0]) * 1e3, len(syncs),
        )  # fmt: skip
        phase.cl_waiting_max = max(sampler.cl_waiting, default=0)
        sizes = table_sizes(server, db)
        phase.wal_bytes = int(
            server.sql(db, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (wal0,))[0][0]  # type: ignore[arg-type]
        )
        phase.growth = {
            t: (sizes[t][0] - sizes0.get(t, (0, 0))[0], sizes[t][1] - sizes0.get(t, (0, 0))[1])
            for t in sizes
        }
        phase.sessions = len(self.stats.sessions) - n0
        phase.skipped = self.stats.skipped - skipped0
        phase.errors = dict(Counter(self.stats.errors) - errors0)

    def pg_xacts(self) -> int:
        """Transactions PostgreSQL committed or rolled back in the store's database (the
        sampler's and these queries' own included: a handful per second)."""
        row = self.server.sql(
            self.db,
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            (self.db,),
        )
        return int(row[0][0])  # type: ignore[call-overload]

    def measured_in_postgres(self, stack: Versions) -> dict[str, int]:
        """The rollout as PostgreSQL holds it: completed sessions and results of
        ``stack``, the keys with a fleet winner of it, and the hosts that hold one."""
        key = stack.key()
        q = {
            "sessions_completed": "SELECT COUNT(*) FROM sessions WHERE versions_json = %s"
            " AND status = 'completed'",
            "results": "SELECT COUNT(*) FROM results r JOIN sessions s ON s.id = r.session_id"
            " WHERE s.versions_json = %s AND s.status = 'completed'",
            "fleet_winners": "SELECT COUNT(*) FROM winners WHERE versions_key = %s",
            "hosts_measuring": "SELECT COUNT(DISTINCT host) FROM sessions WHERE versions_json"
            " = %s AND status = 'completed'",
        }
        return {k: int(self.server.sql(self.db, v, (key,))[0][0]) for k, v in q.items()}  # type: ignore[call-overload]

    def seed_history(self, days: float, sessions: int, disagreements: int) -> None:
        """``days`` of history before the run, written by SQL on the server: ``sessions``
        finished sessions of an older stack (two results of two candidates each) spread
        over the fleet's GPUs, each host's own winners of that stack, and
        ``disagreements`` recorded disagreements spread over the models and keys."""
        hosts, span, t_end = len(self.hosts), days * DAY_S, self.clock() - 60.0
        old = replace(STACK, torch="2.8.0").key()
        names = [w.name for w in GPU_WORKLOADS]
        t0 = time.monotonic()
        with psycopg.connect(self.server.url(self.db), autocommit=True) as c:
            c.execute(
                """INSERT INTO sessions (gpu_uuid, gpu_index, gpu_model, host, backend,
                       versions_json, workloads_json, regimes_json, started_at, ended_at,
                       status, extra_json)
                   SELECT format('GPU-%%s-%%s', lpad(h::text, 4, '0'), g), g, m.models[1 + h %% 2],
                       format('gpu-node-%%s', lpad(h::text, 4, '0')), 'nvml', %(old)s, '[]',
                       '["unthrottled","sustained"]', %(t0)s + i * %(step)s,
                       %(t0)s + i * %(step)s + 600,
                       CASE WHEN i %% 10 < 8 THEN 'completed' ELSE 'failed' END, '{}'
                   FROM generate_series(1, %(n)s) AS i,
                       LATERAL (SELECT i %% %(hosts)s AS h, (i / %(hosts)s) %% 8 AS g) AS hg,
                       (SELECT %(models)s::text[] AS models) AS m""",
                {"old": old, "t0": t_end - span, "step": span / sessions, "n": sessions,
                 "hosts": hosts, "models": list(MODELS)},
            )  # fmt: skip
            c.execute(
                """INSERT INTO results (session_id, workload, regime, winner, tie, margin,
                       noise, recorded_at)
                   SELECT s.id, (%(names)s::text[])[1 + (s.id / 3) %% %(k)s], r.regime, 'a',
                       0, 0.1, 0.01, s.started_at + 300
                   FROM sessions s CROSS JOIN (VALUES ('unthrottled'), ('sustained')) AS r(regime)
                   WHERE s.versions_json = %(old)s""",
                {"names": names, "k": len(names), "old": old},
            )
            c.execute(
                """INSERT INTO candidate_stats (result_id, candidate, family, median_s, spread,
                       samples, rejected, reasons, meta_json)
                   SELECT r.id, c.name, 'fam', c.t, 0.01, 7, 0, 0, '{}'
                   FROM results r CROSS JOIN (VALUES ('a', 1e-3), ('b', 2e-3)) AS c(name, t)"""
            )
            c.execute(
                """INSERT INTO host_winners (host, gpu_model, versions_key, workload, regime,
                       candidate, family, median_s, tie, session_id, result_id, gpu_uuid,
                       measured_at)
                   SELECT DISTINCT ON (s.host, r.workload, r.regime) s.host, s.gpu_model,
                       s.versions_json, r.workload, r.regime, 'a', 'fam', 1e-3, 0, s.id, r.id,
                       s.gpu_uuid, r.recorded_at
                   FROM results r JOIN sessions s ON s.id = r.session_id
                   WHERE s.status = 'completed' AND s.versions_json = %(old)s
                   ORDER BY s.host, r.workload, r.regime, r.recorded_at DESC""",
                {"old": old},
            )
            c.execute(
                """INSERT INTO disagreements (gpu_model, versions_key, workload, regime,
                       kept_candidate, kept_host, kept_gpu_uuid, kept_median_s, new_candidate,
                       new_host, new_gpu_uuid, new_median_s, gap, noise, recorded_at)
                   SELECT (%(models)s::text[])[1 + i %% 2], %(old)s,
                       (%(names)s::text[])[1 + (i / 2) %% %(k)s],
                       CASE WHEN i %% 3 = 0 THEN 'unthrottled' ELSE 'sustained' END,
                       'a', 'gpu-node-0000', 'GPU-0000-0', 1e-3, 'b',
                       format('gpu-node-%%s', lpad((i %% %(hosts)s)::text, 4, '0')), 'GPU-x',
                       9e-4, 0.1, 0.01, %(t0)s + i * %(step)s
                   FROM generate_series(1, %(n)s) AS i""",
                {"models": list(MODELS), "old": old, "names": names, "k": len(names),
                 "hosts": hosts, "t0": t_end - span, "step": span / disagreements,
                 "n": disagreements},
            )  # fmt: skip
            c.execute(
                """INSERT INTO disagreement_totals (gpu_model, workload, regime, n)
                   SELECT gpu_model, workload, regime, COUNT(*) FROM disagreements
                   GROUP BY gpu_model, workload, regime
                   ON CONFLICT (gpu_model, workload, regime)
                   DO UPDATE SET n = disagreement_totals.n + excluded.n"""
            )  # the counts the store keeps beside them
            c.execute("ANALYZE")
        print(f"seeded {days:g} days of history in {time.monotonic() - t0:.0f} s:"
              f" {sessions} sessions, {disagreements} disagreements", flush=True)  # fmt: skip

    def rollout(self, stack: Versions, name: str) -> Phase:
        """Every host gets ``stack`` and wants every key at once; runs until no host has
        pending work."""
        phase = Phase(name)
        n0 = len(self.stats.sessions)
        for h in self.hosts:
            h.stack = stack
            h.request_all()
        with self.measured(phase):
            ticks = 0
            while any(h.busy for h in self.hosts):
                self.tick()
                ticks += 1
                if ticks % 12 == 0:
                    busy = sum(h.busy for h in self.hosts)
                    print(f"  {name}: {ticks * 5:5.0f} sim s, {busy} hosts busy, "
                          f"{len(self.stats.sessions) - n0} measurements", flush=True)  # fmt: skip
                if ticks * self.cfg.tuning.check_interval_s > self.args.max_rollout_s:
                    print(f"  {name}: stopped at --max-rollout-s", flush=True)
                    break
        phase.keys = self.key_counts(self.stats.sessions[n0:], stack)
        phase.pg_measured = self.measured_in_postgres(stack)
        return phase

    def warm_up(self) -> None:
        """Two fleet sync intervals unmeasured: every host has synced (its rows exist)."""
        end = self.clock() + 2 * self.cfg.fleet.sync_interval_s
        while self.clock() < end:
            self.tick()

    def steady(self, seconds: float) -> Phase:
        """Keys measured; hosts sync, and restart at RESTARTS_PER_DAY (asking again)."""
        phase = Phase("steady state")
        rng = random.Random(7)
        n0 = len(self.stats.sessions)
        for h in self.hosts:
            if rng.random() < RESTARTS_PER_DAY * seconds / DAY_S:
                h.restart_at = self.clock() + rng.uniform(0, seconds)
        with self.measured(phase):
            end = self.clock() + seconds
            ticks = 0
            while self.clock() < end:
                self.tick()
                ticks += 1
                if ticks % 24 == 0:
                    print(f"  steady: {ticks * 5:5.0f} sim s", flush=True)
        phase.keys = self.key_counts(self.stats.sessions[n0:], self.hosts[0].stack)
        return phase

    def key_counts(self, measured: list[tuple[str, str, str, str, str, bool]],
                   stack: Versions) -> dict[str, dict[str, Any]]:  # fmt: skip
        """Per key: measurements, first ones, verifications, the most GPUs of one host
        that measured it, and the verify share expected."""
        by_key: dict[str, list[tuple[str, str, bool]]] = defaultdict(list)
        for model, _vkey, name, host, uuid, verify in measured:
            by_key[f"{model}|{name}"].append((host, uuid, verify))
        out = {}
        for key, rows in sorted(by_key.items()):
            model, name = key.split("|")
            per_host = Counter(h for h, _, _ in rows)
            first = [r for r in rows if not r[2]]
            hosts = sum(1 for h in self.hosts if h.model == model)
            first_hosts = {h for h, _, _ in first}
            expect_verify = self.cfg.fleet.verify_fraction * (hosts - len(first_hosts))
            out[key] = {
                "measured": len(rows),
                "first": len(first),
                "verify": len(rows) - len(first),
                "verify_expected_mean": round(expect_verify, 1),
                "max_gpus_of_one_host": max(per_host.values()),
                "hosts": len(per_host),
            }
        return out

    def time_report(self) -> list[float]:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        out = []
        for _ in range(3):
            t0 = time.monotonic()
            res = subprocess.run(
                [sys.executable, "-m", "gpuwatchd", "report", "--fleet", "--store",
                 self.bouncer.url()],
                capture_output=True, text=True, env=env, timeout=120,
            )  # fmt: skip
            out.append(time.monotonic() - t0)
            if res.returncode != 0:
                print("report --fleet failed:", res.stderr[-2000:], flush=True)
                break
            self.report_head = res.stdout[:1500]
        return out

    def close(self) -> None:
        self.pool.shutdown()
        for h in self.hosts:
            h.store.close()
        self.bouncer.stop()
        self.server.stop()


def show(phase: Phase, hosts: int) -> dict[str, Any]:
    """One phase's figures, printed and returned for the JSON summary."""
    day = DAY_S / phase.sim_s if phase.sim_s else 0.0
    rows_day = {t: round(r * day) for t, (r, _) in phase.growth.items() if r}
    bytes_day = {t: round(b * day) for t, (_, b) in phase.growth.items() if b}
    summary = {
        "phase": phase.name,
        "sim_s": phase.sim_s,
        "wall_s": round(phase.wall_s, 1),
        "transactions_per_s": round(phase.per_s(phase.xacts), 2),
        "statements_per_s": round(phase.per_s(phase.queries), 2),
        "statement_ms_p50_p99_n": [
            round(phase.latency_ms[0], 3),
            round(phase.latency_ms[1], 3),
            int(phase.latency_ms[2]),
        ],
        "lock_wait_samples": f"{phase.lock_waiting_samples}/{phase.lock_samples}",
        "lock_waiting_max": phase.lock_waiting_max,
        "lock_waits_logged_over_50ms": phase.lock_wait_log,
        "lock_wait_what": phase.lock_wait_what,
        "server_connections_max": phase.server_conns_max,
        "server_connections_p50": phase.server_conns_p50,
        "server_connections_active_max": phase.active_conns_max,
        "server_connections_active_mean": round(phase.active_conns_mean, 2),
        "transactions_per_s_postgres": round(phase.per_s(phase.pg_xacts), 2),
        "fleet_sync_ms_p50_p99_mean_n": [round(v, 2) for v in phase.sync_ms],
        # the server's own time, all statements of the phase over its syncs (in steady
        # state nearly every statement is a sync's): what a sync costs the database
        "server_statement_ms_per_sync": round(phase.server_ms / max(1, phase.sync_ms[3]), 3),
        "measured_in_postgres": phase.pg_measured,
        "clients_waiting_max": phase.cl_waiting_max,
        "hosts_per_server_connection": round(hosts / max(1, phase.server_conns_max), 1),
        # Little's law: server connections busy at once at the fleet's real pace (the
        # compressed run holds each longer, so this is an upper bound)
        "mean_transaction_ms": round(phase.xact_us / max(1, phase.xacts) / 1e3, 3),
        "server_connections_busy_at_real_pace": round(phase.per_s(phase.xact_us / 1e6), 3),
        "client_wait_s_per_sim_s": round(phase.per_s(phase.client_wait_us / 1e6), 3),
        "rows_added": {t: r for t, (r, _) in phase.growth.items() if r},
        "bytes_added": {t: b for t, (_, b) in phase.growth.items() if b},
        "wal_bytes": phase.wal_bytes,
        "wal_bytes_per_day": round(phase.wal_bytes * day),
        "rows_per_day": rows_day,
        "bytes_per_day": bytes_day,
        "measurements": phase.sessions,
        "skipped": phase.skipped,
        "errors": phase.errors,
        "keys": phase.keys,
        "top_statements": phase.by_statement,
        "costliest_statements_calls_mean_total_ms": phase.costliest,
    }
    print(json.dumps(summary, indent=1), flush=True)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument(
        "--steady-s",
        type=float,
        default=900.0,
        help="simulated seconds of steady state (default 900)",
    )
    ap.add_argument(
        "--session-s",
        type=float,
        default=120.0,
        help="simulated seconds a session takes per workload (default 120)",
    )
    ap.add_argument("--max-rollout-s", type=float, default=4 * 3600.0)
    ap.add_argument("--no-rollout", action="store_true", help="the steady state only")
    ap.add_argument("--verify-fraction", type=float, default=FleetConfig().verify_fraction)
    ap.add_argument("--pool-size", type=int, default=20, help="PgBouncer default_pool_size")
    ap.add_argument("--reserve", type=int, default=5, help="PgBouncer reserve_pool_size")
    ap.add_argument("--threads", type=int, default=32)
    ap.add_argument("--sample-s", type=float, default=0.05, help="wall seconds between samples")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--history-days", type=float, default=30.0, help="history seeded (days)")
    ap.add_argument("--history-sessions", type=int, default=100_000)
    ap.add_argument("--history-disagreements", type=int, default=100_000)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers stopped on the way out
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    fleet = Fleet(args)
    out: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "workloads": [w.name for w in GPU_WORKLOADS],
        "models": MODELS,
    }
    try:
        with fleet.times.installed():
            fleet.open_hosts()
            if args.history_days > 0:
                fleet.seed_history(
                    args.history_days, args.history_sessions, args.history_disagreements
                )
            for h in fleet.hosts[: len(MODELS)]:  # one host per model answered every key
                h.seed()
            fleet.warm_up()
            steady = fleet.steady(args.steady_s)
            out["steady"] = show(steady, args.hosts)
            if not args.no_rollout:
                roll = fleet.rollout(NEW_STACK, "new-stack rollout")
                out["rollout"] = show(roll, args.hosts)
        out["report_fleet_s"] = fleet.time_report()
        out["report_head"] = getattr(fleet, "report_head", "")
        out["store_rows_bytes"] = table_sizes(fleet.server, fleet.db)
        print("report --fleet:", out["report_fleet_s"], flush=True)
    finally:
        fleet.close()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
