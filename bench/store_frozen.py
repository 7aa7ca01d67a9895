"""How long a store call waits on a frozen PostgreSQL before it fails (the long form of
tests/test_faults_store_bounds.py).

Starts the tests' throwaway server, and for each bound opens a store, stops the
postmaster and the backend serving the pooled connection (SIGSTOP), then times two
calls: one on the pooled connection and one that must connect anew. Both must fail with
StoreError within the bound (a connect within ``connect_timeout``, at least libpq's 2 s);
after SIGCONT the next call must answer. A call still blocked after ``--give-up`` seconds
is reported as such (that is the failure this measures).

    python bench/store_frozen.py --bounds 2 5 30
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from pg_server import start_server  # noqa: E402

from gpuwatchd.store import StoreError, open_store  # noqa: E402


def timed(call: Callable[[], object], give_up_s: float) -> tuple[float, str]:
    """Seconds ``call`` took and how it ended ("answered", the error, or "still blocked")."""
    outcome: list[str] = []

    def run() -> None:
        try:
            call()
            outcome.append("answered")
        except StoreError as exc:
            outcome.append(str(exc).rsplit(": ", 1)[-1])

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(give_up_s)
    return time.monotonic() - started, outcome[0] if outcome else "still blocked"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bounds", type=float, nargs="+", default=[2.0, 5.0, 30.0])
    ap.add_argument("--give-up", type=float, default=90.0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    server = start_server()
    failures = 0
    try:
        postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
        print("bound s | pooled call s | new connection s | after SIGCONT s")
        for bound in args.bounds:
            store = open_store(server.url(server.new_database()), call_timeout_s=bound)
            with store._tx.read("find the backend") as conn:
                backend = int(conn.execute("SELECT pg_backend_pid() AS pid").fetchone()["pid"])
            pids = (postmaster, backend)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                pooled = timed(store.sessions, args.give_up)
                fresh = timed(store.sessions, args.give_up)
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            after = timed(store.sessions, args.give_up)
            store.close()
            print(f"{bound:7g} | {pooled[0]:13.2f} | {fresh[0]:16.2f} | {after[0]:.3f}")
            for what, (_, outcome) in (("pooled", pooled), ("new", fresh)):
                if outcome in ("answered", "still blocked"):
                    failures += 1
                    print(f"  {what} call: {outcome}")
            if after[1] != "answered":
                failures += 1
                print(f"  after SIGCONT: {after[1]}")
    finally:
        server.stop()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
