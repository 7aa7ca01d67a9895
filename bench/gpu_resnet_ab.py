"""ResNet-50 with and without gpuwatchd, per layer and per step, in one process: a diagnostic.

Every arm here shares one process (a thread each), and the per-layer kernel check runs
torch.profiler in it, so a cost that stays with a process (a profiler's CUPTI
subscription, say) reaches every arm alike and cannot show. Whether a job is ever slower
with gpuwatchd is measured the way jobs run, in fresh processes:
``bench/gpu_fresh_process_ab.py``.

    python3 bench/gpu_resnet_ab.py all --out DIR [--deadline-s 460] [--top 6] [--all-shapes V,...]
    python3 bench/gpu_resnet_ab.py tune --out DIR [--variants ...] [--top 8] [--all-shapes V,...]
    python3 bench/gpu_resnet_ab.py ab --src DIR --out DIR [--variants ...]
    python3 bench/gpu_resnet_ab.py summary FILE...   (ab.tar.gz, ab-<variant>.json, data file)

For each variant (activations NCHW or channels_last, fp16 or fp32; torchvision's
ResNet-50 built in-process with random weights, batch 32, 224x224):

1. ``capture`` (a fresh process): three training steps (forward + backward) inside
   ``gpuwatchd.torch.capture``, written as ``capture-<variant>.json``.
2. A gpuwatchd daemon (NVML backend, drift off, sustained regime only) gets the top
   ``--top`` forward-conv workloads of every capture (every one for the variants in
   ``--all-shapes``) through the control socket and tunes them at its next open gate.
   Then the store is read back: a submitted shape with no winner, or (for an
   ``--all-shapes`` variant, where the whole-model memory-format switch can be weighed)
   no measured candidate in the other memory format, is asked for once more
   (``retune``, the daemon reloaded with ``--retune-budget-s`` per workload: a session's
   budget counts its candidates' set-up, and the worker's first group also pays its
   start-up); what is still missing is listed in ``tune.json``. The captures and the
   daemon's store are packed into ``tuned.tar.gz``.
3. ``ab`` (a new process per variant, possibly on another machine of the same model):
   the saved capture is loaded (``load_capture``) and applied with
   ``apply_winners(model, capture=..., memory_format="winner")`` before the model's
   first forward pass. Five arms, each a model of its own on a thread of its own
   (cuDNN's plan cache is per thread): ``default`` (what the job runs alone:
   ``cudnn.benchmark=False``), ``default_again`` (the same again: the A/A control of
   every cell), ``gpuwatchd``, ``bench_cool`` (``cudnn.benchmark=True``, first step on a
   cool idle GPU) and ``bench_loaded`` (``cudnn.benchmark=True``, first step beside a
   neighbour process running a bf16 GEMM loop).
   Per conv layer with a recorded choice: every arm convolves the same tensors, from a
   CUDA graph captured on the arm's thread (its cached plan), all graphs in one memory
   pool (:class:`Layer`); the profiler records each arm's kernel launches (name, grid,
   block), so a layer where gpuwatchd applied nothing is shown to run the default's
   kernels. The whole training step: a CUDA graph of forward and backward per arm.
   Layers and steps are timed as graph replays from one thread on one stream, the arms
   alternating in Williams-design rounds (:func:`timed_rounds`); each arm's figure is the
   median of its per-round ratios to ``default`` with a 95% CI (``resnet_ab_stats``).
   For every applied benchmark pick the gpuwatchd arm's kernels are compared with the
   kernels the worker recorded.

``all`` runs ``tune`` then ``ab`` within ``--deadline-s``: each variant's ``ab`` process gets
an equal share of the time left and times for as many rounds as fit (at least
``--min-rounds``). Files in --out: ``tuned.tar.gz``, ``ab.tar.gz`` (one JSON per variant,
per-round times included), ``summary.json`` and ``summary.md``.

Never changes a GPU setting.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gpu_daemon_user_kernels import control  # noqa: E402  # the control socket, one request
from resnet_ab_stats import (  # noqa: E402
    AA,
    ARMS,
    BASE,
    GW,
    load_runs,
    ratio_cell,
    split_segments,
    summarise,
    williams_orders,
)
from resnet_tune_coverage import coverage_gaps  # noqa: E402

from gpuwatchd.tuning.worker.cuda_session import KernelLaunch, kernel_launches  # noqa: E402

PORT = 9878
VARIANTS = ("nchw-fp16", "cl-fp16", "nchw-fp32", "cl-fp32")
BATCH = 32
#: Of an ab process's time left for timing, the part the training step gets.
_STEP_PART = 0.25
#: Seconds an ab process keeps back to write its results.
_WRITE_S = 3.0

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
    names = [w.name for w in convs]
    (out / f"submitted-{args.variant}.json").write_text(json.dumps(names))
    print(json.dumps({"variant": args.variant, "workloads": names}))
    source = {"kind": "capture", "variant": args.variant}
    result = submit_workloads(tuple(convs), source)
    print(f"submitted {len(convs)} conv workloads: {result.how} {result.detail}")
    if result.how != "daemon":
        raise SystemExit(f"the daemon did not queue the workloads: {result.detail}")


# -- stage 3: A/B ---------------------------------------------------------------------------------


class Arm:
    """A model of its own on a thread of its own (cuDNN's plan cache is per thread)."""

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
            return f"not captured ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        self.step_graph = graph
        return "cuda_graph"


def _flag(benchmark: bool) -> None:
    import torch

    torch.backends.cudnn.benchmark = benchmark


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
    """One captured forward-conv shape in every arm, the arms differing in nothing but
    the plan each one's thread has cached.

    Every arm convolves the same input and weight tensors (one pair per layout pair, from
    one seed); each arm's graph of ``GRAPH_CALLS`` calls is captured on that arm's thread
    (its cached plan is what the graph launches), all of them into one memory pool, so
    outputs and workspaces land where the other arms' did. The graphs are replayed from
    one thread on one stream: a replay runs the captured kernels whichever thread
    launches it.
    """

    GRAPH_CALLS = 20

    def __init__(
        self, call: Any, arms: dict[str, Arm], layouts: dict[str, tuple[str, str]]
    ) -> None:
        import torch

        self.call = call
        tensors = {lay: _conv_operands(call, lay) for lay in set(layouts.values())}
        pool = torch.cuda.graph_pool_handle()
        self.eager = {name: _conv_fn(call, *tensors[layouts[name]]) for name in arms}
        self.graphs = {
            name: arm.call(_capture_conv, self.eager[name], pool, self.GRAPH_CALLS)
            for name, arm in arms.items()
        }
        self.arms = arms


def _conv_operands(call: Any, layouts: tuple[str, str]) -> tuple[Any, Any]:
    """The input and weight of ``call`` in ``layouts``, the same values whatever the layout."""
    import torch

    s = call.shape
    dt = getattr(torch, call.dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(s["input"], device="cuda", dtype=dt, generator=g)
    w = torch.randn(s["weight"], device="cuda", dtype=dt, generator=g)
    fx, fw = (
        torch.channels_last if lay == "channels_last" else torch.contiguous_format
        for lay in layouts
    )
    return x.contiguous(memory_format=fx), w.contiguous(memory_format=fw)


def _conv_fn(call: Any, x: Any, w: Any) -> Any:
    import torch
    import torch.nn.functional as F

    s = call.shape

    def conv() -> None:
        with torch.no_grad():
            F.conv2d(x, w, None, s["stride"], s["padding"], s["dilation"], s["groups"])

    return conv


def _capture_conv(conv: Any, pool: Any, calls: int) -> Any:
    """On the arm's thread: warm calls (a plan not cached yet is picked here, with
    ``cudnn.benchmark`` off), then a graph of ``calls`` calls in the shared ``pool``."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            conv()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        for _ in range(calls):
            conv()
    torch.cuda.synchronize()
    return graph


def timed_rounds(
    graphs: dict[str, Any], per_replay: int, replays: int, rounds: int, min_rounds: int,
    deadline: float,
) -> dict[str, list[float]]:  # fmt: skip
    """Seconds per call of every arm, one value per round.

    A round queues every arm's ``replays`` graph replays back to back on this thread's
    stream, in the next order of a Williams design, with a CUDA event between arms and an
    untimed lead-in replay before the first, then waits once: the GPU never idles inside
    a round. Stops after ``rounds``, or at the first whole cycle of orders at or past
    ``min_rounds`` once ``deadline`` (``time.monotonic()``) has passed.
    """
    import torch

    names = [a for a in ARMS if a in graphs]
    orders = [[names[i] for i in o] for o in williams_orders(len(names))]
    out: dict[str, list[float]] = {a: [] for a in names}
    for r in range(rounds):
        if r >= min_rounds and r % len(orders) == 0 and time.monotonic() > deadline:
            break
        order = orders[r % len(orders)]
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(order) + 1)]
        graphs[order[-1]].replay()
        events[0].record()
        for i, arm in enumerate(order):
            for _ in range(replays):
                graphs[arm].replay()
            events[i + 1].record()
        events[-1].synchronize()
        for i, arm in enumerate(order):
            ms = events[i].elapsed_time(events[i + 1])
            out[arm].append(ms / 1e3 / (replays * per_replay))
    return out


def segment_launches(segments: list[Any]) -> list[list[KernelLaunch]]:
    """The distinct kernel launches (name, grid, block) of each callable, from one profiler
    session: a marker kernel on this thread's stream before each marks where it starts."""
    import torch

    def run() -> None:
        for fn in segments:
            torch.cuda._sleep(1000)
            fn()
            torch.cuda.synchronize()

    torch.cuda.synchronize()
    return split_segments(kernel_launches(run, distinct=False), len(segments))


def layer_launches(layers: dict[str, Layer]) -> dict[str, dict[str, Any]]:
    """What every arm's graph of every layer launches (a graph's kernels as CUPTI reports
    them); where the profiler shows none for a graph, what the eager call on the arm's
    thread launches (the plan the graph was captured with)."""
    keys = [(w, a) for w, layer in layers.items() for a in layer.graphs]
    seen = segment_launches([layers[w].graphs[a].replay for w, a in keys])
    blank = [key for key, got in zip(keys, seen, strict=True) if not got]
    eager = segment_launches(
        [lambda w=w, a=a: layers[w].arms[a].call(layers[w].eager[a]) for w, a in blank]
    ) if blank else []  # fmt: skip
    again = dict(zip(blank, eager, strict=True))
    out: dict[str, dict[str, Any]] = {
        w: {"source": {}, "launches": {}, "kernel_names": {}} for w in layers
    }
    for key, got in zip(keys, seen, strict=True):
        w, a = key
        out[w]["launches"][a] = [k.describe() for k in got or again[key]]
        out[w]["kernel_names"][a] = list(dict.fromkeys(k.name for k in got or again[key]))
        out[w]["source"][a] = "graph" if got else "eager"
    for doc in out.values():
        base = doc["launches"][BASE]
        doc["same_launches"] = {a: got == base for a, got in doc["launches"].items()}
    return out


def ab_main(args: argparse.Namespace) -> None:
    import torch

    import gpuwatchd.torch as gt
    from gpuwatchd.client import Client

    variant = args.variant
    src, out = Path(args.src), Path(args.out)
    t_start = time.monotonic()
    cap = gt.load_capture(src / f"capture-{variant}.json")
    client = Client(url="http://127.0.0.1:9", store=src / "gpuwatchd.db")
    doc: dict[str, Any] = {
        "variant": variant,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
    }
    arms = {name: Arm(name, variant) for name in ARMS}
    gw = arms[GW]

    # gpuwatchd: the saved capture, applied before the model's first forward pass
    applied = gw.call(
        lambda: gt.apply_winners(gw.model, capture=cap, client=client, memory_format="winner")
    )
    doc["plan"] = str(applied)
    doc["applied"] = {
        "model_format": applied.model_format,
        "model_format_reason": applied.plan.model_format_reason,
        "warmed": list(applied.warmed),
        "blocked": [list(b) for b in applied.blocked],
        "skipped": [list(s) for s in applied.plan.skipped],
        "blas": applied.blas_library,
    }
    # first steps: default(s) and gpuwatchd as they are, bench_cool on an idle GPU,
    # bench_loaded beside a neighbour's GEMM loop
    for name in (GW, BASE, AA):
        arms[name].first_steps(benchmark=False)
    time.sleep(args.cool_s)
    doc["bench_cool_start"] = _nvml_state()
    arms["bench_cool"].first_steps(benchmark=True)
    neighbour = _neighbour()
    time.sleep(4)
    doc["bench_loaded_start"] = _nvml_state()
    arms["bench_loaded"].first_steps(benchmark=True)
    neighbour.send_signal(signal.SIGTERM)
    neighbour.wait(30)
    _flag(False)
    time.sleep(2)
    doc["setup_s"] = time.monotonic() - t_start

    # every captured forward conv with a recorded choice, alone, in each arm's layouts
    layers: dict[str, Layer] = {}
    for c in applied.plan.convs:
        lay = {name: (c.layouts if name == GW else c.call.layouts) for name in arms}
        layers[c.workload] = Layer(c.call, arms, lay)
    torch.cuda.synchronize()
    try:
        launches = layer_launches(layers)
    except (RuntimeError, ValueError) as e:  # the timings still mean something without it
        doc["launches_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        launches = {w: {} for w in layers}
    # every applied benchmark pick: did the gpuwatchd arm launch the worker's kernels?
    ranked = {w.workload: w for w in client.winners(regime="sustained")}
    checks = []
    for c in applied.plan.convs:
        if not c.acts or c.pick != "benchmark":
            continue
        w = ranked.get(c.workload)
        cands = w.ranked if w is not None else ()
        recorded = next((r.meta.get("kernels") for r in cands if r.name == c.candidate), None)
        ran = launches[c.workload].get("kernel_names", {}).get(GW)
        same = bool(recorded) and ran is not None and sorted(recorded) == sorted(ran)
        checks.append({"workload": c.workload, "recorded": recorded, "ran": ran, "same": same})
    doc["kernel_checks"] = checks

    doc["step_timing"] = {name: arm.capture_step() for name, arm in arms.items()}
    # the time left to --end-by: three quarters to the layers (an equal share each), the
    # rest to the step; every cell gets at least --min-rounds whatever the clock says
    left = max(0.0, args.end_by - time.time() - _WRITE_S)
    step_s = left * _STEP_PART
    t_layers = time.monotonic()
    choices = {c.workload: c for c in applied.plan.convs}
    doc["layers"] = {}
    for i, (w, layer) in enumerate(layers.items()):
        share = (left - step_s - (time.monotonic() - t_layers)) / (len(layers) - i)
        times = timed_rounds(layer.graphs, Layer.GRAPH_CALLS, args.layer_replays, args.rounds,
                             args.min_rounds, time.monotonic() + share)  # fmt: skip
        c = choices[w]
        doc["layers"][w] = {
            "choice": c.candidate, "applied": c.acts, "share": c.call.share,
            "arms": ratio_cell(times), **launches[w], "per_round_s": times,
        }  # fmt: skip
    doc["layers_s"] = time.monotonic() - t_layers
    steps = {name: arm.step_graph for name, arm in arms.items() if arm.step_graph is not None}
    if len(steps) == len(arms):
        step_s = max(0.0, args.end_by - time.time() - _WRITE_S)
        times = timed_rounds(steps, 1, args.step_replays, args.rounds, args.min_rounds,
                             time.monotonic() + step_s)  # fmt: skip
        doc["step"] = ratio_cell(times)
        doc["step_per_round_s"] = times
    doc["end_state"] = _nvml_state()
    doc["total_s"] = time.monotonic() - t_start
    (out / f"ab-{variant}.json").write_text(json.dumps(doc, indent=1, default=str))
    summary = summarise({variant: doc})
    print(json.dumps({"variant": variant, **summary["counts"]}))
    print(summary["table"])


# -- the stages ------------------------------------------------------------------------------------


def http_json(path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=5) as r:
        return json.loads(r.read().decode())


def wait_tuned(sock: Path, timeout_s: float) -> float | None:
    """Seconds until the daemon has nothing pending or running; None past ``timeout_s``."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        pending = control(sock, {"op": "status"})["pending"]
        running = http_json("/api/v1/state")["tuning"]["running_gpus"]
        if not pending and not running:
            return time.time() - t0
        time.sleep(1.0)
    return None


def _env(sock: Path, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["GPUWATCHD_URL"] = f"http://127.0.0.1:{PORT}"
    env["GPUWATCHD_CONTROL_SOCKET"] = str(sock)
    env["GPUWATCHD_SPOOL"] = str(work / "state" / "spool")
    return env


def _gaps(work: Path, variants: list[str], every: set[str]) -> dict[str, dict[str, str]]:
    """Per variant, the submitted shapes the store does not cover yet (see coverage_gaps)."""
    import gpuwatchd.torch as gt
    from gpuwatchd.client import Client, GpuwatchdError
    from gpuwatchd.jobside.winner_plan import latest_by_workload
    from gpuwatchd.store import StoreError

    client = Client(url="http://127.0.0.1:9", store=work / "state" / "gpuwatchd.db")
    try:
        winners = latest_by_workload(client.winners(regime="sustained"))
    except (GpuwatchdError, StoreError, OSError) as e:
        return {v: {"*": f"the store could not be read: {e}"} for v in variants}
    out = {}
    for v in variants:
        cap = gt.load_capture(work / f"capture-{v}.json")
        submitted = json.loads((work / f"submitted-{v}.json").read_text())
        out[v] = coverage_gaps(cap.calls, set(submitted), winners, v in every)
    return out


def tune_main(args: argparse.Namespace) -> None:
    """Capture every variant, let a daemon tune the convs, ask once more for what the
    store lacks, pack captures and store."""
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
    variants = args.variants.split(",")
    t_end = time.time() + args.tune_timeout_s
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.2)
        t0 = time.time()
        for v in variants:
            top = "0" if v in every else str(args.top)
            cmd = [sys.executable, __file__, "capture", "--variant", v, "--out", str(work),
                   "--top", top]  # fmt: skip
            subprocess.run(cmd, env=env, check=True, timeout=300)
        summary["capture_s"] = time.time() - t0
        summary["tune_s"] = wait_tuned(sock, t_end - time.time())
        gaps = summary["gaps_first"] = _gaps(work, variants, every)
        missing = sorted({name for g in gaps.values() for name in g if name != "*"})
        if missing and summary["tune_s"] is not None:
            # a larger budget for the second pass, in force after the daemon's reload
            budget = args.retune_budget_s
            cfg.write_text(CONFIG.format(port=PORT, state=work / "state", sock=sock, budget=budget))
            daemon.send_signal(signal.SIGHUP)
            time.sleep(2.0)
            summary["retune_budget_s"] = budget
            summary["retune"] = control(sock, {"op": "retune", "workloads": missing})
            summary["retune_s"] = wait_tuned(sock, t_end - time.time())
            gaps = _gaps(work, variants, every)
        summary["gaps"] = gaps
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
            for f in sorted([*work.glob("capture-*.json"), *work.glob("submitted-*.json")]):
                tar.add(f, arcname=f.name)
            for name in ("daemon.log", "tune.json"):
                tar.add(work / name, arcname=name)
            db = work / "state" / "gpuwatchd.db"
            if db.exists():
                tar.add(db, arcname=db.name)


def ab_all(args: argparse.Namespace) -> None:
    """Unpack a ``tune`` stage's archive; one ``ab`` process per variant, each given an
    equal share of the time left; pack the results. A variant that fails is recorded and
    the others still run."""
    src = Path(args.work)
    src.mkdir(parents=True, exist_ok=True)
    with tarfile.open(Path(args.src) / "tuned.tar.gz") as tar:
        tar.extractall(src, filter="data")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    variants = args.variants.split(",")
    end = time.time() + args.ab_s
    failed: dict[str, str] = {}
    try:
        for i, v in enumerate(variants):
            share = (end - time.time()) / (len(variants) - i)
            cmd = [sys.executable, __file__, "ab-one", "--variant", v, "--src", str(src),
                   "--out", str(src), "--rounds", str(args.rounds), "--min-rounds",
                   str(args.min_rounds), "--end-by", str(time.time() + share)]  # fmt: skip
            try:
                subprocess.run(cmd, env=env, check=True, timeout=max(share, 0) + 180)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
                failed[v] = str(e)
                print(f"ab {v} failed: {e}", flush=True)
    finally:
        (src / "ab-failed.json").write_text(json.dumps(failed, indent=1))
        with tarfile.open(out / "ab.tar.gz", "w:gz") as tar:
            for f in sorted([*src.glob("ab-*.json")]):
                tar.add(f, arcname=f.name)


def all_main(args: argparse.Namespace) -> None:
    """``tune`` then ``ab`` within ``--deadline-s``, in fresh folders under the temporary
    directory (``--work`` is not used); then summary.json and summary.md."""
    t0 = time.time()
    out = Path(args.out)
    args.work = tempfile.mkdtemp(prefix="gpuwatchd-resnet-")  # no store of an earlier run
    args.tune_timeout_s = min(args.tune_timeout_s, args.deadline_s * args.tune_part)
    try:
        tune_main(args)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        print(f"tune failed: {e}", flush=True)
    if (out / "tuned.tar.gz").exists():
        args.src = str(out)
        args.work = args.work + "-ab"
        args.ab_s = max(60.0, args.deadline_s - (time.time() - t0) - 20.0)
        ab_all(args)
    summary_main(argparse.Namespace(files=[str(out / "ab.tar.gz")], out=str(out)))


def summary_main(args: argparse.Namespace) -> None:
    """The per-cell table and counts of one or more runs; into --out when given."""
    docs: dict[str, Any] = {}
    for f in args.files:
        try:
            runs = load_runs(f)
        except (OSError, ValueError, tarfile.TarError) as e:
            print(f"summary: {f}: {e}", file=sys.stderr)
            continue
        for label, run in runs.items():
            docs[label] = summarise(run)
    text = "\n\n".join(f"## {label}\n\n{s['table']}" for label, s in docs.items())
    counts = {label: s["counts"] for label, s in docs.items()}
    if getattr(args, "out", None):
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "summary.md").write_text(text + "\n")
        Path(args.out, "summary.json").write_text(json.dumps(counts, indent=1))
    print(text)
    print(json.dumps(counts, indent=1))
    if not docs:
        raise SystemExit("summary: no run could be read")


def _add_tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/gpuwatchd-resnet")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--all-shapes", default="", help="variants whose every conv shape is tuned")
    p.add_argument("--budget-s", type=float, default=4.0)
    p.add_argument("--tune-timeout-s", type=float, default=480.0)
    p.add_argument("--retune-budget-s", type=float, default=12.0,
                   help="per-workload budget for shapes the store lacks, asked again")  # fmt: skip


def _add_round_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=60, help="at most this many rounds a cell")
    p.add_argument("--min-rounds", type=int, default=20, help="at least this many, time or not")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tune")
    _add_tune_args(t)
    c = sub.add_parser("capture")
    c.add_argument("--variant", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--top", type=int, default=8, help="0: every forward conv shape")
    a = sub.add_parser("ab")
    a.add_argument("--src", required=True, help="folder holding a tune stage's tuned.tar.gz")
    a.add_argument("--out", required=True)
    a.add_argument("--work", default="/tmp/gpuwatchd-resnet-ab")
    a.add_argument("--variants", default=",".join(VARIANTS))
    a.add_argument("--ab-s", type=float, default=360.0, help="seconds for all variants")
    _add_round_args(a)
    o = sub.add_parser("ab-one")
    o.add_argument("--variant", required=True)
    o.add_argument("--src", required=True)
    o.add_argument("--out", required=True)
    o.add_argument("--end-by", type=float, required=True, help="epoch seconds to finish by")
    o.add_argument("--layer-replays", type=int, default=2)
    o.add_argument("--step-replays", type=int, default=3)
    o.add_argument("--cool-s", type=float, default=6.0)
    _add_round_args(o)
    al = sub.add_parser("all")
    _add_tune_args(al)
    al.add_argument("--deadline-s", type=float, default=460.0)
    al.add_argument("--tune-part", type=float, default=0.5,
                    help="at most this part of the deadline for capture and tuning")  # fmt: skip
    _add_round_args(al)
    s = sub.add_parser("summary")
    s.add_argument("files", nargs="+")
    s.add_argument("--out", default=None, help="also write summary.md and summary.json here")
    args = p.parse_args()
    for name in ("rounds", "min_rounds"):
        if getattr(args, name, 1) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if getattr(args, "deadline_s", 1.0) <= 0:
        p.error("--deadline-s must be > 0")
    if not 0 < getattr(args, "tune_part", 0.5) < 1:
        p.error("--tune-part must be between 0 and 1")
    run = {"tune": tune_main, "capture": capture_main, "ab": ab_all, "ab-one": ab_main,
           "all": all_main, "summary": summary_main}  # fmt: skip
    run[args.cmd](args)


if __name__ == "__main__":
    main()
