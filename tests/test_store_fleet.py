"""The store as a fleet shares it: host winners, disagreements, claims, clocks, resume.

Every test runs on SQLite and on a real PostgreSQL (``store_backends.py``); hosts are
told apart by ``SessionMeta.host``, as daemons with different ``GPUWATCHD_HOST`` are.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from builders import STACK, SettableClock, candidate, seed_session, session_meta
from store_backends import KINDS, Backend, make_backend

from gpuwatchd.daemon.fleet_sync import in_one_transaction
from gpuwatchd.sessions.fleet_settings import FleetConfig
from gpuwatchd.store import (
    MIGRATIONS,
    HostClock,
    SessionMeta,
    SqlStore,
    StoredResult,
    StoreError,
    host_name,
)
from gpuwatchd.store.disagreement import MIN_MARGIN
from gpuwatchd.store.errors import StoreUnavailable, WritesRefused
from gpuwatchd.store.rows import HOST_ENV
from gpuwatchd.tuning.types import Regime, RegimeResult, SessionStatus

U, S = Regime.UNTHROTTLED, Regime.SUSTAINED
H200 = "NVIDIA H200"
TRITON, CUBLAS = "triton[128x256]", "cublas"
NEWER = replace(STACK, torch="2.12.0")
DAY = 86400.0


def result(
    winner: str | None,
    times: dict[str, float | None],
    *,
    regime: Regime = U,
    tie: bool = False,
    noise: float = 0.001,
    workload: str = "gemm",
) -> RegimeResult:
    return RegimeResult(
        workload=workload,
        regime=regime,
        candidates=tuple(candidate(n, regime, t) for n, t in times.items()),
        winner=winner,
        tie=tie,
        margin=None if tie else 0.02,
        noise=noise,
    )


#: What each pick looks like when it wins by ``gap`` (relative) over the other.
def picks(winner: str, gap: float, **kw: object) -> RegimeResult:
    other = CUBLAS if winner == TRITON else TRITON
    return result(winner, {winner: 1.0e-3, other: 1.0e-3 * (1 + gap)}, **kw)  # type: ignore[arg-type]


@pytest.fixture
def clock() -> SettableClock:
    return SettableClock(1_700_000_000.0)


@pytest.fixture(params=KINDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return make_backend(request, tmp_path / "tune.db")


@pytest.fixture
def store(backend: Backend, clock: SettableClock) -> Iterator[SqlStore]:
    s = backend.open(now=clock)
    yield s
    s.close()


def tune(
    store: SqlStore,
    clock: SettableClock,
    host: str,
    *results: RegimeResult,
    gpu: str | None = None,
    status: SessionStatus = SessionStatus.COMPLETED,
    **kw: object,
) -> int:
    """One session on ``host`` recording ``results`` a second apart; returns its id."""
    meta = session_meta(host=host, gpu_uuid=gpu or f"GPU-{host}", **kw)
    return seed_session(
        store,  # type: ignore[arg-type]  # any SqlStore, not only the SQLite one
        meta,
        results,
        status,
        tick=lambda: clock.advance(1),
    )


def fleet(store: SqlStore, regime: Regime = U) -> dict[str, tuple[str, str | None]]:
    """Fleet winners per workload as (candidate, measuring host)."""
    return {w.workload: (w.candidate, w.host) for w in store.winners(regime=regime)}


# -- host identity --------------------------------------------------------------------------


def test_host_name_comes_from_the_environment_else_the_hostname(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(HOST_ENV, raising=False)
    assert host_name() == socket.gethostname()
    monkeypatch.setenv(HOST_ENV, "")
    assert host_name() == socket.gethostname()
    monkeypatch.setenv(HOST_ENV, "gpu-node-17.cluster.local")
    assert host_name() == "gpu-node-17.cluster.local"
    assert session_meta_default_host() == "gpu-node-17.cluster.local"
    for bad in ("node\n2", "x" * 254, "   ", "tab\there"):
        monkeypatch.setenv(HOST_ENV, bad)
        with pytest.raises(StoreError, match=f"^{HOST_ENV}: expected a printable host") as e:
            host_name()
        assert "\n" not in str(e.value)


def session_meta_default_host() -> str:
    return SessionMeta("GPU-1", 0, H200, "sim", (), ()).host


def test_abandon_running_on_a_shared_store_asks_about_this_hosts_sessions_only(
    store: SqlStore, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HOST_ENV, "node-a")
    mine = store.start_session(session_meta(host="node-a"))
    theirs = store.start_session(session_meta(host=socket.gethostname()))
    for sid in (mine, theirs):
        backend.execute("UPDATE sessions SET owner_pid = 4000001 WHERE id = ?", (sid,))
    shared = backend.kind == "postgres"
    assert store.abandon_running(alive=lambda pid: False) == (1 if shared else 2)
    assert store.session(mine).status is SessionStatus.FAILED  # type: ignore[union-attr]
    still = store.session(theirs).status  # type: ignore[union-attr]
    # Shared: the machine's hostname is another host now that GPUWATCHD_HOST names this one.
    assert still is (SessionStatus.RUNNING if shared else SessionStatus.FAILED)


# -- migration ------------------------------------------------------------------------------

TABLES_V2 = {
    "sessions": "id",
    "results": "id",
    "candidate_stats": "id",
    "winners": "gpu_model, versions_key, workload, regime",
    "session_totals": "status",
}


def dump(backend: Backend) -> dict[str, list[tuple[object, ...]]]:
    return {t: backend.execute(f"SELECT * FROM {t} ORDER BY {k}") for t, k in TABLES_V2.items()}


def test_migrating_a_version_2_store_keeps_every_row_and_seeds_host_winners(
    backend: Backend, clock: SettableClock
) -> None:
    with backend.open(now=clock) as s:
        a = tune(s, clock, "node-a", picks(TRITON, 0.02), picks(CUBLAS, 0.03, regime=S))
        b = tune(s, clock, "node-b", picks(TRITON, 0.02, workload="conv"))
        tune(s, clock, "node-a", picks(CUBLAS, 0.02), status=SessionStatus.FAILED)
        s.start_session(session_meta(host="node-c"))
    backend.downgrade_to_2()
    before = dump(backend)
    assert len(before["winners"]) == 3 and len(before["candidate_stats"]) == 8

    with backend.open(now=clock) as s:
        assert s.schema_version() == len(MIGRATIONS)
        assert dump(backend) == before
        seeded = backend.execute(
            "SELECT host, workload, regime, candidate, session_id FROM host_winners"
            " ORDER BY workload, regime"
        )
        assert seeded == [
            ("node-b", "conv", "unthrottled", TRITON, b),
            ("node-a", "gemm", "sustained", CUBLAS, a),
            ("node-a", "gemm", "unthrottled", TRITON, a),
        ]
        assert {(w.workload, w.host) for w in s.winners(regime=U)} == {
            ("gemm", "node-a"),
            ("conv", "node-b"),
        }
        assert s.claims() == [] and s.disagreements() == [] and s.host_clocks() == []


def test_a_host_that_knows_only_schema_2_refuses_to_write_a_newer_store(
    backend: Backend, clock: SettableClock
) -> None:
    backend.open().close()
    backend.downgrade_to_2()
    old = backend.open(migrations=MIGRATIONS[:2], now=clock)  # a host not yet upgraded
    sid = old.start_session(session_meta())
    backend.open().close()  # another host upgrades the shared store to the latest version
    with pytest.raises(StoreError, match=f"schema version {len(MIGRATIONS)}, newer") as e:
        old.finish_session(sid, SessionStatus.COMPLETED)
    assert "\n" not in str(e.value) and "refuses to finish a session" in str(e.value)
    old.close()
    with backend.open(migrations=MIGRATIONS[:2]) as again:  # restarted: reads, never writes
        assert not again.writable and again.session(sid) is not None
        with pytest.raises(WritesRefused, match="refuses to start a session"):
            again.start_session(session_meta())
    with backend.open() as s:
        assert s.session(sid).status is SessionStatus.RUNNING  # type: ignore[union-attr]


# -- host winners, fleet winners, disagreements ---------------------------------------------


def test_every_host_keeps_its_own_winner_and_the_fleet_takes_the_newest(
    store: SqlStore, clock: SettableClock
) -> None:
    a = tune(store, clock, "node-a", picks(TRITON, 0.02))
    assert fleet(store) == {"gemm": (TRITON, "node-a")}
    b = tune(store, clock, "node-b", picks(TRITON, 0.03))  # same pick: the newest wins
    assert fleet(store) == {"gemm": (TRITON, "node-b")}
    (row,) = store.winners()
    assert row.session_id == b and row.gpu_uuid == "GPU-node-b"
    own = {h: store.winners(prefer_host=h)[0] for h in ("node-a", "node-b")}
    assert own["node-a"].session_id == a and own["node-a"].host == "node-a"
    assert own["node-b"].session_id == b
    assert store.disagreements() == []


def test_a_disagreement_beyond_noise_keeps_the_incumbent_and_is_recorded(
    store: SqlStore, clock: SettableClock, caplog: pytest.LogCaptureFixture
) -> None:
    a = tune(store, clock, "node-a", picks(TRITON, 0.02))
    with caplog.at_level(logging.WARNING, logger="gpuwatchd.store"):
        b = tune(store, clock, "node-b", picks(CUBLAS, 0.04, noise=0.01))
    assert fleet(store) == {"gemm": (TRITON, "node-a")}  # not overwritten
    (row,) = store.winners()
    assert row.session_id == a
    (d,) = store.disagreements()
    assert (d.gpu_model, d.versions, d.workload, d.regime) == (H200, STACK, "gemm", U)
    assert (d.kept_candidate, d.kept_host, d.kept_gpu_uuid) == (TRITON, "node-a", "GPU-node-a")
    assert (d.new_candidate, d.new_host, d.new_gpu_uuid) == (CUBLAS, "node-b", "GPU-node-b")
    assert d.kept_median_s == 1.0e-3 and d.new_median_s == 1.0e-3
    assert d.gap == pytest.approx(0.04) and d.noise == 0.01 and d.recorded_at == clock.t
    assert store.disagreement_counts() == {(H200, "gemm", "unthrottled"): 1}
    # The disagreeing host still has its own pick, and reads it before the fleet's.
    (mine,) = store.winners(prefer_host="node-b")
    assert (mine.candidate, mine.session_id, mine.host) == (CUBLAS, b, "node-b")
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "node-b" in warning and "4.0% slower" in warning and "node-a" in warning

    tune(store, clock, "node-c", picks(CUBLAS, 0.05))
    assert store.disagreement_counts() == {(H200, "gemm", "unthrottled"): 2}
    assert [x.new_host for x in store.disagreements()] == ["node-c", "node-b"]  # newest first
    assert [x.new_host for x in store.disagreements(limit=1)] == ["node-c"]
    with pytest.raises(StoreError, match="limit"):
        store.disagreements(limit=0)


def test_a_disputed_incumbent_older_than_the_fleet_trusts_is_replaced(
    store: SqlStore, clock: SettableClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A host that once measured wrong must not hold the fleet's pick against every
    healthy host for ever: past ``keep_incumbent_for_s`` the new pick replaces it."""
    assert store.keep_incumbent_for_s == FleetConfig().max_winner_age_s  # the same default
    store.keep_incumbent_for_s = 7 * DAY
    tune(store, clock, "broken", picks(TRITON, 0.02))
    clock.advance(7 * DAY - 10)  # still fresh: kept
    tune(store, clock, "node-a", picks(CUBLAS, 0.5))
    assert fleet(store) == {"gemm": (TRITON, "broken")}
    clock.advance(30 * DAY)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpuwatchd.store"):
        b = tune(store, clock, "node-b", picks(CUBLAS, 0.5))
    assert fleet(store) == {"gemm": (CUBLAS, "node-b")}
    assert store.winners()[0].session_id == b
    newest = store.disagreements()[0]  # recorded all the same
    assert (newest.kept_host, newest.new_host, newest.new_candidate) == ("broken", "node-b", CUBLAS)
    assert store.disagreement_counts() == {(H200, "gemm", "unthrottled"): 2}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "replaced the fleet's, older than the fleet's max winner age" in warning
    tune(store, clock, "node-c", picks(CUBLAS, 0.5))  # the healthy hosts now agree
    assert fleet(store) == {"gemm": (CUBLAS, "node-c")}
    assert len(store.disagreements()) == 2


def test_keep_incumbent_for_s_refuses_bad_values_in_one_line(store: SqlStore) -> None:
    for bad in (-1.0, float("nan"), "7d", None):
        with pytest.raises(StoreError, match="keep_incumbent_for_s") as err:
            store.keep_incumbent_for_s = bad  # type: ignore[assignment]
        assert "\n" not in str(err.value)


def test_disagreements_are_counted_since_a_time_and_pruned_after_30_days(
    store: SqlStore, clock: SettableClock
) -> None:
    tune(store, clock, "node-a", picks(TRITON, 0.02))
    tune(store, clock, "node-b", picks(CUBLAS, 0.04))  # day 0
    clock.advance(20 * DAY)
    tune(store, clock, "node-c", picks(CUBLAS, 0.04))  # day 20
    key = (H200, "gemm", "unthrottled")
    assert store.disagreement_counts() == {key: 2}
    assert store.disagreement_counts(since=clock.t - DAY) == {key: 1}
    assert store.disagreement_counts(since=clock.t + 1) == {}
    with pytest.raises(StoreError, match="since"):
        store.disagreement_counts(since=float("inf"))
    clock.advance(15 * DAY)  # day 35: the first is over 30 days old, the second is not
    store.prune(older_than_s=365 * DAY)
    assert [d.new_host for d in store.disagreements()] == ["node-c"]
    store.prune(older_than_s=DAY)  # a shorter retention prunes them sooner
    assert store.disagreements() == []


@pytest.mark.parametrize(
    ("host", "new", "why"),
    [
        ("node-a", picks(CUBLAS, 0.10), "same host: it re-tuned"),
        ("node-b", picks(CUBLAS, 0.04, noise=0.05), "within the result's noise"),
        ("node-b", picks(CUBLAS, MIN_MARGIN * 0.8, noise=0.0), "within the protocol's floor"),
        ("node-b", result(None, {CUBLAS: 1.0e-3, TRITON: 1.1e-3}, tie=True), "a tie"),
        ("node-b", result(CUBLAS, {CUBLAS: 1.0e-3}), "the incumbent was not timed"),
    ],
)
def test_no_disagreement_means_the_newest_result_wins(
    store: SqlStore, clock: SettableClock, host: str, new: RegimeResult, why: str
) -> None:
    tune(store, clock, "node-a", picks(TRITON, 0.02))
    tune(store, clock, host, new)
    assert fleet(store) == {"gemm": (CUBLAS, host)}, why
    assert store.disagreements() == [] and store.disagreement_counts() == {}


def test_disagreements_are_per_key(store: SqlStore, clock: SettableClock) -> None:
    tune(store, clock, "node-a", picks(TRITON, 0.02), picks(TRITON, 0.02, regime=S))
    tune(store, clock, "node-b", picks(CUBLAS, 0.04), picks(TRITON, 0.01, regime=S))
    assert fleet(store, U) == {"gemm": (TRITON, "node-a")}
    assert fleet(store, S) == {"gemm": (TRITON, "node-b")}  # agreed: newest
    tune(store, clock, "node-b", picks(CUBLAS, 0.04), versions=NEWER)  # another stack: no incumbent
    assert {(w.versions, w.candidate) for w in store.winners(regime=U)} == {
        (STACK, TRITON),
        (NEWER, CUBLAS),
    }
    assert store.disagreement_counts() == {(H200, "gemm", "unthrottled"): 1}


def test_prefer_host_falls_back_to_the_fleet_per_key(store: SqlStore, clock: SettableClock) -> None:
    tune(store, clock, "node-a", picks(TRITON, 0.02), picks(TRITON, 0.02, workload="conv"))
    tune(store, clock, "node-b", picks(CUBLAS, 0.04))  # disagrees on gemm only
    tune(store, clock, "node-b", picks(CUBLAS, 0.02, regime=S))

    def view(host: str | None, **kw: object) -> set[tuple[str, str, str, str | None]]:
        rows = store.winners(prefer_host=host, **kw)  # type: ignore[arg-type]
        return {(w.workload, w.regime.value, w.candidate, w.host) for w in rows}

    assert view("node-b") == {
        ("gemm", "unthrottled", CUBLAS, "node-b"),  # its own
        ("gemm", "sustained", CUBLAS, "node-b"),
        ("conv", "unthrottled", TRITON, "node-a"),  # none of its own: the fleet's
    }
    assert view("node-new") == view(None)  # a host with no local winners uses the fleet's
    assert view(None) == {
        ("gemm", "unthrottled", TRITON, "node-a"),
        ("gemm", "sustained", CUBLAS, "node-b"),
        ("conv", "unthrottled", TRITON, "node-a"),
    }
    assert view("node-b", workload="gemm", regime=U, latest=True) == {
        ("gemm", "unthrottled", CUBLAS, "node-b")
    }
    assert view("node-b", gpu_model="NVIDIA L4") == set()
    with pytest.raises(StoreError, match="prefer_host"):
        store.winners(prefer_host="")


def test_fleet_winners_by_age_versions_and_host(store: SqlStore, clock: SettableClock) -> None:
    tune(store, clock, "node-a", picks(TRITON, 0.02, workload="old"))
    clock.advance(2 * DAY)
    tune(store, clock, "node-a", picks(TRITON, 0.02))
    tune(store, clock, "node-b", picks(TRITON, 0.02, workload="conv"))
    tune(store, clock, "node-b", picks(CUBLAS, 0.02, workload="conv"), versions=NEWER)
    tune(store, clock, "node-b", picks(CUBLAS, 0.02), gpu_model="NVIDIA L4")

    def names(**kw: object) -> list[tuple[str, str | None]]:
        return [(w.workload, w.host) for w in store.fleet_winners(H200, DAY, **kw)]  # type: ignore[arg-type]

    assert names() == [("conv", "node-b"), ("conv", "node-b"), ("gemm", "node-a")]
    assert [w.workload for w in store.fleet_winners(H200, 3 * DAY)] == [
        "conv",
        "conv",
        "gemm",
        "old",
    ]
    assert names(versions=STACK) == [("conv", "node-b"), ("gemm", "node-a")]
    assert names(versions=NEWER) == [("conv", "node-b")]
    assert names(exclude_host="node-b") == [("gemm", "node-a")]
    assert names(exclude_host="node-a", versions=STACK) == [("conv", "node-b")]
    assert store.fleet_winners("NVIDIA B200", DAY) == []
    with pytest.raises(StoreError, match="max_age_s"):
        store.fleet_winners(H200, -1)
    with pytest.raises(StoreError, match="gpu_model"):
        store.fleet_winners("", DAY)


def test_prune_keeps_sessions_a_host_winner_points_at(
    store: SqlStore, clock: SettableClock
) -> None:
    a = tune(store, clock, "node-a", picks(TRITON, 0.02))
    b = tune(store, clock, "node-b", picks(TRITON, 0.02))  # replaces a's fleet winner
    a_conv = tune(store, clock, "node-a", picks(TRITON, 0.02, workload="conv"))  # a's newest
    failed = tune(store, clock, "node-a", status=SessionStatus.FAILED)
    clock.advance(10 * DAY)
    assert store.prune(older_than_s=DAY) == 1
    assert {s.id for s in store.sessions()} == {a, b, a_conv}  # a: node-a's own gemm winner
    assert store.session(failed) is None
    assert store.winners(prefer_host="node-a", workload="gemm")[0].session_id == a


# -- claims ---------------------------------------------------------------------------------


def test_a_claim_is_held_until_released_or_expired_and_renewed_by_its_holder(
    store: SqlStore, clock: SettableClock
) -> None:
    t0 = clock.t
    assert store.claim("gemm/unthrottled", "node-a", "GPU-1", 60)
    assert not store.claim("gemm/unthrottled", "node-b", "GPU-2", 60)  # held
    assert not store.claim("gemm/unthrottled", "node-a", "GPU-2", 60)  # another GPU of a
    assert store.claim("conv/sustained", "node-b", "GPU-2", 60)  # another key is free
    clock.advance(30)
    assert store.claim("gemm/unthrottled", "node-a", "GPU-1", 60)  # renewed
    (held, _) = sorted(store.claims(), key=lambda c: c.key != "gemm/unthrottled")
    assert (held.key, held.host, held.gpu_uuid) == ("gemm/unthrottled", "node-a", "GPU-1")
    assert held.claimed_at == t0 and held.expires_at == t0 + 90
    clock.advance(59)
    assert not store.claim("gemm/unthrottled", "node-b", "GPU-2", 60)  # still held
    assert [c.key for c in store.claims()] == ["gemm/unthrottled"]  # conv's expired
    clock.advance(1)
    assert store.claims() == []
    assert store.claim("gemm/unthrottled", "node-b", "GPU-2", 60)  # expired: taken over
    (taken,) = store.claims()
    assert (taken.host, taken.claimed_at) == ("node-b", clock.t)

    store.release("gemm/unthrottled", "node-a", "GPU-1")  # not a's any more: no effect
    assert [c.host for c in store.claims()] == ["node-b"]
    store.release("gemm/unthrottled", "node-b", "GPU-2")
    assert store.claims() == []
    assert store.claim("gemm/unthrottled", "node-a", "GPU-1", 60)


def test_claims_refuse_bad_input_in_one_line(store: SqlStore) -> None:
    for args, field in (
        (("", "h", "g", 1.0), "key"),
        (("k", "", "g", 1.0), "host"),
        (("k", "h", None, 1.0), "gpu_uuid"),
        (("k", "h", "g", 0), "ttl_s"),
        (("k", "h", "g", float("nan")), "ttl_s"),
    ):
        with pytest.raises(StoreError, match=f"^{field}") as e:
            store.claim(*args)  # type: ignore[arg-type]
        assert "\n" not in str(e.value)
    assert store.claims() == []


def test_racing_hosts_claim_one_key_and_exactly_one_wins(backend: Backend) -> None:
    """Eight hosts, each with its own connections, claim one key at the same moment."""
    n = 8
    stores = [backend.open() for _ in range(n)]
    start = threading.Barrier(n)
    won: list[str] = []
    errors: list[BaseException] = []

    def host(i: int) -> None:
        try:
            start.wait()
            if stores[i].claim("gemm/sustained", f"node-{i}", f"GPU-{i}", 300):
                won.append(f"node-{i}")
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=host, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        assert len(won) == 1
        (held,) = stores[0].claims()
        assert held.host == won[0]
        assert backend.execute("SELECT owner_pid FROM claims") == [(os.getpid(),)]
    finally:
        for s in stores:
            s.close()


def test_a_stalled_writer_makes_writers_of_its_rows_fail_within_the_lock_timeout(
    backend: Backend,
) -> None:
    """Another host's transaction holds a claim's row and stalls (a network partition): a
    claim of the same key waits at most the lock timeout, then fails in one line; other
    keys never wait on it (no fleet-wide write lock)."""
    if backend.kind != "postgres":
        pytest.skip("SQLite's writers wait at most its busy_timeout_s already")
    import psycopg

    store = backend.open(lock_timeout_s=0.3)
    stalled = psycopg.connect(backend.location, autocommit=True)
    try:
        stalled.execute("BEGIN")
        stalled.execute(
            "INSERT INTO claims (claim_key, host, gpu_uuid, owner_pid, claimed_at, expires_at)"
            " VALUES ('gemm', 'node-a', 'GPU-a', 1, 0, 1e12)"
        )
        done: list[BaseException | bool] = []

        def claim() -> None:
            try:
                done.append(store.claim("gemm", "node-b", "GPU-b", 60))
            except BaseException as e:  # surfaced below
                done.append(e)

        t = threading.Thread(target=claim, daemon=True)
        t.start()
        t.join(10.0)  # far beyond the 0.3 s timeout: without one it would wait for ever
        assert not t.is_alive(), "the claim still waits on the stalled writer's row"
        (err,) = done
        assert isinstance(err, StoreError)
        msg = str(err)
        assert "\n" not in msg and "cannot claim work: waited over 0.3 s for a lock" in msg
        assert store.claim("conv", "node-b", "GPU-b", 60) is True  # another key: no wait
        sid = store.start_session(session_meta())  # nor any other write
        store.finish_session(sid, SessionStatus.COMPLETED)
        assert [c.key for c in store.claims()] == ["conv"]  # reads never wait
        stalled.execute("ROLLBACK")
        assert store.claim("gemm", "node-b", "GPU-b", 60) is True  # and the key works again
    finally:
        stalled.close()
        store.close()


def test_a_write_in_progress_holds_up_no_other_hosts_writes(backend: Backend) -> None:
    """No fleet-wide write lock: one host's open write transaction (a slow network) does
    not make another host's writes wait."""
    if backend.kind != "postgres":
        pytest.skip("SQLite's writers take turns on its file lock by design")
    slow, other = backend.open(), backend.open(lock_timeout_s=0.3)
    try:
        with slow._tx.write("write slowly"):  # open, not committed
            assert other.claim("gemm", "node-b", "GPU-b", 60) is True
            sid = other.start_session(session_meta(host="node-b"))
            other.finish_session(sid, SessionStatus.COMPLETED)
    finally:
        slow.close()
        other.close()


def test_every_postgres_session_bounds_its_waits(backend: Backend) -> None:
    if backend.kind != "postgres":
        pytest.skip("PostgreSQL's settings")
    store = backend.open(lock_timeout_s=2.5, statement_timeout_s=20)
    try:
        for write in (False, True):
            with store._tx.transaction(write, "read the timeouts") as conn:
                row = conn.execute(
                    """SELECT current_setting('lock_timeout') AS lock,
                          current_setting('statement_timeout') AS statement,
                          current_setting('idle_in_transaction_session_timeout') AS idle"""
                ).fetchone()
            assert (row["lock"], row["statement"], row["idle"]) == ("2500ms", "20s", "1min")
    finally:
        store.close()
    for bad in (0, -1, float("inf"), "10s"):
        with pytest.raises(StoreError, match="lock_timeout_s: expected") as err:
            backend.open(lock_timeout_s=bad)
        assert "\n" not in str(err.value)


def test_prune_drops_expired_claims(
    store: SqlStore, backend: Backend, clock: SettableClock
) -> None:
    store.claim("a", "node-a", "GPU-1", 10)
    store.claim("b", "node-a", "GPU-1", 1000)
    clock.advance(100)
    store.prune(older_than_s=DAY)
    assert backend.execute("SELECT claim_key FROM claims") == [("b",)]


# -- host clocks ----------------------------------------------------------------------------


def test_host_clocks_are_upserted_per_gpu_and_filtered_by_age(
    store: SqlStore, clock: SettableClock
) -> None:
    a = HostClock("node-a", "GPU-1", H200, 700.0, 1.44e9, clock.t - 10)
    b = HostClock("node-b", "GPU-2", H200, None, 1.30e9, clock.t - 5000)
    store.report_host_clock(a)
    store.report_host_clock(b)
    assert store.host_clocks() == [a, b]
    newer = replace(a, sustained_clock_hz=1.40e9, power_limit_w=600.0, updated_at=clock.t)
    store.report_host_clock(newer)
    store.report_host_clock(a)  # an older report arriving late changes nothing
    assert store.host_clocks() == [newer, b]
    assert store.host_clocks(max_age_s=3600) == [newer]
    with pytest.raises(StoreError, match="max_age_s"):
        store.host_clocks(max_age_s=-1)
    for bad, field in (
        (replace(a, host=""), "clock.host"),
        (replace(a, sustained_clock_hz=float("inf")), "clock.sustained_clock_hz"),
        (replace(a, power_limit_w=-1.0), "clock.power_limit_w"),
        ("1.4 GHz", "clock"),
    ):
        with pytest.raises(StoreError, match=f"^{field}"):
            store.report_host_clock(bad)  # type: ignore[arg-type]
    assert store.host_clocks() == [newer, b]


# -- resuming a preempted session -----------------------------------------------------------


def test_resumable_results_are_the_newest_of_preempted_sessions_on_the_gpu(
    store: SqlStore, clock: SettableClock
) -> None:
    PRE = SessionStatus.PREEMPTED
    before = tune(store, clock, "h", picks(CUBLAS, 0.02, workload="old"), gpu="GPU-1", status=PRE)
    since = clock.t + 0.5
    first = tune(store, clock, "h", picks(TRITON, 0.02), gpu="GPU-1", status=PRE)
    second = tune(
        store,
        clock,
        "h",
        picks(CUBLAS, 0.02),
        picks(TRITON, 0.02, regime=S),
        gpu="GPU-1",
        status=PRE,
    )
    tune(store, clock, "h", picks(TRITON, 0.09, workload="conv"), gpu="GPU-1")  # completed
    tune(store, clock, "h", picks(TRITON, 0.08, workload="conv"), gpu="GPU-2", status=PRE)
    conv = picks(TRITON, 0.07, workload="conv")
    newer_stack = tune(store, clock, "h", conv, gpu="GPU-1", status=PRE, versions=NEWER)
    wanted = [("gemm", U), ("gemm", S), ("conv", U), ("old", U)]

    found = store.resumable_results("GPU-1", wanted, since=since)
    assert {k: v.session_id for k, v in found.items()} == {
        ("gemm", U): second,  # newer than first's
        ("gemm", S): second,
        ("conv", U): newer_stack,  # no versions asked: any stack
    }
    assert found[("gemm", U)].result.winner == CUBLAS
    assert found[("conv", U)].versions == NEWER
    same_stack = store.resumable_results("GPU-1", wanted, since=since, versions=STACK)
    assert set(same_stack) == {("gemm", U), ("gemm", S)}
    assert store.resumable_results("GPU-1", wanted, since=0)[("old", U)].session_id == before
    assert store.resumable_results("GPU-1", [], since=0) == {}
    assert store.resumable_results("GPU-3", wanted, since=0) == {}
    assert first not in {v.session_id for v in found.values()}
    with pytest.raises(StoreError, match=r"^pairs\[1\]"):
        store.resumable_results("GPU-1", [("gemm", U), ("gemm", "sustained")], since=0)  # type: ignore[list-item]


def test_carried_results_keep_their_time_and_become_winners_on_completion(
    store: SqlStore, clock: SettableClock
) -> None:
    pre = tune(store, clock, "h", picks(TRITON, 0.02), picks(CUBLAS, 0.02, regime=S), gpu="GPU-1",
               status=SessionStatus.PREEMPTED)  # fmt: skip
    carried = store.results(pre)
    clock.advance(600)
    resumed = store.start_session(session_meta(host="h", gpu_uuid="GPU-1"))
    assert store.carry_results(resumed, carried) == 2
    again = store.results(resumed)
    assert [(r.result, r.recorded_at) for r in again] == [
        (r.result, r.recorded_at) for r in carried
    ]
    assert all(r.session_id == resumed for r in again)
    assert store.results(pre) == carried  # copied, not moved
    clock.advance(5)
    store.record_result(resumed, picks(CUBLAS, 0.03))  # measured again: replaces the carried one
    store.finish_session(resumed, SessionStatus.COMPLETED)
    wins = {w.regime: w for w in store.winners()}
    assert wins[U].candidate == CUBLAS and wins[U].measured_at == clock.t
    assert wins[S].session_id == resumed and wins[S].measured_at == carried[1].recorded_at


def test_carrying_results_refuses_what_does_not_belong(
    store: SqlStore, clock: SettableClock
) -> None:
    pre = tune(store, clock, "h", picks(TRITON, 0.02), gpu="GPU-1", status=SessionStatus.PREEMPTED)
    (stored,) = store.results(pre)
    other_gpu = store.start_session(session_meta(host="h", gpu_uuid="GPU-2"))
    with pytest.raises(StoreError, match=r"^results\[0\]\.gpu_uuid: measured on GPU-1"):
        store.carry_results(other_gpu, [stored])
    resumed = store.start_session(session_meta(host="h", gpu_uuid="GPU-1"))
    with pytest.raises(StoreError, match=r"^results\[1\]: gemm/unthrottled appears twice"):
        store.carry_results(resumed, [stored, stored])
    bad = StoredResult(pre, H200, "GPU-1", STACK, -5.0, stored.result)
    with pytest.raises(StoreError, match=r"^results\[0\]\.recorded_at"):
        store.carry_results(resumed, [bad])
    with pytest.raises(StoreError, match=r"^results\[0\]: expected a StoredResult"):
        store.carry_results(resumed, [stored.result])  # type: ignore[list-item]
    with pytest.raises(StoreError, match="is preempted, not running"):
        store.carry_results(pre, [stored])
    assert store.results(resumed) == [] and store.results(other_gpu) == []
    assert store.carry_results(resumed, []) == 0


# -- read-only stores and damaged rows ------------------------------------------------------


def test_a_readonly_store_reads_the_fleet_and_refuses_its_writes(
    store: SqlStore, backend: Backend, clock: SettableClock
) -> None:
    tune(store, clock, "node-a", picks(TRITON, 0.02))
    store.claim("k", "node-a", "GPU-1", 1e6)
    with backend.open(readonly=True, now=clock) as ro:
        assert [w.host for w in ro.fleet_winners(H200, 1e9)] == ["node-a"]
        assert [c.key for c in ro.claims()] == ["k"]
        for write in (
            lambda: ro.claim("k2", "node-a", "GPU-1", 10),
            lambda: ro.release("k", "node-a", "GPU-1"),
            lambda: ro.report_host_clock(HostClock("a", "GPU-1", H200, None, 1e9, 1.0)),
            lambda: ro.carry_results(1, []),
        ):
            with pytest.raises(StoreError, match="read-only"):
                write()
    assert [c.key for c in store.claims()] == ["k"]


def test_damaged_fleet_rows_are_skipped_with_one_warning_each(
    store: SqlStore, backend: Backend, clock: SettableClock, caplog: pytest.LogCaptureFixture
) -> None:
    tune(store, clock, "node-a", picks(TRITON, 0.02))
    tune(store, clock, "node-b", picks(CUBLAS, 0.04))
    tune(store, clock, "node-c", picks(CUBLAS, 0.04))
    store.claim("good", "node-a", "GPU-1", 1e6)
    store.claim("bad", "node-a", "GPU-1", 1e6)
    store.report_host_clock(HostClock("node-a", "GPU-1", H200, None, 1e9, clock.t))
    store.report_host_clock(HostClock("node-b", "GPU-2", H200, None, 1e9, clock.t))
    backend.execute("UPDATE disagreements SET regime = 'lukewarm' WHERE new_host = 'node-b'")
    backend.execute("UPDATE claims SET claimed_at = 'Infinity' WHERE claim_key = 'bad'")
    backend.execute("UPDATE host_clocks SET sustained_clock_hz = 'Infinity' WHERE host = 'node-b'")
    with caplog.at_level(logging.WARNING, logger="gpuwatchd.store"):
        for _ in range(2):
            assert [d.new_host for d in store.disagreements()] == ["node-c"]
            assert [c.key for c in store.claims()] == ["good"]
            assert [c.host for c in store.host_clocks()] == ["node-a"]
    warnings = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warnings) == 3
    assert any("lukewarm" in w for w in warnings)


def test_clock_medians_are_one_row_per_group_computed_by_the_database(
    store: SqlStore, clock: SettableClock
) -> None:
    """The fleet sync reads a median per (GPU model, whole watts), not every host's clock:
    PostgreSQL computes it, SQLite's are computed from its rows; the same numbers."""
    from gpuwatchd.store.rows import ClockMedian

    for host, watts, ghz in (("a", 700.0, 1.4), ("b", 700.2, 1.5), ("c", 699.6, 1.6),
                             ("d", 700.0, 1.7), ("e", None, 1.2)):  # fmt: skip
        store.report_host_clock(HostClock(host, f"GPU-{host}", H200, watts, ghz * 1e9, clock.t))
    store.report_host_clock(HostClock("gone", "GPU-g", H200, 700.0, 0.5e9, clock.t - 5000))
    medians = store.clock_medians(max_age_s=3600)
    assert [(m.gpu_model, m.power_limit_w, m.peers) for m in medians] == [
        (H200, 700, 4),
        (H200, None, 1),
    ]
    assert medians[0] == ClockMedian(H200, 700, pytest.approx(1.55e9), 4)  # type: ignore[arg-type]
    assert medians[1].median_hz == pytest.approx(1.2e9)


# -- batches: a fleet sync's calls in one transaction --------------------------------------


def clocks_of(backend: Backend) -> list[object]:
    """The hosts whose clocks another connection sees committed."""
    return [r[0] for r in backend.execute("SELECT host FROM host_clocks ORDER BY host")]


def a_clock(host: str, clock: SettableClock) -> HostClock:
    return HostClock(host, f"GPU-{host}", H200, 700.0, 1.44e9, clock.t)


def test_calls_in_a_batch_commit_together_when_it_ends(
    store: SqlStore, backend: Backend, clock: SettableClock
) -> None:
    with store.batch(write=True):
        store.report_host_clock(a_clock("node-a", clock))
        assert [c.host for c in store.host_clocks()] == ["node-a"]  # seen inside
        store.report_host_clock(a_clock("node-b", clock))
        assert clocks_of(backend) == []  # nothing committed yet
        with store.batch():  # a nested batch joins
            assert store.claim("gemm", "node-a", "GPU-1", 60) is True
    assert clocks_of(backend) == ["node-a", "node-b"]
    assert [c.key for c in store.claims()] == ["gemm"]


def test_a_failed_call_fails_the_rest_of_its_batch_and_rolls_it_all_back(
    store: SqlStore, backend: Backend, clock: SettableClock
) -> None:
    with pytest.raises(StoreError) as end, store.batch(write=True):
        store.report_host_clock(a_clock("node-a", clock))
        with pytest.raises(StoreError):
            store.finish_session(999, SessionStatus.COMPLETED)  # no such session
        with pytest.raises(StoreError, match="an earlier call failed"):
            store.report_host_clock(a_clock("node-b", clock))
    assert "\n" not in str(end.value) and "999" in str(end.value)
    assert clocks_of(backend) == []
    store.report_host_clock(a_clock("node-c", clock))  # the next call has a transaction
    assert clocks_of(backend) == ["node-c"]


def test_a_read_batch_refuses_writes(
    store: SqlStore, backend: Backend, clock: SettableClock
) -> None:
    with pytest.raises(StoreError, match="inside a read-only batch"), store.batch():
        store.report_host_clock(a_clock("node-a", clock))
    assert clocks_of(backend) == []


def test_the_fleet_tick_is_one_transaction_on_a_shared_store_only(
    store: SqlStore, backend: Backend, clock: SettableClock
) -> None:
    seen: list[list[object]] = []
    steps = [
        lambda: store.report_host_clock(a_clock("node-a", clock)),
        lambda: seen.append(clocks_of(backend)),
        lambda: store.report_host_clock(a_clock("node-b", clock)),
    ]
    in_one_transaction(store, steps)
    # PostgreSQL: the first write is not committed while the tick goes on; SQLite: each
    # step is its own transaction (one would hold the file's write lock over the tick)
    assert seen == [[] if store.shared else ["node-a"]]
    assert clocks_of(backend) == ["node-a", "node-b"]


def test_a_fleet_tick_whose_store_is_down_runs_each_step_alone(
    store: SqlStore, clock: SettableClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    def down(*_: object, **__: object) -> None:
        raise StoreUnavailable(f"store {store.where} is unreachable: stopped")

    monkeypatch.setattr(type(store), "batch", down)
    monkeypatch.setattr(type(store), "shared", True)
    ran: list[int] = []
    in_one_transaction(store, [lambda: ran.append(1), lambda: ran.append(2)])
    assert ran == [1, 2]
