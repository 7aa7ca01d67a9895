"""Generated bad configs through the real command line (tests/test_faults_config.py, long).

Every generated config (tests/fault_cases.py: a key of every section times the values it
must refuse, broken TOML, bad ``[[workload]]`` tables) is checked in-process, then a
sample (``--sample N``, or ``--all``) goes through ``gpuwatchd check-config`` and
``gpuwatchd run`` as subprocesses: each must give one ``gpuwatchd: ...`` line on stderr and
exit 2, and ``run`` must say the same as ``check-config`` without starting. A config that
``check-config`` accepts must run: the daemon starts on it (sim backend), answers
``/metrics`` and stops on SIGTERM with exit 0.

    python bench/faults_config.py                 # every case in-process, 100 by CLI
    nice -n 10 python bench/faults_config.py --all
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from builders import free_port  # noqa: E402
from fault_cases import (  # noqa: E402
    bad_configs,
    child_env,
    refused_in_one_line,
    run_daemon_on,
    run_gpuwatchd,
    write_case,
)

from gpuwatchd.cli.main import main  # noqa: E402


def _in_process(path: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["check-config", "--config", str(path)])
        except SystemExit as exc:
            rc = int(exc.code or 0)
    return rc, out.getvalue(), err.getvalue()


def _runs(path: Path, scratch: Path) -> str | None:
    """Start the daemon on ``path``; None when it serves and stops cleanly, else why not."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config", str(path), "--backend", "sim",
         "--listen", f"127.0.0.1:{port}", "--state-dir", str(scratch / "state"),
         "--control-socket", str(scratch / "c.sock")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    if b"gpuwatchd_gate_open" in r.read():
                        break
            except OSError:
                time.sleep(0.2)
        else:
            return f"never served (exit {proc.poll()})"
        time.sleep(2.0)
        if proc.poll() is not None:
            return f"exited {proc.returncode} while running"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
        if proc.returncode != 0 or "Traceback" in out:
            return f"stopped with {proc.returncode}: {out.strip()[-300:]}"
        return None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main_bench() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sample", type=int, default=100, help="cases through the real CLI")
    ap.add_argument("--all", action="store_true", help="every case through the real CLI")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    cases = dict(bad_configs())
    scratch = Path(tempfile.mkdtemp(prefix="gpuwatchd-faults-config-"))
    refused: list[str] = []
    accepted: list[str] = []
    problems: list[str] = []
    paths: dict[str, Path] = {}
    for name, content in cases.items():
        path = paths[name] = write_case(scratch, name, content, ".toml")
        rc, out, err = _in_process(path)
        lines = err.splitlines()
        if rc == 0 and out.endswith(": OK\n"):
            accepted.append(name)
        elif rc == 2 and len(lines) == 1 and lines[0].startswith("gpuwatchd: "):
            refused.append(name)
        else:
            problems.append(f"{name}: in-process exit {rc}: {err.strip()[-200:]}")
    print(f"{len(cases)} generated configs: {len(refused)} refused in one line (exit 2), "
          f"{len(accepted)} valid, {len(problems)} problems (in-process check-config)")  # fmt: skip

    sample = refused if args.all else random.Random(args.seed).sample(refused, args.sample)
    cli_ok = 0
    t0 = time.monotonic()
    for name in sample:
        checked = run_gpuwatchd(["check-config", "--config", str(paths[name])])
        ran = run_daemon_on(
            ["--config", str(paths[name]), "--backend", "sim"], scratch / "never",
            scratch / "never.sock",
        )  # fmt: skip
        if not refused_in_one_line(checked):
            problems.append(f"{name}: check-config exit {checked.returncode}: {checked.stderr!r}")
        elif not refused_in_one_line(ran) or ran.stderr != checked.stderr:
            problems.append(f"{name}: run exit {ran.returncode}: {ran.stderr.strip()[-200:]!r}")
        else:
            cli_ok += 1
    if (scratch / "never").exists():
        problems.append("a refused config created the state directory: run started")
    took = time.monotonic() - t0
    print(f"{len(sample)} refused configs through the real CLI (check-config and run): "
          f"{cli_ok} one line + exit 2 from both, the same line ({took:.0f} s)")  # fmt: skip

    ran_ok = 0
    for name in accepted:
        why = _runs(paths[name], scratch / f"run-{len(name)}-{ran_ok}")
        if why is None:
            ran_ok += 1
        else:
            problems.append(f"{name}: valid but does not run: {why}")
    print(f"{len(accepted)} valid configs: {ran_ok} started, served /metrics, stopped with 0")
    for p in problems:
        print("PROBLEM", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main_bench())
