"""Fixtures shared by the test files; the builders they use are in ``builders.py``."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import DAEMON_INFO
from pg_server import PostgresServer, start_server

from gpuwatchd.exporter import build_registry
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.serve import HttpServer
from gpuwatchd.sessions import readiness
from gpuwatchd.store import SqlStore, sqlite_store

# Daemons and commands the tests start keep their default state and control socket in a
# folder of this run (systemd's variables, which the defaults honour), never in the
# host's /var/lib/gpuwatchd or /run/gpuwatchd: a store left there by another version
# would otherwise decide whether a test's daemon starts.
_RUN_DIR = Path(tempfile.mkdtemp(prefix="gpuwatchd-tests-"))
os.environ.setdefault("STATE_DIRECTORY", str(_RUN_DIR / "state"))
os.environ.setdefault("RUNTIME_DIRECTORY", str(_RUN_DIR / "run"))
os.environ.setdefault("CACHE_DIRECTORY", str(_RUN_DIR / "cache"))
# A suite run as root starts its daemons as root (`gpuwatchd run` would otherwise become
# [daemon] user); tests of that drop clear this.
os.environ.setdefault("GPUWATCHD_ALLOW_ROOT", "1")


@pytest.fixture
def server(board: StateBoard) -> Iterator[HttpServer]:
    """The exporter's HTTP server on a free port, serving the test module's ``board``."""
    with HttpServer(board, build_registry(board, DAEMON_INFO), ("127.0.0.1", 0)) as srv:
        yield srv


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    """An empty tuning store in the test's directory, on the real clock."""
    with sqlite_store(tmp_path / "tune.db") as s:
        yield s


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One throwaway PostgreSQL server for the whole run (see ``pg_server.py``)."""
    server = start_server()
    yield server
    server.stop()


@pytest.fixture
def worker_has_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """check-config's worker probe answers "all importable" at once, for tests about
    parsing that run it many times (a real probe imports torch each time)."""
    monkeypatch.setattr(
        readiness,
        "probe",
        lambda python, modules=(), **_: readiness.ProbeResult(python, tuple(modules)),
    )
