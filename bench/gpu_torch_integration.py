"""gpuwatchd.torch on a real GPU: the conv of the L4 report tuned idle vs right after a load.

Starts its own daemon (``gpuwatchd run --backend nvml``, tuning disabled) for the gate,
then runs two scenarios, each in a fresh child process (cuDNN's plan cache lives as
long as the process, and this parent must hold no CUDA context of its own, or the gate
would see it as a foreign process):

  idle        the child creates its tensors, then calls ``tune_first_call`` at once.
  after_load  a bf16 8192^3 matmul burn runs in another child for --burn seconds; the
              moment it exits, ``tune_first_call`` is called: the gate must make it
              wait (waited_s) until the GPU has cooled and settled.

Each scenario reports the kernels cudnn.benchmark picked and the steady-state time of
that pick measured cool (short batches with pauses) and under a sustained load (timed
conv batches between back-to-back matmuls, so the clock sits at the power cap). The
idle child also measures the heuristic pick (benchmark off, on its own thread: the
plan cache is per thread). The daemon's gate timeline is kept as evidence.
Never changes a GPU setting. About 90 s with the defaults.

Usage: python bench/gpu_torch_integration.py --out FILE.json [--gpu 0] [--burn 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuwatchd.client import Client, GpuState  # noqa: E402

CONV = {"input": [64, 3, 224, 224], "weight": [64, 3, 3, 3], "padding": 1, "dtype": "float32"}

BURN_SCRIPT = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
print("ready", flush=True)
n, t0 = 0, time.monotonic()
while time.monotonic() - t0 < float(sys.argv[1]):
    for _ in range(20):
        torch.mm(a, b)
    torch.cuda.synchronize()
    n += 20
print(2 * 8192**3 * n / (time.monotonic() - t0) / 1e12, flush=True)
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gate_json(st: GpuState | None) -> dict[str, Any] | None:
    if st is None:
        return None
    return {
        "state": st.state,
        "reasons": list(st.reasons),
        "judged_by": st.judged_by,
        "temp_c": st.temp_c,
        "power_w": st.power_w,
        "sm_clock_mhz": st.sm_clock_mhz,
        "throttle_reasons": list(st.throttle_reasons or ()),
        "compute_pids": list(st.compute_pids or ()),
    }


# -- child: the tuning job ---------------------------------------------------------------------


def time_under_load(
    run_conv: Any, client: Client, uuid: str, seconds: float, warm_s: float = 2.0
) -> dict[str, Any]:
    """Per-call conv time in CUDA-event-timed batches between back-to-back bf16 matmuls."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    calls = 10
    per_call: list[float] = []
    clocks: list[float] = []
    powers: list[float] = []
    reasons: set[str] = set()
    t0 = time.monotonic()
    next_read = t0 + warm_s
    while time.monotonic() - t0 < seconds:
        for _ in range(20):
            torch.mm(a, b)
        start.record()
        for _ in range(calls):
            run_conv()
        end.record()
        end.synchronize()
        now = time.monotonic()
        if now - t0 < warm_s:
            continue
        per_call.append(start.elapsed_time(end) / calls / 1e3)
        if now >= next_read:
            next_read = now + 0.5
            st = client.state(uuid)
            if st.sm_clock_mhz is not None:
                clocks.append(st.sm_clock_mhz)
            if st.power_w is not None:
                powers.append(st.power_w)
            reasons.update(st.throttle_reasons or ())
    del a, b
    torch.cuda.empty_cache()
    return {
        "median_ms": statistics.median(per_call) * 1e3 if per_call else None,
        "batches": len(per_call),
        "sm_clock_mhz_median": statistics.median(clocks) if clocks else None,
        "power_w_median": statistics.median(powers) if powers else None,
        "throttle_reasons_seen": sorted(reasons),
    }


def child(args: argparse.Namespace) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import torch.nn.functional as F

    from gpuwatchd.torch import steady_state_time, tune_first_call
    from gpuwatchd.tuning.worker.cuda_session import launched_kernels

    x = torch.randn(*CONV["input"], device="cuda")
    w = torch.randn(*CONV["weight"], device="cuda")
    torch.cuda.synchronize()
    client = Client(args.url, timeout=5.0)
    uuid = args.uuid
    print("ready", flush=True)
    sys.stdin.readline()  # "go"

    def run_conv() -> Any:
        return F.conv2d(x, w, padding=CONV["padding"])

    out: dict[str, Any] = {
        "scenario": args.child,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "gate_before": gate_json(client.state(uuid)),
    }
    go = time.monotonic()
    polls: list[dict[str, Any]] = []

    def on_poll(st: GpuState) -> None:
        polls.append({"t_s": round(time.monotonic() - go, 2), **(gate_json(st) or {})})

    try:
        with torch.no_grad():
            first = tune_first_call(
                run_conv, client=client, timeout=args.gate_timeout, on_poll=on_poll
            )
    except TimeoutError as exc:
        out["error"] = str(exc)
        out["gate_polls"] = polls
        print("RESULT " + json.dumps(out), flush=True)
        return
    out["gate_polls"] = polls
    out["waited_s"] = first.waited_s
    out["gate_at_call"] = gate_json(first.state)
    with torch.no_grad():
        cool = steady_state_time(run_conv, iters=200, warmup=20, repeats=5, pause_s=0.1)
        out["benchmark"] = {
            "kernels": list(first.kernels),
            "cool_ms": cool * 1e3,
            "loaded": time_under_load(run_conv, client, uuid, args.load_time),
        }
        if args.heuristic:
            # A fresh thread has an empty plan cache: its first call takes the heuristic pick.
            with ThreadPoolExecutor(1, initializer=torch.cuda.set_device, initargs=(0,)) as pool:
                torch.backends.cudnn.benchmark = False
                pool.submit(run_conv).result()
                torch.cuda.synchronize()
                kernels = launched_kernels(lambda: pool.submit(run_conv).result())
                torch.backends.cudnn.benchmark = True
                cool_h = pool.submit(
                    steady_state_time, run_conv, iters=200, warmup=20, repeats=5, pause_s=0.1
                ).result()
                loaded_h = pool.submit(
                    time_under_load, run_conv, client, uuid, args.load_time
                ).result()
            out["heuristic"] = {"kernels": kernels, "cool_ms": cool_h * 1e3, "loaded": loaded_h}
    print("RESULT " + json.dumps(out), flush=True)


# -- parent: daemon, load, scenarios -----------------------------------------------------------


class Timeline(threading.Thread):
    """Follows the daemon's gate for one GPU; keeps every state change."""

    def __init__(self, client: Client, gpu: int, t0: float) -> None:
        super().__init__(daemon=True)
        self.client, self.gpu, self.t0 = client, gpu, t0
        self.changes: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        last = None
        while not self.stop.wait(0.1):
            try:
                st = self.client.state(self.gpu)
            except Exception:
                continue
            if st.state != last:
                last = st.state
                self.changes.append({"t_s": round(time.monotonic() - self.t0, 2), **gate_json(st)})  # type: ignore[dict-item]


def spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )


def expect_ready(proc: subprocess.Popen[str], what: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "ready":
        raise RuntimeError(f"{what} did not start (said {line!r}, exit {proc.poll()})")


def finish_child(proc: subprocess.Popen[str]) -> dict[str, Any]:
    stdout, _ = proc.communicate(timeout=300)
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"tuning child exited {proc.returncode} without a result")


def tune_child(
    args: argparse.Namespace, name: str, url: str, uuid: str, env: dict[str, str]
) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--child", name, "--url", url, "--uuid", uuid,
           "--gate-timeout", str(args.gate_timeout), "--load-time", str(args.load_time),
           "--heuristic" if args.heuristic and name == "idle" else "--no-heuristic"]  # fmt: skip
    return spawn(cmd, env)


def parent(args: argparse.Namespace) -> None:
    t_origin = time.monotonic()
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpuwatchd-torch-bench-"))
    (tmp / "config.toml").write_text("[daemon]\npoll_interval_s = 0.1\n[tuning]\nenabled = false\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    log = (tmp / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config", str(tmp / "config.toml"),
         "--backend", "nvml", "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp)],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
    )  # fmt: skip
    procs: list[subprocess.Popen[str]] = []
    try:
        client = Client(url, timeout=2.0)
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(url + "/healthz", timeout=1).read()
                st = client.state(args.gpu)
                if st.uuid:
                    break
            except Exception:
                pass
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise RuntimeError(
                    f"daemon did not come up; log: {(tmp / 'daemon.log').read_text()[-2000:]}"
                )
            time.sleep(0.2)
        uuid = st.uuid
        child_env = {**env, "CUDA_VISIBLE_DEVICES": uuid}
        timeline = Timeline(client, args.gpu, t_origin)
        timeline.start()
        result: dict[str, Any] = {
            "device": st.name,
            "uuid": uuid,
            "gpu": args.gpu,
            "burn_s": args.burn,
            "load_time_s": args.load_time,
            "conv": CONV,
            "scenarios": {},
        }

        # Scenario 1: idle GPU.
        proc = tune_child(args, "idle", url, uuid, child_env)
        procs.append(proc)
        expect_ready(proc, "idle tuning child")
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result["scenarios"]["idle"] = finish_child(proc)

        # Scenario 2: right after a matmul burn in another process.
        burn = spawn([sys.executable, "-c", BURN_SCRIPT, str(args.burn)], child_env)
        procs.append(burn)
        proc = tune_child(args, "after_load", url, uuid, child_env)
        procs.append(proc)
        expect_ready(burn, "matmul burn")
        burn_start = time.monotonic()
        expect_ready(proc, "after-load tuning child")
        burn_out, _ = burn.communicate(timeout=args.burn + 60)
        burn_end = time.monotonic()
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        after = finish_child(proc)
        after["burn_tflops"] = float(burn_out.strip().splitlines()[-1])
        after["burn_window_s"] = [round(burn_start - t_origin, 2), round(burn_end - t_origin, 2)]
        result["scenarios"]["after_load"] = after
        timeline.stop.set()
        timeline.join()
        result["gate_timeline"] = timeline.changes
        result["elapsed_s"] = time.monotonic() - t_origin
        out_path.write_text(json.dumps(result, indent=1) + "\n")
        summarize(result)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        daemon.terminate()
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()


def summarize(result: dict[str, Any]) -> None:
    print(f"{result['device']} ({result['uuid']}), {result['elapsed_s']:.0f}s")
    for name, sc in result["scenarios"].items():
        if "error" in sc:
            print(f"{name}: {sc['error']}")
            continue
        before = sc["gate_before"]
        print(f"{name}: gate before {before['state']} ({'; '.join(before['reasons'])}); "
              f"waited {sc['waited_s']:.1f}s; at call {sc['gate_at_call']['state']} "
              f"(judged by {sc['gate_at_call']['judged_by']})")  # fmt: skip
        for pick in ("benchmark", "heuristic"):
            p = sc.get(pick)
            if p:
                ld = p["loaded"]
                print(f"  {pick}: cool {p['cool_ms']:.3f} ms, loaded {ld['median_ms']:.3f} ms "
                      f"(SM {ld['sm_clock_mhz_median']} MHz, {ld['power_w_median']} W, "
                      f"{'+'.join(ld['throttle_reasons_seen']) or 'no throttle'})")  # fmt: skip
                for k in p["kernels"]:
                    print(f"    {k}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON file to write (parent)")
    ap.add_argument("--gpu", type=int, default=0, help="daemon (NVML) index of the GPU")
    ap.add_argument("--burn", type=float, default=20.0, help="seconds of matmul load")
    ap.add_argument("--load-time", type=float, default=5.0, help="seconds of each loaded timing")
    ap.add_argument("--gate-timeout", type=float, default=90.0, help="give up waiting after S s")
    ap.add_argument(
        "--heuristic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the heuristic pick (benchmark off) in the idle scenario",
    )
    ap.add_argument("--child", choices=("idle", "after_load"), help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--uuid", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
    elif not args.out:
        ap.error("--out is required")
    else:
        parent(args)


if __name__ == "__main__":
    main()
