"""scripts/install-test-deps.sh picks torch's index by asking PyTorch's CPU index first.

The script runs for real with ``python3 -m pip install`` (and ``sudo``) replaced by
stand-ins on PATH that record their arguments, so nothing is installed; every other
``python3`` call (the index probe, ``pip config``) runs the real interpreter.
"""

from __future__ import annotations

import http.server
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import closed_url

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "install-test-deps.sh"
CI = ROOT / ".ci" / "run"
README = ROOT / "README.md"


def _stand_ins(bin_dir: Path, log: Path, uid: int) -> None:
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(
        "#!/bin/sh\n"
        'if [ "$1 $2 $3" = "-m pip install" ]; then\n'
        f'  echo "python3 $*" >> {shlex.quote(str(log))}; exit 0\n'
        "fi\n"
        # Debian's own python3: the script's PEP 668 check finds it externally managed.
        'case "$*" in *EXTERNALLY-MANAGED*) [ -z "$FAKE_SYSTEM_PYTHON" ] || exit 1;; esac\n'
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    (bin_dir / "sudo").write_text(
        f'#!/bin/sh\necho "sudo $*" >> {shlex.quote(str(log))}\nexec "$@"\n'
    )
    (bin_dir / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)


def _run(
    tmp_path: Path, index: str, uid: int = 0, system_python: bool = False
) -> tuple[subprocess.CompletedProcess[str], str]:
    log = tmp_path / "calls.log"
    _stand_ins(tmp_path / "bin", log, uid)
    env = {
        **os.environ,
        "FAKE_SYSTEM_PYTHON": "1" if system_python else "",
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "TORCH_CPU_INDEX": index,
        "PIP_INDEX_URL": "https://mirror.example/simple",
    }
    res = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    return res, log.read_text() if log.exists() else ""


@pytest.fixture
def cpu_index() -> Iterator[str]:
    """A stand-in for PyTorch's CPU index that answers its /torch/ page."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/whl/cpu/torch/" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) as srv:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{srv.server_address[1]}/whl/cpu"
        srv.shutdown()


def _torch_install(calls: str) -> list[str]:
    line = next(c for c in calls.splitlines() if "torch==2.13.0" in c)
    return shlex.split(line)


def test_torch_comes_from_the_cpu_index_when_it_answers(tmp_path: Path, cpu_index: str) -> None:
    res, calls = _run(tmp_path, cpu_index)
    assert res.returncode == 0, res.stderr
    args = _torch_install(calls)
    assert args[args.index("--index-url") + 1] == cpu_index
    assert args[args.index("--extra-index-url") + 1] == "https://mirror.example/simple"
    assert "-e" in args and args[args.index("-e") + 1] == ".[test]"


def test_torch_comes_from_the_configured_index_when_the_cpu_index_is_unreachable(
    tmp_path: Path,
) -> None:
    res, calls = _run(tmp_path, closed_url())
    assert res.returncode == 0, res.stderr
    args = _torch_install(calls)
    assert "--index-url" not in args and "--extra-index-url" not in args
    assert "does not answer" in res.stdout


def test_a_user_without_root_goes_through_sudo_only_for_the_system(
    tmp_path: Path, cpu_index: str
) -> None:
    res, calls = _run(tmp_path, cpu_index, uid=1000)
    assert res.returncode == 0, res.stderr
    assert not any(c.startswith("sudo") and "pip" in c for c in calls.splitlines())


def test_ci_runs_the_readme_test_command() -> None:
    command = (
        './scripts/install-test-deps.sh && python3 -m pytest -q -m "not slow"'
        " && python3 -m pytest -q -m slow"
    )
    assert command in CI.read_text().splitlines()
    assert command in README.read_text()


def test_the_system_python_is_refused_before_anything_is_installed(
    tmp_path: Path, cpu_index: str
) -> None:
    """Debian's python3 refuses pip (PEP 668): one line naming the venv, and no apt-get."""
    res, calls = _run(tmp_path, cpu_index, uid=1000, system_python=True)
    assert res.returncode == 1
    assert calls == ""
    [line] = res.stderr.splitlines()
    assert "PEP 668" in line and "python3 -m venv .venv && . .venv/bin/activate" in line


def test_the_readme_quick_start_uses_a_venv_and_names_the_python_it_needs() -> None:
    text = README.read_text()
    assert "python3 -m venv .venv && . .venv/bin/activate && pip install . && gpuwatchd run" in text
    assert "Python ≥ 3.11" in text
