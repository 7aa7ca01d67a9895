"""/metrics in both formats, this tree against a baseline tree, in one run: render time
of the daemon's populated registry, and scrape latency with Prometheus' Accept header.

render  In a child process per tree (its PYTHONPATH picks the tree), the daemon's own
        registry (tests/daemon_registry.py: simulated GPUs, gpu/health/tuning/drift/fleet
        collectors populated) is rendered by ``MetricsRenderer`` right after a poll of
        every GPU, as a scrape after a board change is: text (no Accept) and OpenMetrics
        (Prometheus 2.x's Accept). Trees alternate for ``--rounds`` rounds, so neighbours'
        load on a shared host hits both alike; CPU time per render is reported beside the
        wall time.
scrape  Each tree as a real ``gpuwatchd run --backend nvml`` against the cost-faithful fake
        (bench/daemon_cost.py's subject: 8 fake GPUs polled at 10 Hz, tuning and drift
        off), all running throughout, scraped one at a time in ``--rounds`` turns: 10
        client processes each scrape once a second (kept-alive connections, as
        Prometheus) sending Prometheus' Accept header, or none (text).

    git archive HEAD gpuwatchd | tar -x -C /tmp/base
    python3 bench/openmetrics_cost.py --baseline /tmp/base --out /tmp/om [--gpus 8]
        [--renders 200] [--rounds 3] [--scrape-seconds 30] [--phases render,scrape]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
# Not imported here: bench/scrape_latency.py puts this tree first on sys.path, and a render
# child must import the tree its PYTHONPATH names.

#: What Prometheus 2.42 sends (its default scrape protocols).
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
FORMATS = {"text": "", "openmetrics": PROMETHEUS_ACCEPT}
PHASES = ("render", "scrape")


# -- render, in a child per tree ------------------------------------------------------------


def render_child(gpus: int, renders: int) -> dict[str, Any]:
    """Runs in the child: render after every poll, per format; times in ms."""
    sys.path.insert(0, str(ROOT / "tests"))
    from daemon_registry import daemon_registry  # type: ignore[import-not-found]

    import gpuwatchd
    from gpuwatchd.exporter.render import MetricsRenderer

    daemon = daemon_registry(gpus)
    renderer = MetricsRenderer(daemon.registry, daemon.board.all)
    out: dict[str, Any] = {"package": str(Path(gpuwatchd.__file__).parent)}
    for name, accept in FORMATS.items():
        for _ in range(20):  # warm-up: imports, memos, the unchanged parts' first texts
            daemon.poll()
            renderer.render(accept, "")
        wall, cpu = [], []
        for _ in range(renders):
            daemon.poll()
            w0, c0 = time.perf_counter(), time.thread_time()
            body = renderer.render(accept, "").body
            cpu.append((time.thread_time() - c0) * 1e3)
            wall.append((time.perf_counter() - w0) * 1e3)
        out[name] = {"wall_ms": wall, "cpu_ms": cpu, "body_bytes": len(body)}
    return out


def render_phase(trees: list[tuple[str, str]], args: argparse.Namespace) -> dict[str, Any]:
    from scrape_latency import percentile

    runs: dict[str, dict[str, dict[str, list[float]]]] = {}
    for _ in range(args.rounds):
        for tree_name, tree in trees:
            env = {**os.environ, "PYTHONPATH": tree}
            cmd = [sys.executable, __file__, "--render-child", str(args.gpus), str(args.renders)]
            res = json.loads(subprocess.run(cmd, env=env, capture_output=True, check=True).stdout)
            if Path(res["package"]).resolve() != (Path(tree) / "gpuwatchd").resolve():
                raise RuntimeError(f"{tree_name}: the child imported {res['package']}")
            for fmt in FORMATS:
                got = runs.setdefault(tree_name, {}).setdefault(fmt, {"wall_ms": [], "cpu_ms": []})
                got["wall_ms"] += res[fmt]["wall_ms"]
                got["cpu_ms"] += res[fmt]["cpu_ms"]
                got["body_bytes"] = res[fmt]["body_bytes"]
    summary: dict[str, Any] = {}
    for tree_name, formats in runs.items():
        for fmt, got in formats.items():
            wall, cpu = sorted(got["wall_ms"]), sorted(got["cpu_ms"])
            summary[f"{tree_name} {fmt}"] = {
                "renders": len(wall),
                "wall_p50_ms": statistics.median(wall),
                "wall_p90_ms": percentile(wall, 90),
                "cpu_p50_ms": statistics.median(cpu),
                "body_bytes": got["body_bytes"],
            }
    return summary


# -- scrape, a real daemon per tree ------------------------------------------------------------


def scrape_phase(
    trees: list[tuple[str, str]], args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    """Both trees' daemons run throughout; each is scraped alone, in turns of
    ``scrape_seconds / rounds`` per format, so a noisy neighbour hits every subject."""
    from daemon_cost import CLK_TCK, gpuwatchd_subject, process_ticks, start, stop
    from scrape_latency import Load, percentile, scrape_concurrently

    scratch = Path(tempfile.mkdtemp(prefix="gpuwatchd-om-"))
    subjects = {
        name: gpuwatchd_subject(f"{name} fake{args.gpus}", tree, scratch, 0.1, args.gpus)
        for name, tree in trees
    }
    turn_s = args.scrape_seconds / args.rounds
    got: dict[str, dict[str, Any]] = {}
    start(list(subjects.values()), out)
    try:
        for _ in range(args.rounds):
            for fmt, accept in FORMATS.items():
                for name, subject in subjects.items():
                    address = ("127.0.0.1", subject.port)
                    ticks0, t0 = process_ticks(subject.pid), time.monotonic()
                    load = Load("/metrics", 1.0, accept)
                    paced, size = scrape_concurrently(address, load, 10, turn_s, True)
                    entry = got.setdefault(f"{name} {fmt}", {"lat": [], "ticks": 0, "s": 0.0})
                    entry["ticks"] += process_ticks(subject.pid) - ticks0
                    entry["s"] += time.monotonic() - t0
                    entry["lat"] += paced
                    entry["body_bytes"] = size
    finally:
        stop(list(subjects.values()))
    summary: dict[str, Any] = {}
    for key, entry in got.items():
        lat = sorted(entry["lat"])
        summary[key] = {
            "scrapes": len(lat),
            "p50_ms": percentile(lat, 50) * 1e3,
            "p99_ms": percentile(lat, 99) * 1e3,
            "max_ms": lat[-1] * 1e3,
            "daemon_cpu_pct": 100 * entry["ticks"] / CLK_TCK / entry["s"],
            "body_bytes": entry["body_bytes"],
        }
    return summary


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--render-child":
        print(json.dumps(render_child(int(sys.argv[2]), int(sys.argv[3]))))
        return 0
    sys.path.insert(0, str(BENCH))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for logs and results.json")
    ap.add_argument("--baseline", help="another tree holding a gpuwatchd package to compare")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs (simulated; fake in scrape)")
    ap.add_argument("--renders", type=int, default=200, help="renders per format per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, trees alternating")
    ap.add_argument(
        "--scrape-seconds", type=float, default=30.0, help="per tree and format, all rounds"
    )
    ap.add_argument("--phases", default=",".join(PHASES), help=f"subset of {','.join(PHASES)}")
    args = ap.parse_args()
    wanted = [p for p in args.phases.split(",") if p]
    unknown = sorted(set(wanted) - set(PHASES))
    if unknown:
        ap.error(f"--phases: unknown phase(s) {unknown}; known: {', '.join(PHASES)}")
    if args.gpus < 1 or args.renders < 1 or args.rounds < 1 or args.scrape_seconds <= 0:
        ap.error("--gpus, --renders, --rounds must be >= 1 and --scrape-seconds > 0")
    trees = [("new", str(ROOT))]
    if args.baseline:
        if not (Path(args.baseline) / "gpuwatchd").is_dir():
            ap.error(f"--baseline: no gpuwatchd package in {args.baseline}")
        trees.append(("baseline", str(Path(args.baseline).resolve())))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "args": vars(args),
    }
    if "render" in wanted:
        results["render"] = render_phase(trees, args)
        print("| render after a poll | renders | wall p50 ms | wall p90 ms | CPU p50 ms | bytes |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for name, r in results["render"].items():
            print(
                f"| {name} | {r['renders']} | {r['wall_p50_ms']:.2f} | {r['wall_p90_ms']:.2f} "
                f"| {r['cpu_p50_ms']:.2f} | {r['body_bytes']} |"
            )
    if "scrape" in wanted:
        results["scrape"] = scrape_phase(trees, args, out)
        print("| 10 scrapers, 1/s each | scrapes | p50 ms | p99 ms | max ms | daemon CPU % |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for name, r in results["scrape"].items():
            print(
                f"| {name} | {r['scrapes']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} "
                f"| {r['max_ms']:.2f} | {r['daemon_cpu_pct']:.2f} |"
            )
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
