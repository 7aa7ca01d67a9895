"""A throwaway PostgreSQL server for the store's tests: initdb in a temporary directory.

Runs as a non-root user (``postgres`` servers refuse root; CI runs as root, so a user
is created with ``useradd`` when missing). Local connections trust; TCP on 127.0.0.1
needs a password (scram), so ``password_file`` and ``PGPASSWORD`` are tested for real.
Missing binaries fail the tests that need the server, unless
``GPUWATCHD_TEST_NO_POSTGRES=1`` says this machine has none on purpose.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

SKIP_ENV = "GPUWATCHD_TEST_NO_POSTGRES"
RUN_AS = "gpuwatchd-pgtest"
#: The role with a password, for the TCP (scram) tests.
PASSWORD_ROLE = "fleet"
PASSWORD = "s3cret-Fleet-pw"


def find_bindir() -> Path | None:
    """Debian's newest ``/usr/lib/postgresql/<ver>/bin``, or ``pg_ctl`` on PATH."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4])
    )
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path else None


def unavailable(why: str) -> None:
    """Skip when the developer said so; otherwise fail (CI must not silently skip)."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"PostgreSQL tests skipped ({SKIP_ENV}=1): {why}")
    pytest.fail(
        f"PostgreSQL is needed for these tests: {why}; run scripts/install-test-deps.sh"
        f" or set {SKIP_ENV}=1 on a machine without it",
        pytrace=False,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """initdb + pg_ctl start; ``url(db)`` connects over the Unix socket as the superuser."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="gpuwatchd-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self._prefix: list[str] = []
        self._dbs = itertools.count(1)
        if os.geteuid() == 0:
            try:
                pwd.getpwnam(RUN_AS)
            except KeyError:
                subprocess.run(["useradd", "--system", "--no-create-home", RUN_AS], check=True)
            shutil.chown(self.root, RUN_AS, RUN_AS)
            self._prefix = ["runuser", "-u", RUN_AS, "--"]

    def _run(self, *args: str) -> None:
        res = subprocess.run(
            [*self._prefix, *args], capture_output=True, text=True, timeout=240, cwd=self.root
        )
        if res.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {res.stdout}{res.stderr}")

    def start(self) -> None:
        self._run(
            str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres",
            "--auth-local=trust", "--auth-host=scram-sha-256", "--no-sync", "-E", "UTF8",
        )  # fmt: skip
        self.resume()
        self.sql("postgres", f"CREATE ROLE {PASSWORD_ROLE} LOGIN PASSWORD '{PASSWORD}'")

    def resume(self) -> None:
        """Start the server on its existing data (after :meth:`halt`), same port."""
        opts = (
            f"-k {self.root} -p {self.port} -c listen_addresses=127.0.0.1"
            " -c fsync=off -c full_page_writes=off -c max_connections=200"
        )
        self._run(
            str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"),
            "-o", opts, "-w", "-t", "180", "start",
        )  # fmt: skip

    def halt(self) -> None:
        """Stop the server, its data kept (an outage): clients' connections are cut."""
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def stop(self) -> None:
        try:
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def url(self, db: str = "postgres") -> str:
        return f"postgresql:///{db}?host={self.root}&port={self.port}&user=postgres"

    def tcp_url(self, db: str, user: str = PASSWORD_ROLE) -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{db}?sslmode=disable"

    def sql(
        self, db: str, statement: str, args: tuple[object, ...] = ()
    ) -> list[tuple[object, ...]]:
        """Run one statement as the superuser, outside the store; returns its rows."""
        import psycopg

        with psycopg.connect(self.url(db), autocommit=True) as conn:
            cur = conn.execute(statement, args)
            return list(cur.fetchall()) if cur.description else []

    def new_database(self) -> str:
        """A fresh, empty database owned by the password role; returns its name."""
        name = f"store_{os.getpid()}_{next(self._dbs)}"
        self.sql("postgres", f"CREATE DATABASE {name} OWNER {PASSWORD_ROLE}")
        return name


def start_server() -> PostgresServer:
    bindir = find_bindir()
    if bindir is None:
        unavailable("no initdb under /usr/lib/postgresql/*/bin nor pg_ctl on PATH")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        unavailable("psycopg is not installed (pip install -e '.[postgres]')")
    assert bindir is not None
    server = PostgresServer(bindir)
    try:
        server.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        shutil.rmtree(server.root, ignore_errors=True)
        unavailable(f"the server did not start: {e}")
    return server
