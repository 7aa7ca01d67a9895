"""Is a job that uses gpuwatchd ever slower than one that doesn't? A/B in fresh processes.

    python3 bench/gpu_fresh_process_ab.py prepare --out DIR [--cells ...] [--top 6]
    python3 bench/gpu_fresh_process_ab.py ab --src DIR --out DIR [--cells ...] [--deadline-s 540]
    python3 bench/gpu_fresh_process_ab.py ab --dry-run --out DIR        (CPU, a tiny model)

A cell is ``<torchvision model>-<nchw|cl>-<fp16|fp32>`` (random weights, inference under
``torch.no_grad``, batch per model in :data:`BATCH`).

``prepare``: one process captures a few inference steps of every cell with
``gpuwatchd.torch.capture`` (``capture-<cell>.json``) and hands the top ``--top`` forward
convs (and ``--gemm-top`` GEMMs) to a gpuwatchd daemon (NVML backend, sustained regime,
started here) over its control socket; the daemon tunes them at its next open gate. The
captures and the daemon's store are packed into ``DIR/tuned.tar.gz`` with ``tune.json``
(which submitted workload got a winner).

``ab``: every arm is a process of its own that does what a user's job does, from a
process that never touched CUDA (``--start fork``: forked from a parent that imported
torch and torchvision only, so the import is not timed; ``--start exec``: a new
interpreter): build the model, then

- ``plain``: nothing else (the job without gpuwatchd);
- ``gpuwatchd``: ``apply_winners(model, capture=load_capture(...), memory_format="winner")``
  before the first forward pass, and the check that it left nothing behind: no profiler
  enabled, the same threads, every process-wide switch as before except the BLAS library
  the plan says it applied;
- ``plain_again``: ``plain`` once more, the A/A control;
- ``captured`` (only with ``--arms``): ``capture()`` around three steps, then the timing,
  and the same leave-nothing check.

Then ``--warm-s`` seconds of steps, then ``--chunks`` chunks of ``--steps`` steps, each
timed with CUDA events (``time.perf_counter`` on CPU). Rounds: each round runs one
process of every arm of every cell, the arms' order rotating from round to round; rounds
go on until ``--max-rounds``, or until the next round (as long as the longest so far)
would pass ``--deadline-s``; the results are written after every round. At least 5
processes per arm make a verdict (``--processes``: the run says when fewer fitted).
Every chunk is kept. Per arm: the median of its processes' median chunk and its worst
chunk; a cell's verdict compares the gpuwatchd arm with the spread
of all plain processes (``plain`` and ``plain_again``): its median of medians no higher
than the highest plain process median, its worst chunk no worse than the worst plain
chunk. Writes ``DIR/fresh_ab.json`` (everything) and ``DIR/fresh_ab.md`` (the table).

Never changes a GPU setting.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARMS = ("plain", "gpuwatchd", "plain_again")
OPTIONAL_ARMS = ("captured",)
PLAIN = ("plain", "plain_again")
#: Batch per model: large enough that the GPU, not the launches, sets the step time.
BATCH = {
    "resnet50": 64,
    "mobilenet_v3_large": 128,
    "resnext50_32x4d": 64,
    "vit_b_16": 32,
    "tiny": 4,
}
DEFAULT_CELLS = (
    "resnet50-nchw-fp16,resnet50-cl-fp16,resnet50-nchw-fp32,resnet50-cl-fp32,"
    "mobilenet_v3_large-cl-fp16,mobilenet_v3_large-nchw-fp32,vit_b_16-nchw-fp16,vit_b_16-cl-fp32"
)
CAPTURE_STEPS = 3
#: Seconds ``prepare`` keeps back to stop the daemon and pack the archive.
_PACK_S = 15.0
#: What the log line of each process shows.
_SHOWN = ("round", "cell", "arm", "median_ms", "worst_ms", "total_s", "error", "left_behind")


@dataclass(frozen=True)
class Cell:
    model: str
    fmt: str  # nchw or cl
    dt: str  # fp16 or fp32

    @classmethod
    def parse(cls, name: str) -> Cell:
        model, fmt, dt = name.rsplit("-", 2)
        if model not in BATCH or fmt not in ("nchw", "cl") or dt not in ("fp16", "fp32"):
            raise ValueError(f"cell {name!r}: expected <{'|'.join(BATCH)}>-<nchw|cl>-<fp16|fp32>")
        return cls(model, fmt, dt)

    @property
    def name(self) -> str:
        return f"{self.model}-{self.fmt}-{self.dt}"


# -- the model ---------------------------------------------------------------------------------


def build(cell: Cell, device: str) -> tuple[Any, Any]:
    """(model, input) of a cell, made on ``device`` from seed 0: the same in every arm."""
    import torch

    dt = torch.float16 if cell.dt == "fp16" else torch.float32
    fmt = torch.channels_last if cell.fmt == "cl" else torch.contiguous_format
    torch.manual_seed(0)
    with torch.device(device):
        if cell.model == "tiny":
            model = torch.nn.Sequential(
                torch.nn.Conv2d(3, 8, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.Conv2d(8, 8, 3),
                torch.nn.Flatten(),
                torch.nn.LazyLinear(10),
            )
            x = torch.randn(BATCH["tiny"], 3, 16, 16)
            model(x)  # materialise the lazy layer
        else:
            import torchvision

            model = getattr(torchvision.models, cell.model)(weights=None)
            x = torch.randn(BATCH[cell.model], 3, 224, 224)
    model = model.to(device, dt).eval().to(memory_format=fmt)
    return model, x.to(device, dt).contiguous(memory_format=fmt)


def step(model: Any, x: Any) -> None:
    import torch

    with torch.no_grad():
        model(x)


# -- what a process leaves behind ----------------------------------------------------------------


def process_state() -> dict[str, Any]:
    """The process-wide things a library could leave changed: threads, the profiler,
    torch's switches and random state."""
    import torch
    import torch.autograd.profiler as prof

    out: dict[str, Any] = {
        "threads": threading.active_count(),
        "thread_names": sorted(t.name for t in threading.enumerate()),
        "profiler_enabled": bool(torch.autograd._profiler_enabled()),
        "profiler_flag": bool(getattr(prof, "_is_profiler_enabled", False)),
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    out["cpu_rng"] = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:12]
    if torch.cuda.is_available():
        out["preferred_blas_library"] = str(torch.backends.cuda.preferred_blas_library())
        cuda_rng = torch.cuda.get_rng_state().numpy().tobytes()
        out["cuda_rng"] = hashlib.sha1(cuda_rng).hexdigest()[:12]
    return out


def left_behind(
    before: dict[str, Any], after: dict[str, Any], blas_applied: str | None
) -> list[str]:
    """What differs, less the BLAS library the plan said it applied."""
    out = []
    for key, was in before.items():
        now = after.get(key)
        if key == "preferred_blas_library" and blas_applied is not None:
            continue
        if now != was:
            out.append(f"{key}: {was!r} -> {now!r}")
    if after["profiler_enabled"] or after["profiler_flag"]:
        out.append("a profiler is enabled")
    return out


# -- one process ---------------------------------------------------------------------------------


def one_process(cell_name: str, arm: str, src: str, out_path: str, cfg: dict[str, Any]) -> None:
    """Everything one arm's process does; its result as JSON at ``out_path``."""
    t0 = time.perf_counter()
    cell = Cell.parse(cell_name)
    dry = cfg["dry_run"]
    device = "cpu" if dry else "cuda"
    doc: dict[str, Any] = {"cell": cell_name, "arm": arm, "pid": os.getpid()}
    model, x = build(cell, device)
    before = process_state()  # before gpuwatchd is imported: the import counts too
    if arm == "gpuwatchd" and not dry:
        import gpuwatchd.torch as gt
        from gpuwatchd.client import Client

        cap = gt.load_capture(Path(src) / f"capture-{cell_name}.json")
        client = Client(url="http://127.0.0.1:9", store=Path(src) / "gpuwatchd.db")
        t1 = time.perf_counter()
        applied = gt.apply_winners(model, capture=cap, client=client, memory_format="winner")
        doc["apply_s"] = time.perf_counter() - t1
        after = process_state()
        doc["applied"] = {
            "warmed": list(applied.warmed),
            "blocked": [list(b) for b in applied.blocked],
            "model_format": applied.model_format,
            "blas": applied.blas_library,
            "skipped": len(applied.plan.skipped),
            "kept_default": sum(1 for c in applied.plan.convs if c.kept_default),
            "plan": str(applied),
        }
        doc["left_behind"] = left_behind(before, after, applied.blas_library)
    elif arm == "captured" or (arm == "gpuwatchd" and dry):
        import gpuwatchd.torch as gt

        with gt.capture(model):
            for _ in range(CAPTURE_STEPS):
                step(model, x)
        doc["left_behind"] = left_behind(before, process_state(), None)
    doc["setup_s"] = time.perf_counter() - t0
    doc["chunks_ms"] = timed_chunks(model, x, cfg, device)
    doc["median_ms"] = statistics.median(doc["chunks_ms"])
    doc["worst_ms"] = max(doc["chunks_ms"])
    doc["total_s"] = time.perf_counter() - t0
    Path(out_path).write_text(json.dumps(doc))


def timed_chunks(model: Any, x: Any, cfg: dict[str, Any], device: str) -> list[float]:
    """``warm_s`` of steps, then ms per step of each of ``chunks`` chunks of ``steps``."""
    import torch

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t_end = time.perf_counter() + cfg["warm_s"]
    while True:
        step(model, x)
        sync()
        if time.perf_counter() >= t_end:
            break
    out = []
    for _ in range(cfg["chunks"]):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(cfg["steps"]):
                step(model, x)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t = time.perf_counter()
            for _ in range(cfg["steps"]):
                step(model, x)
            ms = (time.perf_counter() - t) * 1e3
        out.append(ms / cfg["steps"])
    return out


def start_process(
    how: str, cell: str, arm: str, src: str, cfg: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """Run one arm's process (forked, or a new interpreter); its JSON, or why it failed."""
    fd, path = tempfile.mkstemp(prefix="fresh-ab-", suffix=".json")
    os.close(fd)
    try:
        if how == "fork":
            import multiprocessing as mp

            p = mp.get_context("fork").Process(
                target=one_process, args=(cell, arm, src, path, cfg), daemon=False
            )
            p.start()
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join()
            rc = p.exitcode
        else:
            cmd = [
                sys.executable,
                __file__,
                "one",
                "--cell",
                cell,
                "--arm",
                arm,
                "--src",
                src,
                "--result",
                path,
                "--cfg",
                json.dumps(cfg),
            ]
            try:
                rc = subprocess.run(cmd, timeout=timeout_s, check=False).returncode
            except subprocess.TimeoutExpired:
                rc = None
        text = Path(path).read_text()
        if rc != 0 or not text:
            return {"cell": cell, "arm": arm, "error": f"exit {rc}"}
        doc: dict[str, Any] = json.loads(text)
        return doc
    finally:
        os.unlink(path)


# -- the A/B -------------------------------------------------------------------------------------


def ab_main(args: argparse.Namespace) -> None:
    import torch  # imported once here: forked processes do not pay it

    if not args.dry_run:
        import torchvision  # noqa: F401
    if args.start == "fork" and torch.cuda.is_initialized():
        print(
            "CUDA is initialised in this process: forked ones could not use it; "
            "starting a new interpreter per process instead",
            flush=True,
        )
        args.start = "exec"

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = ""
    if not args.dry_run:
        work = Path(tempfile.mkdtemp(prefix="gpuwatchd-fresh-ab-"))
        with tarfile.open(Path(args.src) / "tuned.tar.gz") as tar:
            tar.extractall(work, filter="data")
        src = str(work)
    cells = [Cell.parse(c).name for c in args.cells.split(",")]
    arms = list(ARMS) + [a for a in args.arms.split(",") if a in OPTIONAL_ARMS]
    cfg = {
        "warm_s": args.warm_s,
        "chunks": args.chunks,
        "steps": args.steps,
        "dry_run": args.dry_run,
    }
    doc: dict[str, Any] = {
        "cfg": cfg,
        "start": args.start,
        "cells": cells,
        "arms": arms,
        "env": env_facts(args.dry_run),
        "processes": [],
    }
    t0 = time.monotonic()
    rounds = 0
    longest = 0.0
    while rounds < args.max_rounds:
        if time.monotonic() - t0 + longest > args.deadline_s:
            break  # the next round would not end in time
        t_round = time.monotonic()
        for cell in cells:
            order = arms[rounds % len(arms) :] + arms[: rounds % len(arms)]
            for arm in order:
                res = start_process(args.start, cell, arm, src, cfg, args.process_timeout_s)
                res["round"] = rounds
                doc["processes"].append(res)
                print(json.dumps({k: res.get(k) for k in _SHOWN}), flush=True)
        longest = max(longest, time.monotonic() - t_round)
        rounds += 1
        write_results(doc, out, rounds, time.monotonic() - t0)  # a cut-off run keeps its rounds
    print(markdown(doc["summary"], cells, arms) if "summary" in doc else "no round ran")
    if rounds < args.processes:
        print(f"{rounds} process(es) per arm, fewer than --processes {args.processes}")


def write_results(doc: dict[str, Any], out: Path, rounds: int, wall_s: float) -> None:
    doc["rounds"] = rounds
    doc["wall_s"] = wall_s
    doc["summary"] = summarise(doc["processes"], doc["cells"], doc["arms"])
    (out / "fresh_ab.json").write_text(json.dumps(doc, indent=1))
    (out / "fresh_ab.md").write_text(markdown(doc["summary"], doc["cells"], doc["arms"]) + "\n")


def summarise(processes: list[dict[str, Any]], cells: list[str], arms: list[str]) -> dict[str, Any]:
    """Per cell and arm: process medians, worst chunks; per cell the verdict."""
    out: dict[str, Any] = {}
    for cell in cells:
        mine = [p for p in processes if p.get("cell") == cell and "chunks_ms" in p]
        by_arm = {a: [p for p in mine if p["arm"] == a] for a in arms}
        cell_doc: dict[str, Any] = {"arms": {}}
        for a, ps in by_arm.items():
            if not ps:
                continue
            medians = [p["median_ms"] for p in ps]
            cell_doc["arms"][a] = {
                "processes": len(ps),
                "median_ms": statistics.median(medians),
                "process_medians_ms": medians,
                "worst_ms": max(p["worst_ms"] for p in ps),
                "left_behind": sorted({x for p in ps for x in p.get("left_behind", [])}),
                "failed": sum(
                    1
                    for p in processes
                    if p.get("cell") == cell and p.get("arm") == a and "error" in p
                ),
            }
        arms_doc = cell_doc["arms"]
        plain = [m for a in PLAIN for m in arms_doc.get(a, {}).get("process_medians_ms", [])]
        base = arms_doc.get("plain")
        if base and plain:
            plain_worst = max(arms_doc[a]["worst_ms"] for a in PLAIN if a in arms_doc)
            cell_doc["plain_range_ms"] = [min(plain), max(plain)]
            cell_doc["plain_worst_ms"] = plain_worst
            for a in arms_doc:
                if a == "plain":
                    continue
                arm = arms_doc[a]
                arm["ratio_median"] = arm["median_ms"] / base["median_ms"]
                arm["ratio_worst"] = arm["worst_ms"] / base["worst_ms"]
                if a not in PLAIN:
                    arm["median_within"] = arm["median_ms"] <= max(plain)
                    arm["worst_within"] = arm["worst_ms"] <= plain_worst
            gw = [p for p in by_arm.get("gpuwatchd", [])]
            applied = [p.get("applied", {}) for p in gw]
            cell_doc["applied"] = applied[0] if applied else None
        out[cell] = cell_doc
    return out


def markdown(summary: dict[str, Any], cells: list[str], arms: list[str]) -> str:
    cols = " | ".join(f"{a} median (min–max) / worst, ms" for a in arms)
    lines = [
        f"| cell | {cols} | A/A ratio | gpuwatchd ratio (median, worst) | within | applied |",
        "| --- |" + " ---: |" * len(arms) + " ---: | ---: | --- | --- |",
    ]
    for cell in cells:
        c = summary.get(cell, {})
        a_doc = c.get("arms", {})
        parts = []
        for a in arms:
            d = a_doc.get(a)
            if d is None:
                parts.append("—")
                continue
            pm = d["process_medians_ms"]
            parts.append(
                f"{d['median_ms']:.3f} ({min(pm):.3f}–{max(pm):.3f}) / "
                f"{d['worst_ms']:.3f} [{d['processes']}]"
            )
        aa = a_doc.get("plain_again", {}).get("ratio_median")
        gw = a_doc.get("gpuwatchd", {})
        ratio = (
            f"{gw['ratio_median']:.4f}, {gw['ratio_worst']:.4f}" if "ratio_median" in gw else "—"
        )
        within = (
            ("median ok" if gw.get("median_within") else "MEDIAN ABOVE")
            + ", "
            + ("worst ok" if gw.get("worst_within") else "WORST ABOVE")
            if "median_within" in gw
            else "—"
        )
        if gw.get("left_behind"):
            within += "; LEFT BEHIND: " + "; ".join(gw["left_behind"])
        ap = c.get("applied") or {}
        applied = (
            f"{len(ap.get('warmed', []))} warmed, {len(ap.get('blocked', []))} blocked, "
            f"format {ap.get('model_format') or 'kept'}, BLAS {ap.get('blas') or 'kept'}"
            if ap
            else "—"
        )
        aa_text = f"{aa:.4f}" if aa is not None else "—"
        lines.append(
            f"| {cell} | {' | '.join(parts)} | {aa_text} | {ratio} | {within} | {applied} |"
        )
    return "\n".join(lines)


def env_facts(dry: bool) -> dict[str, Any]:
    """Versions and the GPU, read in a child so the parent never touches CUDA."""
    import torch

    facts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if dry:
        return facts
    code = (
        "import json, torch; print(json.dumps({'gpu': torch.cuda.get_device_name(), "
        "'cudnn': torch.backends.cudnn.version()}))"
    )
    try:
        got = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
        )
        facts.update(json.loads(got.stdout.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, ValueError, IndexError) as e:
        facts["error"] = str(e)
    return facts


# -- prepare: capture and tune ------------------------------------------------------------------


def capture_main(args: argparse.Namespace) -> None:
    """Capture every cell in this one process; submit its top workloads to the daemon."""
    import torch

    import gpuwatchd.torch as gt
    from gpuwatchd.jobside.workload_submit import submit_workloads

    work = Path(args.work)
    submitted: dict[str, list[str]] = {}
    for name in args.cells.split(","):
        cell = Cell.parse(name)
        model, x = build(cell, "cuda")
        for _ in range(2):
            step(model, x)
        torch.cuda.synchronize()
        with gt.capture(model) as cap:
            for _ in range(CAPTURE_STEPS):
                step(model, x)
        cap.write(work / f"capture-{cell.name}.json")
        convs = [w for w in cap.workloads() if w.op == "conv2d"][: args.top]
        gemms = [w for w in cap.workloads() if w.op != "conv2d"][: args.gemm_top]
        chosen = [*convs, *gemms]
        submitted[cell.name] = [w.name for w in chosen]
        res = submit_workloads(tuple(chosen), {"kind": "capture", "cell": cell.name})
        print(f"{cell.name}: submitted {len(chosen)} workloads: {res.how} {res.detail}", flush=True)
        if res.how != "daemon":
            raise SystemExit(f"the daemon did not queue the workloads: {res.detail}")
        del model, x
        torch.cuda.empty_cache()
    (work / "submitted.json").write_text(json.dumps(submitted, indent=1))


def prepare_main(args: argparse.Namespace) -> None:
    from gpu_resnet_ab import CONFIG, PORT, _env, wait_tuned  # the ResNet bench's daemon set-up

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpuwatchd-fresh-prepare-"))
    (work / "state").mkdir()
    sock = work / "ctl.sock"
    cfg = work / "config.toml"
    cfg.write_text(CONFIG.format(port=PORT, state=work / "state", sock=sock, budget=args.budget_s))
    env = _env(sock, work)
    summary: dict[str, Any] = {"cells": args.cells.split(","), "budget_s": args.budget_s}
    log = (work / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config", str(cfg)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    t_end = time.time() + args.deadline_s - _PACK_S
    capture: subprocess.Popen[bytes] | None = None
    try:
        for _ in range(150):
            if sock.exists():
                break
            time.sleep(0.2)
        t0 = time.time()
        cmd = [
            sys.executable,
            __file__,
            "capture",
            "--cells",
            args.cells,
            "--work",
            str(work),
            "--top",
            str(args.top),
            "--gemm-top",
            str(args.gemm_top),
        ]
        capture = subprocess.Popen(cmd, env=env)
        if capture.wait(max(1.0, t_end - time.time())) != 0:
            raise SystemExit(f"capture failed: exit {capture.returncode}")
        summary["capture_s"] = time.time() - t0
        summary["tune_s"] = wait_tuned(sock, t_end - time.time())
        summary["coverage"] = coverage(work)
        print(json.dumps(summary, indent=1), flush=True)
    finally:
        if capture is not None and capture.poll() is None:
            capture.kill()
            capture.wait()
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
        (work / "tune.json").write_text(json.dumps(summary, indent=1))
        with tarfile.open(out / "tuned.tar.gz", "w:gz") as tar:
            for f in sorted(work.glob("capture-*.json")):
                tar.add(f, arcname=f.name)
            for name in ("submitted.json", "tune.json", "daemon.log"):
                if (work / name).exists():
                    tar.add(work / name, arcname=name)
            db = work / "state" / "gpuwatchd.db"
            if db.exists():
                tar.add(db, arcname=db.name)
        (out / "tune.json").write_text(json.dumps(summary, indent=1))


def coverage(work: Path) -> dict[str, Any]:
    """Per cell: submitted workloads with and without a sustained winner in the store."""
    from gpuwatchd.client import Client
    from gpuwatchd.jobside.winner_plan import latest_by_workload

    path = work / "submitted.json"
    if not path.exists():
        return {"error": "no submitted.json: the capture failed"}
    submitted = json.loads(path.read_text())
    try:
        client = Client(url="http://127.0.0.1:9", store=work / "state" / "gpuwatchd.db")
        won = latest_by_workload(client.winners(regime="sustained"))
    except Exception as e:  # the archive is still worth having
        return {"error": f"{type(e).__name__}: {e}"}
    return {
        cell: {
            "tuned": sum(1 for n in names if n in won),
            "missing": [n for n in names if n not in won],
        }
        for cell, names in submitted.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prepare")
    pr.add_argument("--out", required=True)
    pr.add_argument("--cells", default=DEFAULT_CELLS)
    pr.add_argument("--top", type=int, default=6, help="forward-conv workloads per cell")
    pr.add_argument("--gemm-top", type=int, default=3, help="GEMM workloads per cell")
    pr.add_argument("--budget-s", type=float, default=3.0)
    pr.add_argument("--deadline-s", type=float, default=420.0, help="capture, tune and pack")
    c = sub.add_parser("capture")
    c.add_argument("--cells", required=True)
    c.add_argument("--work", required=True)
    c.add_argument("--top", type=int, default=6)
    c.add_argument("--gemm-top", type=int, default=3)
    a = sub.add_parser("ab")
    a.add_argument("--src", default="", help="folder holding prepare's tuned.tar.gz")
    a.add_argument("--out", required=True)
    a.add_argument("--cells", default=DEFAULT_CELLS)
    a.add_argument("--arms", default=",".join(ARMS), help="also: captured")
    a.add_argument("--start", choices=("fork", "exec"), default="fork")
    a.add_argument("--processes", type=int, default=5, help="at least this many per arm")
    a.add_argument("--max-rounds", type=int, default=50)
    a.add_argument("--deadline-s", type=float, default=540.0)
    a.add_argument("--warm-s", type=float, default=1.5)
    a.add_argument("--chunks", type=int, default=6)
    a.add_argument("--steps", type=int, default=12)
    a.add_argument("--process-timeout-s", type=float, default=120.0)
    a.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, no store")
    o = sub.add_parser("one")
    o.add_argument("--cell", required=True)
    o.add_argument("--arm", required=True)
    o.add_argument("--src", default="")
    o.add_argument("--result", required=True)
    o.add_argument("--cfg", required=True)
    args = p.parse_args()
    # a SIGTERM (an outer timeout) unwinds: the daemon is stopped, what ran is written
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.cmd == "ab":
        if args.dry_run:
            args.cells = "tiny-nchw-fp32"
            args.warm_s, args.chunks, args.steps = min(args.warm_s, 0.05), 3, 2
        elif not args.src:
            p.error("ab: --src (prepare's --out) is required unless --dry-run")
        if args.processes < 1 or args.chunks < 1 or args.steps < 1:
            p.error("--processes, --chunks and --steps must be at least 1")
        ab_main(args)
    elif args.cmd == "one":
        one_process(args.cell, args.arm, args.src, args.result, json.loads(args.cfg))
    else:
        {"prepare": prepare_main, "capture": capture_main}[args.cmd](args)


if __name__ == "__main__":
    main()
