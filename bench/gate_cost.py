"""Cost of one gate evaluation on a 50-sample window (5 s at 10 Hz).

The poller calls :func:`gpuwatchd.gate.evaluate` for every sample of every GPU; at
10 Hz on 8 GPUs that is 80 calls a second, so the budget is ~20 µs a call. Three
synthetic cases (a quiet GPU, where every check runs and the gate is open; a
power-capped one; a GPU with an own and a foreign process), then the mean over the
recorded H200 trace (window of the last N samples). Each synthetic case is timed over a
plain deque (the window sorted per call) and over a :class:`~gpuwatchd.gate.SampleWindow`
(what the poller keeps: spans held in order). Run: ``python bench/gate_cost.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
import timeit
from collections import deque
from pathlib import Path

# Run from a checkout without `pip install -e .`: import the package from the tree.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuwatchd.gate import GateConfig, GateDecision, SampleWindow, evaluate
from gpuwatchd.telemetry.trace import load_trace
from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason

INFO = DeviceInfo(
    index=0,
    uuid="GPU-bench",
    name="NVIDIA H200",
    max_sm_clock_mhz=1980.0,
    power_limit_w=700.0,
    slowdown_temp_c=89.0,
)


def _window(n: int, *, capped: bool, procs: tuple[int, ...] | None) -> deque[Sample]:
    win: deque[Sample] = deque(maxlen=n)
    for i in range(n):
        win.append(
            Sample(
                gpu=0,
                t=i * 0.1,
                temp_c=(61.0 if capped else 40.0) + (i % 2),
                power_w=(692.0 if capped else 125.0) + (i % 3),
                sm_clock_mhz=(1410.0 + 15 * (i % 6)) if capped else 1980.0,
                reasons=ThrottleReason.SW_POWER_CAP if capped else ThrottleReason(0),
                util_gpu=1.0 if capped else 0.0,
                procs=procs,
            )
        )
    return win


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=50, help="samples per window")
    ap.add_argument("--calls", type=int, default=20000, help="calls per case")
    args = ap.parse_args()
    cfg = GateConfig()
    cases = {
        "quiet (open)": (_window(args.window, capped=False, procs=()), frozenset[int]()),
        "power-capped": (_window(args.window, capped=True, procs=None), frozenset[int]()),
        "own+foreign pids": (_window(args.window, capped=True, procs=(7, 9)), frozenset({7})),
    }
    for label, (win, own) in cases.items():  # steady state: the same window each call
        prev = GateDecision(evaluate(win, INFO, cfg, None, own).state, (), 0.0, 0.0, -100.0)

        def call(
            win: deque[Sample] = win, own: frozenset[int] = own, prev: GateDecision = prev
        ) -> GateDecision:
            return evaluate(win, INFO, cfg, prev, own)

        best = min(timeit.repeat(call, number=args.calls, repeat=5))
        kept = SampleWindow(win)

        def call_kept(
            kept: SampleWindow = kept, own: frozenset[int] = own, prev: GateDecision = prev
        ) -> GateDecision:
            return evaluate(kept, INFO, cfg, prev, own)

        best_kept = min(timeit.repeat(call_kept, number=args.calls, repeat=5))
        print(
            f"{label:18s} {best / args.calls * 1e6:7.2f} µs per evaluate ({args.window} samples), "
            f"{best_kept / args.calls * 1e6:.2f} µs over a SampleWindow"
        )

    print(f"{'H200 trace replay':18s} {_trace_cost(args.window):7.2f} µs per evaluate (mean)")


def _trace_cost(window_len: int) -> float:
    """Mean cost over the recorded H200 matmul trace, every state and transition included."""
    trace = load_trace(Path(__file__).resolve().parent.parent / "tests/data/h200-matmul-burn.jsonl")
    samples = trace.samples[0]
    info = trace.devices[0]
    cfg = GateConfig()
    win: deque[Sample] = deque(maxlen=window_len)
    prev: GateDecision | None = None
    elapsed = 0.0
    for s in samples:
        win.append(s)
        t0 = time.perf_counter()
        prev = evaluate(win, info, cfg, prev)
        elapsed += time.perf_counter() - t0
    return elapsed / len(samples) * 1e6


if __name__ == "__main__":
    main()
