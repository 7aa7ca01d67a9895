"""How fast a GPU's power readings and its power limiter follow a load step.

The protocol's power probe loads a kernel back to back for ``power_probe_s`` (1 s) before
it trusts a power reading, because ``nvmlDeviceGetPowerUsage`` is a 1 s average on recent
GPUs; and its unthrottled regime paces short batches so the limiter never engages. Both
rules cost tuning time. This bench measures what they rest on, on the lent GPU:

- ``step``: idle, then a bf16 GEMM back to back for ``--load-s``, then idle again
  (``--steps`` times). NVML is sampled every few milliseconds: averaged power
  (``nvmlDeviceGetPowerUsage``), instantaneous power (field ``POWER_INSTANT``), SM clock
  and the clock-event reasons. Per step: when instantaneous power, averaged power and the
  SM clock reach 95% of their plateau, and when a power-cap reason is first seen.
- ``paced``: the same GEMM in ``--batch-ms`` batches with idle pauses between them, for
  each of ``--pauses-ms`` (the unthrottled regime's duty cycle is 10 ms on, 25 ms off),
  each after the GPU idled: whether the clock ever leaves its maximum.

It only reads GPU state and runs kernels; it never changes a GPU setting.

    python3 bench/decisions/gpu_power_step.py --out DIR [--load-s 3 --steps 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pynvml
import torch

POWER_INSTANT = getattr(pynvml, "NVML_FI_DEV_POWER_INSTANT", 186)
POWER_CAP_BITS = 0x4 | 0x80  # SW power cap, HW power brake


class Sampler(threading.Thread):
    """Reads NVML as fast as it answers, with a small sleep; keeps every sample."""

    def __init__(self, handle: Any, period_s: float) -> None:
        super().__init__(daemon=True)
        self.handle = handle
        self.period_s = period_s
        self.samples: list[dict[str, float]] = []
        self.marks: list[tuple[float, str]] = []
        self._halt = threading.Event()

    def mark(self, label: str) -> None:
        self.marks.append((time.perf_counter(), label))

    def run(self) -> None:
        h = self.handle
        while not self._halt.is_set():
            t = time.perf_counter()
            avg = pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0
            fv = pynvml.nvmlDeviceGetFieldValues(h, [POWER_INSTANT])[0]
            inst = fv.value.uiVal / 1000.0 if fv.nvmlReturn == 0 else float("nan")
            clock = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
            reasons = pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
            self.samples.append(
                {"t": t, "avg_w": avg, "inst_w": inst, "sm_mhz": clock, "reasons": reasons}
            )
            time.sleep(self.period_s)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def first_at(samples: list[dict[str, float]], t0: float, key: str, level: float) -> float | None:
    """Seconds after t0 at which ``key`` first reaches ``level`` (>=)."""
    for s in samples:
        if s["t"] >= t0 and s[key] >= level:
            return s["t"] - t0
    return None


def first_below(samples: list[dict[str, float]], t0: float, key: str, level: float) -> float | None:
    for s in samples:
        if s["t"] >= t0 and s[key] < level:
            return s["t"] - t0
    return None


def step_summary(
    samples: list[dict[str, float]], t0: float, t1: float, max_mhz: float
) -> dict[str, Any]:
    """Times to 95% of each plateau (the last second of the load), and the first cap."""
    inside = [s for s in samples if t0 <= s["t"] <= t1]
    tail = [s for s in inside if s["t"] >= t1 - 1.0]
    plateau = {k: statistics.median(s[k] for s in tail) for k in ("avg_w", "inst_w", "sm_mhz")}
    cap = next((s["t"] - t0 for s in inside if int(s["reasons"]) & POWER_CAP_BITS), None)
    return {
        "plateau": plateau,
        "inst_w_95_s": first_at(inside, t0, "inst_w", 0.95 * plateau["inst_w"]),
        "avg_w_95_s": first_at(inside, t0, "avg_w", 0.95 * plateau["avg_w"]),
        "first_power_cap_reason_s": cap,
        "sm_below_0.9_max_s": first_below(inside, t0, "sm_mhz", 0.9 * max_mhz),
        "sm_within_2pct_of_plateau_s": next(
            (
                s["t"] - t0
                for s in inside
                if abs(s["sm_mhz"] - plateau["sm_mhz"]) <= 0.02 * plateau["sm_mhz"]
                and s["t"] - t0 > 0.05
            ),
            None,
        ),
        "samples": len(inside),
    }


def paced_summary(
    samples: list[dict[str, float]],
    pause_ms: float,
    t0: float,
    t1: float,
    batch_calls: int,
    per_call: float,
    max_mhz: float,
) -> dict[str, Any]:
    inside = [s for s in samples if t0 <= s["t"] <= t1]
    return {
        "batch_calls": batch_calls,
        "batch_ms": batch_calls * per_call * 1e3,
        "pause_ms": pause_ms,
        "min_sm_mhz": min(s["sm_mhz"] for s in inside),
        "samples_under_0.9_max": sum(1 for s in inside if s["sm_mhz"] < 0.9 * max_mhz),
        "max_inst_w": max(s["inst_w"] for s in inside),
        "max_avg_w": max(s["avg_w"] for s in inside),
        "power_cap_reason_samples": sum(1 for s in inside if int(s["reasons"]) & POWER_CAP_BITS),
        "samples": len(inside),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--load-s", type=float, default=3.0)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-ms", type=float, default=10.0)
    ap.add_argument("--pauses-ms", default="25", help="comma-separated pauses to try")
    ap.add_argument("--paced-s", type=float, default=4.0)
    ap.add_argument("--period-ms", type=float, default=2.0)
    ap.add_argument("--n", type=int, default=8192, help="GEMM size (n x n x n, bf16)")
    args = ap.parse_args()

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    max_mhz = float(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM))
    limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0
    driver = pynvml.nvmlSystemGetDriverVersion()
    a = torch.randn(args.n, args.n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.n, args.n, device="cuda", dtype=torch.bfloat16)
    c = a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    per_call = (time.perf_counter() - t) / 10
    batch_calls = max(1, round(args.batch_ms / 1e3 / per_call))

    def load(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(4):
                torch.matmul(a, b, out=c)
            torch.cuda.synchronize()

    sampler = Sampler(handle, args.period_ms / 1e3)
    sampler.start()
    time.sleep(args.idle_s)
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        load(args.load_s)
        t1 = time.perf_counter()
        steps.append((t0, t1))
        time.sleep(args.idle_s)
    paced_windows = []
    for pause_ms in (float(p) for p in args.pauses_ms.split(",")):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < args.paced_s:
            for _ in range(batch_calls):
                torch.matmul(a, b, out=c)
            torch.cuda.synchronize()
            time.sleep(pause_ms / 1e3)
        paced_windows.append((pause_ms, t0, time.perf_counter()))
        time.sleep(args.idle_s)
    time.sleep(1.0)
    sampler.stop()
    pynvml.nvmlShutdown()

    samples = sampler.samples
    doc = {
        "command": "python3 bench/decisions/gpu_power_step.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "device": torch.cuda.get_device_name(0),
        "driver": driver,
        "max_sm_mhz": max_mhz,
        "power_limit_w": limit_w,
        "gemm_ms": per_call * 1e3,
        "sample_period_ms_median": 1e3
        * statistics.median(b["t"] - a["t"] for a, b in itertools.pairwise(samples)),
        "steps": [step_summary(samples, t0, t1, max_mhz) for t0, t1 in steps],
        "paced": [
            paced_summary(samples, *w, batch_calls, per_call, max_mhz) for w in paced_windows
        ],
        "trace": [
            {**s, "t": round(s["t"] - steps[0][0], 4)}
            for s in samples[:: max(1, len(samples) // 6000)]
        ],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "power-step.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "trace"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
