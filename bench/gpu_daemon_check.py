"""Validate the daemon on a real GPU: idle, a bf16 matmul burn, cool-down.

Runs ``gpuwatchd run --backend nvml`` at 10 Hz while this script idles the GPU,
runs a bf16 8192^3 matmul loop, then idles again. A thread follows the daemon's
/api/v1/state and keeps every gate transition; another records a gpuwatchd-trace/1
file of the same run through the nvml backend. Writes to --out:
  trace.jsonl      the recorded trace (a test fixture)
  summary.json     gate transitions, when the power cap appeared, metrics snapshots
Never changes a GPU setting: it only reads NVML and runs matmuls.

Usage: python bench/gpu_daemon_check.py --out DIR [--idle 5 --load 40 --cool 30]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from gpuwatchd.telemetry.nvml import NvmlBackend
from gpuwatchd.telemetry.trace import TraceWriter

LOAD_SCRIPT = """
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
print(2 * 8192**3 * n / (time.monotonic() - t0) / 1e12)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.read()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--idle", type=float, default=5.0)
    ap.add_argument("--load", type=float, default=40.0)
    ap.add_argument("--cool", type=float, default=30.0)
    ap.add_argument("--gpu", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_file = (out / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--backend", "nvml", "--poll-interval", "0.1",
         "--listen", f"127.0.0.1:{port}", "--log-level", "info"],
        stdout=log_file, stderr=subprocess.STDOUT,
    )  # fmt: skip
    for _ in range(100):
        try:
            get(base + "/healthz")
            break
        except OSError:
            time.sleep(0.1)

    stop = threading.Event()
    t_origin = time.monotonic()
    transitions: list[dict[str, object]] = []
    states: list[tuple[float, str]] = []

    def follow() -> None:
        last = None
        while not stop.is_set():
            try:
                doc = json.loads(get(base + "/api/v1/state"))
            except OSError:
                time.sleep(0.05)
                continue
            g = doc["gpus"][args.gpu]
            gate = g.get("gate") or {}
            sample = g.get("sample") or {}
            now = time.monotonic() - t_origin
            states.append((round(now, 3), gate.get("state", "?")))
            if gate.get("state") != last:
                last = gate.get("state")
                transitions.append({
                    "t": round(now, 3), "state": last, "reasons": gate.get("reasons"),
                    "sm_clock_mhz": sample.get("sm_clock_mhz"), "power_w": sample.get("power_w"),
                    "temp_c": sample.get("temp_c"), "throttle": sample.get("throttle_reasons"),
                })  # fmt: skip
            time.sleep(0.05)

    backend = NvmlBackend()
    info = backend.device_info(args.gpu)
    events: list[dict[str, object]] = []
    writer = TraceWriter(out / "trace.jsonl", [info], 0.05, events)
    first_cap: list[float] = []

    def record() -> None:
        next_at = time.monotonic()
        while not stop.is_set():
            s = backend.read(args.gpu)
            t = s.t - t_origin
            writer.write(s, t=t)
            if not first_cap and s.reasons is not None and s.reasons & 0x4:
                first_cap.append(t)
            next_at += 0.05
            time.sleep(max(0.0, next_at - time.monotonic()))

    threads = [threading.Thread(target=follow), threading.Thread(target=record)]
    for th in threads:
        th.start()

    # The load runs in a child process that exits when it ends, as a real job would:
    # while it lives it is a foreign compute process, so the gate must say "busy".
    snapshots: dict[str, str] = {}
    time.sleep(args.idle)
    snapshots["idle"] = get(base + "/metrics").decode()
    spawned = time.monotonic() - t_origin
    events.append({"t": round(spawned, 3), "what": "matmul process starts (imports torch)"})
    child = subprocess.Popen(
        [sys.executable, "-c", LOAD_SCRIPT, str(args.load)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    child.stdout.readline()  # "ready": CUDA context and operands exist, the loop starts
    load_start = time.monotonic() - t_origin
    events.append({"t": round(load_start, 3), "what": "bf16 8192^3 matmul loop starts"})
    time.sleep(args.load / 2)
    snapshots["load"] = get(base + "/metrics").decode()
    tflops = float(child.communicate()[0].strip() or "nan")
    load_end = time.monotonic() - t_origin
    events.append({"t": round(load_end, 3), "what": f"matmul process exits ({tflops:.0f} TFLOP/s)"})
    time.sleep(args.cool)
    events.append({"t": round(time.monotonic() - t_origin, 3), "what": "end of idle cool-down"})
    snapshots["cool"] = get(base + "/metrics").decode()
    status = subprocess.run([sys.executable, "-m", "gpuwatchd", "status", "--url", base],
                            capture_output=True, text=True)  # fmt: skip
    stop.set()
    for th in threads:
        th.join()
    writer.close()
    # The header is written first; rewrite it now that the events are known.
    lines = (out / "trace.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    header["events"] = events
    (out / "trace.jsonl").write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    daemon.terminate()
    t0 = time.monotonic()
    daemon.wait(10)
    stop_s = time.monotonic() - t0
    summary = {
        "device": info.name, "driver": info.driver_version, "power_limit_w": info.power_limit_w,
        "max_sm_clock_mhz": info.max_sm_clock_mhz, "load_start": load_start, "load_end": load_end,
        "tflops": tflops, "first_power_cap_t": first_cap[0] if first_cap else None,
        "transitions": transitions, "daemon_exit": daemon.returncode, "daemon_stop_s": stop_s,
        "status_table": status.stdout, "states": states,
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for k, v in snapshots.items():
        (out / f"metrics-{k}.txt").write_text(v)
    print(status.stdout)
    print(f"load {load_start:.2f}-{load_end:.2f} s, {tflops:.0f} TFLOP/s, first cap {first_cap}")
    for tr in transitions:
        print(tr)
    open_during = [t for t, s in states if load_start + 0.5 < t < load_end and s == "cool_stable"]
    print("open during load:", len(open_during), "daemon exit", daemon.returncode, f"{stop_s:.2f}s")
    os._exit(0)


if __name__ == "__main__":
    main()
