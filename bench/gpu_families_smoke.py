"""Smoke run of the real-GPU candidate families on a lent H100/H200.

Builds every GPU family on a small and a big workload, sets every candidate up (compile,
correctness check against float64, kernel names), times a few batches of each through
:class:`CudaSession` with the GPU state read around every batch, asks ``triton.autotune``
what it would pick, prints a table and writes everything as JSON to ``--out``.

This is not the tuning protocol (no regimes, no rejection, no interleaving): it shows
that the families and the session work on real hardware and what they measure. It only
reads GPU state and runs kernels; it never changes a GPU setting. Budget: under 3 minutes
on an H100 (``--budget-s`` stops timing early, everything else still gets reported).

    python bench/gpu_families_smoke.py --out smoke.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.worker.candidate import Candidate, CandidateError
from gpuwatchd.tuning.worker.cuda_session import CudaSession, cuda_identities, normalize_uuid
from gpuwatchd.tuning.worker.families import torch_conv, torch_matmul, triton_matmul

FAMILIES: dict[str, Callable[..., Sequence[Candidate]]] = {
    "triton.matmul": triton_matmul.build,
    "torch.matmul": torch_matmul.build,
    "torch.conv2d": torch_conv.build,
}
GEMM = ("triton.matmul", "torch.matmul")
WORKLOADS = (
    Workload("gemm-bf16-2048", "matmul", {"m": 2048, "n": 2048, "k": 2048}, "bf16", GEMM),
    Workload("gemm-bf16-8192", "matmul", {"m": 8192, "n": 8192, "k": 8192}, "bf16", GEMM),
    Workload(
        "conv-l4-fp32",
        "conv2d",
        {"input": [64, 3, 224, 224], "weight": [64, 3, 3, 3], "padding": 1},
        "float32",
        ("torch.conv2d",),
    ),
    Workload(
        "conv-fp16",
        "conv2d",
        {"input": [64, 128, 56, 56], "weight": [128, 128, 3, 3], "padding": 1},
        "float16",
        ("torch.conv2d",),
    ),
)


def open_telemetry() -> Any:
    """NvmlBackend when it can start, else None (the session then reads no GPU state)."""
    try:
        from gpuwatchd.telemetry.nvml import NvmlBackend

        return NvmlBackend()
    except Exception as e:  # missing module, no NVML: the smoke run still times kernels
        print(f"note: no NVML telemetry ({type(e).__name__}: {e}); GPU state not recorded")
        return None


def telemetry_index(telemetry: Any) -> int:
    """The telemetry index of the GPU CUDA calls device 0 (honours CUDA_VISIBLE_DEVICES)."""
    want = cuda_identities()[0].uuid
    for i in telemetry.devices():
        uuid = telemetry.device_info(i).uuid
        if want and uuid and normalize_uuid(uuid) == normalize_uuid(want):
            return int(i)
    raise RuntimeError(f"no telemetry device has CUDA device 0's uuid {want}")


def state(session: CudaSession) -> dict[str, Any]:
    s = session.sample()
    return {
        "sm_clock_mhz": s.sm_clock_mhz,
        "power_w": s.power_w,
        "temp_c": s.temp_c,
        "reasons": int(s.reasons) if s.reasons is not None else None,
    }


def time_candidate(
    session: CudaSession, cand: Candidate, batches: int, batch_s: float
) -> dict[str, Any]:
    """A few timed batches of about ``batch_s`` each, with the GPU state around each."""
    session.time_batch(cand, 1)  # warm
    one = session.time_batch(cand, 1)
    calls = max(1, min(2000, round(batch_s / one)))
    out = []
    for _ in range(batches):
        before = state(session)
        t = session.time_batch(cand, calls)
        after = state(session)
        out.append({"calls": calls, "s_per_call": t / calls, "before": before, "after": after})
    return {
        "calls": calls,
        "batches": out,
        "median_s": statistics.median(b["s_per_call"] for b in out),
    }


def run_workload(
    session: CudaSession, w: Workload, batches: int, batch_s: float, deadline: float
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for fam in w.families:
        cands = list(FAMILIES[fam](w, session))
        try:
            for c in cands:
                row: dict[str, Any] = {"workload": w.name, "family": fam, "candidate": c.name}
                rows.append(row)
                t0 = time.perf_counter()
                try:
                    c.setup()
                except CandidateError as e:
                    row["error"] = str(e)
                    continue
                row["setup_s"] = time.perf_counter() - t0
                row["meta"] = c.meta()
                if time.monotonic() > deadline:
                    row["skipped"] = "over --budget-s"
                else:
                    row.update(time_candidate(session, c, batches, batch_s))
                c.teardown()
        finally:
            for c in cands:
                c.teardown()
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'workload':<16} {'candidate':<30} {'ms/call':>9} {'TFLOP/s':>8} {'SM MHz':>7} "
        f"{'W':>5}  kernel / error"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        med = r.get("median_s")
        meta = r.get("meta", {})
        tflops = meta.get("flops", 0) / med / 1e12 if med else None
        clocks = [b["after"]["sm_clock_mhz"] for b in r.get("batches", [])]
        power = [b["after"]["power_w"] for b in r.get("batches", [])]
        clk = statistics.median(clocks) if clocks and None not in clocks else None
        pw = statistics.median(power) if power and None not in power else None
        info = r.get("error") or r.get("skipped") or ", ".join(meta.get("kernels", []))
        print(
            f"{r['workload']:<16} {r['candidate']:<30} "
            f"{_fmt(med and med * 1e3, 9, 4)} {_fmt(tflops, 8, 1)} {_fmt(clk, 7, 0)} "
            f"{_fmt(pw, 5, 0)}  {info[:90]}"
        )


def _fmt(v: float | None, width: int, digits: int) -> str:
    return f"{v:>{width}.{digits}f}" if isinstance(v, int | float) else f"{'-':>{width}}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="write the JSON results here")
    ap.add_argument("--batches", type=int, default=3, help="timed batches per candidate")
    ap.add_argument("--batch-s", type=float, default=0.05, help="target seconds per batch")
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop timing after this")
    ap.add_argument("--no-autotune", action="store_true", help="skip triton.autotune's pick")
    args = ap.parse_args(argv)
    start = time.monotonic()
    deadline = start + args.budget_s

    telemetry = open_telemetry()
    index = telemetry_index(telemetry) if telemetry is not None else 0
    session = CudaSession(index, telemetry, cuda_device=0 if telemetry is None else None)
    print(f"device: {session.info.name} (cuda:{session.cuda_device}, telemetry {index})")
    print(f"software: {session.software()}")

    rows: list[dict[str, Any]] = []
    autotune: dict[str, Any] = {}
    for w in WORKLOADS:
        rows += run_workload(session, w, args.batches, args.batch_s, deadline)
        if "triton.matmul" in w.families and not args.no_autotune:
            try:
                autotune[w.name] = triton_matmul.triton_autotune_pick(w)
            except Exception as e:  # report, do not lose the rest of the run
                autotune[w.name] = {"error": f"{type(e).__name__}: {e}"}
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    session.flush_l2()
    torch.cuda.synchronize()
    flush_s = time.perf_counter() - t0

    print_table(rows)
    for name, pick in autotune.items():
        print(f"triton.autotune on {name}: {pick.get('name') or pick.get('error')}")
    result = {
        "device": dataclasses.asdict(session.info),
        "cuda_device": session.cuda_device,
        "software": session.software(),
        "l2_bytes": session.l2_bytes,
        "flush_l2_s": flush_s,
        "workloads": [w.to_json() for w in WORKLOADS],
        "results": rows,
        "triton_autotune": autotune,
        "wall_s": time.monotonic() - start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    session.close()
    if telemetry is not None:
        telemetry.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
