"""Resume benchmark: finishing a tuning plan when the GPU is free only in short windows.

A production host's gate opens for idle windows of 5-60 s (uniform, seeded) between
busy periods of 30-300 s. Each window runs one tuning session with the real
:class:`~gpuwatchd.sessions.runner.TuneRunner` and the real sim worker subprocess on the
simulated H200 (``idle`` scenario, the ``sim`` family); the gate preempts the session
when the window closes, as the daemon does when a job takes the GPU. With resume the
next session measures only the (workload, regime) pairs still missing; without it
(``resume_max_age_s=0``) every window starts the plan again. Both variants see the same
windows for a seed.

Time is simulated: the worker's clock is paced at ``--speed`` simulated seconds per real
second (``SimSpec.speed``), the gate's clock runs at the same speed through a window,
and busy periods are skipped at once. So a window's time includes the worker's start-up
(interpreter and imports, in real time times the speed), as on a real GPU where the
worker's torch import and CUDA start take seconds. The store and the runner judge ages
on this clock too.

Other people may edit the worker while this runs: the package is copied once at the
start and every worker runs that copy (its hash is in the report).

Reported per plan and seed: the plan's completion time (busy periods + windows until the
session that completes it ends), GPU time (the windows' time the tuner held the GPU),
windows used; runs that are not done after ``--max-windows`` are reported as such.
A calibration run first measures the plan uninterrupted (one unbounded window): its
simulated length and each pair's.

    nice -n 10 python3 bench/resume_windows.py --out bench/data/sim-resume-windows.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuwatchd.sessions.runner import TuneRunner  # noqa: E402
from gpuwatchd.store import sqlite_store  # noqa: E402
from gpuwatchd.telemetry.sim import SimBackend  # noqa: E402
from gpuwatchd.telemetry.types import DeviceInfo  # noqa: E402
from gpuwatchd.tuning.session_spec import SessionSpec, SimSpec  # noqa: E402
from gpuwatchd.tuning.settings import DEFAULT_RESUME_MAX_AGE_S, ProtocolConfig  # noqa: E402
from gpuwatchd.tuning.types import Regime, SessionStatus, Workload  # noqa: E402
from gpuwatchd.tuning.workloads import DEFAULT_WORKLOADS, device_kind  # noqa: E402

SCENARIO = "idle"
#: Unix time of simulated t = 0 (the store keeps unix seconds).
EPOCH = 1.8e9
BOTH = (Regime.UNTHROTTLED, Regime.SUSTAINED)
DEFAULT_SIM = tuple(w for w in DEFAULT_WORKLOADS if device_kind(w) == "sim")


def _gemm(name: str, m: int, n: int, k: int) -> Workload:
    return Workload(name, "matmul", {"m": m, "n": n, "k": k}, "bfloat16", ("sim",))


def model_gemms(model: str, hidden: int, ffn: int, vocab: int = 32000) -> tuple[Workload, ...]:
    """The 8 GEMMs of a transformer: its layer and LM head over 8192 prefill tokens, and
    its layer's QKV, MLP-up and MLP-down in 1024-token decode batches."""
    shapes = {
        "qkv": (8192, 3 * hidden, hidden),
        "attn-out": (8192, hidden, hidden),
        "mlp-up": (8192, ffn, hidden),
        "mlp-down": (8192, hidden, ffn),
        "lm-head": (8192, vocab, hidden),
        "decode-qkv": (1024, 3 * hidden, hidden),
        "decode-mlp-up": (1024, ffn, hidden),
        "decode-mlp-down": (1024, hidden, ffn),
    }
    return tuple(_gemm(f"sim-{model}-{what}", *mnk) for what, mnk in shapes.items())


#: What a host tunes for one 7B-parameter model, and for four model sizes.
LLM8 = model_gemms("7b", 4096, 11008)
LLM32 = (
    *LLM8,
    *model_gemms("13b", 5120, 13824),
    *model_gemms("34b", 8192, 22016),
    *model_gemms("70b", 8192, 28672, vocab=128256),
)
PLANS: dict[str, tuple[Workload, ...]] = {"default": DEFAULT_SIM, "llm8": LLM8, "llm32": LLM32}


class SimTime:
    """The bench's simulated clock: real time times ``speed``, plus skipped busy time."""

    def __init__(self, speed: float) -> None:
        self.speed = speed
        self._origin = time.monotonic()
        self._skipped = 0.0
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return (time.monotonic() - self._origin) * self.speed + self._skipped

    def unix(self) -> float:
        return EPOCH + self.now()

    def skip(self, seconds: float) -> None:
        with self._lock:
            self._skipped += seconds


@dataclass
class Window:
    opens: float
    length: float
    status: str
    held_s: float  # from the session's start to its end
    startup_s: float | None  # from the session's start to the worker's first progress
    measured: int  # pairs the worker delivered
    reused: int


@dataclass
class Run:
    plan: str
    seed: int
    resume: bool
    done: bool
    completion_s: float  # from t = 0 to the end of the completing session (or the cap)
    gpu_s: float
    windows: list[Window] = field(default_factory=list)


def plan_spec(
    info: DeviceInfo, workloads: tuple[Workload, ...], start_t: float, speed: float
) -> SessionSpec:
    """The job the daemon's planner builds for these workloads (``sessions.plan``)."""
    protocol = ProtocolConfig()
    return SessionSpec(
        gpu_index=info.index,
        gpu_uuid=info.uuid,
        device="sim",
        workloads=workloads,
        regimes=BOTH,
        protocol=protocol,
        time_budget_s=protocol.time_budget_s * len(workloads) * len(BOTH),
        sim=SimSpec(SCENARIO, 0, 1, start_t=start_t, speed=speed),
    )


def snapshot_worker(scratch: Path) -> tuple[list[str], str]:
    """Copy the package; the command that runs the worker from the copy, and its hash."""
    src = scratch / "src"
    shutil.copytree(
        ROOT / "gpuwatchd", src / "gpuwatchd", ignore=shutil.ignore_patterns("__pycache__")
    )
    digest = hashlib.sha256()
    for path in sorted((src / "gpuwatchd").rglob("*.py")):
        digest.update(path.relative_to(src).as_posix().encode() + b"\0" + path.read_bytes())
    code = (
        f"import runpy, sys; sys.path.insert(0, {str(src)!r}); "
        "runpy.run_module('gpuwatchd.tuning.worker', run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", code], digest.hexdigest()[:12]


def run_window(
    runner: TuneRunner,
    clock: SimTime,
    info: DeviceInfo,
    workloads: tuple[Workload, ...],
    length: float,
) -> tuple[Window, bool]:
    opens = clock.now()
    closes = opens + length
    first_progress: list[float] = []

    def progress(_p: dict[str, Any]) -> None:
        if not first_progress:
            first_progress.append(clock.now())

    def gate() -> str | None:
        return "window closed: a job took the GPU" if clock.now() >= closes else None

    spec = plan_spec(info, workloads, opens, clock.speed)
    timeout = (length if math.isfinite(length) else 3600.0) / clock.speed + 60.0
    out = runner.run_session(spec, info, "sim", gate, progress, timeout)
    if out.status is SessionStatus.FAILED:
        raise RuntimeError(f"session {out.session_id} failed: {out.why}")
    ended = clock.now()
    window = Window(
        opens=opens,
        length=length,
        status=out.status.value,
        held_s=ended - opens,
        startup_s=first_progress[0] - opens if first_progress else None,
        measured=len(out.results) - len(out.reused_from),
        reused=len(out.reused_from),
    )
    return window, out.status is SessionStatus.COMPLETED


def run_plan(plan: str, seed: int, resume: bool, args: argparse.Namespace, scratch: Path) -> Run:
    clock = SimTime(args.speed)
    info = SimBackend(gpus=1, scenario=SCENARIO, seed=0).device_info(0)
    rng = random.Random(seed)
    run = Run(plan, seed, resume, False, 0.0, 0.0)
    db = scratch / f"{plan}-{seed}-{'resume' if resume else 'restart'}.db"
    with sqlite_store(db, now=clock.unix) as store:
        runner = TuneRunner(
            store,
            worker_cmd=args.worker_cmd,
            poll_s=0.01,
            resume_max_age_s=DEFAULT_RESUME_MAX_AGE_S if resume else 0,
            now=clock.unix,
        )
        for _ in range(args.max_windows):
            clock.skip(rng.uniform(args.busy_min, args.busy_max))
            length = rng.uniform(args.window_min, args.window_max)
            window, done = run_window(runner, clock, info, PLANS[plan], length)
            run.windows.append(window)
            run.gpu_s += window.held_s
            if done:
                run.done = True
                break
        run.completion_s = clock.now()
    return run


def calibrate(plan: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """The plan in one window that never closes: its length, and each pair's."""
    clock = SimTime(args.speed)
    info = SimBackend(gpus=1, scenario=SCENARIO, seed=0).device_info(0)
    with sqlite_store(scratch / f"{plan}-calibration.db", now=clock.unix) as store:
        runner = TuneRunner(store, worker_cmd=args.worker_cmd, poll_s=0.01, now=clock.unix)
        window, done = run_window(runner, clock, info, PLANS[plan], math.inf)
        assert done, "the calibration session did not complete"
        (row,) = store.sessions(limit=1)
        stored = store.results(row.id)
    start = EPOCH + window.opens + (window.startup_s or 0.0)
    pairs, last = [], start
    for s in stored:
        pairs.append(
            {"workload": s.result.workload, "regime": s.result.regime.value,
             "sim_s": round(s.recorded_at - last, 2)}
        )  # fmt: skip
        last = s.recorded_at
    return {
        "held_s": round(window.held_s, 2),
        "startup_s": round(window.startup_s or 0.0, 2),
        "pairs": pairs,
    }


def summary(runs: list[Run]) -> dict[str, Any]:
    done = [r for r in runs if r.done]
    out: dict[str, Any] = {"runs": len(runs), "done": len(done)}
    if done:
        out["completion_s_median"] = round(statistics.median(r.completion_s for r in done), 1)
        out["completion_s_max"] = round(max(r.completion_s for r in done), 1)
        out["gpu_s_median"] = round(statistics.median(r.gpu_s for r in done), 1)
        out["windows_median"] = statistics.median(len(r.windows) for r in done)
        out["windows_max"] = max(len(r.windows) for r in done)
    startups = [w.startup_s for r in runs for w in r.windows if w.startup_s is not None]
    if startups:
        out["startup_s_median"] = round(statistics.median(startups), 1)
    undone = [r for r in runs if not r.done]
    if undone:
        out["not_done"] = [
            {"seed": r.seed, "windows": len(r.windows), "after_s": round(r.completion_s, 1),
             "gpu_s": round(r.gpu_s, 1)}
            for r in undone
        ]  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--plans", default="default,llm8,llm32", help=f"comma-separated, of {list(PLANS)}"
    )
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--speed", type=float, default=20.0, help="simulated s per real s")
    ap.add_argument("--window-min", type=float, default=5.0)
    ap.add_argument("--window-max", type=float, default=60.0)
    ap.add_argument("--busy-min", type=float, default=30.0)
    ap.add_argument("--busy-max", type=float, default=300.0)
    ap.add_argument("--max-windows", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    plans = [p for p in args.plans.split(",") if p]
    for p in plans:
        if p not in PLANS:
            ap.error(f"--plans: unknown plan {p!r} (known: {', '.join(PLANS)})")
    if not 0 < args.window_min <= args.window_max or not 0 <= args.busy_min <= args.busy_max:
        ap.error("windows and busy periods: need 0 < min <= max")
    t0 = time.monotonic()
    report: dict[str, Any] = {
        "machine": platform.node(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "command": " ".join(["python3", "bench/resume_windows.py", *sys.argv[1:]]),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "time": time.strftime("%H:%M:%S UTC", time.gmtime()),
        "plans": {},
    }
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="resume-bench-") as tmp:
        scratch = Path(tmp)
        args.worker_cmd, report["worker_code_sha256"] = snapshot_worker(scratch)
        for plan in plans:
            cal = calibrate(plan, args, scratch)
            n_pairs = len(PLANS[plan]) * len(BOTH)
            log(f"{plan}: {n_pairs} pairs, uninterrupted {cal['held_s']} s simulated")
            entry: dict[str, Any] = {"pairs": n_pairs, "calibration": cal, "variants": {}}
            for resume in (True, False):
                runs = []
                for seed in range(args.seeds):
                    run = run_plan(plan, seed, resume, args, scratch)
                    runs.append(run)
                    state = "done" if run.done else "NOT done"
                    log(
                        f"  {plan} seed {seed} {'resume' if resume else 'restart'}: {state}"
                        f" after {len(run.windows)} windows, {run.completion_s:.0f} s,"
                        f" GPU {run.gpu_s:.0f} s"
                    )
                name = "resume" if resume else "restart"
                entry["variants"][name] = {
                    "summary": summary(runs),
                    "runs": [asdict(r) for r in runs],
                }
            report["plans"][plan] = entry
    report["wall_s"] = round(time.monotonic() - t0, 1)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps({p: {"calibration": e["calibration"]["held_s"], **{
        v: d["summary"] for v, d in e["variants"].items()}} for p, e in report["plans"].items()},
        indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
