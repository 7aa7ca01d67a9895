"""How long ``gpuwatchd run --backend nvml`` takes to exit after SIGTERM, per tree.

Each tree (its PYTHONPATH) runs the daemon against the fake NVML (bench/daemon_under_test.py,
``--fake-gpus``): its XID thread sits in ``nvmlEventSetWait`` with the daemon's 5 s timeout,
as on a real GPU. The daemon is stopped ``--settle`` seconds after /metrics first answers,
``--runs`` times per tree, trees alternating.

    git archive HEAD gpuwatchd | tar -x -C /tmp/base
    python3 bench/sigterm_stop.py --baseline /tmp/base [--runs 3] [--gpus 2] [--settle 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_time(tree: str, gpus: int, settle_s: float) -> float:
    """Seconds from SIGTERM to the daemon's exit (it must exit 0)."""
    home = Path(tempfile.mkdtemp(prefix="gpuwatchd-stop-"))
    (home / "config.toml").write_text("[tuning]\nenabled = false\n\n[drift]\nenabled = false\n")
    port = free_port()
    argv = [
        sys.executable, str(BENCH / "daemon_under_test.py"), "--fake-gpus", str(gpus), "--",
        "run", "--config", str(home / "config.toml"), "--backend", "nvml",
        "--poll-interval", "0.1", "--listen", f"127.0.0.1:{port}", "--log-level", "warning",
        "--state-dir", str(home), "--control-socket", str(home / "control.sock"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{tree}: the daemon never served /metrics") from None
                time.sleep(0.2)
        time.sleep(settle_s)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if rc != 0:
        raise RuntimeError(f"{tree}: the daemon exited {rc} after SIGTERM")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="another tree holding a gpuwatchd package to compare")
    ap.add_argument("--runs", type=int, default=3, help="stops per tree")
    ap.add_argument("--gpus", type=int, default=2, help="fake GPUs")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds served before SIGTERM")
    args = ap.parse_args()
    if args.runs < 1 or args.gpus < 1 or args.settle < 0:
        ap.error("--runs and --gpus must be >= 1, --settle >= 0")
    trees = [("new", str(ROOT))]
    if args.baseline:
        if not (Path(args.baseline) / "gpuwatchd").is_dir():
            ap.error(f"--baseline: no gpuwatchd package in {args.baseline}")
        trees.append(("baseline", str(Path(args.baseline).resolve())))
    took: dict[str, list[float]] = {name: [] for name, _ in trees}
    for _ in range(args.runs):
        for name, tree in trees:
            took[name].append(stop_time(tree, args.gpus, args.settle))
    for name, times in took.items():
        shown = ", ".join(f"{t:.2f}" for t in times)
        print(f"{name}: SIGTERM -> exit in {shown} s (max {max(times):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
