"""What one NVML poll costs: raw pynvml calls against NvmlBackend, per GPU.

For every GPU it times, in µs per call (median over --repeats runs of --iters calls):
each fast field's raw pynvml call alone, all of them together, ``NvmlBackend.read``;
then, with --slow-iters calls, the energy counter raw and through ``read_energy``, the
memory-temperature field value, the max SM clock and ``device_info(refresh=True)``.
It prints a table and writes JSON to --out. It only reads: no GPU setting is changed.
On a host without NVML or without a GPU it prints one line and exits 0.

    python bench/nvml_poll_cost.py --out nvml_poll_cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwatchd.telemetry.backend import BackendUnavailable, TelemetryError
from gpuwatchd.telemetry.nvml import NvmlBackend


def per_call_us(fn: Callable[[], Any], iters: int, repeats: int) -> list[float]:
    """µs per call of each of ``repeats`` timed runs of ``iters`` calls (after a warm-up)."""
    for _ in range(min(iters, 100)):
        fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter_ns() - start) / iters / 1000.0)
    return runs


def raw_fast_calls(nv: Any, handle: Any) -> dict[str, Callable[[], Any]]:
    """The raw pynvml calls behind ``read``, one closure each, as a user would write them."""
    reasons = getattr(
        nv, "nvmlDeviceGetCurrentClocksEventReasons", nv.nvmlDeviceGetCurrentClocksThrottleReasons
    )
    return {
        "temperature": lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU),
        "power": lambda: nv.nvmlDeviceGetPowerUsage(handle),
        "sm_clock": lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM),
        "mem_clock": lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_MEM),
        "clock_reasons": lambda: reasons(handle),
        "utilization": lambda: nv.nvmlDeviceGetUtilizationRates(handle),
        "processes": lambda: nv.nvmlDeviceGetComputeRunningProcesses(handle),
        "pstate": lambda: nv.nvmlDeviceGetPerformanceState(handle),
    }


def supported(nv: Any, fn: Callable[[], Any]) -> str | None:
    """None if the call works on this GPU, else NVML's reason."""
    try:
        fn()
    except (nv.NVMLError, TelemetryError) as exc:
        return str(exc)
    return None


def bench_gpu(
    nv: Any, backend: NvmlBackend, gpu: int, iters: int, slow_iters: int, repeats: int
) -> dict[str, Any]:
    handle = nv.nvmlDeviceGetHandleByIndex(gpu)
    info = backend.device_info(gpu)
    rows: dict[str, dict[str, Any]] = {}

    def timed(label: str, fn: Callable[[], Any], n: int) -> None:
        why = supported(nv, fn)
        if why is not None:
            rows[label] = {"unsupported": why}
            return
        runs = per_call_us(fn, n, repeats)
        rows[label] = {"median_us": statistics.median(runs), "runs_us": runs, "iters": n}

    timed("loop overhead (empty lambda)", lambda: None, iters)
    fast = raw_fast_calls(nv, handle)
    for label, fn in fast.items():
        timed(f"raw {label}", fn, iters)
    working = [fn for label, fn in fast.items() if "unsupported" not in rows[f"raw {label}"]]

    def together() -> None:
        for fn in working:
            fn()

    timed("raw fast fields together", together, iters)
    timed("NvmlBackend.read", lambda: backend.read(gpu), iters)

    def mem_temp() -> Any:
        value = nv.nvmlDeviceGetFieldValues(handle, [nv.NVML_FI_DEV_MEMORY_TEMP])[0]
        if value.nvmlReturn != nv.NVML_SUCCESS:
            raise nv.NVMLError(value.nvmlReturn)
        return value

    timed("raw memory temperature (field value)", mem_temp, slow_iters)
    timed("raw total energy", lambda: nv.nvmlDeviceGetTotalEnergyConsumption(handle), slow_iters)
    timed("NvmlBackend.read_energy (+ memory temp)", lambda: backend.read_energy(gpu), slow_iters)
    timed(
        "raw max SM clock", lambda: nv.nvmlDeviceGetMaxClockInfo(handle, nv.NVML_CLOCK_SM),
        max(1, slow_iters // 4),
    )  # fmt: skip
    timed(
        "NvmlBackend.device_info(refresh=True)",
        lambda: backend.device_info(gpu, refresh=True),
        max(1, slow_iters // 10),
    )
    raw = rows["raw fast fields together"].get("median_us")
    wrapped = rows["NvmlBackend.read"].get("median_us")
    sample = backend.read(gpu)
    return {
        "index": gpu,
        "name": info.name,
        "uuid": info.uuid,
        "driver_version": info.driver_version,
        "rows": rows,
        "read_over_raw": wrapped / raw if raw and wrapped else None,
        "last_sample": {
            "temp_c": sample.temp_c,
            "power_w": sample.power_w,
            "sm_clock_mhz": sample.sm_clock_mhz,
            "reasons": sample.reasons.names() if sample.reasons is not None else None,
            "mem_temp_c": sample.mem_temp_c,
            "procs": len(sample.procs) if sample.procs is not None else None,
        },
    }


def print_table(result: dict[str, Any]) -> None:
    for g in result["gpus"]:
        print(f"\nGPU {g['index']}: {g['name']} (driver {g['driver_version']})")
        print(f"{'call':44} {'µs/call':>10} {'min':>9} {'max':>9}")
        for label, row in g["rows"].items():
            if "unsupported" in row:
                print(f"{label:44} {'unsupported: ' + row['unsupported']:>30}")
                continue
            runs = row["runs_us"]
            print(f"{label:44} {row['median_us']:10.2f} {min(runs):9.2f} {max(runs):9.2f}")
        ratio = g["read_over_raw"]
        print(f"NvmlBackend.read / raw together: {ratio:.2f}x" if ratio else "ratio: n/a")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    parser.add_argument("--iters", type=int, default=20000, help="calls per run, fast fields")
    parser.add_argument("--slow-iters", type=int, default=200, help="calls per run, slow ones")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per row")
    args = parser.parse_args(argv)
    for name in ("iters", "slow_iters", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    try:
        backend = NvmlBackend()
    except BackendUnavailable as exc:
        print(f"nvml_poll_cost: skipped: {exc}")
        args.out.write_text(json.dumps({"skipped": str(exc), "gpus": []}, indent=2) + "\n")
        return 0
    import pynvml as nv  # type: ignore[import-untyped]  # present: NvmlBackend just started with it

    nv.nvmlInit()  # our own reference for the raw calls; NVML counts them
    try:
        result = {
            "host": platform.node(),
            "python": platform.python_version(),
            "pynvml": getattr(nv, "__version__", None) or _dist_version("nvidia-ml-py"),
            "iters": args.iters,
            "slow_iters": args.slow_iters,
            "repeats": args.repeats,
            "statistic": "median over repeats of mean µs per call",
            "gpus": [
                bench_gpu(nv, backend, gpu, args.iters, args.slow_iters, args.repeats)
                for gpu in backend.devices()
            ],
        }
    finally:
        nv.nvmlShutdown()
        backend.close()
    print_table(result)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


def _dist_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
