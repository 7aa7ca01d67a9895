"""ResNet-50 with and without gpuwatchd: captured, tuned by the daemon, applied in a new process.

    python3 bench/gpu_resnet_ab.py tune --out DIR [--variants ...] [--top 8] [--all-shapes V,...]
    python3 bench/gpu_resnet_ab.py ab --src DIR --out DIR [--variants ...]

For each variant (activations NCHW or channels_last, fp16 or fp32; torchvision's
ResNet-50 built in-process with random weights, batch 32, 224x224):

1. ``capture`` (a fresh process): three training steps (forward + backward) inside
   ``gpuwatchd.torch.capture``, written as ``capture-<variant>.json``.
2. A gpuwatchd daemon (NVML backend, drift off, sustained regime only) gets the top
   ``--top`` forward-conv workloads of every capture (every one for the variants in
   ``--all-shapes``) through the control socket and tunes them at its next open gate.
   The captures and the daemon's store are packed into ``tuned.tar.gz``.
3. ``ab`` (a new process per variant, possibly on another machine of the same model):
   the saved capture is loaded (``load_capture``) and applied with
   ``apply_winners(model, capture=..., memory_format="winner")`` before the model's
   first forward pass. Five arms, each a
   model of its own on a thread of its own (cuDNN's plan cache is per thread):
   ``default`` (what the job runs alone: ``cudnn.benchmark=False``), ``default_again``
   (the same, an A/A control whose ratio is the noise floor), ``gpuwatchd``,
   ``bench_cool`` (``cudnn.benchmark=True``, first step on a cool idle GPU) and
   ``bench_loaded`` (``cudnn.benchmark=True``, first step beside a neighbour process
   running a bf16 GEMM loop). Then, interleaved in rounds with the order rotating:
   every tuned conv layer alone (a CUDA graph of back-to-back calls, captured on the
   arm's thread after its plan is cached: GPU time only) and the whole training step
   (likewise a CUDA graph of forward and backward, captured after the arm's first steps).
   Each arm's time is reported as a ratio to ``default`` (median over rounds).
   For every applied benchmark pick the profiler's kernels in the gpuwatchd arm are
   compared with the winner's recorded kernels.

Never changes a GPU setting. ``ab`` writes ``ab.tar.gz`` (one JSON per variant) into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gpu_daemon_user_kernels import control  # noqa: E402  # the control socket, one request

PORT = 9878
VARIANTS = ("nchw-fp16", "cl-fp16", "nchw-fp32", "cl-fp32")
BATCH = 32
ARMS = ("default", "default_again", "gpuwatchd", "bench_cool", "bench_loaded")

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
    convs = [w for w in cap.workloads() if w.op == "conv2d"][: args.top or None]
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
        self.step_graph: Any = None

    def call(self, fn: Any, *args: Any) -> Any:
        return self.pool.submit(fn, *args).result()

    def first_steps(self, benchmark: bool) -> None:
        """The arm's first training steps, where cuDNN picks (and caches) its plans."""
        import torch

        self.call(_flag, benchmark)
        self.call(lambda: [step(self.model, self.x) for _ in range(3)])
        torch.cuda.synchronize()

    def capture_step(self) -> str:
        """A CUDA graph of one training step, captured on this arm's thread after its
        first steps (its cuDNN plans cached): replays time the GPU work alone."""
        return str(self.call(self._capture_step))

    def _capture_step(self) -> str:
        import torch

        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    step(self.model, self.x)
            torch.cuda.current_stream().wait_stream(side)
            self.model.zero_grad(set_to_none=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.model(self.x).float().sum().backward()
            torch.cuda.synchronize()
        except RuntimeError as e:
            return f"eager ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        self.step_graph = graph
        return "cuda_graph"

    def timed_step(self, calls: int) -> float:
        if self.step_graph is not None:
            return float(self.call(_timed, self.step_graph.replay, calls))
        return float(self.call(_timed, lambda: step(self.model, self.x), calls))


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


class Layer:
    """One forward conv of a captured shape, in given layouts, on an arm's thread.

    ``conv`` is one call (its plan cached on the arm's thread by the first one);
    ``graph`` replays ``GRAPH_CALLS`` of them, captured on that thread: GPU time only.
    """

    GRAPH_CALLS = 20

    def __init__(self, arm: Arm, call: Any, layouts: tuple[str, str]) -> None:
        self.arm = arm
        self.conv, self.graph = arm.call(self._make, call, layouts)

    @classmethod
    def _make(cls, call: Any, layouts: tuple[str, str]) -> tuple[Any, Any]:
        import torch
        import torch.nn.functional as F

        s = call.shape
        dt = getattr(torch, call.dtype)
        fx, fw = (
            torch.channels_last if lay == "channels_last" else torch.contiguous_format
            for lay in layouts
        )
        x = torch.randn(s["input"], device="cuda", dtype=dt).contiguous(memory_format=fx)
        w = torch.randn(s["weight"], device="cuda", dtype=dt).contiguous(memory_format=fw)

        def conv() -> None:
            with torch.no_grad():
                F.conv2d(x, w, None, s["stride"], s["padding"], s["dilation"], s["groups"])

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                conv()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(cls.GRAPH_CALLS):
                conv()
        return conv, graph

    def timed(self, replays: int) -> float:
        return float(self.arm.call(_timed, self.graph.replay, replays)) / self.GRAPH_CALLS


def _kernels_of(arm: Arm, fn: Any) -> list[str]:
    from gpuwatchd.tuning.worker.cuda_session import launched_kernels

    return list(arm.call(launched_kernels, fn))


def _ratios(times: dict[str, list[float]]) -> dict[str, Any]:
    """Each arm's median over rounds and its per-round ratio to ``default`` (median, range)."""
    base = times["default"]
    out: dict[str, Any] = {}
    for name, xs in times.items():
        ratios = sorted(t / b for t, b in zip(xs, base, strict=True))
        n = len(ratios)
        out[name] = {
            "median_s": statistics.median(xs),
            "ratio_to_default": statistics.median(ratios),
            # the middle half of the per-round ratios: how far one round's ratio wanders
            "ratio_q1": ratios[n // 4],
            "ratio_q3": ratios[(3 * n) // 4],
        }
    return out


def ab_main(args: argparse.Namespace) -> None:
    import torch

    import gpuwatchd.torch as gt
    from gpuwatchd.client import Client

    variant = args.variant
    src, out = Path(args.src), Path(args.out)
    cap = gt.load_capture(src / f"capture-{variant}.json")
    client = Client(url="http://127.0.0.1:9", store=src / "gpuwatchd.db")
    doc: dict[str, Any] = {"variant": variant, "gpu": torch.cuda.get_device_name()}
    arms = {name: Arm(name, variant) for name in ARMS}
    gw = arms["gpuwatchd"]

    # gpuwatchd: the saved capture, applied before the model's first forward pass
    applied = gw.call(
        lambda: gt.apply_winners(gw.model, capture=cap, client=client, memory_format="winner")
    )
    doc["plan"] = str(applied)
    doc["applied"] = {
        "model_format": applied.model_format,
        "warmed": list(applied.warmed),
        "blocked": [list(b) for b in applied.blocked],
        "blas": applied.blas_library,
    }
    # first steps: default(s) and gpuwatchd as they are, bench_cool on an idle GPU,
    # bench_loaded beside a neighbour's GEMM loop
    for name in ("gpuwatchd", "default", "default_again"):
        arms[name].first_steps(benchmark=False)
    time.sleep(8)
    doc["bench_cool_start"] = _nvml_state()
    arms["bench_cool"].first_steps(benchmark=True)
    neighbour = _neighbour()
    time.sleep(4)
    doc["bench_loaded_start"] = _nvml_state()
    arms["bench_loaded"].first_steps(benchmark=True)
    neighbour.send_signal(signal.SIGTERM)
    neighbour.wait(30)
    _flag(False)
    time.sleep(3)

    # every captured forward conv with a recorded choice, alone, in each arm's layouts
    layers: dict[str, dict[str, Layer]] = {}
    for c in applied.plan.convs:
        layers[c.workload] = {
            name: Layer(arm, c.call, c.layouts if name == "gpuwatchd" else c.call.layouts)
            for name, arm in arms.items()
        }
    # what really runs: the gpuwatchd arm's kernels for every benchmark pick it applied
    ranked = {w.workload: w for w in client.winners(regime="sustained")}
    checks = []
    for c in applied.plan.convs:
        if not c.acts or c.pick != "benchmark":
            continue
        w = ranked.get(c.workload)
        cands = w.ranked if w is not None else ()
        recorded = next((r.meta.get("kernels") for r in cands if r.name == c.candidate), None)
        got = _kernels_of(gw, layers[c.workload]["gpuwatchd"].conv)
        checks.append({"workload": c.workload, "recorded": recorded, "ran": got,
                       "same": bool(recorded) and sorted(recorded) == sorted(got)})  # fmt: skip
    doc["kernel_checks"] = checks

    doc["step_timing"] = {name: arm.capture_step() for name, arm in arms.items()}
    layer_times = {w: {a: [] for a in ARMS} for w in layers}
    step_times: dict[str, list[float]] = {a: [] for a in ARMS}
    for r in range(args.rounds):
        order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
        for w, by_arm in layers.items():
            for name in order:
                layer_times[w][name].append(by_arm[name].timed(args.layer_replays))
        for name in order:
            step_times[name].append(arms[name].timed_step(args.step_calls))
    doc["end_state"] = _nvml_state()
    choices = {c.workload: c for c in applied.plan.convs}
    doc["layers"] = {
        w: {"choice": choices[w].candidate, "applied": choices[w].acts,
            "share": choices[w].call.share, **_ratios(t)}
        for w, t in layer_times.items()
    }  # fmt: skip
    doc["step"] = _ratios(step_times)
    (out / f"ab-{variant}.json").write_text(json.dumps(doc, indent=1, default=str))
    st = doc["step"]
    print(
        f"{variant}: step vs default: gpuwatchd {st['gpuwatchd']['ratio_to_default']:.4f}, "
        f"A/A {st['default_again']['ratio_to_default']:.4f}, "
        f"bench_cool {st['bench_cool']['ratio_to_default']:.4f}, "
        f"bench_loaded {st['bench_loaded']['ratio_to_default']:.4f}; "
        f"model_format {applied.model_format}; kernel checks "
        f"{sum(c['same'] for c in checks)}/{len(checks)}"
    )
    for w, d in doc["layers"].items():
        print(
            f"  {w}: {d['choice']}{'' if d['applied'] else ' (default kept)'} "
            f"gw {d['gpuwatchd']['ratio_to_default']:.4f} "
            f"A/A {d['default_again']['ratio_to_default']:.4f} "
            f"cool {d['bench_cool']['ratio_to_default']:.4f} "
            f"loaded {d['bench_loaded']['ratio_to_default']:.4f}"
        )


# -- the stages ------------------------------------------------------------------------------------


def http_json(path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=5) as r:
        return json.loads(r.read().decode())


def wait_tuned(sock: Path, timeout_s: float) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        pending = control(sock, {"op": "status"})["pending"]
        running = http_json("/api/v1/state")["tuning"]["running_gpus"]
        if not pending and not running:
            return time.time() - t0
        time.sleep(1.0)
    raise SystemExit(f"the daemon did not finish tuning within {timeout_s:g}s")


def _env(sock: Path, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["GPUWATCHD_URL"] = f"http://127.0.0.1:{PORT}"
    env["GPUWATCHD_CONTROL_SOCKET"] = str(sock)
    env["GPUWATCHD_SPOOL"] = str(work / "state" / "spool")
    return env


def tune_main(args: argparse.Namespace) -> None:
    """Capture every variant, let a daemon tune the convs, pack captures and store."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    (work / "state").mkdir(parents=True, exist_ok=True)
    sock = work / "ctl.sock"
    cfg = work / "config.toml"
    cfg.write_text(CONFIG.format(port=PORT, state=work / "state", sock=sock, budget=args.budget_s))
    env = _env(sock, work)
    summary: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    log = (work / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config", str(cfg)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    every = set(args.all_shapes.split(",")) if args.all_shapes else set()
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.2)
        t0 = time.time()
        for v in args.variants.split(","):
            top = "0" if v in every else str(args.top)
            cmd = [sys.executable, __file__, "capture", "--variant", v, "--out", str(work),
                   "--top", top]  # fmt: skip
            subprocess.run(cmd, env=env, check=True, timeout=300)
        summary["capture_s"] = time.time() - t0
        summary["tune_s"] = wait_tuned(sock, args.tune_timeout_s)
        print(json.dumps(summary))
    finally:
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
            for name in ("daemon.log", "tune.json"):
                tar.add(work / name, arcname=name)
            tar.add(work / "state" / "gpuwatchd.db", arcname="gpuwatchd.db")


def ab_all(args: argparse.Namespace) -> None:
    """Unpack a ``tune`` stage's archive; one ``ab`` process per variant; pack the results."""
    src = Path(args.work)
    src.mkdir(parents=True, exist_ok=True)
    with tarfile.open(Path(args.src) / "tuned.tar.gz") as tar:
        tar.extractall(src, filter="data")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for v in args.variants.split(","):
        cmd = [sys.executable, __file__, "ab-one", "--variant", v, "--src", str(src), "--out",
               str(src), "--rounds", str(args.rounds)]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, timeout=500)
    with tarfile.open(out / "ab.tar.gz", "w:gz") as tar:
        for f in sorted(src.glob("ab-*.json")):
            tar.add(f, arcname=f.name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tune")
    t.add_argument("--out", required=True)
    t.add_argument("--work", default="/tmp/gpuwatchd-resnet")
    t.add_argument("--variants", default=",".join(VARIANTS))
    t.add_argument("--top", type=int, default=8)
    t.add_argument("--all-shapes", default="", help="variants whose every conv shape is tuned")
    t.add_argument("--budget-s", type=float, default=4.0)
    t.add_argument("--tune-timeout-s", type=float, default=480.0)
    c = sub.add_parser("capture")
    c.add_argument("--variant", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--top", type=int, default=8, help="0: every forward conv shape")
    a = sub.add_parser("ab")
    a.add_argument("--src", required=True, help="folder holding a tune stage's tuned.tar.gz")
    a.add_argument("--out", required=True)
    a.add_argument("--work", default="/tmp/gpuwatchd-resnet-ab")
    a.add_argument("--variants", default=",".join(VARIANTS))
    a.add_argument("--rounds", type=int, default=16)
    o = sub.add_parser("ab-one")
    o.add_argument("--variant", required=True)
    o.add_argument("--src", required=True)
    o.add_argument("--out", required=True)
    o.add_argument("--rounds", type=int, default=16)
    o.add_argument("--layer-replays", type=int, default=5)
    o.add_argument("--step-calls", type=int, default=10)
    args = p.parse_args()
    {"tune": tune_main, "capture": capture_main, "ab": ab_all, "ab-one": ab_main}[args.cmd](args)


if __name__ == "__main__":
    main()
