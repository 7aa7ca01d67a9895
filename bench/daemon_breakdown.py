"""Where a sim daemon's CPU goes, per poll tick and per scrape: thread CPU by function.

Runs ``gpuwatchd run --backend sim`` (tuning and drift off) from this tree or ``--tree``
with the functions named in ``TIMED`` wrapped to add up the calling thread's CPU time
(``time.thread_time_ns``) and their calls, scrapes it once a second over a new
connection each time (as bench/daemon_cost.py's start-up phase does; ``--keep-alive``:
over one kept connection, as Prometheus does), and prints, for
a steady window after ``--settle`` seconds: each thread's CPU and wake-ups per second
(/proc schedstat and context switches) and each timed function's CPU per second, calls
per second and CPU per call. Nested functions are counted in both (``data_received``
holds ``answer``, which holds the render). The wrappers add about a microsecond per
call; compare trees run the same way, not these figures with bench/daemon_cost.py's.

    python3 bench/daemon_breakdown.py [--tree DIR] [--gpus 1] [--hz 1] [--seconds 30]
        [--path /metrics] [--keep-alive]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from daemon_cost import free_port  # noqa: E402

#: (module, class, attribute) of every function timed in the daemon.
TIMED = (
    ("selectors", "EpollSelector", "select"),
    ("asyncio.base_events", "BaseEventLoop", "_run_once"),
    ("asyncio.selector_events", "_SelectorSocketTransport", "__init__"),
    ("asyncio.selector_events", "_SelectorSocketTransport", "_read_ready"),
    ("gpuwatchd.serve.http_loop", "LoopServer", "_accept"),
    ("gpuwatchd.serve.http_loop", "LoopServer", "answer"),
    ("gpuwatchd.serve.http_loop", "LoopServer", "frame"),
    ("gpuwatchd.serve.http_loop", "_Connection", "connection_made"),
    ("gpuwatchd.serve.http_loop", "_Connection", "data_received"),
    ("gpuwatchd.serve.http_loop", "_Connection", "close"),
    ("gpuwatchd.exporter.render", "MetricsRenderer", "render_at_once"),
    ("gpuwatchd.exporter.collectors.base", "GpuwatchdCollector", "render"),
    ("gpuwatchd.monitor.poller", "Poller", "poll_once"),
    ("gpuwatchd.monitor.poller", "Poller", "_publish"),
    ("gpuwatchd.telemetry.sim.backend", "SimBackend", "read"),
    ("threading", "Event", "wait"),
    ("gpuwatchd.monitor.stop_signal", "StopSignal", "wait"),  # absent from older trees
)

#: Run in the daemon's interpreter: wraps TIMED, counts each sub-collector's run and
#: encoding, and writes the totals and per-thread CPU to $BREAKDOWN_OUT on SIGUSR2.
_PRELUDE = """
import collections, importlib, json, os, signal, sys, threading, time
TIMED = json.loads(os.environ["BREAKDOWN_TIMED"])
acc = collections.defaultdict(lambda: [0, 0])
def timed(label, f):
    def wrapper(*a, **k):
        t0 = time.thread_time_ns()
        try:
            return f(*a, **k)
        finally:
            entry = acc[label]
            entry[0] += time.thread_time_ns() - t0
            entry[1] += 1
    return wrapper
for module, cls, attr in TIMED:
    try:
        owner = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError):
        continue
    setattr(owner, attr, timed(f"{cls}.{attr}", getattr(owner, attr)))
from gpuwatchd.exporter.collectors import base as _base
_run_here, _finish = _base._Worker.run_here, _base.GpuwatchdCollector._finish_encoded
def run_here(self):
    return timed("collect:" + self.sub.name, _run_here)(self)
def finish(self, worker, run, stuck, encode):
    return timed("encode:" + worker.sub.name, _finish)(self, worker, run, stuck, encode)
_base._Worker.run_here, _base.GpuwatchdCollector._finish_encoded = run_here, finish
def dump(*_):
    threads = {}
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{t.native_id}/status") as f:
                switches = sum(int(l.split()[1]) for l in f if "ctxt_switches" in l)
        except OSError:
            continue
        threads[t.name] = [ns, switches]
    out = os.environ["BREAKDOWN_OUT"]
    with open(out + ".tmp", "w") as f:
        json.dump({"acc": acc, "threads": threads}, f)
    os.replace(out + ".tmp", out)
signal.signal(signal.SIGUSR2, dump)
from gpuwatchd.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def snapshot(pid: int, out: Path) -> dict[str, dict[str, list[int]]]:
    out.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 5
    while not out.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the daemon wrote no breakdown")
        time.sleep(0.02)
    return json.loads(out.read_text())  # type: ignore[no-any-return]


class Scraper:
    """GET ``path`` once a call: over a new connection each time (urllib closes it), or
    over one HTTP/1.1 connection kept open between calls."""

    def __init__(self, port: int, path: str, keep_alive: bool) -> None:
        self.url = f"http://127.0.0.1:{port}{path}"
        self.path = path
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5) if keep_alive else None

    def __call__(self) -> None:
        if self.conn is None:
            urllib.request.urlopen(self.url, timeout=5).read()
            return
        self.conn.request("GET", self.path)
        response = self.conn.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"{self.url}: HTTP {response.status}")

    def once_a_second_for(self, seconds: float) -> None:
        start = time.monotonic()
        for n in range(1, int(seconds) + 1):
            time.sleep(max(0.0, start + n - time.monotonic()))
            self()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=str(ROOT), help="the tree whose gpuwatchd runs")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--hz", type=float, default=1.0, help="poll rate")
    ap.add_argument("--seconds", type=float, default=30.0, help="the measured window")
    ap.add_argument("--settle", type=float, default=8.0, help="scraped before measuring")
    ap.add_argument("--path", default="/metrics", help="what is scraped, e.g. /healthz")
    ap.add_argument("--keep-alive", action="store_true", help="one connection kept open")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="daemon-breakdown-"))
    config = home / "config.toml"
    config.write_text("[tuning]\nenabled = false\n\n[drift]\nenabled = false\n")
    port = free_port()
    out = home / "breakdown.json"
    argv = [
        sys.executable, "-c", _PRELUDE,
        "run", "--config", str(config), "--backend", "sim", "--gpus", str(args.gpus),
        "--poll-interval", str(1.0 / args.hz), "--listen", f"127.0.0.1:{port}",
        "--log-level", "warning", "--state-dir", str(home),
        "--control-socket", str(home / "control.sock"),
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(args.tree).resolve()),
        "BREAKDOWN_OUT": str(out),
        "BREAKDOWN_TIMED": json.dumps(TIMED),
    }
    url = f"http://127.0.0.1:{port}{args.path}"
    with open(home / "daemon.log", "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=home)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"{url} never answered (log: {home}/daemon.log)") from None
                time.sleep(0.05)
        scrape = Scraper(port, args.path, args.keep_alive)
        scrape.once_a_second_for(args.settle)
        before, t0 = snapshot(proc.pid, out), time.monotonic()
        scrape.once_a_second_for(args.seconds)
        after, elapsed = snapshot(proc.pid, out), time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    how = "over one kept connection" if args.keep_alive else "a new connection each"
    print(f"# {args.tree}: {args.gpus} sim GPU(s) at {args.hz:g} Hz, {args.path} 1/s, {how}")
    print("| thread | µs CPU per s | wake-ups per s |\n| --- | ---: | ---: |")
    total = 0.0
    for name, (ns, switches) in after["threads"].items():
        ns0, sw0 = before["threads"].get(name, [0, 0])
        total += (ns - ns0) / 1e3 / elapsed
        print(f"| {name} | {(ns - ns0) / 1e3 / elapsed:.1f} | {(switches - sw0) / elapsed:.1f} |")
    print(f"| all threads | {total:.1f} | |")
    print("\n| function | µs CPU per s | calls per s | µs per call |\n| --- | ---: | ---: | ---: |")
    for label, (ns, calls) in sorted(after["acc"].items()):
        ns0, calls0 = before["acc"].get(label, [0, 0])
        n = calls - calls0
        if n:
            us = (ns - ns0) / 1e3
            print(f"| {label} | {us / elapsed:.1f} | {n / elapsed:.1f} | {us / n:.1f} |")


if __name__ == "__main__":
    main()
