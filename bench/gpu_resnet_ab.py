"""ResNet-50 with and without gpuwatchd: captured, tuned by the daemon, applied in a new process.

    python3 bench/gpu_resnet_ab.py e2e --out DIR [--variants nchw-fp16,cl-fp16,...] [--top 10]

For each variant (activations NCHW or channels_last, fp16 or fp32; torchvision's
ResNet-50 built in-process with random weights, batch 32, 224x224):

1. ``capture`` (a fresh process): three training steps (forward + backward) inside
   ``gpuwatchd.torch.capture``, written as ``capture-<variant>.json``.
2. A gpuwatchd daemon (NVML backend, drift off, sustained regime only) gets the top
   ``--top`` forward-conv workloads of every capture through ``Capture.submit`` (the
   control socket) and tunes them at its next open gate.
3. ``ab`` (a new process per variant): the saved capture is loaded
   (``load_capture``) and applied with ``apply_winners(model, capture=...,
   memory_format="winner")`` before the model's first forward pass. Four arms, each a
   model of its own on a thread of its own (cuDNN's plan cache is per thread):
   ``default`` (what the job runs alone: ``cudnn.benchmark=False``), ``gpuwatchd``,
   ``bench_cool`` (``cudnn.benchmark=True``, first step on a cool idle GPU) and
   ``bench_loaded`` (``cudnn.benchmark=True``, first step beside a neighbour process
   running a bf16 GEMM loop). Then, interleaved in rounds with the order rotating:
   every tuned conv layer alone (back-to-back calls: sustained) and the whole training
   step. Each arm's time is reported as a ratio to ``default`` (median over rounds).
   For every applied benchmark pick the profiler's kernels in the gpuwatchd arm are
   compared with the winner's recorded kernels.

Never changes a GPU setting. Writes ``result.json`` and the captures into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PORT = 9878
VARIANTS = ("nchw-fp16", "cl-fp16", "nchw-fp32", "cl-fp32")
BATCH = 32
ARMS = ("default", "gpuwatchd", "bench_cool", "bench_loaded")

CONFIG = """
[daemon]
backend = "nvml"
listen = "127.0.0.1:{port}"
poll_interval_s = 0.2
state_dir = "{state}"
control_socket = "{sock}"
log_level = "info"

[tuning]
check_interval_s = 1.0
regimes = ["sustained"]

[tuning.protocol]
time_budget_s = {budget}
settle_timeout_s = 6.0

[drift]
enabled = false
"""


# -- the model ---------------------------------------------------------------------------------


def build(variant: str) -> tuple[Any, Any]:
    """(model, input batch) of a variant; the same random weights every time (seed 0)."""
    import torch
    import torchvision

    fmt_name, dt_name = variant.split("-")
    dt = torch.float16 if dt_name == "fp16" else torch.float32
    fmt = torch.channels_last if fmt_name == "cl" else torch.contiguous_format
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).to("cuda", dt).to(memory_format=fmt)
    x = torch.randn(BATCH, 3, 224, 224, device="cuda", dtype=dt).contiguous(memory_format=fmt)
    return model, x


def step(model: Any, x: Any) -> None:
    """One training step without the optimizer: forward, a scalar loss, backward."""
    model.zero_grad(set_to_none=True)
    model(x).float().sum().backward()


# -- stage 1: capture ----------------------------------------------------------------------------


def capture_main(args: argparse.Namespace) -> None:
    import torch

    import gpuwatchd.torch as gt
    from gpuwatchd.jobside.workload_submit import submit_workloads

    model, x = build(args.variant)
    for _ in range(2):
        step(model, x)
    torch.cuda.synchronize()
    with gt.capture(model) as cap:
        for _ in range(3):
            step(model, x)
    out = Path(args.out)
    cap.write(out / f"capture-{args.variant}.json")
    convs = [w for w in cap.workloads() if w.op == "conv2d"][: args.top]
    print(json.dumps({"variant": args.variant, "workloads": [w.name for w in convs]}))
    source = {"kind": "capture", "variant": args.variant}
    result = submit_workloads(tuple(convs), source)
    print(f"submitted {len(convs)} conv workloads: {result.how} {result.detail}")
    if result.how != "daemon":
        raise SystemExit(f"the daemon did not queue the workloads: {result.detail}")


# -- stage 3: A/B ---------------------------------------------------------------------------------


class Arm:
    """A model of its own on a thread of its own, bound to the GPU."""

    def __init__(self, name: str, variant: str) -> None:
        self.name = name
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.model, self.x = self.call(build, variant)

    def call(self, fn: Any, *args: Any) -> Any:
        return self.pool.submit(fn, *args).result()


def _flag(benchmark: bool) -> None:
    import torch

    torch.backends.cudnn.benchmark = benchmark


def _timed(fn: Any, n: int) -> float:
    """Seconds per call of ``fn`` over ``n`` back-to-back calls (CUDA events)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def _neighbour() -> subprocess.Popen[bytes]:
    code = (
        "import torch, time\n"
        "a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)\n"
        "t = time.time()\n"
        "while time.time() - t < 30:\n"
        "    a @ a\n"
    )
    return subprocess.Popen([sys.executable, "-c", code])


def _nvml_state() -> dict[str, float]:
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    return {
        "temp_c": float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
        "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1e3,
        "sm_mhz": float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
        "util": float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu),
    }


def _layer_fn(arm: Arm, call: Any, layouts: tuple[str, str]) -> Any:
    """A forward conv of the captured shape in ``layouts``, made on the arm's thread."""
    import torch
    import torch.nn.functional as F

    s = call.shape
    dt = getattr(torch, call.dtype)
    fx, fw = (
        torch.channels_last if lay == "channels_last" else torch.contiguous_format
        for lay in layouts
    )

    def make() -> Any:
        x = torch.randn(s["input"], device="cuda", dtype=dt).contiguous(memory_format=fx)
        w = torch.randn(s["weight"], device="cuda", dtype=dt).contiguous(memory_format=fw)

        def run() -> None:
            with torch.no_grad():
                F.conv2d(x, w, None, s["stride"], s["padding"], s["dilation"], s["groups"])

        return run

    return arm.call(make)


def _kernels_of(arm: Arm, fn: Any) -> list[str]:
    from gpuwatchd.tuning.worker.cuda_session import launched_kernels

    return list(arm.call(launched_kernels, fn))


def ab_main(args: argparse.Namespace) -> None:
    import torch

    import gpuwatchd.torch as gt
    from gpuwatchd.client import Client

    variant = args.variant
    out = Path(args.out)
    cap = gt.load_capture(out / f"capture-{variant}.json")
    client = Client(url=f"http://127.0.0.1:{PORT}")
    doc: dict[str, Any] = {"variant": variant, "gpu": torch.cuda.get_device_name()}
    arms = {name: Arm(name, variant) for name in ARMS}
    bench_flag = {"default": False, "gpuwatchd": False, "bench_cool": True, "bench_loaded": True}

    # gpuwatchd: load + apply before the model's first forward pass, on the arm's thread
    gw = arms["gpuwatchd"]
    applied = gw.call(
        lambda: gt.apply_winners(gw.model, capture=cap, client=client, memory_format="winner")
    )
    doc["plan"] = str(applied)
    doc["applied"] = {
        "model_format": applied.model_format,
        "warmed": list(applied.warmed),
        "blocked": [list(b) for b in applied.blocked],
        "blas": applied.blas_library,
        "convs": [
            {
                "workload": c.workload,
                "candidate": c.candidate,
                "pick": c.pick,
                "layouts": list(c.layouts),
                "kept_default": c.kept_default,
            }
            for c in applied.plan.convs
        ],
    }
    # first steps: default and gpuwatchd as they are, bench_cool on an idle GPU,
    # bench_loaded beside a neighbour's GEMM loop
    for name in ("gpuwatchd", "default"):
        arm = arms[name]
        arm.call(_flag, bench_flag[name])
        arm.call(lambda a=arm: [step(a.model, a.x) for _ in range(3)])
        torch.cuda.synchronize()
    time.sleep(8)
    doc["bench_cool_start"] = _nvml_state()
    arm = arms["bench_cool"]
    arm.call(_flag, True)
    arm.call(lambda: [step(arm.model, arm.x) for _ in range(3)])
    torch.cuda.synchronize()
    neighbour = _neighbour()
    time.sleep(4)
    doc["bench_loaded_start"] = _nvml_state()
    loaded = arms["bench_loaded"]
    loaded.call(_flag, True)
    loaded.call(lambda: [step(loaded.model, loaded.x) for _ in range(3)])
    torch.cuda.synchronize()
    neighbour.send_signal(signal.SIGTERM)
    neighbour.wait(30)
    _flag(False)
    time.sleep(3)

    # the layers: every captured forward conv with a plan choice
    choices = {c.workload: c for c in applied.plan.convs}
    job_layouts = {}
    layers = []
    for c in applied.plan.convs:
        job_layouts[c.workload] = c.call.layouts
        layers.append(c)
    fns: dict[str, dict[str, Any]] = {}
    for c in layers:
        fns[c.workload] = {
            name: _layer_fn(
                arm, c.call, c.layouts if name == "gpuwatchd" else job_layouts[c.workload]
            )
            for name, arm in arms.items()
        }
    # what really runs: the gpuwatchd arm's kernels for every benchmark pick it applied
    ranked = {w.workload: w for w in client.winners(regime="sustained")}
    checks = []
    for c in layers:
        if c.kept_default or c.pick != "benchmark":
            continue
        w = ranked.get(c.workload)
        recorded = next(
            (r.meta.get("kernels") for r in (w.ranked if w else ()) if r.name == c.candidate), None
        )
        got = _kernels_of(gw, fns[c.workload]["gpuwatchd"])
        checks.append({"workload": c.workload, "recorded": recorded, "ran": got,
                       "same": bool(recorded) and sorted(recorded) == sorted(got)})  # fmt: skip
    doc["kernel_checks"] = checks

    rounds = args.rounds
    layer_times: dict[str, dict[str, list[float]]] = {
        c.workload: {a: [] for a in ARMS} for c in layers
    }
    step_times: dict[str, list[float]] = {a: [] for a in ARMS}
    for r in range(rounds):
        order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
        for c in layers:
            for name in order:
                fn = fns[c.workload][name]
                arms[name].call(fn)  # one untimed call: the same cached plan, warm caches
                layer_times[c.workload][name].append(arms[name].call(_timed, fn, args.layer_calls))
        for name in order:
            arm = arms[name]
            step_times[name].append(
                arm.call(_timed, lambda a=arm: step(a.model, a.x), args.step_calls)
            )
    doc["end_state"] = _nvml_state()

    def summary(times: dict[str, list[float]]) -> dict[str, Any]:
        base = times["default"]
        out_: dict[str, Any] = {}
        for name in ARMS:
            ratios = [t / b for t, b in zip(times[name], base, strict=True)]
            out_[name] = {
                "median_s": statistics.median(times[name]),
                "ratio_to_default": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
            }
        return out_

    doc["layers"] = {
        w: {"choice": choices[w].candidate, "kept_default": choices[w].kept_default,
            "share": choices[w].call.share, **summary(t)}
        for w, t in layer_times.items()
    }  # fmt: skip
    doc["step"] = summary(step_times)
    (out / f"ab-{variant}.json").write_text(json.dumps(doc, indent=1, default=str))
    s = doc["step"]
    print(
        f"{variant}: step gpuwatchd/default {s['gpuwatchd']['ratio_to_default']:.4f}, "
        f"bench_cool {s['bench_cool']['ratio_to_default']:.4f}, "
        f"bench_loaded {s['bench_loaded']['ratio_to_default']:.4f}; "
        f"model_format {applied.model_format}; kernel checks "
        f"{sum(c['same'] for c in checks)}/{len(checks)}"
    )
    for w, d in doc["layers"].items():
        print(
            f"  {w}: {d['choice']}{' (default)' if d['kept_default'] else ''} "
            f"gw {d['gpuwatchd']['ratio_to_default']:.4f} "
            f"cool {d['bench_cool']['ratio_to_default']:.4f} "
            f"loaded {d['bench_loaded']['ratio_to_default']:.4f}"
        )


# -- the whole run ------------------------------------------------------------------------------


def http_json(path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=5) as r:
        return json.loads(r.read().decode())


def control(sock: Path, doc: dict[str, Any]) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(sock))
        s.sendall(json.dumps(doc).encode() + b"\n")
        buf = b""
        while b"\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    answer: dict[str, Any] = json.loads(buf.split(b"\n")[0])
    return answer


def wait_tuned(sock: Path, timeout_s: float) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        pending = control(sock, {"op": "status"})["pending"]
        running = http_json("/api/v1/state")["tuning"]["running_gpus"]
        if not pending and not running:
            return time.time() - t0
        time.sleep(1.0)
    raise SystemExit(f"the daemon did not finish tuning within {timeout_s:g}s")


def e2e(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    (work / "state").mkdir(parents=True, exist_ok=True)
    sock = work / "ctl.sock"
    cfg = work / "config.toml"
    cfg.write_text(CONFIG.format(port=PORT, state=work / "state", sock=sock, budget=args.budget_s))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["GPUWATCHD_URL"] = f"http://127.0.0.1:{PORT}"
    env["GPUWATCHD_CONTROL_SOCKET"] = str(sock)
    env["GPUWATCHD_SPOOL"] = str(work / "state" / "spool")
    variants = args.variants.split(",")
    summary: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    log = (out / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config", str(cfg)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    me = [sys.executable, __file__]
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.2)
        t0 = time.time()
        for v in variants:
            cmd = [*me, "capture", "--variant", v, "--out", str(out), "--top", str(args.top)]
            subprocess.run(cmd, env=env, check=True, timeout=300)
        summary["capture_s"] = time.time() - t0
        summary["tune_s"] = wait_tuned(sock, args.tune_timeout_s)
        for v in variants:
            cmd = [*me, "ab", "--variant", v, "--out", str(out), "--rounds", str(args.rounds)]
            subprocess.run(cmd, env=env, check=True, timeout=400)
        summary["variants"] = {v: json.loads((out / f"ab-{v}.json").read_text()) for v in variants}
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
        (out / "result.json").write_text(json.dumps(summary, indent=1, default=str))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("e2e")
    e.add_argument("--out", required=True)
    e.add_argument("--work", default="/tmp/gpuwatchd-resnet")
    e.add_argument("--variants", default=",".join(VARIANTS))
    e.add_argument("--top", type=int, default=10)
    e.add_argument("--budget-s", type=float, default=8.0)
    e.add_argument("--tune-timeout-s", type=float, default=360.0)
    e.add_argument("--rounds", type=int, default=8)
    c = sub.add_parser("capture")
    c.add_argument("--variant", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--top", type=int, default=10)
    a = sub.add_parser("ab")
    a.add_argument("--variant", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--rounds", type=int, default=8)
    a.add_argument("--layer-calls", type=int, default=20)
    a.add_argument("--step-calls", type=int, default=4)
    args = p.parse_args()
    {"e2e": e2e, "capture": capture_main, "ab": ab_main}[args.cmd](args)


if __name__ == "__main__":
    main()
