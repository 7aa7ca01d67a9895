"""Print the CPU cost of one SimBackend.read() at the daemon's polling pattern.

The daemon polls 8 GPUs at 10 Hz and must stay under 0.5 % of one core in total, so a
simulated read should cost a few tens of microseconds at most. Simulated time moves
100 ms between polls, as it would in production, through a ManualClock.

    python bench/history/sim_read_cost.py [--scenario power-cap] [--gpus 8] [--seconds 600]
"""

from __future__ import annotations

import argparse
import contextlib
import time

from gpuwatchd.telemetry.backend import GpuLost
from gpuwatchd.telemetry.clocks import ManualClock
from gpuwatchd.telemetry.sim import SCENARIOS, SimBackend


def measure(scenario: str, gpus: int, seconds: float, period_s: float = 0.1) -> float:
    """Microseconds of CPU per read() over ``seconds`` of simulated polling."""
    clock = ManualClock()
    backend = SimBackend(gpus=gpus, scenario=scenario, clock=clock)
    polls = int(seconds / period_s)
    reads = 0
    start = time.process_time()
    for _ in range(polls):
        for gpu in range(gpus):
            with contextlib.suppress(GpuLost):  # gpu-lost's window; still a read
                backend.read(gpu)
            reads += 1
        clock.advance(period_s)
    return (time.process_time() - start) / reads * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default=None)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=600.0, help="simulated seconds")
    args = parser.parse_args()
    names = [args.scenario] if args.scenario else list(SCENARIOS)
    for name in names:
        us = measure(name, args.gpus, args.seconds)
        core = us * 1e-6 * args.gpus * 10 * 100  # percent of one core at 10 Hz
        print(
            f"{name:12s} {us:6.1f} µs/read  ({core:.3f} % of a core for {args.gpus} GPUs at 10 Hz)"
        )


if __name__ == "__main__":
    main()
