"""No root where job input is handled: a root start of ``gpuwatchd run`` becomes
``[daemon] user`` before it reads anything from outside, or refuses in one line; the
shipped systemd unit and DaemonSet start the daemon (and so its worker) as a user
that is not root and cannot become anyone else."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_kubernetes import _container, _one, rendered  # noqa: F401 (fixture)
from test_systemd_unit import _service

from gpuwatchd.config import Config, DaemonConfig
from gpuwatchd.daemon import privileges
from gpuwatchd.daemon.privileges import ALLOW_ROOT, SYSTEM_DIRS, PrivilegeError, drop_root

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a root start needs root")
NOBODY = pwd.getpwnam("nobody")


def _run_as_root(
    config: Path, env: dict[str, str], backend: str = "nvml"
) -> subprocess.CompletedProcess[str]:
    """``gpuwatchd run`` (NVML: the real daemon; it refuses before NVML is touched)."""
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "run", "--config", str(config), "--backend", backend],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_root
@pytest.mark.parametrize(
    ("user", "why"),
    [
        ("no-such-user-here", "[daemon] user 'no-such-user-here' does not exist on this host"),
        ("root", "[daemon] user 'root' is root"),
        ("", "[daemon] user is empty"),
    ],
)
def test_a_root_start_without_a_user_to_become_refuses_in_one_line(
    tmp_path: Path, user: str, why: str
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        f'[daemon]\nuser = "{user}"\nlisten = "127.0.0.1:0"\nstate_dir = "{tmp_path}"\n'
    )
    env = {k: v for k, v in os.environ.items() if k != ALLOW_ROOT}
    out = _run_as_root(config, env)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if "started as root" in line]
    assert len(lines) == 1 and why in lines[0], out.stderr
    assert not (tmp_path / "gpuwatchd.db").exists()  # nothing was opened as root


@pytest.fixture
def nobodys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder nobody may enter, holding the daemon's configured folders. The switch
    itself is under test: the install counts as readable (this machine's interpreter may
    sit in root's 0700 home; test_unreadable_* checks that part)."""
    monkeypatch.setattr(privileges, "unreadable", lambda user, paths: None)
    d = Path(tempfile.mkdtemp(prefix="gw-drop-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _in_child(fn: object) -> str:
    """Run ``fn()`` in a forked child (which may drop root); its text back, or its error."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        try:
            text = str(fn())  # type: ignore[operator]
        except BaseException as e:
            text = f"ERROR {type(e).__name__}: {e}"
        os.write(w, text.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return text


def _uids() -> str:
    status = Path("/proc/self/status").read_text()
    uid = next(line for line in status.splitlines() if line.startswith("Uid:"))
    gid = next(line for line in status.splitlines() if line.startswith("Gid:"))
    groups = next(line for line in status.splitlines() if line.startswith("Groups:"))
    return f"{uid.split()[1:]} {gid.split()[1:]} {groups.split()[1:]}"


@needs_root
def test_a_root_start_becomes_the_configured_user_for_good(nobodys: Path) -> None:
    cfg = Config(daemon=DaemonConfig(user="nobody", state_dir=str(nobodys / "state"),
                                     control_socket=str(nobodys / "run" / "c.sock")))  # fmt: skip
    env: dict[str, str] = {"CACHE_DIRECTORY": str(nobodys / "cache")}

    def drop() -> str:
        user = drop_root(cfg, env)
        assert user is not None and env["USER"] == "nobody"
        try:
            os.setuid(0)
        except PermissionError:
            return _uids()
        return "still root"

    got = _in_child(drop)
    n = str(NOBODY.pw_uid)
    g = str(NOBODY.pw_gid)
    assert (
        got == f"{[n] * 4} {[g] * 4} {[str(x) for x in os.getgrouplist('nobody', NOBODY.pw_gid)]}"
    )


@needs_root
def test_a_root_start_makes_the_default_folders_the_users_and_points_the_daemon_there(
    nobodys: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dirs = tuple(d.__class__(d.variable, nobodys / d.variable, d.mode) for d in SYSTEM_DIRS)
    monkeypatch.setattr("gpuwatchd.daemon.privileges.SYSTEM_DIRS", dirs)
    env: dict[str, str] = {}
    got = _in_child(lambda: drop_root(Config(daemon=DaemonConfig(user="nobody")), env) and env)
    for d in dirs:
        st = d.path.stat()
        assert (st.st_uid, oct(st.st_mode & 0o777)) == (NOBODY.pw_uid, oct(d.mode)), d
        assert f"'{d.variable}': '{d.path}'" in got


@needs_root
def test_a_default_folder_that_belongs_to_someone_else_is_refused(
    nobodys: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = nobodys / "gpuwatchd"
    state.mkdir()  # left by an earlier root run: root's
    dirs = (SYSTEM_DIRS[0].__class__("STATE_DIRECTORY", state, 0o700),)
    monkeypatch.setattr("gpuwatchd.daemon.privileges.SYSTEM_DIRS", dirs)
    with pytest.raises(PrivilegeError) as err:
        drop_root(Config(daemon=DaemonConfig(user="nobody")), {})
    assert str(err.value).startswith(f"gpuwatchd run: {state} belongs to uid 0")
    assert os.geteuid() == 0  # refused before anything was given up


def test_not_root_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    env: dict[str, str] = {}
    assert drop_root(Config(daemon=DaemonConfig(user="no-such-user-here")), env) is None
    assert env == {}


# -- as shipped --------------------------------------------------------------------------------


def test_the_unit_starts_the_daemon_and_its_worker_as_a_user_that_cannot_become_root() -> None:
    service = _service()
    assert service["DynamicUser"] == ["yes"] and "User" not in service
    # No capability at all: the daemon cannot switch users, so its worker (a child) is
    # the same unprivileged uid; NoNewPrivileges stops setuid binaries on the way.
    assert service["CapabilityBoundingSet"] == [""] and service["AmbientCapabilities"] == [""]
    assert service["NoNewPrivileges"] == ["yes"]
    env = " ".join(service.get("Environment", []))
    assert ALLOW_ROOT not in env
    # The worker's caches are its own folders under CacheDirectory=, not shared ones.
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TMPDIR"):
        assert var not in env
    assert service["CacheDirectory"] == ["gpuwatchd"]


def test_the_daemonset_runs_the_daemon_and_its_worker_as_non_root(
    rendered: dict[str, list[object]],  # noqa: F811
) -> None:
    ds = _one(rendered["base"], "DaemonSet")
    c = _container(ds)
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] not in (0, None)
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert ALLOW_ROOT not in env
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TMPDIR"):
        assert var not in env
    assert env["CACHE_DIRECTORY"] == "/var/cache/gpuwatchd"


@needs_root
def test_unreadable_names_the_first_path_the_user_cannot_read(tmp_path: Path) -> None:
    closed = Path(tempfile.mkdtemp(prefix="gw-closed-", dir="/tmp"))  # 0700, root's
    try:
        assert privileges.unreadable(NOBODY, (Path("/usr"), closed)) == closed
        assert privileges.unreadable(NOBODY, (Path("/usr"), Path("/bin"))) is None
    finally:
        closed.rmdir()


@needs_root
@pytest.mark.parametrize("backend", ["nvml", "sim"])
def test_a_root_start_whose_user_cannot_read_the_install(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, backend: str
) -> None:
    """A daemon refuses in one line; the simulated demo, whose socket and spool only root
    can reach, keeps root and says why (never a traceback from a lazy import later)."""
    monkeypatch.setattr(privileges, "unreadable", lambda user, paths: Path("/root/venv"))
    cfg = Config(daemon=DaemonConfig(user="nobody", backend=backend))
    env: dict[str, str] = {}
    if backend == "nvml":
        with pytest.raises(PrivilegeError, match=r"'nobody' cannot read /root/venv"):
            drop_root(cfg, env)
    else:
        assert drop_root(cfg, env) is None
        assert "nobody cannot read /root/venv" in caplog.text
    assert env == {} and os.geteuid() == 0
