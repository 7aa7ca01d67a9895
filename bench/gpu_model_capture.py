"""Issue 9, done-when 3: a model's own shapes, tuned, and torch.compile with gpuwatchd's table.

A stack of transformer blocks built here (random bf16 weights, fused QKV, SDPA attention,
GELU MLP; no downloads) goes through three stages, each in a fresh process with empty
Inductor and Triton caches (so compile times are cold and nothing leaks between stages):

  capture  a few eager training steps (forward + backward) inside
           ``gpuwatchd.torch.capture()``: every GEMM with its GPU-time share; the
           workloads are written as TOML (``workloads.toml``) and JSON (``capture.json``).
  tune     the model compiled with ``mode="max-autotune"`` inside
           ``gpuwatchd.torch.capture_compiled()``: the GEMM sites Inductor lowers (nothing
           benchmarked). Each site's choices (the ``inductor.mm`` family: ATen and every
           Triton config Inductor generates, each compiled alone with a one-entry lookup
           table), and the top eager GEMM shapes (``torch.gemm``/``torch.matmul``), are
           tuned with gpuwatchd's protocol in the sustained regime, in-process as the worker
           does (``CudaSession`` with NVML telemetry); results go into a gpuwatchd store.
  ab       A: ``use_inductor_winners()`` (the table built from the store) then
           ``torch.compile(mode="max-autotune")``; B: ``torch.compile(mode="max-autotune")``
           with its own benchmarking. Compile time (first call) of each, how many GEMM
           autotune benchmarks Inductor ran (``select_algorithm_autotune``), then an
           interleaved A/B of the sustained step time (rounds of back-to-back inference
           steps, order alternating, SM clock and power read from NVML meanwhile). Also
           ``apply_winners()`` on an eager capture (the BLAS library it picks).

Never changes a GPU setting. Writes ``result.json`` (all figures), ``capture.json`` and
``workloads.toml`` into --out.

Usage: python bench/gpu_model_capture.py --out DIR [--smoke] [--layers 2 --dim 1024 --tokens 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# -- the model -------------------------------------------------------------------------------


def build_model(args: argparse.Namespace) -> Any:
    """Transformer blocks: QKV and MLP-up are both d -> 3d, so the GEMM sites repeat."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.up = nn.Linear(d, 3 * d)
            self.down = nn.Linear(3 * d, d)

        def forward(self, x: Any) -> Any:
            b, s, d = x.shape
            qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.dim, args.heads) for _ in range(args.layers)])
    return model.to("cuda", torch.bfloat16)


def model_input(args: argparse.Namespace, requires_grad: bool = False) -> Any:
    import torch

    g = torch.Generator(device="cuda").manual_seed(1)
    batch = args.tokens // args.seq
    x = torch.randn(batch, args.seq, args.dim, device="cuda", dtype=torch.bfloat16, generator=g)
    return x.requires_grad_(requires_grad)


def step(model: Any, x: Any) -> Any:
    """One inference step: what torch.compile compiles (a fresh copy per variant)."""
    return model(x)


# -- stage: capture --------------------------------------------------------------------------


def stage_capture(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    import gpuwatchd.torch as gt

    model = build_model(args)
    x = model_input(args, requires_grad=True)
    for _ in range(2):  # warm up cuBLAS handles and kernels outside the capture
        model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    with gt.capture(model) as cap:
        for _ in range(args.capture_steps):
            model(x).float().square().mean().backward()
    cap.write(work / "capture.json")
    cap.write(work / "workloads.toml")
    print(cap.table(limit=20), flush=True)
    top = [w.to_json() for w in cap.workloads(top=args.eager_top)]
    return {
        "table": cap.table(limit=20),
        "timer": cap.captured.timer,
        "total_ms": cap.captured.total_s * 1e3,
        "steps": args.capture_steps,
        "calls": [c.to_json() for c in cap.calls],
        "gemm_share": sum(c.share for c in cap.calls),
        "top_workloads": top,
    }


# -- stage: tune -----------------------------------------------------------------------------


def stage_tune(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    import gpuwatchd.torch as gt
    from gpuwatchd.store import SessionMeta, sqlite_store
    from gpuwatchd.telemetry.nvml import NvmlBackend
    from gpuwatchd.tuning.settings import ProtocolConfig
    from gpuwatchd.tuning.types import Regime, SessionStatus, Versions, Workload
    from gpuwatchd.tuning.winners import job_default
    from gpuwatchd.tuning.worker.cuda_session import CudaSession
    from gpuwatchd.tuning.worker.families import candidates_for
    from gpuwatchd.tuning.worker.inductor import fresh_function
    from gpuwatchd.tuning.worker.protocol import tune

    model = build_model(args).eval()
    x = model_input(args)
    t0 = time.perf_counter()
    sites: tuple[Workload, ...] = ()
    site_facts: list[dict[str, Any]] = []
    inductor_error = None
    try:
        with torch.no_grad(), gt.capture_compiled() as compiled_cap:
            torch.compile(fresh_function(step, "record"), mode="max-autotune")(model, x)
            torch.cuda.synchronize()
        print(compiled_cap.table(), flush=True)
        sites = compiled_cap.workloads()
        site_facts = [
            {"workload": s.workload().name, "count": s.count, "choices": len(s.choices())}
            for s in compiled_cap.sites
        ]
    except Exception as e:  # no lookup table in this torch: still tune the eager shapes
        traceback.print_exc()
        inductor_error = f"{type(e).__name__}: {e}"
    record_s = time.perf_counter() - t0
    if args.max_choices:
        sites = tuple(
            Workload(w.name, w.op, w.shape, w.dtype, w.families, {"max_choices": args.max_choices})
            for w in sites
        )
    eager = []
    capture_doc = json.loads((work / "capture.json").read_text()) if args.eager_top else {}
    for w in capture_doc.get("workloads", [])[: args.eager_top]:
        eager.append(Workload.from_json(w))
    nvml = NvmlBackend()
    session = CudaSession(0, nvml)
    sw = session.software()
    versions = Versions(
        driver=session.info.driver_version,
        cuda=sw.get("cuda"),
        torch=sw.get("torch"),
        triton=sw.get("triton"),
        cudnn=sw.get("cudnn"),
    )
    cfg = ProtocolConfig(
        time_budget_s=args.budget_s,
        settle_timeout_s=args.settle_s,
        settle_window_s=min(3.0, args.settle_s),
        min_rounds=3,
    )
    store = sqlite_store(work / "store.db")
    workloads = (*sites, *eager)
    sid = store.start_session(
        SessionMeta.for_device(
            session.info,
            backend="nvml",
            workloads=tuple(workloads),
            regimes=(Regime.SUSTAINED,),
            versions=versions,
            sample=nvml.read(0),
        )
    )
    out: list[dict[str, Any]] = []
    for w in workloads:
        t1 = time.perf_counter()
        try:
            cands = candidates_for(w, session)
            built_s = time.perf_counter() - t1
            # warm-up and settling of every candidate come out of the budget: scale it
            budget = max(args.budget_s, args.budget_per_choice_s * len(cands))
            (result,) = tune(
                w, cands, session, [Regime.SUSTAINED], replace(cfg, time_budget_s=budget)
            )
        except Exception as e:  # one bad workload must not lose the others' results
            traceback.print_exc()
            out.append({"workload": w.name, "error": f"{type(e).__name__}: {e}"})
            continue
        store.record_result(sid, result)
        default, kept = job_default(result)
        out.append(
            {
                "workload": w.name,
                # what the model runs without gpuwatchd, and whether the winner beat it
                "job_default": default,
                "beat_default": None if default is None else not kept,
                "family": w.families[0],
                "candidates": len(cands),
                "budget_s": budget,
                "build_s": built_s,
                "tune_s": time.perf_counter() - t1,
                "winner": result.winner,
                "tie": result.tie,
                "margin": result.margin,
                "ranked": [
                    {
                        "name": c.name,
                        "median_ms": c.median_s * 1e3 if c.median_s else None,
                        "spread": c.spread,
                        "samples": c.samples,
                        "sm_clock_mhz": c.sm_clock_hz / 1e6 if c.sm_clock_hz else None,
                        "power_w": c.power_w,
                        "error": c.meta.get("error"),
                        "compile_s": c.meta.get("compile_s"),
                    }
                    for c in result.candidates
                ],
            }
        )
        print(f"tuned {w.name}: {result.winner} (tie {result.tie})", flush=True)
    store.finish_session(sid, SessionStatus.COMPLETED)
    store.close()
    session.close()
    nvml.close()
    return {
        "record_compile_s": record_s,
        "inductor_error": inductor_error,
        "sites": site_facts,
        "results": out,
        "protocol": {"time_budget_s": args.budget_s, "settle_timeout_s": args.settle_s},
    }


# -- stage: ab -------------------------------------------------------------------------------


class PowerSampler:
    """SM clock and power from NVML every 100 ms while the A/B runs."""

    def __init__(self) -> None:
        from gpuwatchd.telemetry.nvml import NvmlBackend

        self._nvml = NvmlBackend()
        self.samples: list[tuple[float | None, float | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            s = self._nvml.read(0)
            self.samples.append((s.sm_clock_mhz, s.power_w))

    def __enter__(self) -> PowerSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._nvml.close()

    def summary(self) -> dict[str, Any]:
        clocks = [c for c, _ in self.samples if c is not None]
        power = [p for _, p in self.samples if p is not None]
        return {
            "sm_clock_mhz_median": statistics.median(clocks) if clocks else None,
            "power_w_median": statistics.median(power) if power else None,
            "samples": len(self.samples),
        }


def stage_ab(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    from torch._dynamo.utils import counters

    import gpuwatchd.torch as gt
    from gpuwatchd.client import Client
    from gpuwatchd.tuning.worker.inductor import fresh_function

    model = build_model(args).eval()
    x = model_input(args)
    client = Client(url="http://127.0.0.1:9", store=work / "store.db")
    try:
        applied = apply_eager(args, client)
    except Exception as e:
        traceback.print_exc()
        applied = {"error": f"{type(e).__name__}: {e}"}
    installed = gt.use_inductor_winners(client=client)
    note = None
    if not installed.table:
        installed.remove()
        installed = gt.use_inductor_winners(client=client, gpu_model=None)
        note = "no winners under this GPU's torch name; used any GPU model"
    print(installed.describe(), flush=True)

    def compile_variant(tag: str) -> tuple[Any, dict[str, Any]]:
        from unittest import mock

        from torch._inductor.graph import GraphLowering

        before = counters["inductor"]["select_algorithm_autotune"]
        fn = torch.compile(fresh_function(step, tag), mode="max-autotune")
        codes: list[str] = []
        t0 = time.perf_counter()
        with torch.no_grad():
            # the generated code says what each GEMM site was compiled to
            with mock.patch.object(GraphLowering, "save_output_code", codes.append):
                out = fn(model, x).float().clone()  # CUDA graphs reuse the output buffer
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            for _ in range(3):  # cudagraph trees: warm-up, record, replay
                fn(model, x)
            torch.cuda.synchronize()
        return fn, {
            "compile_s": first,
            "gemm_autotune_benchmarks": counters["inductor"]["select_algorithm_autotune"] - before,
            "gemm_kernels": gemm_kernels(codes),
            "out": out,
        }

    fa, info_a = compile_variant("gpuwatchd")
    handed = list(installed.handler.handed)
    info_a["sites_not_decided_by_the_table"] = sum(1 for _, _, n in handed if n > 1)
    installed.remove()
    fb, info_b = compile_variant("maxautotune")
    out_a, out_b = info_a.pop("out"), info_b.pop("out")
    rel = float((out_a - out_b).norm() / out_b.norm())
    timing = interleaved_ab(fa, fb, model, x, args)
    return {
        "note": note,
        "table_sites": installed.sites,
        "table": installed.table,
        "handed": [{"op": op, "key": key, "choices": n} for op, key, n in handed],
        "gpuwatchd": info_a,
        "max_autotune": info_b,
        "output_rel_diff": rel,
        "ab": timing,
        "apply_winners": applied,
    }


def gemm_kernels(codes: list[str]) -> dict[str, Any]:
    """What Inductor's generated code calls for GEMMs: ATen externs (``extern_kernels.addmm``,
    ``extern_kernels.bias_addmm``...) and Triton template kernels, with their counts."""
    import re
    from collections import Counter

    text = "\n".join(codes)
    externs = Counter(re.findall(r"extern_kernels\.(\w+)\(", text))
    templates = Counter(re.findall(r"\b(triton_tem_\w+)\.run\(", text))
    return {"codes_seen": len(codes), "extern": dict(externs), "templates": dict(templates)}


def interleaved_ab(
    fa: Any, fb: Any, model: Any, x: Any, args: argparse.Namespace
) -> dict[str, Any]:
    """Rounds of back-to-back steps, A then B or B then A, no pause: the sustained state."""
    import torch

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {"gpuwatchd": [], "max_autotune": []}
    fns = {"gpuwatchd": fa, "max_autotune": fb}
    with torch.no_grad():
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.ab_warm_s:  # reach the sustained clock first
            for fn in (fa, fb):
                for _ in range(args.ab_steps):
                    fn(model, x)
            torch.cuda.synchronize()
        with PowerSampler() as sampler:
            for r in range(args.ab_rounds):
                order = (
                    ("gpuwatchd", "max_autotune") if r % 2 == 0 else ("max_autotune", "gpuwatchd")
                )
                for name in order:
                    start.record()
                    for _ in range(args.ab_steps):
                        fns[name](model, x)
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end) / args.ab_steps)
    ratios = [a / b for a, b in zip(times["gpuwatchd"], times["max_autotune"], strict=True)]
    mean = statistics.fmean(ratios)
    half = 1.96 * statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else None
    return {
        "rounds": args.ab_rounds,
        "steps_per_round": args.ab_steps,
        "gpuwatchd_ms_median": statistics.median(times["gpuwatchd"]),
        "max_autotune_ms_median": statistics.median(times["max_autotune"]),
        "ratio_mean": mean,
        "ratio_ci95_half": half,
        "gpuwatchd_ms": times["gpuwatchd"],
        "max_autotune_ms": times["max_autotune"],
        "telemetry": sampler.summary(),
    }


def apply_eager(args: argparse.Namespace, client: Any) -> dict[str, Any]:
    """An eager capture of one training step, then apply_winners: the plan it makes."""
    import torch

    import gpuwatchd.torch as gt

    model = build_model(args)
    x = model_input(args, requires_grad=True)
    with gt.capture(model):
        model(x).float().square().mean().backward()
    applied = gt.apply_winners(model, client=client, gpu_model=None)
    return {
        "plan": applied.plan.describe(),
        "blas_library": applied.blas_library,
        "preferred_blas_library_now": str(torch.backends.cuda.preferred_blas_library()),
    }


# -- driver ----------------------------------------------------------------------------------

STAGES = {"capture": stage_capture, "tune": stage_tune, "ab": stage_ab}


def run_stage(args: argparse.Namespace) -> int:
    work = Path(args.work)
    try:
        result = STAGES[args.stage](args, work)
        rc = 0
    except Exception as e:
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"}
        rc = 1
    (work / f"stage-{args.stage}.json").write_text(json.dumps(result, indent=2, default=str))
    return rc


def env_facts() -> dict[str, Any]:
    import torch

    from gpuwatchd.tuning.worker.inductor import lookup_table_support

    props = torch.cuda.get_device_properties(0)
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "gpu": torch.cuda.get_device_name(0),
        "gcnArchName": getattr(props, "gcnArchName", None),
        "lookup_table": lookup_table_support() or "available",
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for result.json and the capture files")
    p.add_argument("--smoke", action="store_true", help="a tiny model and budgets: a dry run")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--capture-steps", type=int, default=3)
    p.add_argument("--eager-top", type=int, default=3, help="eager GEMM workloads to tune")
    p.add_argument("--max-choices", type=int, default=0, help="per site (0: all of them)")
    p.add_argument("--budget-s", type=float, default=8.0, help="least protocol budget")
    p.add_argument(
        "--budget-per-choice-s", type=float, default=1.0, help="protocol budget per candidate"
    )
    p.add_argument("--settle-s", type=float, default=4.0)
    p.add_argument("--ab-rounds", type=int, default=16)
    p.add_argument("--ab-steps", type=int, default=20)
    p.add_argument("--ab-warm-s", type=float, default=3.0)
    p.add_argument("--stage", choices=tuple(STAGES), help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.layers, args.dim, args.heads, args.tokens, args.seq = 1, 512, 8, 2048, 512
        args.max_choices, args.budget_s, args.settle_s = 3, 2.0, 1.0
        args.budget_per_choice_s = 0.5
        args.ab_rounds, args.ab_steps, args.ab_warm_s, args.eager_top = 4, 5, 0.5, 1
    if args.stage:
        return run_stage(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpuwatchd-model-"))
    result: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k not in ("stage", "work")}
    }
    result["env"] = env_facts()
    print(json.dumps(result["env"]), flush=True)
    rc = 0
    for stage in STAGES:
        env = dict(os.environ)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor-{stage}")
        env["TRITON_CACHE_DIR"] = str(work / f"triton-{stage}")
        env["PYTHONUNBUFFERED"] = "1"
        cmd = [sys.executable, __file__, *sys.argv[1:], "--stage", stage, "--work", str(work)]
        t0 = time.perf_counter()
        code = subprocess.call(cmd, env=env)
        stage_file = work / f"stage-{stage}.json"
        doc = (
            json.loads(stage_file.read_text()) if stage_file.exists() else {"error": f"exit {code}"}
        )
        doc["wall_s"] = time.perf_counter() - t0
        result[stage] = doc
        rc = rc or code
        (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    for name in ("capture.json", "workloads.toml"):
        if (work / name).exists():
            shutil.copy(work / name, out / name)
    return rc


if __name__ == "__main__":
    sys.exit(main())
