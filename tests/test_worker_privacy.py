"""The tuning worker's own folders and interpreter flags: nothing another local user
prepared is ever read as code.

Inductor's default cache is ``/tmp/torchinductor_<user>`` and Triton's ``~/.triton``:
a local user who creates such a folder first and seeds the module Inductor is about to
generate runs code in the worker. So the worker's Triton, Inductor, CUDA and temporary
folders are ``worker-<uid>/...`` under gpuwatchd's cache directory, 0700 and its own;
one owned by someone else or writable by others is refused in one line. ``-s`` keeps
the user-site folder (and the ``.pth`` files in it) off ``sys.path``.
"""

from __future__ import annotations

import getpass
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatchd.sessions.runner import TuneRunner
from gpuwatchd.store import SqlStore, sqlite_store
from gpuwatchd.telemetry.sim import SimBackend
from gpuwatchd.tuning.session_spec import SessionSpec, SimSpec
from gpuwatchd.tuning.types import Regime, SessionStatus, Workload
from gpuwatchd.tuning.worker_isolation import (
    PRIVATE_DIRS,
    PYTHON_FLAGS,
    PrivateDirError,
    ensure_private_dirs,
    worker_environment,
)

PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """gpuwatchd's cache directory (systemd's CACHE_DIRECTORY=) in a temporary folder."""
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("CACHE_DIRECTORY", str(d))
    return d


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    with sqlite_store(tmp_path / "w.db") as s:
        yield s


def _worker(env: dict[str, str], code: str) -> list[str]:
    """Run ``code`` as the worker's interpreter runs (its flags, env and directory)."""
    assert ensure_private_dirs(env) is None  # what the worker does first
    out = subprocess.run(
        [sys.executable, *PYTHON_FLAGS, "-c", code],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return out.stdout.split()


def test_the_worker_env_points_every_cache_into_its_own_folder(cache: Path) -> None:
    env = worker_environment({**os.environ, "TRITON_CACHE_DIR": "/tmp/shared"}, PACKAGE_ROOT)
    root = cache / f"worker-{os.geteuid()}"
    for name, sub in PRIVATE_DIRS.items():
        assert env[name] == str(root / sub)


def test_a_seeded_tmp_torchinductor_folder_is_never_used(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    shared = tmp_path / "shared-tmp"  # the /tmp every local user can write
    shared.mkdir()
    seeded = shared / f"torchinductor_{getpass.getuser()}"
    seeded.mkdir()
    (seeded / "planted.py").write_text("raise SystemExit('planted code ran')\n")
    monkeypatch.setenv("TMPDIR", str(shared))
    env = worker_environment(dict(os.environ), PACKAGE_ROOT)
    code = (
        "import tempfile\n"
        "from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir\n"
        "print(cache_dir(), triton_cache_dir(0), tempfile.gettempdir())"
    )
    got = _worker(env, code)
    root = str(cache / f"worker-{os.geteuid()}") + "/"
    assert len(got) == 3 and all(p.startswith(root) for p in got), got
    assert not any(p.startswith(str(shared)) for p in got)


def test_user_site_pth_files_never_run_in_the_worker(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("PYTHONUSERBASE", str(home / ".local"))
    site = subprocess.run(
        [sys.executable, "-c", "import site; print(site.getusersitepackages())"],
        env={**os.environ, "PYTHONUSERBASE": str(home / ".local")},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site).mkdir(parents=True)
    marker = tmp_path / "pth-ran"
    (Path(site) / "evil.pth").write_text(f"import os; open({str(marker)!r}, 'w').close()\n")
    env = worker_environment(dict(os.environ), PACKAGE_ROOT)
    env["PYTHONUSERBASE"] = str(home / ".local")  # as the worker user's own ~/.local
    _worker(env, "import sys; print(len(sys.path))")
    assert not marker.exists()


@pytest.mark.parametrize("how", ["writable by others", "owned by uid"])
def test_a_cache_folder_that_is_not_the_workers_own_is_refused_in_one_line(
    cache: Path, how: str
) -> None:
    env = worker_environment(dict(os.environ), PACKAGE_ROOT)
    inductor = Path(env["TORCHINDUCTOR_CACHE_DIR"])
    inductor.mkdir(parents=True)
    if how == "writable by others":
        inductor.chmod(0o777)
    elif os.geteuid() == 0:
        os.chown(inductor, 65534, 65534)
    else:
        pytest.skip("giving a folder away needs root")
    with pytest.raises(PrivateDirError) as err:
        ensure_private_dirs(env)
    text = str(err.value)
    assert text.startswith(f"worker folder {inductor}: {how}") and "\n" not in text


def test_the_real_worker_refuses_to_start_with_a_shared_cache_folder(
    cache: Path, store: SqlStore
) -> None:
    inductor = cache / f"worker-{os.geteuid()}" / PRIVATE_DIRS["TORCHINDUCTOR_CACHE_DIR"]
    inductor.mkdir(parents=True)
    inductor.chmod(0o777)
    info = SimBackend(gpus=1, scenario="idle", seed=3).device_info(0)
    wl = Workload("sim-gemm", "gemm", {"m": 64, "n": 64, "k": 64}, "bf16", ("sim",))
    spec = SessionSpec(0, info.uuid, "sim", (wl,), (Regime.UNTHROTTLED,), sim=SimSpec("idle", 3, 1))
    out = TuneRunner(store).run_session(spec, info, "sim", lambda: None, None, 60)
    assert out.status is SessionStatus.FAILED
    assert f"worker folder {inductor}: writable by others" in (out.why or "")
