"""SIGKILL during store writes, many times (the long form of tests/test_faults_store.py).

A child process writes complete tuning sessions (start, two results with eight
candidates each, finish completed) to one SQLite store in a loop and prints each id once
its last transaction committed; it is SIGKILLed at a random moment 20-400 ms after it is
ready, ``--kills`` times. After every kill the store must open without being moved aside,
hold every printed session completed with both results, and the session cut off must be
marked failed (abandoned) by the next opener, once. The store's totals must agree.
SQLite is the only store back end there is.

    python bench/faults_store.py --kills 60
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from store_faults import kill_writers  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)  # one "marked failed" WARNING per kill otherwise
    path = Path(tempfile.mkdtemp(prefix="gpuwatchd-faults-store-")) / "kill.db"
    t0 = time.monotonic()
    report = kill_writers(path, args.kills, seed=args.seed)
    print(
        f"{report.kills} SIGKILLs during writes ({time.monotonic() - t0:.0f} s): "
        f"{report.committed} sessions committed and printed, all found complete: "
        f"{not report.problems}; {report.abandoned} cut-off sessions marked failed; "
        f"store moved aside: {any('moved aside' in p for p in report.problems)}"
    )
    for p in report.problems:
        print("PROBLEM", p)
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
