"""The shared store through Debian's PgBouncer in transaction mode, as a fleet reaches it.

Two hosts share ONE server connection (``default_pool_size = 1``): every transaction of
either may run on it, so anything the store left on a server connection (a prepared
statement, a session setting) would show here. Skipped where pgbouncer is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from builders import STACK, SettableClock, candidate, session_meta
from pg_bouncer import Bouncer, find_pgbouncer
from pg_server import PostgresServer

from gpuwatchd.daemon.fleet_sync import in_one_transaction
from gpuwatchd.store import HostClock
from gpuwatchd.store.postgres import postgres_store
from gpuwatchd.tuning.types import Regime, RegimeResult, SessionStatus

H200 = "NVIDIA H200"
U = Regime.UNTHROTTLED


@pytest.fixture
def bouncer(postgres_server: PostgresServer) -> Iterator[Bouncer]:
    binary = find_pgbouncer()
    if binary is None:
        pytest.skip("Debian's pgbouncer is not installed (apt-get install pgbouncer)")
    b = Bouncer(postgres_server, postgres_server.new_database(), pool_size=1)
    b.start(binary)
    yield b
    b.stop()


def gemm_result() -> RegimeResult:
    cands = (candidate("triton[128x256]", U, 1.0e-3), candidate("cublas", U, 1.2e-3))
    return RegimeResult("gemm", U, cands, "triton[128x256]", False, 0.2, 0.001)


def test_two_hosts_claim_measure_and_sync_through_one_pooled_server_connection(
    bouncer: Bouncer,
) -> None:
    clock = SettableClock(1_800_000_000.0)
    a = postgres_store(bouncer.url(), now=clock)
    b = postgres_store(bouncer.url(), now=clock)
    try:
        key = f"{H200}|{STACK.key()}|gemm"
        assert a.claim(key, "node-a", "GPU-a", 60) is True
        assert b.claim(key, "node-b", "GPU-b", 60) is False  # node-a holds it
        meta = session_meta(host="node-a", gpu_uuid="GPU-a", regimes=(U,))
        sid = a.start_session(meta)
        a.record_result(sid, gemm_result())
        a.finish_session(sid, SessionStatus.COMPLETED)
        a.release(key, "node-a", "GPU-a")
        for _ in range(8):  # psycopg would prepare it after 5 runs: none may be
            winners = b.fleet_winners(H200, 3600)
        assert [(w.workload, w.candidate, w.host) for w in winners] == [
            ("gemm", "triton[128x256]", "node-a")
        ]
        assert b.claim(key, "node-b", "GPU-b", 60) is True  # given back
        clocks = [HostClock(h, f"GPU-{h}", H200, 700.0, 1.44e9, clock.t) for h in ("a", "b")]
        in_one_transaction(b, [lambda: b.report_host_clock(clocks[0]),
                               lambda: b.report_host_clock(clocks[1])])  # fmt: skip
        assert [m.peers for m in a.clock_medians(60)] == [2]
        for store in (a, b):
            with store._tx.transaction(False, "read the settings") as conn:
                row = conn.execute(
                    "SELECT current_setting('idle_in_transaction_session_timeout') AS idle,"
                    " current_setting('lock_timeout') AS lock"
                ).fetchone()
            assert (row["idle"], row["lock"]) == ("1min", "10s")  # set in each transaction
    finally:
        a.close()
        b.close()
    (pool,) = [p for p in bouncer.admin("SHOW POOLS") if p["database"] == bouncer.db]
    assert int(pool["sv_active"]) + int(pool["sv_idle"]) + int(pool["sv_used"]) <= 1
    servers = bouncer.server.sql(
        bouncer.db,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
        " AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
        (bouncer.db,),
    )
    assert servers in ([(0,)], [(1,)])
