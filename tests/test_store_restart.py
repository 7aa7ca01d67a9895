"""A PostgreSQL restart behind the fleet's shipped PgBouncer settings.

PostgreSQL stopped and started again (an upgrade, a failover) with PgBouncer in front
as deploy/kubernetes/fleet/pgbouncer.ini configures it: the store's calls made during
and after the restart succeed (they may wait), none fails, and none waits its whole
call bound (PgBouncer's default settings held calls 15 s). Skipped where pgbouncer is
not installed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from pg_bouncer import Bouncer, find_pgbouncer, shipped_timings
from pg_server import PostgresServer, start_server

from gpuwatchd.daemon.host_identity import RELEASE_WAIT_S
from gpuwatchd.daemon.store_link import StoreLink
from gpuwatchd.store import StoreError
from gpuwatchd.store.deadline import CALL_TIMEOUT_S
from gpuwatchd.store.postgres import postgres_store

#: How long PostgreSQL stays down.
DOWN_S = 1.0
DAEMONSET = Path(__file__).resolve().parents[1] / "deploy/kubernetes/base/daemonset.yaml"


@pytest.fixture(scope="module")
def restarted_server() -> Iterator[PostgresServer]:
    """A server of this module's own: its tests stop and start it."""
    server = start_server()
    yield server
    server.stop()


@pytest.fixture
def bouncer(restarted_server: PostgresServer) -> Iterator[Bouncer]:
    binary = find_pgbouncer()
    if binary is None:
        pytest.skip("Debian's pgbouncer is not installed (apt-get install pgbouncer)")
    b = Bouncer(restarted_server, restarted_server.new_database(), pool_size=2,
                settings=shipped_timings())  # fmt: skip
    b.start(binary)
    yield b
    b.stop()


def test_the_shipped_settings_make_a_one_second_restart_invisible_to_the_store(
    bouncer: Bouncer, restarted_server: PostgresServer
) -> None:
    assert shipped_timings()["server_login_retry"] == "1"
    store = postgres_store(bouncer.url(), call_timeout_s=30.0)
    store.claims()  # the store's pooled connection, and a server connection behind it
    calls: list[tuple[float, str | None]] = []
    stop = threading.Event()

    def call_all_the_time() -> None:
        while not stop.wait(0.05):
            began = time.monotonic()
            try:
                store.claim("gemm", "node-a", "GPU-a", 60.0)
                failed = None
            except StoreError as e:
                failed = str(e)
            calls.append((time.monotonic() - began, failed))

    caller = threading.Thread(target=call_all_the_time, name="caller")
    caller.start()
    try:
        time.sleep(0.5)
        halted = time.monotonic()
        restarted_server.halt()
        time.sleep(DOWN_S)
        restarted_server.resume()
        down_s = time.monotonic() - halted  # stopping, down, starting again
        time.sleep(3.0)
    finally:
        stop.set()
        caller.join(60)
        store.close()
    failures = [why for _, why in calls if why is not None]
    assert failures == [], failures
    # A call waits about as long as PostgreSQL was away, not PgBouncer's default 15 s
    # login retry on top (nor the daemon's 30 s call bound).
    assert len(calls) > 10 and max(took for took, _ in calls) < down_s + 5.0


def test_a_wrong_password_is_tried_again_ever_less_often(
    restarted_server: PostgresServer, tmp_path: Path
) -> None:
    """1,000 daemons with a wrong password must not fail a login each per second each."""
    wrong = tmp_path / "pw"
    wrong.write_text("not-the-password\n")
    url = restarted_server.tcp_url(restarted_server.new_database())
    store = postgres_store(url, password_file=wrong, connect_now=False)
    link = StoreLink(store)
    try:
        waits = []
        for _ in range(5):
            link()  # one look: a login that fails
            waits.append(link._wait_s)
        assert not store.up
        assert waits == sorted(waits) and waits[-1] >= 8.0  # 1, 2, 4, 8, 16 s, jittered
    finally:
        store.close()


def test_the_daemonsets_grace_period_covers_the_daemons_worst_stop() -> None:
    """Kubernetes kills a pod whose stop outlasts it: the session's thread (2 s), the
    poller (2 s), the host name given back (bounded) and a store call in flight, cut at
    its bound, must all fit."""
    daemonset = yaml.safe_load(DAEMONSET.read_text(encoding="utf-8"))
    grace = daemonset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    worst_stop_s = 2.0 + 2.0 + RELEASE_WAIT_S + CALL_TIMEOUT_S
    assert grace > worst_stop_s
