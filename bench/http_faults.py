"""Connection floods, slow clients and scrape latency, for gpuwatchd's HTTP server and others.

Each scenario prints one line per server; every server runs in a fresh process serving
the same 8-GPU board through the same render cache, updated at 10 Hz:

* ``latency``: 10 scrapers on kept-alive connections, back to back for 3 s: p50/p99,
  server CPU per scrape, RSS. ``paced``: the same, each scraper every 10 ms.
* ``held``: N connections held open, half idle and half dripping a header byte every
  2 s; then /metrics is fetched on 20 fresh connections, one after another. Target for
  gpuwatchd: every answer within 100 ms with N = 1000.
* ``fdlimit``: the server runs with RLIMIT_NOFILE 256 while 372 idle connections are
  opened (issue 11 item 8's setting): /metrics must still answer and the server must not
  spin (its CPU use while idle is printed).

Servers: ``gpuwatchd`` (this tree), ``old`` (the ThreadingHTTPServer one, from a copy of
its module: ``git show a726ddb:gpuwatchd/exporter/http.py > /tmp/old_http.py``, with its
import of ``gpuwatchd.exporter.web.config`` names pointed at their modules of today),
``cheroot`` and ``waitress`` (WSGI, same renderer; ``pip install cheroot waitress``).

    python bench/http_faults.py                                   # gpuwatchd, all scenarios
    python bench/http_faults.py --servers gpuwatchd,old,cheroot,waitress --old /tmp/old_http.py
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import resource
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this tree's code
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scrape_latency import (
    Load,
    make_board,
    percentile,
    poll_like_a_daemon,
    scrape_concurrently,
)

Serve = Callable[[object, object], tuple[tuple[str, int], Callable[[], None]]]
#: Where the ``old`` server's module was saved (passed to the server process).
OLD_MODULE_ENV = "GPUWATCHD_BENCH_OLD_HTTP"


def raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def rss_mib(pid: int | None = None) -> float:
    """Resident set size from /proc, in MiB (NaN when no fd is left to read it)."""
    try:
        status = Path(f"/proc/{pid or 'self'}/status").read_text()
    except OSError:
        return float("nan")
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def serve_gpuwatchd(board: object, registry: object) -> tuple[tuple[str, int], Callable[[], None]]:
    from gpuwatchd.serve import HttpServer

    server = HttpServer(board, registry, ("127.0.0.1", 0))  # type: ignore[arg-type]
    server.start()
    return server.address, server.stop


def serve_old(board: object, registry: object) -> tuple[tuple[str, int], Callable[[], None]]:
    """The ThreadingHTTPServer-based module this tree replaced, loaded from a saved copy."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("old_http", os.environ[OLD_MODULE_ENV])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_http"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    server = module.HttpServer(board, registry, ("127.0.0.1", 0))
    server.start()
    return server.address, server.stop


def _wsgi_app(board: object, registry: object) -> Callable[..., list[bytes]]:
    """A WSGI /metrics over the same render cache gpuwatchd uses (a fair comparison)."""
    from gpuwatchd.exporter.render import MetricsRenderer

    renderer = MetricsRenderer(registry, board.all)  # type: ignore[arg-type, attr-defined]

    def app(environ: dict[str, str], start_response: Callable[..., object]) -> list[bytes]:
        rendered = renderer.render(environ.get("HTTP_ACCEPT", ""), "")
        headers = [
            ("Content-Type", rendered.content_type),
            ("Content-Length", str(len(rendered.body))),
        ]
        start_response("200 OK", headers)
        return [rendered.body]

    return app


def serve_cheroot(board: object, registry: object) -> tuple[tuple[str, int], Callable[[], None]]:
    from cheroot import wsgi

    server = wsgi.Server(("127.0.0.1", 0), _wsgi_app(board, registry))  # 10 threads default
    server.prepare()
    threading.Thread(target=server.serve, daemon=True).start()
    return server.bind_addr, server.stop


def serve_waitress(board: object, registry: object) -> tuple[tuple[str, int], Callable[[], None]]:
    import logging

    import waitress

    logging.getLogger("waitress.queue").setLevel(logging.ERROR)  # a line per queued request
    server = waitress.create_server(_wsgi_app(board, registry), host="127.0.0.1", port=0)
    threading.Thread(target=server.run, daemon=True).start()
    return ("127.0.0.1", server.effective_port), server.close


def _server_process(kind: str, fd_limit: int, poll_hz: float, conn: Connection) -> None:
    """Child: serve an 8-GPU board with server ``kind``; answer "stats" until "stop"."""
    from gpuwatchd.exporter import DaemonInfo, build_registry

    if fd_limit:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, hard))
    board = make_board(8)
    registry = build_registry(board, DaemonInfo.current("bench"))
    serve = SERVERS[kind]
    address, stop_server = serve(board, registry)
    stop = threading.Event()
    threading.Thread(target=poll_like_a_daemon, args=(board, poll_hz, stop), daemon=True).start()
    conn.send(address)
    while (message := conn.recv()) != "stop":
        if message == "stats":
            conn.send((time.process_time(), rss_mib(), threading.active_count()))
    stop.set()
    stop_server()


SERVERS: dict[str, Serve] = {
    "gpuwatchd": serve_gpuwatchd,
    "old": serve_old,
    "cheroot": serve_cheroot,
    "waitress": serve_waitress,
}


@dataclass
class ServerProcess:
    """A server in a child process (spawned: no inherited sockets or threads)."""

    kind: str
    fd_limit: int = 0
    poll_hz: float = 10.0

    def __enter__(self) -> ServerProcess:
        self._parent, child = mp.Pipe()
        ctx = mp.get_context("spawn")
        self._proc = ctx.Process(
            target=_server_process,
            args=(self.kind, self.fd_limit, self.poll_hz, child),
            daemon=True,
        )
        self._proc.start()
        if not self._parent.poll(60):
            self._proc.kill()
            raise RuntimeError(f"server {self.kind!r} did not start (see its traceback above)")
        self.address: tuple[str, int] = self._parent.recv()
        return self

    def stats(self) -> tuple[float, float, int]:
        """(CPU seconds used, RSS MiB, threads) of the server process now."""
        self._parent.send("stats")
        return self._parent.recv()

    def __exit__(self, *exc: object) -> None:
        self._parent.send("stop")
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


def get_metrics(address: tuple[str, int], timeout: float = 5.0) -> tuple[bool, float]:
    """GET /metrics on a fresh connection; (answered 200, seconds)."""
    request = b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n"
    started = time.monotonic()
    try:
        with socket.create_connection(address, timeout=timeout) as sock:
            sock.sendall(request)
            data = bytearray()
            while chunk := sock.recv(1 << 16):
                data += chunk
        ok = data.startswith(b"HTTP/1.1 200") or data.startswith(b"HTTP/1.0 200")
    except OSError:
        ok = False
    return ok, time.monotonic() - started


class Held:
    """``n`` connections held open, every other one dripping a header byte every 2 s."""

    def __init__(self, address: tuple[str, int], n: int, drip_every_s: float = 2.0) -> None:
        self.socks: list[socket.socket] = []
        self.refused = 0
        for i in range(n):
            try:
                sock = socket.create_connection(address, timeout=5)
            except OSError:
                self.refused += 1
                continue
            if i % 2:
                sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Drip: ")
            self.socks.append(sock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drip, args=(drip_every_s,), daemon=True)
        self._thread.start()

    def _drip(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            for sock in self.socks[1::2]:
                with contextlib.suppress(OSError):
                    sock.send(b"a")

    def alive(self) -> int:
        """How many held connections the server has not closed."""
        count = 0
        for sock in self.socks:
            try:
                sock.setblocking(False)
                closed = sock.recv(1, socket.MSG_PEEK) == b""
            except BlockingIOError:
                closed = False
            except OSError:
                closed = True
            finally:
                sock.setblocking(True)
            count += not closed
        return count

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self.socks:
            sock.close()


def probe(address: tuple[str, int], count: int = 20, timeout: float = 5.0) -> dict[str, float]:
    results = [get_metrics(address, timeout) for _ in range(count)]
    times = sorted(t for _, t in results)
    return {
        "ok": sum(ok for ok, _ in results) / count,
        "p50_ms": percentile(times, 50) * 1e3,
        "max_ms": times[-1] * 1e3,
    }


def scenario_latency(
    kind: str, clients: int = 10, seconds: float = 3.0, interval_s: float = 0.0
) -> str:
    with ServerProcess(kind) as server:
        get_metrics(server.address)  # warm-up
        cpu0, _, _ = server.stats()
        latencies, size = scrape_concurrently(
            server.address, Load("/metrics", interval_s), clients, seconds, False
        )
        cpu1, rss, threads = server.stats()
    values = sorted(latencies)
    return (
        f"{kind}: {clients} scrapers "
        f"{f'every {interval_s * 1e3:g} ms' if interval_s else 'back to back'}, "
        f"{len(values) / seconds:.0f} scrapes/s, "
        f"p50 {percentile(values, 50) * 1e3:.2f} ms, p99 {percentile(values, 99) * 1e3:.2f} ms, "
        f"server CPU {(cpu1 - cpu0) / len(values) * 1e3:.2f} ms/scrape, RSS {rss:.0f} MiB, "
        f"{threads} threads, body {size / 1024:.0f} KiB"
    )


def scenario_held(kind: str, n: int) -> str:
    raise_fd_limit(2 * n + 512)
    with ServerProcess(kind, fd_limit=2 * n + 512) as server:
        cpu0, rss0, _ = server.stats()
        held = Held(server.address, n)
        time.sleep(3.0)
        result = probe(server.address, timeout=2.0)
        alive = held.alive()
        cpu1, rss1, threads = server.stats()
        held.close()
    return (
        f"{kind}: {n} held ({n // 2} dripping), {alive} still open after 3 s: /metrics ok "
        f"{result['ok']:.0%}, p50 {result['p50_ms']:.1f} ms, max {result['max_ms']:.1f} ms; "
        f"server RSS {rss0:.0f} -> {rss1:.0f} MiB, {threads} threads, CPU {cpu1 - cpu0:.2f} s"
    )


def scenario_fdlimit(kind: str, limit: int = 256, idle: int = 372) -> str:
    with ServerProcess(kind, fd_limit=limit) as server:
        held = Held(server.address, idle, drip_every_s=3600.0)  # idle, no drips
        time.sleep(1.0)
        cpu0, _, _ = server.stats()
        time.sleep(5.0)
        cpu1, _, _ = server.stats()
        result = probe(server.address, count=10, timeout=2.0)
        held.close()
    return (
        f"{kind}: fd limit {limit}, {idle} idle connections: /metrics ok {result['ok']:.0%}, "
        f"p50 {result['p50_ms']:.1f} ms, max {result['max_ms']:.1f} ms; server CPU while "
        f"idle {(cpu1 - cpu0) / 5 * 100:.1f}% of a core"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", type=int, default=1000, help="connections to hold")
    parser.add_argument(
        "--scenarios",
        default="latency,paced,held,fdlimit",
        help="comma-separated: latency,paced,held,fdlimit",
    )
    parser.add_argument("--interval-ms", type=float, default=10.0, help="pacing of 'paced'")
    parser.add_argument(
        "--servers", default="gpuwatchd", help=f"comma-separated: {','.join(SERVERS)}"
    )
    parser.add_argument(
        "--old", metavar="FILE", help="saved copy of the old http.py (server 'old')"
    )
    args = parser.parse_args()
    servers = args.servers.split(",")
    unknown = [name for name in servers if name not in SERVERS]
    if unknown:
        parser.error(f"--servers: unknown {unknown}; expected some of {', '.join(SERVERS)}")
    if "old" in servers:
        if not args.old:
            parser.error("--servers old needs --old FILE")
        os.environ[OLD_MODULE_ENV] = str(Path(args.old).resolve())
    scenarios = {
        "latency": scenario_latency,
        "paced": lambda kind: scenario_latency(kind, interval_s=args.interval_ms / 1e3),
        "held": lambda kind: scenario_held(kind, args.held),
        "fdlimit": scenario_fdlimit,
    }
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    for name in args.scenarios.split(","):
        for kind in servers:
            print(f"[{name}] {scenarios[name](kind)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
