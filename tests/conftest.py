"""Fixtures shared by the test files; the builders they use are in ``builders.py``."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
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
# A simulated daemon's throwaway directory ($XDG_RUNTIME_DIR/gpuwatchd-sim) is this run's
# too: `report` falls back to a simulated store, and the user's own must not answer.
(_RUN_DIR / "xdg").mkdir(mode=0o700)
os.environ["XDG_RUNTIME_DIR"] = str(_RUN_DIR / "xdg")
os.environ.setdefault("CACHE_DIRECTORY", str(_RUN_DIR / "cache"))
# A suite run as root starts its daemons as root (`gpuwatchd run` would otherwise become
# [daemon] user); tests of that drop clear this.
os.environ.setdefault("GPUWATCHD_ALLOW_ROOT", "1")


#: Threads a test must stop before it ends even though they are daemon threads: a poller
#: left running logs into the next test's captured (then closed) output.
MUST_STOP = ("gpuwatchd-poll", "gpuwatchd-slow")
#: How long a test's threads may take to finish after it (a loaded machine is slow).
THREAD_GRACE_S = 10.0


def _outliving(before: set[threading.Thread]) -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t not in before and t.is_alive() and (not t.daemon or t.name.startswith(MUST_STOP))
    ]


@pytest.fixture(autouse=True)
def no_thread_outlives_its_test() -> Iterator[None]:
    """Fail a test that leaves a non-daemon thread or a poller thread running (given
    THREAD_GRACE_S to finish): each test stops what it started."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + THREAD_GRACE_S
    for t in _outliving(before):
        t.join(max(0.0, deadline - time.monotonic()))
    left = _outliving(before)
    if left:
        pytest.fail(f"threads outlived the test: {', '.join(sorted(t.name for t in left))}")


@pytest.fixture(autouse=True)
def root_logging_as_it_was() -> Iterator[None]:
    """Undo a command run in-process (``main(["run", ...])`` calls ``logging.basicConfig``):
    its handler writes to the test's captured stderr, which is closed once the test ends,
    so every later record would print "--- Logging error --- ... I/O operation on closed
    file" with a traceback."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in before and type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)


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
