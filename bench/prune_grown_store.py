"""``gpuwatchd store prune`` on a grown fleet store: 100k sessions of 1,000 hosts.

Seeds a real PostgreSQL (fsync on) with ``--sessions`` sessions over ``--days`` days on
``--hosts`` hosts × 8 GPUs, two results of two candidates each per session, each host's
own winners (its newest result per key: hosts × 20 rows) and the fleet's, then times
``gpuwatchd store prune`` (the CLI, in this process) keeping ``--keep-days``: total
seconds, batches, the slowest batch. It then times one batch with the index migration 7
added on ``host_winners(result_id)`` dropped again (what every store had before), to
show what the index is for.

Run: ``python3 bench/prune_grown_store.py [--sessions 100000] [--hosts 1000]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from durable_pg import start_durable_server  # noqa: E402

from gpuwatchd.cli.main import main as cli  # noqa: E402
from gpuwatchd.store.postgres import postgres_store  # noqa: E402
from gpuwatchd.store.retention import PRUNE_CLAIM  # noqa: E402

DAY = 86400.0
GPUS = 8
WORKLOADS = 10


def seed(url: str, sessions: int, hosts: int, days: float, now: float) -> dict[str, int]:
    """The grown store, written by SQL (a real fleet took months)."""
    import psycopg

    postgres_store(url).close()  # the schema, migrated
    gpus = hosts * GPUS
    span = days * DAY
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(
            """INSERT INTO sessions (gpu_uuid, gpu_index, gpu_model, host, backend,
                   versions_json, workloads_json, regimes_json, started_at, ended_at,
                   status, extra_json)
               SELECT 'GPU-' || (i %% %(gpus)s), (i %% %(gpus)s) %% 8, 'NVIDIA H200',
                   'node-' || ((i %% %(gpus)s) / 8), 'nvml', '{"driver":"580"}',
                   '[]', '["unthrottled","sustained"]',
                   %(t0)s + i * %(step)s, %(t0)s + i * %(step)s + 600,
                   CASE WHEN i %% 10 < 8 THEN 'completed' WHEN i %% 10 = 8 THEN 'failed'
                        ELSE 'preempted' END, '{}'
               FROM generate_series(1, %(n)s) AS i""",
            {"gpus": gpus, "t0": now - span, "step": span / sessions, "n": sessions},
        )
        c.execute(
            f"""INSERT INTO results (session_id, workload, regime, winner, tie, margin,
                    noise, recorded_at)
                SELECT s.id, 'wl-' || ((s.id / 3) % {WORKLOADS}), r.regime, 'a', 0, 0.1, 0.01,
                    s.started_at + 300
                FROM sessions s CROSS JOIN (VALUES ('unthrottled'), ('sustained')) AS r(regime)"""
        )
        c.execute(
            """INSERT INTO candidate_stats (result_id, candidate, family, median_s, spread,
                   samples, rejected, reasons, meta_json)
               SELECT r.id, c.name, 'fam', c.t, 0.01, 7, 0, 0, '{}'
               FROM results r CROSS JOIN (VALUES ('a', 1e-3), ('b', 2e-3)) AS c(name, t)"""
        )
        cols = """gpu_model, versions_key, workload, regime, candidate, family, median_s,
            tie, session_id, result_id, gpu_uuid, measured_at"""
        pick = """SELECT DISTINCT ON ({key}) s.host, s.gpu_model, s.versions_json, r.workload,
                r.regime, 'a', 'fam', 1e-3, 0, s.id, r.id, s.gpu_uuid, r.recorded_at
            FROM results r JOIN sessions s ON s.id = r.session_id
            WHERE s.status = 'completed'
            ORDER BY {key}, r.recorded_at DESC"""
        c.execute(
            f"INSERT INTO host_winners (host, {cols}) "
            + pick.format(key="s.host, r.workload, r.regime")
        )
        c.execute(
            f"INSERT INTO winners ({cols}) SELECT {cols} FROM ("
            + pick.format(key="r.workload, r.regime")
            + ") AS fleet (host, gpu_model, versions_key, workload, regime, candidate, family,"
            " median_s, tie, session_id, result_id, gpu_uuid, measured_at)"
        )
        c.execute("ANALYZE")
        return {
            t: int(c.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0])  # type: ignore[index]
            for t in ("sessions", "results", "candidate_stats", "host_winners", "winners")
        }


def explain_batch(url: str, keep_s: float, now: float) -> dict[str, object]:
    """EXPLAIN ANALYZE of one batch, rolled back: the select of what may go (its plan's
    top node and time) and the DELETE's foreign-key triggers (each one's time), so a
    check that scans a table instead of an index shows."""
    import psycopg

    from gpuwatchd.store.postgres import translate
    from gpuwatchd.store.prune_sql import _DELETABLE

    out: dict[str, object] = {}
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("BEGIN")
        try:
            sql = translate(_DELETABLE)
            plan = c.execute(
                f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", (now - keep_s, 1000)
            ).fetchone()[0][0]  # type: ignore[index]
            out["select_ms"] = plan["Execution Time"]
            ids = [r[0] for r in c.execute(sql, (now - keep_s, 1000)).fetchall()]
            plan = c.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) DELETE FROM sessions WHERE id = ANY(%s)", (ids,)
            ).fetchone()[0][0]  # type: ignore[index]
            out["delete_sessions"] = len(ids)
            out["delete_ms"] = plan["Execution Time"]
            out["triggers_ms"] = {
                f"{t['Trigger Name']} on {t['Relation']}": round(t["Time"], 1)
                for t in plan.get("Triggers", [])
            }
        finally:
            c.execute("ROLLBACK")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=100_000)
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--days", type=float, default=120.0)
    ap.add_argument("--keep-days", type=float, default=30.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    server = start_durable_server()
    try:
        db = server.new_database()
        url = server.url(db)
        now = time.time()
        t = time.perf_counter()
        sizes = seed(url, args.sessions, args.hosts, args.days, now)
        seed_s = time.perf_counter() - t
        print(f"seeded in {seed_s:.0f} s: {sizes}", flush=True)
        explained = explain_batch(url, args.keep_days * DAY, now)
        print(f"one batch explained: {json.dumps(explained)}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "config.toml"
            config.write_text(
                f'[daemon]\nstate_dir = "{tmp}"\n[store]\nurl = "{url}"\n'
                f"keep_sessions_s = {args.keep_days * DAY}\n"
            )
            t = time.perf_counter()
            rc = cli(["store", "prune", "--config", str(config), "--wait", "0"])
            prune_s = time.perf_counter() - t
        left = server.sql(db, "SELECT COUNT(*) FROM sessions")[0][0]
        print(f"store prune: exit {rc} in {prune_s:.1f} s; {left} sessions left", flush=True)
        # One batch more without the index every store lacked before migration 7.
        server.sql(db, "DROP INDEX host_winners_by_result")
        store = postgres_store(url)
        try:
            server.sql(
                db, "UPDATE sessions SET ended_at = ended_at - %s WHERE status <> 'running'",
                (365 * DAY,),
            )  # fmt: skip
            explained_unindexed = explain_batch(url, args.keep_days * DAY, now)
            print(f"... without the index: {json.dumps(explained_unindexed)}", flush=True)
            assert store.claim(PRUNE_CLAIM, "bench", "bench", 600)
            t = time.perf_counter()
            n = store.prune_batch(args.keep_days * DAY, 200)
            unindexed_s = time.perf_counter() - t
        finally:
            store.close()
        print(f"without host_winners(result_id): {n} sessions in {unindexed_s:.1f} s", flush=True)
        out = {
            "sessions": args.sessions,
            "hosts": args.hosts,
            "sizes": sizes,
            "seed_s": seed_s,
            "prune_exit": rc,
            "prune_s": prune_s,
            "sessions_left": left,
            "unindexed_batch": {"sessions": n, "s": unindexed_s},
            "one_batch_explained": explained,
            "one_batch_explained_without_the_index": explained_unindexed,
        }
        if args.out is not None:
            args.out.write_text(json.dumps(out, indent=1) + "\n")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
