"""CPU, memory and scrape latency of a real ``gpuwatchd run --backend sim`` process.

For each GPU count: start the daemon polling at 10 Hz, let it settle, then
1. read its CPU time from /proc/PID/stat over ``--seconds`` with nobody scraping
   (the cost of polling itself: the 0.5%-of-one-core target), and its RSS;
2. run 10 concurrent scrapers against /metrics for ``--seconds`` and report p50/p99.

Usage: python bench/history/daemon_overhead.py [--gpus 1 8 64] [--seconds 30] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def scrape_latencies(url: str, clients: int, seconds: float) -> list[float]:
    out: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker() -> None:
        mine = []
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            with urllib.request.urlopen(url, timeout=5) as r:
                r.read()
            mine.append(time.perf_counter() - t0)
        with lock:
            out.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def run_one(gpus: int, seconds: float, clients: int, interval: float = 0.1) -> dict[str, float]:
    port = free_port()
    scratch = tempfile.mkdtemp(prefix="gpuwatchd-bench-")
    config = os.path.join(scratch, "config.toml")
    with open(config, "w") as f:  # polling cost only: no tuning sessions in the window
        f.write("[tuning]\nenabled = false\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config", config, "--backend", "sim",
         "--gpus", str(gpus), "--poll-interval", str(interval), "--listen", f"127.0.0.1:{port}",
         "--log-level", "warning", "--state-dir", scratch,
         "--control-socket", os.path.join(scratch, "control.sock")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url, timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        time.sleep(3)  # let start-up work (imports, first slow reads) finish
        c0, t0 = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(seconds)
        c1, t1 = cpu_seconds(proc.pid), time.monotonic()
        rss = rss_mb(proc.pid)
        with urllib.request.urlopen(url, timeout=5) as r:
            body = r.read()
        lat = sorted(scrape_latencies(url, clients, seconds))
        return {
            "gpus": gpus,
            "cpu_pct_of_one_core": 100 * (c1 - c0) / (t1 - t0),
            "rss_mb": rss,
            "metrics_bytes": len(body),
            "scrapes": len(lat),
            "scrape_p50_ms": 1000 * statistics.median(lat),
            "scrape_p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))],
        }
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--interval", type=float, default=0.1, help="poll period (0.1 = 10 Hz)")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = [run_one(g, args.seconds, args.clients, args.interval) for g in args.gpus]
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, Python {platform.python_version()}")  # fmt: skip
    print(
        "| GPUs | CPU % of one core (10 Hz, no scrapes) | RSS MB | /metrics bytes "
        "| scrapes | p50 ms | p99 ms (10 clients) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['gpus']} | {r['cpu_pct_of_one_core']:.2f} | {r['rss_mb']:.1f} | "
              f"{r['metrics_bytes']} | {r['scrapes']} | {r['scrape_p50_ms']:.2f} | "
              f"{r['scrape_p99_ms']:.2f} |")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
