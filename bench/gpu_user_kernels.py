"""Users' own Triton kernels on a real GPU: the job/daemon round trip and the pick regret.

    python3 bench/gpu_user_kernels.py --out DIR [--trials 4] [--budget-s 5]

Stages (each writes its part of DIR/user_kernels.json as soon as it is done):

A. job run 1 (``examples/user_kernels/driver.py`` in its own process, empty store, no
   daemon): every kernel misses, Triton autotunes (start-up time recorded, and its pick:
   a trial on a cool GPU) and a tuning request is spooled.
B. the daemon's part, as it runs at an open gate: read the spool, turn each request into
   a ``triton.user`` workload (allowed_modules = ["user_kernels"]) and run the real worker
   subprocess through :class:`~gpuwatchd.sessions.runner.TuneRunner` in both regimes,
   recording into the store. Rejected configs (out of resources, wrong output) are kept.
C. job run 2: every kernel hits, with zero seconds of autotuning; start-up time saved.
D. more trials of plain ``triton.autotune`` over the same configs, in this process:
   right after a burn (a bf16 GEMM loop), and beside a neighbour's load (a GEMM loop in
   another process), alternating.
E. scoring: every config of every case timed by an independent interleaved measurement
   in a sustained loop (back-to-back, shuffled each round, CUDA events); the regret of a
   pick is its time over the best config's, minus one. Triton's picks (A + D) and
   gpuwatchd's sustained winners (C) are scored the same way.

Never changes GPU settings.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path[:0] = [str(ROOT), str(EXAMPLES)]

import torch  # noqa: E402
import triton  # noqa: E402

from gpuwatchd.tuning.submitted.kernels import config_spec  # noqa: E402

NEIGHBOUR = """
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
while True:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
"""


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class Report:
    """The JSON document, rewritten after every stage so a cut-off run still reports."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"started": now_iso(), "stages": {}}

    def put(self, key: str, value: Any) -> None:
        self.doc["stages"][key] = value
        self.path.write_text(json.dumps(self.doc, indent=1, default=str))
        print(f"[{now_iso()}] stage {key} done", flush=True)


def gpu_facts() -> dict[str, Any]:
    from gpuwatchd.telemetry.nvml import NvmlBackend

    nvml = NvmlBackend()
    info = nvml.device_info(0)
    nvml.close()
    return {
        "gpu": info.name,
        "uuid": info.uuid,
        "driver": info.driver_version,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
    }


# -- A and C: the job, in its own process ------------------------------------------------------


def job_run(env: dict[str, str], out: Path, tag: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "user_kernels.driver", "--faulty", "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    print(proc.stdout[-4000:], proc.stderr[-3000:], sep="\n", flush=True)
    results = json.loads(out.read_text()) if out.is_file() else []
    return {
        "tag": tag,
        "rc": proc.returncode,
        "wall_s": wall,
        "autotune_s_total": sum(r["autotune_s"] or 0.0 for r in results),
        "first_call_s_total": sum(r["first_call_s"] for r in results),
        "cases": results,
        "log_tail": proc.stderr[-2500:],
    }


# -- B: the daemon's part ------------------------------------------------------------------------


def daemon_tunes(spool: Path, db: Path, budget_s: float) -> dict[str, Any]:
    from gpuwatchd.sessions.runner import TuneRunner
    from gpuwatchd.store import sqlite_store
    from gpuwatchd.telemetry.nvml import NvmlBackend
    from gpuwatchd.tuning.intake.spool import KERNEL, Rejected, Spool, SpoolEntry
    from gpuwatchd.tuning.session_spec import SessionSpec
    from gpuwatchd.tuning.settings import ProtocolConfig
    from gpuwatchd.tuning.types import Regime

    reader = Spool(spool)
    items = list(reader.scan(KERNEL))
    entries = [e for e in items if isinstance(e, SpoolEntry)]
    rejected = [e for e in items if isinstance(e, Rejected)]
    workloads = tuple(e.request.to_workload() for e in entries)
    nvml = NvmlBackend()
    info = nvml.device_info(0)
    sample = nvml.read(0)
    nvml.close()
    protocol = ProtocolConfig(
        time_budget_s=budget_s, min_rounds=3, warmup_s=0.1, settle_timeout_s=3.0
    )
    spec = SessionSpec(
        gpu_index=0,
        gpu_uuid=info.uuid,
        device="cuda",
        workloads=workloads,
        regimes=(Regime.UNTHROTTLED, Regime.SUSTAINED),
        protocol=protocol,
        time_budget_s=budget_s * 2 * len(workloads) + 60,
        allowed_modules=("user_kernels",),
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = str(EXAMPLES) + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    with sqlite_store(db) as store:
        runner = TuneRunner(store, env=env)
        outcome = runner.run_session(
            spec, info, "nvml", should_preempt=lambda: None, timeout_s=600, sample=sample
        )
    for e in entries:
        reader.remove(e)
    reader.close()
    results = []
    for r in outcome.results:
        results.append({
            "workload": r.workload,
            "regime": r.regime.value,
            "winner": r.winner,
            "tie": r.tie,
            "margin": r.margin,
            "candidates": [
                {
                    "name": c.name,
                    "median_ms": c.median_s * 1e3 if c.median_s else None,
                    "spread": c.spread,
                    "samples": c.samples,
                    "sm_clock_mhz": c.sm_clock_hz / 1e6 if c.sm_clock_hz else None,
                    "error": c.meta.get("error"),
                    "max_rel_difference": c.meta.get("max_rel_difference"),
                }
                for c in r.candidates
            ],
        })  # fmt: skip
    return {
        "requests": len(entries),
        "rejected_files": [(r.name, r.reason) for r in rejected],
        "status": outcome.status.value,
        "why": outcome.why,
        "session_s": time.perf_counter() - t0,
        "results": results,
    }


# -- D and E: trials and scoring, in this process ------------------------------------------------


def cases() -> list[dict[str, Any]]:
    """The bench cases: the driver's, launched through the bare JIT function and a grid."""
    from user_kernels import driver, fused_matmul_bias_act, layer_norm, softmax

    dev, dt = "cuda", torch.float16
    out: list[dict[str, Any]] = []
    for m, n, k in driver.SHAPES["matmul_bias_gelu"]:
        a = torch.randn(m, k, device=dev, dtype=dt)
        b = torch.randn(k, n, device=dev, dtype=dt) / k**0.5
        bias = torch.randn(n, device=dev, dtype=dt)
        c = torch.empty(m, n, device=dev, dtype=dt)
        out.append({
            "kernel": "matmul_bias_gelu", "shape": [m, n, k],
            "wrapper": fused_matmul_bias_act.matmul_bias_act_kernel,
            "grid": fused_matmul_bias_act.grid(m, n),
            "args": (a, b, bias, c, m, n, k, *a.stride(), *b.stride(), *c.stride()),
            "kwargs": {"ACTIVATION": "gelu"},
        })  # fmt: skip
    for rows, cols in driver.SHAPES["softmax"]:
        x = torch.randn(rows, cols, device=dev, dtype=dt)
        y = torch.empty_like(x)
        out.append({
            "kernel": "softmax", "shape": [rows, cols], "wrapper": softmax.softmax_kernel,
            "grid": (rows,), "args": (x, y, cols, x.stride(0), y.stride(0)), "kwargs": {},
        })  # fmt: skip
    for rows, cols in driver.SHAPES["layer_norm"]:
        x = torch.randn(rows, cols, device=dev, dtype=dt)
        y = torch.empty_like(x)
        w = torch.randn(cols, device=dev, dtype=dt)
        bias = torch.randn(cols, device=dev, dtype=dt)
        mean = torch.empty(rows, device=dev, dtype=torch.float32)
        rstd = torch.empty(rows, device=dev, dtype=torch.float32)
        out.append({
            "kernel": "layer_norm", "shape": [rows, cols], "wrapper": layer_norm.layer_norm_kernel,
            "grid": (rows,), "args": (x, y, w, bias, mean, rstd, x.stride(0), cols, 1e-5),
            "kwargs": {},
        })  # fmt: skip
    return out


def triton_pick(case: dict[str, Any]) -> dict[str, Any]:
    """Plain ``triton.autotune`` over the case's configs, fresh, as a job's first call."""
    w = case["wrapper"]
    tuner = triton.autotune(configs=list(w.configs), key=list(w.keys))(w.fn)
    t0 = time.perf_counter()
    tuner[case["grid"]](*case["args"], **case["kwargs"])
    torch.cuda.synchronize()
    return {
        "pick": config_spec(tuner.best_config).label,
        "bench_s": getattr(tuner, "bench_time", time.perf_counter() - t0),
    }


def burn(seconds: float) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def trials(cs: list[dict[str, Any]], states: list[str], burn_s: float) -> list[dict[str, Any]]:
    out = []
    for i, state in enumerate(states):
        neighbour = None
        if state == "neighbour":
            neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR])
            time.sleep(4.0)  # its CUDA context and first GEMMs are up
        try:
            for case in cs:
                if state == "after_burn":
                    burn(burn_s)
                rec = triton_pick(case)
                out.append({"trial": i + 1, "state": state, "kernel": case["kernel"],
                            "shape": case["shape"], **rec})  # fmt: skip
        finally:
            if neighbour is not None:
                neighbour.terminate()
                neighbour.wait(10)
        time.sleep(1.0)
    return out


def score(case: dict[str, Any], rounds: int, warm_s: float) -> dict[str, float]:
    """ms per call of every config, interleaved in a sustained back-to-back loop."""
    w = case["wrapper"]
    launchers = {}
    for cfg in w.configs:
        label = config_spec(cfg).label
        grid = case["grid"]
        meta = {**cfg.all_kwargs(), **case["kwargs"]}
        g = grid(meta) if callable(grid) else grid
        kwargs = {**case["kwargs"], **cfg.all_kwargs()}
        try:
            w.fn[g](*case["args"], **kwargs)
            torch.cuda.synchronize()
        except Exception as e:  # out of resources: not a candidate
            print(f"score: {label}: {type(e).__name__}", flush=True)
            continue
        launchers[label] = (w.fn[g], kwargs)

    def go(label: str, n: int) -> None:
        fn, kwargs = launchers[label]
        for _ in range(n):
            fn(*case["args"], **kwargs)

    calls = {}
    for label in launchers:  # calibrate: about 10 ms per timed batch
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        go(label, 3)
        e.record()
        e.synchronize()
        calls[label] = max(2, int(10.0 / max(s.elapsed_time(e) / 3, 1e-3)))
    end = time.perf_counter() + warm_s
    while time.perf_counter() < end:  # settle into the sustained state
        for label in launchers:
            go(label, calls[label])
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in launchers}
    rng = random.Random(0)
    order = list(launchers)
    for _ in range(rounds):
        rng.shuffle(order)
        for label in order:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            go(label, calls[label])
            e.record()
            e.synchronize()
            times[label].append(s.elapsed_time(e) / calls[label])
    return {k: statistics.median(v) for k, v in times.items()}


def regrets(scores: dict[str, dict[str, float]], picks: list[tuple[str, str]]) -> dict[str, Any]:
    """Mean and worst regret of (case id, pick label) pairs under ``scores``."""
    vals = []
    for cid, label in picks:
        s = scores.get(cid, {})
        if label in s:
            vals.append(s[label] / min(s.values()) - 1.0)
    if not vals:
        return {"n": 0}
    return {"n": len(vals), "mean": statistics.mean(vals), "worst": max(vals)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--trials", type=int, default=4, help="in-process trials (stage D)")
    p.add_argument("--budget-s", type=float, default=5.0, help="worker seconds per regime")
    p.add_argument("--burn-s", type=float, default=2.5)
    p.add_argument("--rounds", type=int, default=12)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out / "user_kernels.json")
    report.doc["facts"] = gpu_facts()
    report.doc["command"] = " ".join(sys.argv)
    work = Path(tempfile.mkdtemp(prefix="gpuwatchd-uk-"))
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(EXAMPLES), env.get("PYTHONPATH", "")]),
        "GPUWATCHD_STORE": str(work / "gpuwatchd.db"),
        "GPUWATCHD_SPOOL": str(work / "spool"),
        "GPUWATCHD_CONTROL_SOCKET": str(work / "no-daemon.sock"),
        "GPUWATCHD_URL": "http://127.0.0.1:9",
    })  # fmt: skip
    from gpuwatchd.store import sqlite_store

    sqlite_store(work / "gpuwatchd.db").close()  # an empty store: the first run finds no winner
    report.put("A_job_run_1", job_run(env, work / "run1.json", "miss"))
    try:
        report.put("B_daemon_tunes", daemon_tunes(work / "spool", work / "gpuwatchd.db",
                                                  args.budget_s))  # fmt: skip
    except Exception as e:  # keep going: the trials and scores stand on their own
        report.put("B_daemon_tunes", {"error": f"{type(e).__name__}: {e}"})
    report.put("C_job_run_2", job_run(env, work / "run2.json", "hit"))

    cs = cases()
    states = (["after_burn", "neighbour"] * args.trials)[: args.trials]
    report.put("D_trials", trials(cs, states, args.burn_s))
    scores = {}
    for case in cs:
        cid = f"{case['kernel']}{case['shape']}"
        scores[cid] = score(case, args.rounds, warm_s=2.0)
    report.put("E_scores_ms", scores)

    def cid_of(r: dict[str, Any]) -> str:
        return f"{r['kernel']}{r['shape']}"

    run1 = [r for r in report.doc["stages"]["A_job_run_1"]["cases"] if r["kernel"] in
            {"matmul_bias_gelu", "softmax", "layer_norm"}]  # fmt: skip
    run2 = [r for r in report.doc["stages"]["C_job_run_2"]["cases"] if r["kernel"] in
            {"matmul_bias_gelu", "softmax", "layer_norm"}]  # fmt: skip
    triton_picks = [(cid_of(r), r["config"]) for r in run1]
    triton_picks += [(cid_of(r), r["pick"]) for r in report.doc["stages"]["D_trials"]]
    ours = [(cid_of(r), r["config"]) for r in run2 if r["source"] == "winner"]
    per_case = {}
    for cid in scores:
        per_case[cid] = {
            "best": min(scores[cid], key=scores[cid].get),
            "triton": regrets(scores, [t for t in triton_picks if t[0] == cid]),
            "gpuwatchd": regrets(scores, [t for t in ours if t[0] == cid]),
        }
    report.put("summary", {
        "triton_autotune": regrets(scores, triton_picks),
        "gpuwatchd_sustained": regrets(scores, ours),
        "per_case": per_case,
        "startup_autotune_s": {
            "run1_miss": report.doc["stages"]["A_job_run_1"]["autotune_s_total"],
            "run2_hit": report.doc["stages"]["C_job_run_2"]["autotune_s_total"],
        },
    })  # fmt: skip
    print(json.dumps(report.doc["stages"]["summary"], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
