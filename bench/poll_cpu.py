"""CPU per GPU poll in the daemon's own objects, A/B between trees in one run.

Builds a real :class:`~gpuwatchd.daemon.process.Daemon` (tuning and drift off, so its
poller has the listeners ``gpuwatchd run`` gives it) over the daemon's NVML backend on
the cost-faithful fake (tests/fakes_nvml.py, ``--costs hot|pace``), starts no thread,
and drives ``Poller.poll_once`` for every GPU from the main thread once per period, as
the sweeper does, so caches are as cold as in production. Reports the thread CPU time
(``time.thread_time``) per GPU poll, NVML's own busy time included, and where it goes
(``--profile``: cProfile's top functions). ``--tree DIR`` runs the same measurement
from another tree (``git archive HEAD gpuwatchd | tar -x -C DIR``) in a subprocess,
alternating with this tree, so both see the same machine load.

Usage: python3 bench/poll_cpu.py [--gpus 8] [--sweeps 200] [--period 0.1]
           [--costs hot] [--tree DIR] [--rounds 3] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


def measure(gpus: int, sweeps: int, period: float, costs: str, profile: bool) -> dict[str, object]:
    """µs of this thread's CPU per GPU poll over ``sweeps`` paced sweeps (after a warm-up)."""
    sys.path.append(str(ROOT / "tests"))
    from fakes_nvml import DAEMON_PACE_CALL_COSTS, REAL_CALL_COSTS, FakeNvml  # type: ignore[import-not-found]

    sys.modules["pynvml"] = FakeNvml(
        gpus, costs={"hot": REAL_CALL_COSTS, "pace": DAEMON_PACE_CALL_COSTS}[costs]
    )
    from gpuwatchd.config import load_config
    from gpuwatchd.daemon.process import Daemon

    state = Path(tempfile.mkdtemp(prefix="gpuwatchd-pollcpu-"))
    config = state / "config.toml"
    config.write_text(
        "[tuning]\nenabled = false\n\n[drift]\nenabled = false\n\n"
        f'[daemon]\nbackend = "nvml"\nstate_dir = "{state}"\nlisten = "127.0.0.1:0"\n'
        f"poll_interval_s = {period}\n"
        f'control_socket = "{state / "control.sock"}"\n'
    )
    daemon = Daemon(load_config(str(config)), config_path=str(config))
    poller = daemon.poller
    for gpu in daemon.backend.devices():
        poller.poll(gpu)
    for gpu in daemon.backend.devices():  # energy and health fields, as the daemon starts
        poller._read_slow(poller._tracks[gpu])
    tracks = list(poller._tracks.values())
    warmup = max(10, sweeps // 5)
    prof = cProfile.Profile() if profile else None
    cpu = 0.0
    per_sweep: list[float] = []
    next_at = time.monotonic()
    for k in range(warmup + sweeps):
        next_at += period
        time.sleep(max(0.0, next_at - time.monotonic()))
        if prof is not None and k == warmup:
            prof.enable()
        c0 = time.thread_time()
        for track in tracks:
            poller.poll_once(track)
        spent = time.thread_time() - c0
        if k >= warmup:
            cpu += spent
            per_sweep.append(spent)
    out: dict[str, object] = {
        "us_per_gpu_poll": cpu / (sweeps * gpus) * 1e6,
        "median_sweep_us": statistics.median(per_sweep) * 1e6,
        "pct_of_core": cpu / (sweeps * period) * 100,
    }
    if prof is not None:
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(22)
        stats.sort_stats("cumulative").print_stats(30)
        out["profile"] = text.getvalue()
    return out


def run_tree(tree: str, args: argparse.Namespace) -> dict[str, object]:
    argv = [sys.executable, __file__, "--child", "--gpus", str(args.gpus), "--sweeps",
            str(args.sweeps), "--period", str(args.period), "--costs", args.costs]  # fmt: skip
    if args.profile:
        argv.append("--profile")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (tree, ROOT.as_posix()) if p)}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--sweeps", type=int, default=200)
    ap.add_argument("--period", type=float, default=0.1)
    ap.add_argument("--costs", choices=("hot", "pace"), default="hot")
    ap.add_argument("--tree", help="a second tree holding a gpuwatchd package (baseline)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the trees")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gpus < 1 or args.sweeps < 1 or not args.period > 0 or args.rounds < 1:
        ap.error("--gpus, --sweeps, --rounds must be >= 1 and --period > 0")
    if args.child:
        print(json.dumps(measure(args.gpus, args.sweeps, args.period, args.costs, args.profile)))
        return 0
    trees = {"new": str(ROOT)}
    if args.tree:
        trees["baseline"] = str(Path(args.tree).resolve())
    results: dict[str, list[dict[str, object]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            results[name].append(run_tree(tree, args))
    for name, runs in results.items():
        us = [float(r["us_per_gpu_poll"]) for r in runs]  # type: ignore[arg-type]
        pct = statistics.median(float(r["pct_of_core"]) for r in runs)  # type: ignore[arg-type]
        print(
            f"{name:9s} {statistics.median(us):6.1f} µs per GPU poll (runs: "
            f"{', '.join(f'{u:.1f}' for u in us)}); {args.gpus} GPUs every {args.period:g} s "
            f"= {pct:.3f}% of a core"
        )
        if args.profile:
            print(runs[-1]["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
