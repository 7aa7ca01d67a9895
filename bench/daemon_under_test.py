"""Run ``gpuwatchd`` for a bench: pynvml optionally replaced by the cost-faithful fake.

    python3 bench/daemon_under_test.py [--fake-gpus N] [--fake-costs hot|pace]
        [--threads-file F] -- run --backend nvml ...

``--fake-gpus N``: ``import pynvml`` yields ``FakeNvml(N, costs=...)`` from
tests/fakes_nvml.py (``--fake-costs hot``: REAL_CALL_COSTS, ``pace``:
DAEMON_PACE_CALL_COSTS), so the daemon's own NVML backend (``--backend nvml``) runs
against calls that cost what real ones do, on a host without N GPUs.
``--threads-file F``: on SIGUSR1, write ``{"threads": {native thread id: name}, "modules":
[...]}`` to F (JSON), so a bench can name the per-thread CPU time it reads from /proc and
see what the process imported (memory).

Everything after ``--`` is gpuwatchd's own command line. Which gpuwatchd runs is whatever
``import gpuwatchd`` finds (PYTHONPATH picks this tree or a baseline copy).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

TESTS = Path(__file__).resolve().parents[1] / "tests"


def install_fake_nvml(gpus: int, costs: str) -> None:
    """Make ``import pynvml`` return a fake of ``gpus`` GPUs whose calls cost real time:
    ``hot`` the hot-loop costs, ``pace`` those of calls made at 10 Hz."""
    sys.path.append(str(TESTS))
    from fakes_nvml import DAEMON_PACE_CALL_COSTS, REAL_CALL_COSTS, FakeNvml

    table = {"hot": REAL_CALL_COSTS, "pace": DAEMON_PACE_CALL_COSTS}[costs]
    sys.modules["pynvml"] = FakeNvml(gpus, costs=table)


def dump_threads_on_sigusr1(path: str) -> None:
    def dump(_signum: int, _frame: FrameType | None) -> None:
        names = {str(t.native_id): t.name for t in threading.enumerate()}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"threads": names, "modules": sorted(sys.modules)}, f)
        os.replace(tmp, path)

    signal.signal(signal.SIGUSR1, dump)


def main() -> int:
    argv = sys.argv[1:]
    if "--" not in argv:
        print("daemon_under_test: put gpuwatchd's arguments after '--'", file=sys.stderr)
        return 2
    split = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fake-gpus", type=int, default=0, help="fake GPUs (0: the real pynvml)")
    ap.add_argument(
        "--fake-costs", choices=("hot", "pace"), default="hot", help="the fake's cost table"
    )
    ap.add_argument("--threads-file", help="where SIGUSR1 writes the thread-name map")
    args = ap.parse_args(argv[:split])
    if args.fake_gpus < 0:
        ap.error(f"--fake-gpus must be >= 0, got {args.fake_gpus}")
    if args.fake_gpus:
        install_fake_nvml(args.fake_gpus, args.fake_costs)
    if args.threads_file:
        dump_threads_on_sigusr1(args.threads_file)
    from gpuwatchd.cli.main import main as gpuwatchd_main

    return gpuwatchd_main(argv[split + 1 :])


if __name__ == "__main__":
    sys.exit(main())
