"""A frozen PostgreSQL (its processes stopped with SIGSTOP) makes store calls fail within
their bound, with one WARNING per outage, instead of stalling the caller for good.

The postmaster and the backend serving the store's pooled connection are stopped for
real (``pg_server.py``'s server); the bound is made small through the store's config.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from builders import session_meta
from pg_server import PostgresServer

from gpuwatchd.config import Config, StoreConfig
from gpuwatchd.store import SqlStore, StoreError, open_store
from gpuwatchd.store.deadline import Watchdog

#: The test's bound on each store call (seconds); the default is 30.
BOUND_S = 2.0


def _postmaster_pid(server: PostgresServer) -> int:
    return int((server.data / "postmaster.pid").read_text().split()[0])


def _backend_pid(store: SqlStore) -> int:
    with store._tx.read("find the backend") as conn:  # the pooled connection the next call uses
        return int(conn.execute("SELECT pg_backend_pid() AS pid").fetchone()["pid"])


@contextmanager
def _stopped(*pids: int) -> Iterator[None]:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def _call_in_thread(call: object) -> tuple[threading.Thread, list[BaseException]]:
    """Run ``call`` where a hang would not hang the test run: join it with a timeout."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()  # type: ignore[operator]
        except BaseException as e:  # surfaced by the caller
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


@pytest.fixture
def frozen_store(postgres_server: PostgresServer, tmp_path: Path) -> Iterator[SqlStore]:
    cfg = Config(store=StoreConfig(url=postgres_server.url(postgres_server.new_database())))
    cfg = cfg.with_overrides(store={"call_timeout_s": BOUND_S})
    store = open_store(cfg.store.url, call_timeout_s=cfg.store.call_timeout_s)
    assert store.shared
    try:
        yield store
    finally:
        store.close()


def test_a_call_on_a_stopped_server_fails_within_its_bound_and_warns_once(
    postgres_server: PostgresServer,
    frozen_store: SqlStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = frozen_store
    store.start_session(session_meta())
    backend = _backend_pid(store)
    with caplog.at_level(logging.WARNING, logger="gpuwatchd.store"):
        with _stopped(_postmaster_pid(postgres_server), backend):
            for _ in range(2):  # the pooled connection, then a fresh connect
                t, errors = _call_in_thread(store.sessions)
                t.join(timeout=BOUND_S * 10)
                assert not t.is_alive(), "a store call on a stopped server did not return"
                assert len(errors) == 1 and isinstance(errors[0], StoreError), errors
                message = str(errors[0])
                assert f"no answer within {BOUND_S:g} s" in message and "\n" not in message
        warnings = [r.getMessage() for r in caplog.records if "no answer within" in r.getMessage()]
        assert len(warnings) == 1, warnings  # one per outage, not one per call
        store.probe()  # calls fail at once until a retry is due; a probe asks now
        assert len(store.sessions()) == 1  # answered again: nothing was lost
    assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_a_write_on_a_stopped_backend_moves_to_a_fresh_connection(
    postgres_server: PostgresServer, frozen_store: SqlStore
) -> None:
    """Only the backend stopped (the postmaster still accepts): the pooled connection gets
    no answer within its bound and is hung up on; nothing was sent past its BEGIN, so the
    write is made once more, on a fresh connection, and lands exactly once."""
    store = frozen_store
    backend = _backend_pid(store)
    with _stopped(backend):
        t, errors = _call_in_thread(lambda: store.start_session(session_meta()))
        t.join(timeout=BOUND_S * 10)
        assert not t.is_alive()
        assert errors == []
        assert len(store.sessions()) == 1  # served by a new backend while the old one is stopped
    assert _backend_pid(store) != backend


def test_the_watchdog_runs_only_overrun_alarms() -> None:
    now = [0.0]
    dog = Watchdog(clock=lambda: now[0])
    ran = threading.Event()
    early = dog.arm(1.0, lambda: pytest.fail("a disarmed alarm ran"))
    assert dog.disarm(early) is False
    late = dog.arm(0.0, ran.set)
    assert ran.wait(5)
    assert dog.disarm(late) is True


def test_the_bound_is_a_config_key_checked_like_every_number() -> None:
    assert Config().store.call_timeout_s == 30.0
    with pytest.raises(ValueError, match=r"store\.call_timeout_s"):
        Config().with_overrides(store={"call_timeout_s": 0})
