"""What a newcomer's typos and interruptions get: one line that says what is wrong and
what to do, and nothing created where it was not asked for."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from builders import wait_until


def _gpuwatchd(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-m", "gpuwatchd", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_record_refuses_an_out_file_in_a_missing_directory(tmp_path: Path) -> None:
    out = tmp_path / "typo-dir" / "x.jsonl"
    res = _gpuwatchd(tmp_path, "record", "--backend", "sim", "--duration", "1", "--out", str(out))
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"gpuwatchd: --out {out}: no directory {out.parent}; create it first"
    ]
    assert not out.parent.exists()


def test_a_record_cut_short_says_so_and_keeps_what_it_wrote(tmp_path: Path) -> None:
    out = tmp_path / "run.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "record", "--backend", "sim", "--duration", "600",
         "--out", str(out)],
        env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as a terminal delivers it: a suite started in the background (`cmd &`
        # in a script) runs with SIGINT ignored, and its children would inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        wait_until(lambda: out.exists() and out.read_text().count("\n") >= 3, timeout=60)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130
    last = err.strip().splitlines()[-1]
    assert last.startswith("recording cut short after ") and "of 10:00: wrote " in last
    assert last.endswith(f"samples to {out}")
    assert "Traceback" not in err


def test_a_port_out_of_range_is_named(tmp_path: Path) -> None:
    res = _gpuwatchd(tmp_path, "run", "--backend", "sim", "--listen", ":99999")
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "gpuwatchd: --listen: listen address ':99999': port 99999 is out of range 0-65535"
    ]


def test_a_port_in_use_says_how_to_find_its_holder_and_how_to_move(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = _gpuwatchd(tmp_path, "run", "--backend", "sim", "--listen", f"127.0.0.1:{port}")
    assert res.returncode == 1
    [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("gpuwatchd: ")]
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in line
    assert f"ss -ltnp 'sport = :{port}'" in line and "--listen HOST:PORT" in line


def test_help_loads_only_the_command_line(tmp_path: Path) -> None:
    """`gpuwatchd --help` builds every command's parser and nothing else: no workload
    registry (its plugin entry points were 40% of a 0.2 s help), no config, validation or
    wire protocol."""
    probe = (
        "import contextlib, io, sys\n"
        "from gpuwatchd.cli.main import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--help'])\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('gpuwatchd'))))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = set(res.stdout.split())
    assert all(m == "gpuwatchd" or m.startswith("gpuwatchd.cli") for m in loaded), loaded
    assert "gpuwatchd.cli.progress" not in loaded  # dataclasses and validation come with it
