"""Debian's PgBouncer in transaction mode in front of a test server's database.

The fleet's daemons reach PostgreSQL through it (docs/fleet.md): the next transaction of
a client may run on another server connection, so the store must keep no state on one.
Run as the test server's user (PgBouncer refuses root); ``admin`` reads its console.
"""

from __future__ import annotations

import configparser
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from pg_server import RUN_AS, PostgresServer

#: Where Debian's package puts it.
BINARY = "/usr/sbin/pgbouncer"
#: The fleet's shipped configuration, whose timings the tests run under.
SHIPPED_INI = Path(__file__).resolve().parents[1] / "deploy/kubernetes/fleet/pgbouncer.ini"
#: The shipped settings that decide how an outage of PostgreSQL looks to its clients.
TIMINGS = ("server_login_retry", "server_connect_timeout", "query_wait_timeout")


def shipped_timings() -> dict[str, str]:
    """:data:`TIMINGS` as the shipped pgbouncer.ini sets them."""
    parser = configparser.ConfigParser(inline_comment_prefixes=None)
    parser.read(SHIPPED_INI, encoding="utf-8")
    return {key: parser["pgbouncer"][key] for key in TIMINGS if key in parser["pgbouncer"]}


def find_pgbouncer() -> str | None:
    return shutil.which("pgbouncer") or (BINARY if Path(BINARY).exists() else None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Bouncer:
    """``pgbouncer`` for ``server``'s database ``db``: ``pool_size`` server connections
    (and ``reserve`` more when clients wait over a second), clients trusted on 127.0.0.1."""

    def __init__(
        self,
        server: PostgresServer,
        db: str,
        *,
        pool_size: int,
        reserve: int = 0,
        settings: dict[str, str] | None = None,
    ):
        self.server, self.db, self.pool_size, self.reserve = server, db, pool_size, reserve
        self.settings = settings or {}
        self.root = Path(tempfile.mkdtemp(prefix="gpuwatchd-pgbouncer-"))
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, binary: str) -> None:
        (self.root / "userlist.txt").write_text('"postgres" ""\n', encoding="utf-8")
        (self.root / "pgbouncer.ini").write_text(
            f"""[databases]
{self.db} = host={self.server.root} port={self.server.port} dbname={self.db} user=postgres

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir = {self.root}
auth_type = trust
auth_file = {self.root}/userlist.txt
admin_users = postgres
pool_mode = transaction
max_client_conn = 5000
default_pool_size = {self.pool_size}
reserve_pool_size = {self.reserve}
reserve_pool_timeout = 1
logfile = {self.root}/pgbouncer.log
pidfile = {self.root}/pgbouncer.pid
"""
            + "".join(f"{key} = {value}\n" for key, value in self.settings.items()),
            encoding="utf-8",
        )
        prefix: list[str] = []
        if os.geteuid() == 0:  # PgBouncer refuses root: the server's user runs it
            for path in (self.root, *self.root.iterdir()):
                shutil.chown(path, RUN_AS, RUN_AS)
            prefix = ["runuser", "-u", RUN_AS, "--"]
        # one descriptor per client: a 1,000-host bench needs more than the usual 1,024
        script = 'ulimit -n 12000 2>/dev/null; exec "$0" "$1"'
        self.proc = subprocess.Popen(
            [*prefix, "sh", "-c", script, binary, str(self.root / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                self.admin("SHOW VERSION")
                return
            except OSError as e:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"pgbouncer did not start: {self.log_tail()}") from e
                time.sleep(0.1)

    def log_tail(self) -> str:
        try:
            return (self.root / "pgbouncer.log").read_text(errors="replace")[-800:]
        except OSError:
            return "(no log)"

    def url(self) -> str:
        """The store's URL through PgBouncer."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.db}?sslmode=disable"

    def admin(self, command: str) -> list[dict[str, Any]]:
        """A command on PgBouncer's admin console; rows as dicts (OSError when down)."""
        import psycopg

        try:
            with psycopg.connect(
                f"postgresql://postgres@127.0.0.1:{self.port}/pgbouncer?sslmode=disable",
                autocommit=True,
                connect_timeout=2,
            ) as conn:
                cur = conn.cursor()
                cur.execute(command)
                names = [c.name for c in cur.description or ()]
                return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        except psycopg.OperationalError as e:
            raise OSError(str(e)) from e

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        shutil.rmtree(self.root, ignore_errors=True)
