"""Where a poll's CPU time goes: read, gate, bookkeeping, per GPU, at the daemon's pace.

Polls 8 simulated GPUs once every 100 ms (as the daemon does at 10 Hz, so caches are
as cold as in production) and times each part with perf_counter.

Usage: python bench/history/poll_breakdown.py [--gpus 8] [--sweeps 150]
"""

from __future__ import annotations

import argparse
import time

from gpuwatchd import gate
from gpuwatchd.gate import GateConfig
from gpuwatchd.monitor.board import StateBoard
from gpuwatchd.monitor.poller import Poller
from gpuwatchd.telemetry.sim import SimBackend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--sweeps", type=int, default=150)
    args = ap.parse_args()
    backend = SimBackend(gpus=args.gpus)
    poller = Poller(backend, StateBoard(), GateConfig(), period_s=0.1)
    spent = {"read": 0.0, "gate": 0.0}
    read, evaluate = backend.read, gate.evaluate

    def timed_read(gpu: int):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return read(gpu)
        finally:
            spent["read"] += time.perf_counter() - t

    def timed_evaluate(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return evaluate(*a, **k)
        finally:
            spent["gate"] += time.perf_counter() - t

    backend.read = timed_read  # type: ignore[method-assign]
    gate.evaluate = timed_evaluate
    warmup = args.sweeps // 5
    total, polls = 0.0, 0
    for k in range(args.sweeps):
        time.sleep(0.1)
        if k == warmup:
            spent = {"read": 0.0, "gate": 0.0}
            total, polls = 0.0, 0
        t = time.perf_counter()
        for g in range(args.gpus):
            poller.poll(g)
        total += time.perf_counter() - t
        polls += args.gpus
    rest = total - spent["read"] - spent["gate"]
    us = 1e6 / polls
    print(
        f"per GPU poll: {total * us:.1f} µs = sim read {spent['read'] * us:.1f} + gate "
        f"{spent['gate'] * us:.1f} + bookkeeping {rest * us:.1f}; "
        f"{args.gpus} GPUs at 10 Hz = {total / polls * args.gpus * 10 * 100:.2f}% of a core"
    )


if __name__ == "__main__":
    main()
