"""The real round trip of a user's Triton kernel through a running gpuwatchd daemon.

    python3 bench/gpu_daemon_user_kernels.py --out DIR [--kernels softmax,layer_norm]

On an empty state directory:

1. start ``gpuwatchd run`` (nvml backend, ``allowed_modules = ["user_kernels"]``, drift
   off so only the users' work is tuned, a short protocol budget);
2. job run 1 (``examples/user_kernels``, decorated with ``gpuwatchd.triton.autotune``):
   every key misses, Triton autotunes (its start-up time is recorded) and a
   ``tune_kernel`` request goes to the daemon over its control socket;
3. the daemon tunes the requests at the next open gate, in both regimes, with its own
   runner and worker; this waits until nothing is pending or running;
4. job run 2: it first waits for the gate holding its own CUDA context (the daemon
   judges the GPU for the job: ``register_job`` + ``job_gate``), then every key hits:
   zero seconds autotuning, the recorded sustained winner.

Writes DIR/e2e.json (the figures), job1.json, job2.json, winners.json, metrics.txt,
report.txt and daemon.log. Never changes GPU settings.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
PORT = 9877

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
allowed_modules = ["user_kernels"]

[tuning.protocol]
time_budget_s = {budget}
settle_timeout_s = 8.0

[drift]
enabled = false
"""


def now() -> float:
    return time.time()


def env_for(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(ROOT), str(EXAMPLES), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["GPUWATCHD_URL"] = f"http://127.0.0.1:{PORT}"
    env["GPUWATCHD_CONTROL_SOCKET"] = str(work / "ctl.sock")
    env["GPUWATCHD_SPOOL"] = str(work / "state" / "spool")
    return env


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


def http_text(path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=5) as r:
        return str(r.read().decode())


def run_job(
    out: Path, name: str, env: dict[str, str], kernels: str, shapes: int, wait_gate: bool
) -> Any:
    cmd = [sys.executable, __file__, "job", "--kernels", kernels, "--json", str(out / name),
           "--shapes", str(shapes)]  # fmt: skip
    if wait_gate:
        cmd.append("--wait-gate")
    t0 = now()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}")
    doc = json.loads((out / name).read_text())
    doc["wall_s"] = now() - t0
    return doc


def wait_tuned(sock: Path, timeout_s: float) -> dict[str, Any]:
    """Until the daemon has nothing pending or running; when the session started and ended."""
    t0 = now()
    started = None
    while now() - t0 < timeout_s:
        pending = control(sock, {"op": "status"})["pending"]
        state = json.loads(http_text("/api/v1/state"))
        running = state["tuning"]["running_gpus"]
        if running and started is None:
            started = now()
        if not pending and not running:
            return {"waited_s": now() - t0, "session_started_after_s": (started or now()) - t0}
        time.sleep(0.5)
    raise SystemExit(f"the daemon did not finish tuning within {timeout_s:g}s")


def e2e(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    (work / "state").mkdir(parents=True, exist_ok=True)
    sock = work / "ctl.sock"
    cfg = work / "config.toml"
    cfg.write_text(CONFIG.format(port=PORT, state=work / "state", sock=sock, budget=args.budget_s))
    env = env_for(work)
    summary: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "stages": {}}
    log = (out / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpuwatchd", "run", "--config", str(cfg)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.2)
        summary["stages"]["job1"] = run_job(out, "job1.json", env, args.kernels, args.shapes, False)
        summary["stages"]["tuning"] = wait_tuned(sock, args.tune_timeout_s)
        summary["stages"]["job2"] = run_job(out, "job2.json", env, args.kernels, args.shapes, True)
        (out / "winners.json").write_text(http_text("/api/v1/winners"))
        (out / "metrics.txt").write_text(http_text("/metrics"))
        summary["figures"] = figures(summary["stages"], json.loads(http_text("/api/v1/winners")))
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
        report = subprocess.run(
            [sys.executable, "-m", "gpuwatchd", "report", "--config", str(cfg)],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        (out / "report.txt").write_text(report.stdout + report.stderr)
        summary["defaults"] = default_verdicts(cfg, env)
        (out / "e2e.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary.get("figures"), indent=1))


def default_verdicts(cfg: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """Per (workload, regime) of the store: the job's default, the winner, and whether the
    winner beat the default beyond the noise (``gpuwatchd report --format json``)."""
    report = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "report", "--config", str(cfg), "--format", "json"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    keys = ("workload", "regime", "job_default", "winner", "tie")
    return [
        {
            **{k: r[k] for k in keys},
            "beat_default": None if r["job_default"] is None else not r["kept_default"],
        }
        for r in json.loads(report.stdout)["results"]
    ]


def figures(stages: dict[str, Any], winners_doc: dict[str, Any]) -> dict[str, Any]:
    """Per case: run 1's autotuning time, run 2's, and whether run 2 used the sustained winner."""
    sustained = {
        w["workload"]: w["candidate"] for w in winners_doc["winners"] if w["regime"] == "sustained"
    }
    regimes: dict[str, list[str]] = {}
    for w in winners_doc["winners"]:
        regimes.setdefault(w["workload"], []).append(w["regime"])
    rows = []
    for first, second in zip(stages["job1"]["cases"], stages["job2"]["cases"], strict=True):
        rows.append({
            "kernel": first["kernel"], "shape": first["shape"],
            "run1_source": first["source"], "run1_autotune_s": first["autotune_s"],
            "run1_first_call_s": first["first_call_s"], "run1_submission": first["submission"],
            "run2_source": second["source"], "run2_autotune_s": second["autotune_s"],
            "run2_first_call_s": second["first_call_s"], "run2_config": second["config"],
            "recorded_sustained_winner": sustained.get(second["workload"]),
            "uses_sustained_winner": sustained.get(second["workload"]) == second["config"],
            "regimes_recorded": sorted(regimes.get(second["workload"], [])),
            "run2_rel_error": second["rel_error"],
        })  # fmt: skip
    return {
        "cases": rows,
        "autotune_s_run1_total": sum(r["run1_autotune_s"] for r in rows),
        "autotune_s_run2_total": sum(r["run2_autotune_s"] for r in rows),
        "job1_wall_s": stages["job1"]["wall_s"],
        "job2_wall_s": stages["job2"]["wall_s"],
        "job2_gate": stages["job2"].get("gate"),
        "tuning": stages["tuning"],
    }


def job(args: argparse.Namespace) -> None:
    """One job run: the selected example kernels, each called once, checked against torch."""
    import logging

    import torch

    sys.path[:0] = [str(ROOT), str(EXAMPLES)]
    from user_kernels import driver

    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    torch.ones(1, device="cuda").sum().item()  # this job now holds a CUDA context
    gate = None
    if args.wait_gate:
        from gpuwatchd.client import Client

        t0 = time.perf_counter()
        st = Client().wait_until_stable(0, timeout=60)
        gate = {"waited_s": time.perf_counter() - t0, "judged_by": st.judged_by,
                "state": st.state, "reasons": list(st.reasons)}  # fmt: skip
    wanted = set(args.kernels.split(","))
    taken: dict[str, int] = {}
    cases = []
    for name, shape, kernel, call in driver.cases():
        if name not in wanted or taken.get(name, 0) >= args.shapes:
            continue
        taken[name] = taken.get(name, 0) + 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got, ref = call()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        c = kernel.gpuwatchd_last
        cases.append({
            "kernel": name, "shape": list(shape), "config": c.label, "source": c.source,
            "workload": c.workload, "reason": c.reason, "autotune_s": c.autotune_s,
            "submission": c.submission.how if c.submission else None,
            "submission_detail": c.submission.detail if c.submission else None,
            "first_call_s": first_s, "rel_error": err,
        })  # fmt: skip
    Path(args.json).write_text(json.dumps({"gate": gate, "cases": cases}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("e2e")
    e.add_argument("--out", required=True)
    e.add_argument("--work", default="/tmp/gpuwatchd-e2e")
    e.add_argument("--kernels", default="softmax,layer_norm,matmul_bias_gelu")
    e.add_argument("--shapes", type=int, default=1, help="shapes per kernel (of the driver's 2)")
    e.add_argument("--budget-s", type=float, default=4.0, help="protocol time budget per regime")
    e.add_argument("--tune-timeout-s", type=float, default=200.0)
    j = sub.add_parser("job")
    j.add_argument("--kernels", required=True)
    j.add_argument("--json", required=True)
    j.add_argument("--wait-gate", action="store_true")
    j.add_argument("--shapes", type=int, default=2)
    args = p.parse_args()
    e2e(args) if args.cmd == "e2e" else job(args)


if __name__ == "__main__":
    main()
