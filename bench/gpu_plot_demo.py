"""Real-GPU pictures for the README: record NVML while ``gpuwatchd tune`` runs, then plot.

Usage: python3 bench/gpu_plot_demo.py [OUTDIR] [BUDGET_S]  (default gpu-plots, 12 s)

Records GPU 0 every 0.1 s from before the tune until 10 s after it (the cool-down),
tunes one GEMM in both regimes with a per-regime budget, and writes OUTDIR/trace.jsonl
(header with ``t0_unix``, the unix time of its t = 0), gpu.db, tune.log, report.png
and timeline.png. Finishes in under 2 minutes (the tune is cut at 90 s).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpuwatchd.gate import GateConfig
from gpuwatchd.report.figure import save_figure
from gpuwatchd.report.results_plot import plot_report
from gpuwatchd.report.text import build_report
from gpuwatchd.report.timeline_plot import build_timeline_figure
from gpuwatchd.store import sqlite_store
from gpuwatchd.telemetry.nvml import NvmlBackend
from gpuwatchd.telemetry.trace import T0_UNIX_KEY, TraceWriter

PERIOD_S = 0.1
TUNE_TIMEOUT_S = 90.0
COOL_DOWN_S = 10.0


def record(path: Path, stop: threading.Event, t0_unix: list[float]) -> None:
    """Sample GPU 0 until ``stop``; t = 0 is the first sample, taken at ``t0_unix[0]``."""
    backend = NvmlBackend()
    try:
        with TraceWriter(path, [backend.device_info(0)], PERIOD_S) as writer:
            t0: float | None = None
            next_at = time.monotonic()
            while not stop.is_set():
                sample = backend.read(0)
                if t0 is None:
                    t0 = sample.t
                    t0_unix.append(time.time())
                writer.write(sample, t=sample.t - t0)
                next_at += PERIOD_S
                stop.wait(max(0.0, next_at - time.monotonic()))
    finally:
        backend.close()


def add_t0(path: Path, t0_unix: float) -> None:
    """Put ``t0_unix`` in the header (the reader ignores header keys it does not know)."""
    header, rest = path.read_text().split("\n", 1)
    doc = json.loads(header)
    doc[T0_UNIX_KEY] = t0_unix
    path.write_text(json.dumps(doc) + "\n" + rest)


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-plots")
    budget = sys.argv[2] if len(sys.argv) > 2 else "12"
    out.mkdir(parents=True, exist_ok=True)
    trace, db = out / "trace.jsonl", out / "gpu.db"
    stop = threading.Event()
    t0_unix: list[float] = []
    recorder = threading.Thread(target=record, args=(trace, stop, t0_unix), daemon=True)
    recorder.start()
    time.sleep(2.0)  # some idle before the tune
    cmd = [
        sys.executable,
        "-m",
        "gpuwatchd",
        "tune",
        "--backend",
        "nvml",
        "--budget",
        budget,
        "--store",
        str(db),
        "--poll-interval",
        "0.1",
        "--workload",
        "gemm-bf16-8192",
    ]
    with (out / "tune.log").open("w") as log:
        try:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=TUNE_TIMEOUT_S)
            rc = done.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    time.sleep(COOL_DOWN_S)
    stop.set()
    recorder.join()
    add_t0(trace, t0_unix[0])
    print((out / "tune.log").read_text())

    store = sqlite_store(db, readonly=True)
    try:
        doc, sessions = build_report(store), store.sessions(limit=100)
    finally:
        store.close()
    if doc["results"]:
        print("wrote", plot_report(doc, out / "report.png"))
    timeline = build_timeline_figure(trace, sessions, gate_cfg=GateConfig())
    print("wrote", save_figure(timeline, out / "timeline.png"))
    print(f"tune exit {rc}; sessions: {[(s.id, s.status.value) for s in sessions]}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
