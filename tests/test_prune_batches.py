"""Pruning a grown store: bounded batches under a short lease that expires with the work,
``store prune`` cooperating with the daemon's pruner, stale running sessions ended, and
every foreign key a prune's DELETE checks indexed (real PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import GEMM_8192, S, candidate, session_meta
from pg_server import PostgresServer

from gpuwatchd.cli.main import main
from gpuwatchd.config import STORE_NAME
from gpuwatchd.store import SqlStore, StoreError, sqlite_store
from gpuwatchd.store.owner import Holder
from gpuwatchd.store.postgres import postgres_store
from gpuwatchd.store.retention import (
    LEASE_S,
    PRUNE_CLAIM,
    PRUNED_CLAIM,
    STALE_RUNNING_S,
    Pruner,
)
from gpuwatchd.tuning.types import RegimeResult, SessionStatus

DAY = 86400.0
T0 = 1_700_000_000.0


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _result() -> RegimeResult:
    return RegimeResult(
        GEMM_8192.name, S, (candidate("a", S, 1e-3), candidate("b", S, 2e-3)), "a", False, 1.0,
        0.01,
    )  # fmt: skip


@pytest.fixture
def clock() -> Clock:
    return Clock(T0)


@pytest.fixture
def db(postgres_server: PostgresServer) -> str:
    return postgres_server.new_database()


@pytest.fixture
def store(postgres_server: PostgresServer, db: str, clock: Clock) -> Iterator[SqlStore]:
    s = postgres_store(postgres_server.url(db), now=clock)
    yield s
    s.close()


def _grow(store: SqlStore, gpus: int, per_gpu: int) -> set[int]:
    """Sessions on ``gpus`` GPUs of as many hosts, each with a result; returns the ids
    pruning must keep (each GPU's winner session, its newest completed one)."""
    keep = set()
    for g in range(gpus):
        meta = session_meta(host=f"node-{g}", gpu_uuid=f"GPU-{g}")
        for i in range(per_gpu):
            sid = store.start_session(meta)
            store.record_result(sid, _result())
            status = SessionStatus.COMPLETED if i % 2 == 0 else SessionStatus.FAILED
            store.finish_session(sid, status)
            if status is SessionStatus.COMPLETED:
                newest = sid
        keep.add(newest)
    keep |= {w.session_id for w in store.winners()}
    return keep


def _ids(store: SqlStore) -> set[int]:
    return {s.id for s in store.sessions(limit=10_000)}


def test_the_daemons_pruner_deletes_in_batches_and_keeps_the_store_bounded(
    store: SqlStore, clock: Clock
) -> None:
    """A grown store is pruned a bounded batch per transaction; a pruner whose time is
    up leaves the rest to its next check (no "pruned" mark yet), and the store shrinks
    to what must stay: winners' sessions and each GPU's newest completed one."""
    keep = _grow(store, gpus=4, per_gpu=9)
    clock.t += 30 * DAY
    pruner = Pruner(
        store, host="node-0", machine="m-0", keep_sessions_s=7 * DAY, keep_clocks_s=7 * DAY,
        interval_s=DAY, batch=5, budget_s=0.0,
    )  # fmt: skip
    sizes = [len(_ids(store))]
    while (done := pruner()) is not None and not done.complete:
        assert done.sessions == 5 and done.batches == 1, "one bounded batch per check"
        assert store.claim_holder(PRUNED_CLAIM) is None, "not done: due again at the next check"
        assert store.claim_holder(PRUNE_CLAIM) is None, "the lease goes with the work"
        sizes.append(len(_ids(store)))
    assert done is not None and done.complete
    assert _ids(store) == keep
    assert sizes == sorted(sizes, reverse=True) and len(sizes) >= 5
    assert store.results(min(keep)) != [], "kept sessions keep their results"
    held = store.claim_holder(PRUNED_CLAIM)
    assert held is not None and held.expires_at == clock.t + DAY
    other = Pruner(store, host="node-1", machine="m-1", keep_sessions_s=7 * DAY,
                   keep_clocks_s=7 * DAY, interval_s=DAY)  # fmt: skip
    assert other() is None, "pruned within the interval: the others skip"
    assert store.session_totals()[SessionStatus.COMPLETED] == 4 * 5, "counts outlive pruning"


def test_a_failed_pruning_leaves_the_lease_to_the_next_check_not_an_interval(
    store: SqlStore, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    keep = _grow(store, gpus=2, per_gpu=4)
    clock.t += 30 * DAY
    kw = {"keep_sessions_s": 7 * DAY, "keep_clocks_s": 7 * DAY, "interval_s": DAY}
    pruner = Pruner(store, host="node-0", machine="m-0", **kw)  # type: ignore[arg-type]
    real = store.prune_batch

    def fails(*_a: object) -> int:
        raise StoreError("store x: cannot prune old sessions: a statement ran over 28 s")

    monkeypatch.setattr(store, "prune_batch", fails)
    assert pruner() is None
    assert store.claim_holder(PRUNE_CLAIM) is None and store.claim_holder(PRUNED_CLAIM) is None
    monkeypatch.setattr(store, "prune_batch", real)
    clock.t += 600  # the next check, minutes later
    done = pruner()
    assert done is not None and done.complete and _ids(store) == keep


def test_a_pruner_that_stalls_loses_its_lease_within_minutes(store: SqlStore, clock: Clock) -> None:
    assert store.claim(PRUNE_CLAIM, "node-a", "m-a", LEASE_S)  # node-a prunes, then hangs
    kw = {"keep_sessions_s": 7 * DAY, "keep_clocks_s": 7 * DAY, "interval_s": DAY}
    b = Pruner(store, host="node-b", machine="m-b", **kw)  # type: ignore[arg-type]
    assert b() is None, "node-a holds the lease"
    clock.t += LEASE_S + 1
    assert b() is not None, "its lease expired with its work"


def test_stale_running_sessions_of_a_host_gone_are_ended_failed_and_counted(
    store: SqlStore, clock: Clock
) -> None:
    gone = store.start_session(session_meta(host="node-gone", gpu_uuid="GPU-g"))
    alive = store.start_session(session_meta(host="node-alive", gpu_uuid="GPU-a"))
    young = store.start_session(
        session_meta(host="node-gone", gpu_uuid="GPU-y", started_at=T0 + DAY)
    )
    clock.t += STALE_RUNNING_S + DAY
    alive_host = Holder("m-alive", "boot-1", "nonce-1")
    assert store.claim_host("node-alive", alive_host, 60).held  # still renewing its name
    kw = {"keep_sessions_s": 7 * DAY, "keep_clocks_s": 7 * DAY, "interval_s": DAY}
    done = Pruner(store, host="node-0", machine="m-0", **kw)()  # type: ignore[arg-type]
    assert done is not None and done.stale == 1
    statuses = {sid: store.session(sid).status for sid in (gone, alive, young)}  # type: ignore[union-attr]
    assert statuses == {
        gone: SessionStatus.FAILED,
        alive: SessionStatus.RUNNING,
        young: SessionStatus.RUNNING,
    }
    assert store.session_totals()[SessionStatus.FAILED] == 1


def test_every_foreign_key_a_prune_checks_is_indexed(
    store: SqlStore, postgres_server: PostgresServer, db: str
) -> None:
    """Deleting a session checks every row that references it (or its results): each
    such column must lead an index, or each deleted row scans a table (host_winners'
    result_id scanned 71 ms per result on a 1,000-host store)."""
    unindexed = postgres_server.sql(
        db,
        """SELECT c.conrelid::regclass::text, a.attname
           FROM pg_constraint c
           JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1]
           WHERE c.contype = 'f' AND NOT EXISTS (
               SELECT 1 FROM pg_index i
               WHERE i.indrelid = c.conrelid AND i.indkey[0] = c.conkey[1])
           ORDER BY 1, 2""",
    )
    assert unindexed == []


def test_store_prune_waits_for_the_daemons_pruner_and_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    with sqlite_store(state / STORE_NAME) as store:
        assert store.claim(PRUNE_CLAIM, "node-a", "m-a", LEASE_S)  # a daemon prunes now
    config = tmp_path / "config.toml"
    config.write_text(f'[daemon]\nstate_dir = "{state}"\n')
    assert main(["store", "prune", "--config", str(config), "--wait", "0"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "is being pruned by host node-a (m-a, since" in err and "--wait" in err
    with sqlite_store(state / STORE_NAME) as store:
        store.release(PRUNE_CLAIM, "node-a", "m-a")
    assert main(["store", "prune", "--config", str(config), "--wait", "0"]) == 0
    assert capsys.readouterr().out.startswith("pruned 0 session(s)")
    with sqlite_store(state / STORE_NAME) as store:
        assert store.claim_holder(PRUNE_CLAIM) is None, "the CLI gave the lease back"


def _picks(fast: str, slow: str) -> RegimeResult:
    cands = (candidate(fast, S, 1.0e-3), candidate(slow, S, 1.3e-3))
    return RegimeResult(GEMM_8192.name, S, cands, fast, False, 0.3, 0.01)


def test_disagreement_counts_are_kept_as_recorded_and_pruned(store: SqlStore, clock: Clock) -> None:
    """The counts a sync reads are kept per key beside the disagreements, not counted
    over a month of them; pruning takes the old ones off."""
    key = ("NVIDIA H200", GEMM_8192.name, S.value)
    for i, (fast, slow) in enumerate([("a", "b"), ("b", "a"), ("b", "a")]):
        meta = session_meta(host=f"node-{i}", gpu_uuid=f"GPU-{i}")
        sid = store.start_session(meta)
        store.record_result(sid, _picks(fast, slow))
        store.finish_session(sid, SessionStatus.COMPLETED)
        clock.t += DAY
    assert store.disagreement_counts() == {key: 2}
    assert store.disagreement_counts(gpu_models=["NVIDIA H200"]) == {key: 2}
    assert store.disagreement_counts(gpu_models=["NVIDIA L4"]) == {}
    assert store.disagreement_counts(since=clock.t - DAY) == {key: 1}
    clock.t += 29 * DAY  # the first disagreement is over 30 days old now
    store.prune_rest(90 * DAY)
    assert store.disagreement_counts() == {key: 1}
    clock.t += 2 * DAY
    store.prune_rest(90 * DAY)
    assert store.disagreement_counts() == {} and store.disagreements() == []
