"""The control socket on its own thread per client, or on the HTTP server's event loop.

Two subjects, each a server process holding what the daemon holds: an HTTP server over a
1-GPU board and the control socket serving the daemon's real ``retune``/``status`` op
table (a scheduler with two GPUs' queues):

  threads  the control server of ``--baseline DIR`` (selectors and a thread per client;
           ``git archive main gpuwatchd | tar -x -C DIR``), beside its own HTTP loop
  loop     this tree: both servers on one :class:`gpuwatchd.serve.loop.ServeLoop`

Per subject, from client processes (the job side's own client, which asks again after a
``busy`` answer, as jobs do): the latency of a ``status`` op, one client alone, 4
clients of one user at once (its share of the slots) and 8 (twice its share: some are
told ``busy`` and ask again 20-40 ms later; the busy answers are counted); the server's
CPU per op (getrusage of the server process, dead threads included); its threads and RSS
idle and at the peak of the 8-client phase; and with one user's silent connections
holding every slot that user may have: the threads they cost, how fast a fifth
connection of that user is told ``busy``, and how fast /healthz and another user's
request are answered meanwhile.

    python3 bench/decisions/serve_model.py --baseline /tmp/base [--ops 400] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = 8
IDLE_HELD = 4  # MAX_CLIENTS_PER_PEER: one user's share of the slots
HELD_PROBES = 20  # busy answers, /healthz and other-user requests timed while they are held


# -- the server process ------------------------------------------------------------------


def serve(model: str, sock_path: str) -> None:
    """Run the subject's servers until stdin closes; print its port, then rusage on demand."""
    from gpuwatchd.config import Config
    from gpuwatchd.daemon.ops import OpTable
    from gpuwatchd.daemon.retune import retune_ops

    sys.path.insert(0, str(ROOT / "tests"))
    from builders import DAEMON_INFO, board_of, full_h200

    from gpuwatchd.exporter import build_registry

    class Queues:
        def __init__(self) -> None:
            self._pending: dict[int, tuple[str, ...]] = {0: ("sim-gemm",), 1: ()}

        def request(self, gpu: int, workloads: Any, reason: str) -> None:
            self._pending[gpu] = tuple(w.name for w in workloads)

        def pending(self) -> dict[int, tuple[str, ...]]:
            return dict(self._pending)

    cfg = Config()
    ops = OpTable(retune_ops(Queues(), cfg, lambda: [0, 1], lambda: cfg.workloads))
    board = board_of(full_h200())
    registry = build_registry(board, DAEMON_INFO)
    if model == "loop":
        from gpuwatchd.serve import HttpServer
        from gpuwatchd.serve.control import ControlServer
        from gpuwatchd.serve.loop import ServeLoop

        shared = ServeLoop()
        http = HttpServer(board, registry, ("127.0.0.1", 0), serve_loop=shared)
        control = ControlServer(sock_path, ops, serve_loop=shared)
    else:
        from gpuwatchd.daemon.control_server import ControlServer as ThreadControl  # noqa: I001
        from gpuwatchd.exporter import HttpServer as OldHttp

        http = OldHttp(board, registry, ("127.0.0.1", 0))
        control = ThreadControl(sock_path, ops)
    http.start()
    control.start()
    print(json.dumps({"port": http.address[1]}), flush=True)
    for _ in sys.stdin:  # each line asks for the process's CPU so far
        ru = resource.getrusage(resource.RUSAGE_SELF)
        print(json.dumps({"cpu_s": ru.ru_utime + ru.ru_stime}), flush=True)
    control.stop()
    http.stop()


# -- the clients -------------------------------------------------------------------------


def _client(sock_path: str, n: int, start: Any, out: Any) -> None:
    from gpuwatchd.client import control
    from gpuwatchd.client.control import ask
    from gpuwatchd.control.wire import is_busy

    busy = [0]
    once = control._ask_once

    def counted(*args: Any) -> dict[str, Any]:
        answer = once(*args)
        busy[0] += is_busy(answer)
        return answer

    control._ask_once = counted  # type: ignore[assignment]
    start.wait()
    lat, failed = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            answer = ask(sock_path, '{"op":"status"}', timeout=10.0)
        except Exception as exc:
            failed.append(str(exc))
            continue
        lat.append(time.perf_counter() - t0)
        if answer.get("ok") is not True:
            failed.append(str(answer))
    out.put((lat, failed, busy[0]))


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class Subject:
    def __init__(self, model: str, tree: Path, workdir: Path) -> None:
        self.model = model
        self.sock = str(workdir / f"{model}.sock")
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", model, "--sock", self.sock],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        self.port = json.loads(self.proc.stdout.readline())["port"]

    def cpu_s(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return float(json.loads(self.proc.stdout.readline())["cpu_s"])

    def status(self) -> dict[str, int]:
        fields = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("Threads", "VmRSS"):
                fields[key] = int(value.split()[0])
        return fields

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


def run_clients(subject: Subject, clients: int, n: int) -> tuple[list[float], dict[str, int], int]:
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_client, args=(subject.sock, n, start, out)) for _ in range(clients)
    ]
    for p in procs:
        p.start()
    peak = {"Threads": 0, "VmRSS": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for k, v in subject.status().items():
                peak[k] = max(peak[k], v)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start.set()
    lat: list[float] = []
    busy = 0
    for _ in procs:
        got, failed, turned_away = out.get()
        lat += got
        busy += turned_away
        for why in failed:
            print(f"{subject.model}: a client's request failed: {why}", file=sys.stderr)
    for p in procs:
        p.join()
    stop.set()
    sampler.join()
    return lat, peak, busy


def held_phase(subject: Subject) -> dict[str, Any]:
    """One user's silent connections hold its share: their cost, and who still gets in."""
    from gpuwatchd.client.control import _ask_once

    before = subject.status()["Threads"]
    held = []
    for _ in range(IDLE_HELD):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(subject.sock)
        held.append(s)
    time.sleep(0.2)
    threads_held = subject.status()["Threads"]
    busy_s, healthz_s, other_s = [], [], []
    answer: dict[str, Any] = {}
    for _ in range(HELD_PROBES):
        t0 = time.perf_counter()
        answer = _ask_once(Path(subject.sock), '{"op":"status"}', 5.0)
        busy_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{subject.port}/healthz", timeout=5) as r:
            r.read()
        healthz_s.append(time.perf_counter() - t0)
        other = _other_user_latency(subject.sock)
        if other is not None:
            other_s.append(other)
    for s in held:
        s.close()
    return {
        "threads_before": before,
        "threads_held": threads_held,
        "busy_answer_p50_ms": pct(busy_s, 0.5) * 1e3,
        "busy": str(answer.get("error", ""))[:40],
        "healthz_p50_ms": pct(healthz_s, 0.5) * 1e3,
        "other_user_p50_ms": pct(other_s, 0.5) * 1e3 if other_s else None,
    }


def _other_user_latency(sock_path: str) -> float | None:
    """A request from uid 65534 (refused by policy: the answer still shows it got a slot)."""
    if os.geteuid() != 0:
        return None
    os.chmod(os.path.dirname(sock_path), 0o755)
    os.chmod(sock_path, 0o666)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody, ask once
        os.close(r)
        try:
            os.setgid(65534)
            os.setuid(65534)
            t0 = time.perf_counter()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(5)
                s.connect(sock_path)
                s.sendall(b'{"op":"status"}\n')
                s.recv(4096)
            os.write(w, str(time.perf_counter() - t0).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = os.read(r, 64)
    os.close(r)
    os.waitpid(pid, 0)
    return float(data) if data else None


def measure(subject: Subject, ops: int) -> dict[str, Any]:
    run_clients(subject, 1, 50)  # warm: imports, first threads
    with urllib.request.urlopen(f"http://127.0.0.1:{subject.port}/healthz", timeout=5) as r:
        r.read()
    idle = subject.status()
    cpu0 = subject.cpu_s()
    alone, _, _ = run_clients(subject, 1, ops)
    cpu1 = subject.cpu_s()
    share, _, share_busy = run_clients(subject, IDLE_HELD, ops // 2)
    cpu2 = subject.cpu_s()
    crowd, peak, crowd_busy = run_clients(subject, CLIENTS, ops // 2)
    cpu3 = subject.cpu_s()
    after = subject.status()
    return {
        "alone_p50_ms": pct(alone, 0.5) * 1e3,
        "alone_p99_ms": pct(alone, 0.99) * 1e3,
        "cpu_per_op_alone_ms": (cpu1 - cpu0) / ops * 1e3,
        "share_p50_ms": pct(share, 0.5) * 1e3,
        "share_p99_ms": pct(share, 0.99) * 1e3,
        "share_busy": share_busy,
        "cpu_per_op_share_ms": (cpu2 - cpu1) / len(share) * 1e3,
        "crowd_p50_ms": pct(crowd, 0.5) * 1e3,
        "crowd_p99_ms": pct(crowd, 0.99) * 1e3,
        "crowd_busy": crowd_busy,
        "cpu_per_op_crowd_ms": (cpu3 - cpu2) / len(crowd) * 1e3,
        "threads_idle": idle["Threads"],
        "threads_peak": peak["Threads"],
        "threads_after": after["Threads"],
        "rss_idle_mib": idle["VmRSS"] / 1024,
        "rss_after_mib": after["VmRSS"] / 1024,
        **held_phase(subject),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, help="tree with the thread-per-client server")
    ap.add_argument("--ops", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2, help="subjects alternate, this many times")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--sock", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.sock)
        return
    trees = {"loop": ROOT}
    if args.baseline is not None:
        trees["threads"] = args.baseline.resolve()
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in trees}
    with tempfile.TemporaryDirectory(prefix="gwsm-", dir="/tmp") as tmp:
        for _ in range(args.rounds):
            for model, tree in trees.items():
                subject = Subject(model, tree, Path(tmp))
                try:
                    results[model].append(measure(subject, args.ops))
                finally:
                    subject.close()
    for model, rounds in results.items():
        for i, r in enumerate(rounds):
            print(
                model,
                i,
                " ".join(
                    f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                ),
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
