"""Cost of one ``add_workloads`` on the daemon's kept list as the list grows.

Times :meth:`gpuwatchd.daemon.added_workloads.AddedWorkloads.add` of one workload (the
part of an ``add_workloads`` request that grows with the list: keeping it on disk) at
100, 1,000 and 10,000 workloads already added, in a fresh temporary state directory.
Run it with ``PYTHONPATH`` pointing at the code to measure::

    PYTHONPATH=. python3 bench/decisions/added_workloads_add.py --adds 200
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from gpuwatchd.daemon.added_workloads import FILE_NAME, AddedWorkloads
from gpuwatchd.tuning.types import Workload

SOURCE = {"kind": "capture", "host": "bench", "pid": 1, "torch": "2.11.0"}


def workload(i: int) -> Workload:
    shape = {"m": 64 + i % 7, "n": 64, "k": 64}
    return Workload(f"model{i:06d}.gemm.float16", "matmul", shape, "float16", ("torch.matmul",))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--adds", type=int, default=200, help="timed adds at each size")
    p.add_argument("--sizes", default="100,1000,10000")
    args = p.parse_args()
    kept = AddedWorkloads(Path(tempfile.mkdtemp(prefix="gw-bench-")) / FILE_NAME)
    kept.load()
    serial = 0
    for size in (int(s) for s in args.sizes.split(",")):
        while len(kept.names()) < size:
            batch = [workload(serial + j) for j in range(min(500, size - len(kept.names())))]
            kept.add(batch, SOURCE)
            serial += len(batch)
        times = []
        for _ in range(args.adds):
            t0 = time.perf_counter()
            kept.add([workload(serial)], SOURCE)
            times.append(time.perf_counter() - t0)
            serial += 1
        ms = [t * 1000 for t in times]
        print(
            f"{size:6d} added: one add median {statistics.median(ms):7.2f} ms, "
            f"mean {statistics.fmean(ms):7.2f} ms, max {max(ms):7.1f} ms"
        )


if __name__ == "__main__":
    main()
