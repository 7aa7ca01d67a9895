"""tests/pg_server.py's throwaway PostgreSQL, but durable: fsync and full-page writes on.

The tests' server turns both off on its command line (which no ``ALTER SYSTEM`` can
override), to spare the machine's disk; a bench that counts what a fleet costs the
database must pay for every commit's flush as a production server does.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from pg_server import PostgresServer, find_bindir


class DurableServer(PostgresServer):
    """A server whose commits reach the disk (``fsync = on``, ``full_page_writes = on``)."""

    def resume(self) -> None:
        opts = (
            f"-k {self.root} -p {self.port} -c listen_addresses=127.0.0.1"
            " -c fsync=on -c full_page_writes=on -c synchronous_commit=on"
            " -c max_connections=200"
        )
        self._run(
            str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"),
            "-o", opts, "-w", "-t", "180", "start",
        )  # fmt: skip


def start_durable_server() -> DurableServer:
    """A started durable server; SystemExit naming what is missing otherwise."""
    bindir = find_bindir()
    if bindir is None:
        raise SystemExit("no PostgreSQL: no initdb under /usr/lib/postgresql/*/bin")
    server = DurableServer(bindir)
    server.start()
    fsync = server.sql("postgres", "SHOW fsync")[0][0]
    if fsync != "on":
        raise SystemExit(f"the bench's server runs with fsync = {fsync}")
    return server
