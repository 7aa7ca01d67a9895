"""Where a monitoring daemon's memory goes: each import's own RSS, read in the daemon itself.

Runs ``gpuwatchd run --backend sim --gpus 1`` (tuning and drift off, as
bench/daemon_cost.py runs it) with every import wrapped: the process's resident pages are
read from /proc/self/statm when an import starts and when it ends, and an import's own
share is what it added less what the imports it made added (so ``asyncio`` is not
charged for ``ssl``). After the third scrape of /metrics the process writes what it read,
with its VmRSS, RssAnon, RssFile and threads. Imports are grouped by owner: the package
that made them (a gpuwatchd subpackage, or APScheduler, prometheus_client, tzlocal),
with asyncio, ssl, hashlib (OpenSSL's libcrypto) and sqlite3 in groups of their own
whoever imported them first. ``interpreter`` is the process before its first import of
gpuwatchd (python3 with site); ``after start`` is the rest: threads, the daemon's heap,
the allocator's arenas.

Pages are counted where they are first touched, so a neighbour can be charged for a
page another module started; groups are steadier than modules (``--runs`` averages).
``--tracemalloc`` runs once more with tracemalloc on and prints the Python heap's
largest lines after the third scrape and what grew after the first answer.

Usage: python3 bench/import_rss.py [--runs 3] [--baseline DIR] [--modules]
           [--tracemalloc] [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Packages that are a group of their own wherever they are imported from.
OWN_GROUP = {"asyncio": "asyncio", "_asyncio": "asyncio", "ssl": "ssl", "_ssl": "ssl"}
OWN_GROUP |= {"hashlib": "hashlib", "_hashlib": "hashlib", "sqlite3": "sqlite3"}
OWN_GROUP |= {"_sqlite3": "sqlite3"}
#: Third-party packages whose imports are charged to them.
THIRD_PARTY = ("prometheus_client",)

#: The daemon, with each import's resident pages recorded (run as ``python3 -c``).
WRAPPER = r"""
import json, os, signal, sys
_fd = os.open("/proc/self/statm", os.O_RDONLY)
_PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024
def _pages():
    f = os.pread(_fd, 128, 0).split()
    return int(f[1]) * _PAGE_KIB, int(f[2]) * _PAGE_KIB  # resident, file-backed
START = _pages()
boot = sys.modules["_frozen_importlib"]
parent, own, stack = {}, {}, []
find_and_load = boot._find_and_load
def traced(name, import_):
    parent.setdefault(name, stack[-1][0] if stack else None)
    frame = [name, _pages(), [0, 0]]
    stack.append(frame)
    try:
        return find_and_load(name, import_)
    finally:
        stack.pop()
        now = _pages()
        added = [now[0] - frame[1][0], now[1] - frame[1][1]]
        mine = own.setdefault(name, [0, 0])
        mine[0] += added[0] - frame[2][0]
        mine[1] += added[1] - frame[2][1]
        if stack:
            stack[-1][2][0] += added[0]
            stack[-1][2][1] += added[1]
boot._find_and_load = traced
out, heap = sys.argv[1], sys.argv[2] == "1"
if heap:
    import tracemalloc
    tracemalloc.start(1)
    first = []
    signal.signal(signal.SIGUSR2, lambda *_: first.append(tracemalloc.take_snapshot()))
def dump(*_):
    boot._find_and_load = find_and_load
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "Threads"):
                status[key] = int(value.split()[0])
    doc = {"start": START, "parent": parent, "own": own, "status": status}
    if heap:
        snap = tracemalloc.take_snapshot()
        doc["heap_top"] = [str(s) for s in snap.statistics("lineno")[:15]]
        doc["heap_grew"] = [str(s) for s in snap.compare_to(first[0], "lineno")[:10]]
    with open(out + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(out + ".tmp", out)
signal.signal(signal.SIGUSR1, dump)
from gpuwatchd.cli.main import main
sys.exit(main(sys.argv[3:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> None:
    with urllib.request.urlopen(url, timeout=5) as r:
        r.read()


def run_once(tree: str, heap: bool) -> dict[str, Any]:
    """One sim daemon from ``tree``: scraped three times, a second apart, then read."""
    with tempfile.TemporaryDirectory() as home:
        config = Path(home, "config.toml")
        config.write_text("[tuning]\nenabled = false\n\n[drift]\nenabled = false\n")
        out, port = str(Path(home, "imports.json")), free_port()
        argv = [
            sys.executable, "-c", WRAPPER, out, "1" if heap else "0",
            "run", "--config", str(config), "--backend", "sim", "--gpus", "1",
            "--poll-interval", "1", "--listen", f"127.0.0.1:{port}", "--log-level", "warning",
            "--state-dir", home, "--control-socket", str(Path(home, "control.sock")),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": tree}
        proc = subprocess.Popen(argv, env=env, cwd=home)
        try:
            url = f"http://127.0.0.1:{port}/metrics"
            deadline = time.monotonic() + 60
            while True:
                try:
                    get(url)
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the daemon from {tree} never answered") from None
                    time.sleep(0.05)
            if heap:
                proc.send_signal(signal.SIGUSR2)
            for _ in range(3):
                time.sleep(1.0)
                get(url)
            time.sleep(1.0)
            proc.send_signal(signal.SIGUSR1)
            while not os.path.exists(out):
                if proc.poll() is not None:
                    raise RuntimeError(f"the daemon from {tree} exited")
                time.sleep(0.05)
            doc: dict[str, Any] = json.loads(Path(out).read_text())
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return doc


def owner(name: str, parent: dict[str, str | None]) -> str:
    """The group an import is charged to (see the module docstring)."""
    at: str | None = name
    while at:
        top = at.split(".")[0]
        if top in OWN_GROUP:
            return OWN_GROUP[top]
        if top == "gpuwatchd":
            return ".".join(at.split(".")[:2])
        if top in THIRD_PARTY:
            return top
        at = parent.get(at)
    return "other"


def groups(doc: dict[str, Any]) -> dict[str, tuple[float, int]]:
    """kB and module count per group, with ``interpreter`` and ``after start``."""
    kib: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for name, (resident, _file) in doc["own"].items():
        g = owner(name, doc["parent"])
        kib[g] += resident
        count[g] += 1
    kib["interpreter"] = doc["start"][0]
    kib["after start"] = (
        doc["status"]["VmRSS"]
        - doc["start"][0]
        - sum(v for k, v in kib.items() if k != "interpreter")
    )
    return {g: (kib[g], count[g]) for g in kib}


def summarize(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over runs: each group's kB and modules, and the process's status."""
    per = [groups(d) for d in docs]
    names = sorted({g for p in per for g in p})
    mean = {g: sum(p.get(g, (0.0, 0))[0] for p in per) / len(per) for g in names}
    mods = {g: max(p.get(g, (0.0, 0))[1] for p in per) for g in names}
    status = {k: sum(d["status"][k] for d in docs) / len(docs) for k in docs[0]["status"]}
    own: dict[str, float] = collections.defaultdict(float)
    for d in docs:
        for name, (resident, _file) in d["own"].items():
            own[name] += resident / len(docs)
    return {"groups": {g: [mean[g], mods[g]] for g in names}, "status": status, "own": own}


def print_table(results: dict[str, dict[str, Any]], modules: bool) -> None:
    trees = list(results)
    first = results[trees[0]]["groups"]
    names = sorted(
        {g for r in results.values() for g in r["groups"]}, key=lambda g: -first.get(g, [0])[0]
    )
    print("| group | " + " | ".join(f"{t} MiB (modules)" for t in trees) + " |")
    print("| --- |" + " ---: |" * len(trees))
    for g in names:
        cells = []
        for t in trees:
            kib, n = results[t]["groups"].get(g, [0.0, 0])
            cells.append(f"{kib / 1024:.2f} ({n})" if n else f"{kib / 1024:.2f}")
        print(f"| {g} | " + " | ".join(cells) + " |")
    for key in ("VmRSS", "RssAnon", "RssFile", "Threads"):
        vals = [results[t]["status"][key] for t in trees]
        text = [f"{v:.0f}" if key == "Threads" else f"{v / 1024:.2f}" for v in vals]
        print(f"| **{key}** | " + " | ".join(text) + " |")
    if modules:
        for t in trees:
            own = results[t]["own"]
            print(f"\n{t}: the 30 largest single imports (kB, own share)")
            for name, kib in sorted(own.items(), key=lambda x: -x[1])[:30]:
                print(f"  {name:50s} {kib:7.0f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="daemons per tree, alternating")
    ap.add_argument("--baseline", help="another tree (git archive main gpuwatchd | tar -x)")
    ap.add_argument("--modules", action="store_true", help="also the largest single imports")
    ap.add_argument("--tracemalloc", action="store_true", help="the heap's largest lines")
    ap.add_argument("--json", help="write the means here")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")
    trees = {"new": str(ROOT)}
    if args.baseline:
        trees["baseline"] = str(Path(args.baseline).resolve())
    docs: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
    for _ in range(args.runs):
        for name, tree in trees.items():
            docs[name].append(run_once(tree, heap=False))
    results = {t: summarize(d) for t, d in docs.items()}
    print_table(results, args.modules)
    if args.tracemalloc:
        for name, tree in trees.items():
            doc = run_once(tree, heap=True)
            print(f"\n{name}: Python heap after three scrapes, largest lines")
            print("\n".join(f"  {line}" for line in doc["heap_top"]))
            print(f"{name}: grown since the first answer")
            print("\n".join(f"  {line}" for line in doc["heap_grew"]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
