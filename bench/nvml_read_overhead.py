"""gpuwatchd's own CPU per ``NvmlBackend.read``, A/B between trees in one run.

``read`` runs against a stub pynvml whose getters return constants at once, so what is
timed is the backend's Python alone (the field loop, conversions, the ``Sample``), not
the driver and not a fake's bookkeeping: the part a change to the read path can move.
``bench/poll_cpu.py`` times the whole poll, whose noise on a shared machine is larger
than this part. ``--tree DIR`` times another tree's backend in a subprocess
(``git archive <rev> gpuwatchd | tar -x -C DIR``), alternating with this one.

Usage: python3 bench/nvml_read_overhead.py [--tree DIR] [--rounds 3] [--reads 50000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent


class _NvmlError(Exception):
    def __init__(self, value: int | None = None) -> None:
        super().__init__(value)
        self.value = value


def stub_nvml() -> types.ModuleType:
    """One H200 under a power-capped matmul, as constants; functions it lacks are
    unsupported (FunctionNotFound), as on a driver without them."""
    nv = types.ModuleType("pynvml")
    util = SimpleNamespace(gpu=97, memory=40)
    procs = [SimpleNamespace(pid=4242, usedGpuMemory=1 << 30)]
    values = {
        "NVMLError": _NvmlError,
        "NVML_TEMPERATURE_GPU": 0,
        "NVML_CLOCK_SM": 1,
        "NVML_CLOCK_MEM": 2,
        "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN": 1,
        "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN": 0,
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 1,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetUUID": lambda h: "GPU-stub",
        "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId="00000000:19:00.0"),
        "nvmlDeviceGetTemperature": lambda h, sensor: 61,
        "nvmlDeviceGetPowerUsage": lambda h: 693_500,
        "nvmlDeviceGetClockInfo": lambda h, clock: 1440,
        "nvmlDeviceGetCurrentClocksEventReasons": lambda h: 0x4,
        "nvmlDeviceGetUtilizationRates": lambda h: util,
        "nvmlDeviceGetComputeRunningProcesses_v3": lambda h: procs,
        "nvmlDeviceGetPerformanceState": lambda h: 0,
    }
    for name, value in values.items():
        setattr(nv, name, value)
    return nv


def measure(reads: int, repeats: int) -> dict[str, float]:
    """µs of this thread's CPU per read: median and best of ``repeats`` timed runs."""
    from gpuwatchd.telemetry.nvml import NvmlBackend

    read = NvmlBackend(nvml=stub_nvml()).read
    for _ in range(reads // 2):  # warm-up: unsupported getters learnt, caches filled
        read(0)
    runs = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(reads):
            read(0)
        runs.append((time.thread_time() - start) / reads * 1e6)
    return {"median_us": statistics.median(runs), "best_us": min(runs)}


def run_tree(tree: str, reads: int, repeats: int) -> dict[str, float]:
    argv = [sys.executable, __file__, "--child", "--reads", str(reads), "--repeats", str(repeats)]
    env = {**os.environ, "PYTHONPATH": tree}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, cwd=tree)
    result: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", help="a second tree holding a gpuwatchd package (baseline)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the trees")
    ap.add_argument("--reads", type=int, default=50_000)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 1 or args.reads < 1 or args.repeats < 1:
        ap.error("--rounds, --reads and --repeats must be >= 1")
    if args.child:
        print(json.dumps(measure(args.reads, args.repeats)))
        return 0
    trees = {"new": str(ROOT)}
    if args.tree:
        trees["baseline"] = str(Path(args.tree).resolve())
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            results[name].append(run_tree(tree, args.reads, args.repeats))
    for name, runs in results.items():
        medians = [r["median_us"] for r in runs]
        print(
            f"{name:9s} {statistics.median(medians):.2f} µs of CPU per read (runs: "
            f"{', '.join(f'{m:.2f}' for m in medians)}; best {min(r['best_us'] for r in runs):.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
