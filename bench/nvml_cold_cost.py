"""What NVML calls cost when made at a daemon's pace, not in a hot loop.

bench/nvml_poll_cost.py and bench/nvml_call_cpu.py time calls back to back, where the
driver answers some of them from a cache. A daemon calls each getter once a period.
This replays call sequences after a pause (``spacing``: 0.1 s is a 10 Hz poll) and
times every call of the sequence with ``thread_time`` (CPU) and ``perf_counter`` (wall),
median over the rounds: the daemon's poll order, the clocks-event reasons alone and
twice, and the alternatives to the costly getters (the throttle-time and energy field
values, violation status). GPU 0 only; only reads, changes no GPU setting.

Usage: python3 bench/nvml_cold_cost.py [--out FILE.json] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import pynvml  # type: ignore[import-untyped]

Call = tuple[str, Callable[[], Any]]


def sequences(h: Any) -> dict[str, list[Call]]:
    nv = pynvml
    temp: Call = ("temperature", lambda: nv.nvmlDeviceGetTemperature(h, 0))
    power: Call = ("power", lambda: nv.nvmlDeviceGetPowerUsage(h))
    sm: Call = ("sm clock", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
    mem: Call = ("mem clock", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM))
    reasons: Call = ("reasons", lambda: nv.nvmlDeviceGetCurrentClocksEventReasons(h))
    util: Call = ("utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h))
    procs: Call = ("processes", lambda: nv.nvmlDeviceGetComputeRunningProcesses_v3(h))
    pstate: Call = ("pstate", lambda: nv.nvmlDeviceGetPerformanceState(h))
    throttle_ids = [74, 76, 269, 270, 271]  # NVML_FI_DEV_CLOCKS_EVENT_REASON_* (ns counters)

    def violation(policy: int) -> Callable[[], Any]:
        return lambda: nv.nvmlDeviceGetViolationStatus(h, policy)

    return {
        "daemon order": [temp, power, sm, mem, reasons, util, procs, pstate],
        "reasons first": [reasons, temp, power, sm, mem, util, procs, pstate],
        "reasons twice": [reasons, reasons],
        "legacy throttle reasons": [
            ("throttle reasons", lambda: nv.nvmlDeviceGetCurrentClocksThrottleReasons(h))
        ],
        "supported reasons": [
            ("supported", lambda: nv.nvmlDeviceGetSupportedClocksEventReasons(h))
        ],
        "throttle-time fields": [
            ("fields 74,76,269-271", lambda: nv.nvmlDeviceGetFieldValues(h, throttle_ids))
        ],
        "violation status": [
            ("power", violation(nv.NVML_PERF_POLICY_POWER)),
            ("thermal", violation(nv.NVML_PERF_POLICY_THERMAL)),
        ],
        "energy field": [("field 83", lambda: nv.nvmlDeviceGetFieldValues(h, [83]))],
        "energy call": [("total energy", lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h))],
    }


def replay(seq: list[Call], spacing: float, rounds: int) -> list[dict[str, Any]]:
    """Median CPU and wall µs of each call of ``seq``, the sequence run after a pause."""
    cpu: list[list[float]] = [[] for _ in seq]
    wall: list[list[float]] = [[] for _ in seq]
    errors = [""] * len(seq)
    for _ in range(rounds):
        time.sleep(spacing)
        for i, (_, fn) in enumerate(seq):
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                fn()
            except (pynvml.NVMLError, AttributeError) as exc:  # unsupported, or old bindings
                errors[i] = str(exc)
            cpu[i].append((time.thread_time() - c0) * 1e6)
            wall[i].append((time.perf_counter() - w0) * 1e6)
    return [
        {
            "call": name,
            "cpu_us": statistics.median(cpu[i]),
            "wall_us": statistics.median(wall[i]),
            "cpu_us_max": max(cpu[i]),
            "error": errors[i],
        }
        for i, (name, _) in enumerate(seq)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error(f"--rounds must be >= 3, got {args.rounds}")
    pynvml.nvmlInit()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = str(pynvml.nvmlDeviceGetName(h))
        for label, seq in sequences(h).items():
            results[label] = {}
            for spacing, rounds in ((0.1, args.rounds), (1.0, 3), (0.01, args.rounds), (0.0, 50)):
                results[label][f"{spacing:g}"] = replay(seq, spacing, rounds)
    finally:
        pynvml.nvmlShutdown()
    print(f"# {name}: median CPU µs per call (wall µs), the sequence run after a pause")
    print("| sequence | call | after 0.1 s | after 1 s | after 0.01 s | back to back |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for label, by_spacing in results.items():
        for i, row in enumerate(by_spacing["0.1"]):
            cells = [
                f"{by_spacing[s][i]['cpu_us']:.1f} ({by_spacing[s][i]['wall_us']:.0f})"
                for s in ("0.1", "1", "0.01", "0")
            ]
            err = f" [{row['error']}]" if row["error"] else ""
            print(f"| {label} | {row['call']}{err} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": name, "rounds": args.rounds, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
