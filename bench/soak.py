"""Soak: the daemon on 8 simulated GPUs polled at 10 Hz, scraped every 100 ms, RSS sampled.

Starts ``gpuwatchd run --backend sim --gpus 8 --poll-interval 0.1`` as its own process,
scrapes ``/metrics`` every 100 ms (one keep-alive connection, like Prometheus) and reads
the daemon's RSS from ``/proc/PID/status`` every 10 s. RSS growth is measured from the
end of the warm-up (the first minute, or a fifth of a shorter run: imports, first
renders and caches settle there) to the end. Tuning is off unless ``--tune``: a tuning
worker is a separate process with its own memory, and sim sessions would spend CPU the
soak does not measure. Target (issue 11): growth under 5 MB over 30 minutes.

    nice -n 10 python bench/soak.py --minutes 5
    nice -n 10 python bench/soak.py --minutes 30
"""

from __future__ import annotations

import argparse
import http.client
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(port: int, scratch: Path, tune: bool) -> subprocess.Popen[bytes]:
    cfg = scratch / "soak.toml"
    cfg.write_text(f"[tuning]\nenabled = {'true' if tune else 'false'}\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config", str(cfg), "--backend", "sim",
         "--gpus", "8", "--poll-interval", "0.1", "--listen", f"127.0.0.1:{port}",
         "--state-dir", str(scratch / "state"), "--control-socket", str(scratch / "c.sock"),
         "--log-level", "warning"],
        stdout=open(scratch / "daemon.log", "wb"), stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--scrape-ms", type=float, default=100.0)
    ap.add_argument("--rss-every-s", type=float, default=10.0)
    ap.add_argument("--tune", action="store_true", help="leave tuning on (sim sessions)")
    args = ap.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="gpuwatchd-soak-"))
    port = free_port()
    proc = start(port, scratch, args.tune)
    latencies: list[float] = []
    failures = 0
    rss: list[tuple[float, int]] = []
    try:
        conn: http.client.HTTPConnection | None = None
        deadline = time.monotonic() + 30
        while True:  # wait until it serves
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/metrics")
                conn.getresponse().read()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the daemon did not start; see " + str(scratch)) from None
                time.sleep(0.2)
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        next_scrape = t0
        next_rss = t0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_rss:
                rss.append((now - t0, rss_kib(proc.pid)))
                next_rss += args.rss_every_s
            start_t = time.perf_counter()
            try:
                assert conn is not None
                conn.request("GET", "/metrics")
                body = conn.getresponse().read()
                if b"gpuwatchd_gate_open" not in body:
                    failures += 1
                latencies.append(time.perf_counter() - start_t)
            except (OSError, http.client.HTTPException):
                failures += 1
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            next_scrape += args.scrape_ms / 1000
            time.sleep(max(0.0, next_scrape - time.monotonic()))
        rss.append((time.monotonic() - t0, rss_kib(proc.pid)))
        alive = proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    warm_s = min(60.0, args.minutes * 60 / 5)
    after_warm = [kib for t, kib in rss if t >= warm_s]
    base = after_warm[0]
    growth_mib = (rss[-1][1] - base) / 1024
    lat = sorted(latencies)
    p = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000) if lat else (lambda q: 0.0)
    print(f"soak {args.minutes:g} min, 8 sim GPUs at 10 Hz, scrape every {args.scrape_ms:g} ms, "
          f"tuning {'on' if args.tune else 'off'}")  # fmt: skip
    peak = max(k for _, k in rss) / 1024
    print(f"  RSS: start {rss[0][1] / 1024:.1f} MiB, after {warm_s:.0f} s warm-up "
          f"{base / 1024:.1f} MiB, end {rss[-1][1] / 1024:.1f} MiB, max {peak:.1f} MiB; "
          f"growth after warm-up {growth_mib:+.2f} MiB")  # fmt: skip
    if len(after_warm) > 2:
        slope = statistics.linear_regression(
            [t for t, _ in rss if t >= warm_s], [k / 1024 for k in after_warm]
        ).slope
        print(f"  RSS trend after warm-up: {slope * 3600:+.2f} MiB/hour")
    print(f"  scrapes: {len(latencies)} ok, {failures} failed; latency p50 {p(0.5):.2f} ms, "
          f"p99 {p(0.99):.2f} ms, max {p(1.0):.2f} ms; alive at the end: {alive}")  # fmt: skip
    print(f"  samples (s, MiB): {[(round(t), round(k / 1024, 1)) for t, k in rss]}")
    print(f"  logs: {scratch / 'daemon.log'}")
    return 0 if alive and failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
