"""How much of each pynvml call gpuwatchd makes is CPU time, and how much is waiting.

bench/nvml_poll_cost.py gives wall time per call; a daemon's cost is CPU time. This
times every call the NVML backend makes (fast fields, slow fields, static facts, the
XID event wait) with both ``perf_counter`` and ``thread_time`` on GPU 0, median of
``--repeats`` runs, and prints one row per call. tests/fakes_nvml.REAL_CALL_COSTS takes
its CPU shares from here. Only reads; changes no GPU setting.

Usage: python3 bench/nvml_call_cpu.py [--out FILE.json] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import pynvml  # type: ignore[import-untyped]


def timed(fn: Callable[[], Any], iters: int) -> tuple[float, float]:
    """(wall µs, CPU µs) per call over ``iters`` calls; an NVML error counts as a call."""
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    for _ in range(iters):
        with contextlib.suppress(pynvml.NVMLError):
            fn()
    return (
        (time.perf_counter() - wall0) / iters * 1e6,
        (time.thread_time() - cpu0) / iters * 1e6,
    )


def calls(h: Any) -> dict[str, tuple[Callable[[], Any], int]]:
    """name -> (call, iterations): fast getters 2000 times, slow ones 10-50 times."""
    nv = pynvml
    fields = [nv.NVML_FI_DEV_MEMORY_TEMP, nv.NVML_FI_DEV_PCIE_REPLAY_COUNTER]
    return {
        "nvmlDeviceGetTemperature": (lambda: nv.nvmlDeviceGetTemperature(h, 0), 2000),
        "nvmlDeviceGetPowerUsage": (lambda: nv.nvmlDeviceGetPowerUsage(h), 2000),
        "nvmlDeviceGetClockInfo": (lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), 2000),
        "nvmlDeviceGetCurrentClocksEventReasons": (
            lambda: nv.nvmlDeviceGetCurrentClocksEventReasons(h),
            2000,
        ),
        "nvmlDeviceGetUtilizationRates": (lambda: nv.nvmlDeviceGetUtilizationRates(h), 2000),
        "nvmlDeviceGetComputeRunningProcesses_v3": (
            lambda: nv.nvmlDeviceGetComputeRunningProcesses_v3(h),
            2000,
        ),
        "nvmlDeviceGetPerformanceState": (lambda: nv.nvmlDeviceGetPerformanceState(h), 2000),
        "nvmlDeviceGetMemoryInfo": (lambda: nv.nvmlDeviceGetMemoryInfo(h), 500),
        "nvmlDeviceGetRemappedRows": (lambda: nv.nvmlDeviceGetRemappedRows(h), 500),
        "nvmlDeviceGetFanSpeed": (lambda: nv.nvmlDeviceGetFanSpeed(h), 500),
        "nvmlDeviceGetFieldValues": (lambda: nv.nvmlDeviceGetFieldValues(h, fields), 20),
        "nvmlDeviceGetTotalEnergyConsumption": (
            lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h),
            20,
        ),
        "nvmlDeviceGetMaxClockInfo": (
            lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM),
            10,
        ),
        "nvmlDeviceGetTemperatureThreshold": (
            lambda: nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
            20,
        ),
        "nvmlDeviceGetPcieThroughput": (
            lambda: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES),
            5,
        ),
    }


def event_wait(h: Any, timeout_ms: int, iters: int) -> tuple[float, float]:
    """(wall, CPU) µs of one ``nvmlEventSetWait_v2`` that times out (no XID fires)."""
    event_set = pynvml.nvmlEventSetCreate()
    try:
        pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, event_set)
        return timed(lambda: pynvml.nvmlEventSetWait_v2(event_set, timeout_ms), iters)
    finally:
        pynvml.nvmlEventSetFree(event_set)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        rows: dict[str, dict[str, float]] = {}
        for call, (fn, iters) in calls(h).items():
            runs = [timed(fn, iters) for _ in range(args.repeats)]
            rows[call] = {
                "wall_us": statistics.median(w for w, _ in runs),
                "cpu_us": statistics.median(c for _, c in runs),
                "iters": iters,
            }
        for timeout_ms, iters in ((1, 50), (1000, 2)):
            wall, cpu = event_wait(h, timeout_ms, iters)
            rows[f"nvmlEventSetWait_v2 ({timeout_ms} ms timeout)"] = {
                "wall_us": wall,
                "cpu_us": cpu,
                "iters": iters,
            }
    finally:
        pynvml.nvmlShutdown()
    print(f"# {name}, median of {args.repeats} runs")
    print("| call | wall µs | CPU µs | CPU share |")
    print("| --- | ---: | ---: | ---: |")
    for call, r in rows.items():
        share = r["cpu_us"] / r["wall_us"] if r["wall_us"] else 0.0
        print(f"| {call} | {r['wall_us']:.2f} | {r['cpu_us']:.2f} | {share:.0%} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": str(name), "repeats": args.repeats, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
