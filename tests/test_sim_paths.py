"""A simulated daemon stays out of the system's paths, and every reader finds stores by one rule.

The README's first command runs ``gpuwatchd run --backend sim`` as whoever types it, root
included: its store and control socket go to a private throwaway directory
(``$XDG_RUNTIME_DIR/gpuwatchd-sim``), never /var/lib/gpuwatchd or /run/gpuwatchd, whose
store the job client would serve to every user. ``gpuwatchd report`` and the job client
look for a store in the same places, and say where they looked when there is none.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from builders import closed_url, free_port, wait_until
from daemon_helpers import http_get

from gpuwatchd.daemon.privileges import install_paths, unreadable
from gpuwatchd.store import StoreError
from gpuwatchd.store.location import make_private_dir

SYSTEM_PATHS = (Path("/var/lib/gpuwatchd"), Path("/run/gpuwatchd"))


def _snapshot(path: Path) -> object:
    """What a path holds: None when absent, else every entry below it with its mtime."""
    if not path.exists():
        return None
    return sorted((str(p), p.lstat().st_mtime_ns) for p in [path, *path.rglob("*")])


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCHD_")}
    for name in ("STATE_DIRECTORY", "RUNTIME_DIRECTORY"):
        env.pop(name, None)
    (tmp_path / "xdg").mkdir(mode=0o700)
    env.update(
        XDG_RUNTIME_DIR=str(tmp_path / "xdg"),
        XDG_STATE_HOME=str(tmp_path / "state"),
        HOME=str(tmp_path / "home"),
        PYTHONUNBUFFERED="1",
    )
    return env


def _gpuwatchd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="the system paths are root's defaults")
def test_the_sim_demo_as_root_leaves_the_system_store_and_run_dir_untouched(
    tmp_path: Path,
) -> None:
    before = {p: _snapshot(p) for p in SYSTEM_PATHS}
    env = _env(tmp_path)
    port = free_port()
    # As root the demo gives root up: it runs as [daemon] user, else nobody, in that
    # user's private directory under the temporary folder (root's XDG folder is not its).
    # Where that user cannot use the install (a venv in root's 0700 home), the demo keeps
    # root instead, in root's private folder: only root reaches its socket and spool.
    demo_user = _demo_user()
    if unreadable(demo_user, install_paths()) is None:
        runs_as = demo_user.pw_uid
        sim_dir = Path(tempfile.gettempdir()) / f"gpuwatchd-sim-{runs_as}"
    else:
        runs_as, sim_dir = 0, tmp_path / "xdg" / "gpuwatchd-sim"
    shutil.rmtree(sim_dir, ignore_errors=True)
    args = ["--scenario", "power-cap", "--speed", "10", "--listen", f"127.0.0.1:{port}"]
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--backend", "sim", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(
            lambda: ((sim_dir / "control.sock").exists() and _serves(port)) or daemon.poll(),
            timeout=60,
            what="the simulated daemon to serve",
        )
        assert daemon.poll() is None, daemon.stdout.read() if daemon.stdout else ""
        assert _uids(daemon.pid) == {runs_as}
        retune = _gpuwatchd(env, "retune", "--pending")  # finds the simulated daemon's socket
        assert retune.returncode == 0, retune.stderr
    finally:
        daemon.send_signal(signal.SIGTERM)
        out, _ = daemon.communicate(timeout=60)
    try:
        assert daemon.returncode == 0, out
        assert (sim_dir / "gpuwatchd.db").is_file()
        assert os.stat(sim_dir).st_mode & 0o777 == 0o700
        assert {p: _snapshot(p) for p in SYSTEM_PATHS} == before
    finally:  # root's `report` would read this demo's store
        shutil.rmtree(sim_dir, ignore_errors=True)


def _demo_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("gpuwatchd")
    except KeyError:
        return pwd.getpwnam("nobody")


def _uids(pid: int) -> set[int]:
    """The real, effective, saved and filesystem uids of a running process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return {int(u) for u in line.split()[1:]}
    raise AssertionError(f"no Uid line for {pid}")


def _serves(port: int) -> bool:
    try:
        return "gpuwatchd_build_info" in http_get(f"http://127.0.0.1:{port}/metrics")
    except OSError:
        return False


def test_report_reads_the_simulated_store_when_no_daemon_store_exists(tmp_path: Path) -> None:
    env = _env(tmp_path)
    tune = _gpuwatchd(
        env, "tune", "--backend", "sim", "--scenario", "power-cap", "--workload", "sim-gemm"
    )
    assert tune.returncode == 0, tune.stderr
    assert (tmp_path / "xdg" / "gpuwatchd-sim" / "gpuwatchd.db").is_file()
    report = _gpuwatchd(env, "report")
    if Path("/var/lib/gpuwatchd/gpuwatchd.db").is_file():  # a real daemon's wins: fine too
        return
    assert report.returncode == 0, report.stderr
    assert "sim-gemm" in report.stdout and "simulated GPU's store" in report.stderr


def test_report_and_the_client_name_the_same_places_and_the_daemons_api(
    tmp_path: Path,
) -> None:
    env = _env(tmp_path)
    url = closed_url()
    env["GPUWATCHD_URL"] = url
    if Path("/var/lib/gpuwatchd/gpuwatchd.db").is_file():
        pytest.skip("this host has a system store: there is always one to read")
    report = _gpuwatchd(env, "report")
    assert report.returncode == 1
    [line] = report.stderr.splitlines()
    own = tmp_path / "state" if os.geteuid() else Path("/var/lib/gpuwatchd")
    assert f"no store file at {own / 'gpuwatchd.db'}" in line
    assert "/var/lib/gpuwatchd/gpuwatchd.db" in line
    assert "$GPUWATCHD_STORE" in line and f"{url}/api/v1/winners" in line

    probe = (
        "from gpuwatchd.client import Client, GpuwatchdUnavailable\n"
        "try:\n    Client().winners()\nexcept GpuwatchdUnavailable as exc:\n    print(exc)\n"
    )
    client = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    daemon_store_part = line.split("no store file at ", 1)[1].split(" or ")[0]
    assert daemon_store_part in client.stdout, client.stdout + client.stderr
    assert f"{url}/api/v1/winners" in client.stdout
    assert "gpuwatchd-sim" not in client.stdout  # jobs never read simulated winners


def test_the_sim_directory_must_be_private(tmp_path: Path) -> None:
    assert make_private_dir(tmp_path / "new").stat().st_mode & 0o777 == 0o700
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    with pytest.raises(StoreError, match="not a private directory"):
        make_private_dir(tmp_path / "open")
    (tmp_path / "link").symlink_to(tmp_path / "new")
    with pytest.raises(StoreError, match="not a private directory"):
        make_private_dir(tmp_path / "link")
