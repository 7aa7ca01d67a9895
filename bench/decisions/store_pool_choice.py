"""The store's own connection pool against psycopg_pool: import time, memory, threads,
and whether the next call works after a PostgreSQL restart.

Starts a throwaway server (tests/pg_server.py), opens the store (one pooled connection)
and a psycopg_pool ``ConnectionPool`` (min_size 1, ``check_connection`` on every
checkout), restarts the server with ``pg_ctl restart -m fast`` and makes one call on
each. Needs ``pip install psycopg-pool`` (it is not a dependency of gpuwatchd).

    python bench/decisions/store_pool_choice.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from pg_server import start_server  # noqa: E402


def rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1])
    return 0


def import_s(modules: str) -> float:
    """The best of five fresh interpreters importing ``modules``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {modules}"], check=True, env=env)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    import psycopg_pool

    from gpuwatchd.store.postgres import postgres_store

    print(f"import psycopg: {import_s('psycopg'):.3f} s;"
          f" psycopg + psycopg_pool: {import_s('psycopg, psycopg_pool'):.3f} s")  # fmt: skip
    server = start_server()
    try:
        url = server.url(server.new_database())
        rss, threads = rss_kb(), threading.active_count()
        store = postgres_store(url)
        store.schema_version()
        print(f"store: +{rss_kb() - rss} kB RSS, +{threading.active_count() - threads} threads")
        rss, threads = rss_kb(), threading.active_count()
        pool = psycopg_pool.ConnectionPool(
            url,
            min_size=1,
            max_size=4,
            kwargs={"autocommit": True},
            check=psycopg_pool.ConnectionPool.check_connection,
        )
        pool.wait()
        with pool.connection() as conn:
            conn.execute("SELECT 1")
        print(
            f"psycopg_pool: +{rss_kb() - rss} kB RSS, +{threading.active_count() - threads} threads"
        )
        opts = f"-k {server.root} -p {server.port} -c listen_addresses=127.0.0.1"
        subprocess.run(
            [*server._prefix, str(server.bindir / "pg_ctl"), "-D", str(server.data), "-m",
             "fast", "-w", "restart", "-l", str(server.root / "log2"), "-o", opts],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=server.root,
        )  # fmt: skip
        for name, call in (
            ("store", store.schema_version),
            ("psycopg_pool", lambda: pool.connection().__enter__().execute("SELECT 1")),
        ):
            try:
                call()
                print(f"{name}: the first call after the restart works")
            except Exception as e:
                print(f"{name}: the first call after the restart fails: {' '.join(str(e).split())}")
        pool.close()
        store.close()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
