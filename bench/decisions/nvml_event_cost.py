"""What NVML's XID event subscription costs a process: CPU, wall time and memory per step.

The daemon counts XID errors from an NVML event set (``gpuwatchd.telemetry.nvml_xid``).
This measures each step of that on the lent GPU, in a fresh process, beside the steps
every NVML reader pays: ``import pynvml``, ``nvmlInit``, a device handle, one read; then
``nvmlEventSetCreate``, ``nvmlDeviceGetSupportedEventTypes``,
``nvmlDeviceRegisterEvents`` (XID only), a few 100 ms ``nvmlEventSetWait`` calls, and a
registration on a set another thread is waiting on (the order the daemon used to take).
Each row: wall seconds, process CPU seconds (utime + stime) and RSS / anonymous RSS
after the step. It subscribes to events only; it changes no GPU setting.

    python3 bench/decisions/nvml_event_cost.py [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any


def rss_kib() -> tuple[int, int]:
    vm = anon = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                vm = int(line.split()[1])
            elif line.startswith("RssAnon:"):
                anon = int(line.split()[1])
    return vm, anon


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--waits", type=int, default=5)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []

    def step(name: str, fn: Any) -> Any:
        w0, c0 = time.perf_counter(), cpu_s()
        value = fn()
        vm, anon = rss_kib()
        rows.append(
            {
                "step": name,
                "wall_s": time.perf_counter() - w0,
                "cpu_s": cpu_s() - c0,
                "rss_mib": vm / 1024,
                "anon_mib": anon / 1024,
            }
        )
        return value

    vm, anon = rss_kib()
    rows.append({"step": "interpreter", "wall_s": 0, "cpu_s": cpu_s(), "rss_mib": vm / 1024,
                 "anon_mib": anon / 1024})  # fmt: skip
    nv = step("import pynvml", lambda: __import__("pynvml"))
    step("nvmlInit", nv.nvmlInit)
    h = step("handle", lambda: nv.nvmlDeviceGetHandleByIndex(0))
    step("one read (power, temp, clocks)", lambda: (
        nv.nvmlDeviceGetPowerUsage(h),
        nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
        nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
    ))  # fmt: skip
    es = step("nvmlEventSetCreate", nv.nvmlEventSetCreate)
    supported = step(
        "nvmlDeviceGetSupportedEventTypes", lambda: nv.nvmlDeviceGetSupportedEventTypes(h)
    )
    step("nvmlDeviceRegisterEvents (XID)", lambda: nv.nvmlDeviceRegisterEvents(h, 0x8, es))
    for i in range(args.waits):

        def wait() -> None:
            try:
                nv.nvmlEventSetWait_v2(es, 100)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) != nv.NVML_ERROR_TIMEOUT:
                    raise

        step(f"nvmlEventSetWait 100 ms #{i + 1}", wait)
    step("nvmlEventSetFree", lambda: nv.nvmlEventSetFree(es))
    # The daemon's order before the fix: a thread already waits on the set (3 s timeout)
    # when the GPU is registered on it.
    es2 = nv.nvmlEventSetCreate()

    def waiter() -> None:
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlEventSetWait_v2(es2, 3000)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    step(
        "nvmlDeviceRegisterEvents (XID) while another thread waits on the set (3 s)",
        lambda: nv.nvmlDeviceRegisterEvents(h, 0x8, es2),
    )
    t.join()
    nv.nvmlEventSetFree(es2)
    step("nvmlShutdown", nv.nvmlShutdown)
    doc = {"supported_event_types": supported, "rows": rows}
    print(f"supported event types: {supported:#x}")
    print("| step | wall s | CPU s | RSS MiB | anon MiB |\n| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['step']} | {r['wall_s']:.3f} | {r['cpu_s']:.3f} | {r['rss_mib']:.1f} "
              f"| {r['anon_mib']:.1f} |")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
