"""CPU a job pays to import gpuwatchd's job-side modules, beside a bare interpreter.

    python3 bench/job_import_cpu.py [--runs 20] [--tree DIR ...] [--out FILE]

Each run is a fresh ``python3 -c "import <module>"`` (``pass`` for the bare interpreter),
started with the tree as its working directory so that tree's ``gpuwatchd`` is the one
imported (``--tree`` more than once compares trees, e.g. before and after a change); an
untimed first run of each writes its bytecode, as an installed package has it. The
commands alternate run by run; the CPU of each is the child's user + system time
(``os.wait4``). Prints and writes (``--out``) the median and the spread per command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODULES = ("gpuwatchd.client", "gpuwatchd.triton", "gpuwatchd.torch")


def one_run(code: str, tree: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one fresh interpreter running ``code``."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")
    }
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", code], cwd=tree, env=env)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"{code!r} in {tree}: exit {p.returncode}")
    return usage.ru_utime + usage.ru_stime, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--tree", action="append", default=None, help="default: this checkout")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    trees = [Path(t).resolve() for t in (args.tree or [str(ROOT)])]
    commands = [("bare interpreter", "pass", trees[0])]
    commands += [(f"import {m} ({t})", f"import {m}", t) for t in trees for m in MODULES]
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in commands}
    wall: dict[str, list[float]] = {name: [] for name, _, _ in commands}
    for _, code, tree in commands:  # one untimed run each: the page cache, .pyc files written
        one_run(code, tree)
    for _ in range(args.runs):
        for name, code, tree in commands:
            c, w = one_run(code, tree)
            cpu[name].append(c)
            wall[name].append(w)
    bare = statistics.median(cpu["bare interpreter"])
    doc: dict[str, Any] = {"python": sys.version.split()[0], "runs": args.runs, "results": {}}
    for name, _, _ in commands:
        med = statistics.median(cpu[name])
        doc["results"][name] = {
            "cpu_s_median": med,
            "cpu_s_min": min(cpu[name]),
            "cpu_s_max": max(cpu[name]),
            "wall_s_median": statistics.median(wall[name]),
            "times_bare": med / bare if bare > 0 else None,
        }
        print(
            f"{name:60s} CPU {med * 1e3:7.1f} ms (min {min(cpu[name]) * 1e3:.1f}, "
            f"max {max(cpu[name]) * 1e3:.1f}), {med / bare:.1f}x bare"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
