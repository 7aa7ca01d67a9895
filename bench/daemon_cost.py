"""The daemon's own cost, beside its references, in one run: CPU per thread, wake-ups, RSS,
scrape latency and throughput.

Every subject is a real ``gpuwatchd run`` process (tuning and drift off) started through
bench/daemon_under_test.py: ``--backend nvml`` against the real GPU, or against the
cost-faithful fake NVML (tests/fakes_nvml.REAL_CALL_COSTS) for ``--fake-gpus`` GPUs, so
the daemon's own NVML backend is what is measured. ``--baseline DIR`` runs every subject
a second time from another tree (e.g. ``git archive HEAD gpuwatchd | tar -x -C DIR``)
in the same window; ``--nvitop`` adds nvitop-exporter polling at 1 s beside the 1 Hz
subjects.

Phases, subjects of one phase running side by side (16 cores: they do not compete):
  10hz   every tree: the real GPU (``--real``) and the fake GPUs, polled at 10 Hz
  1hz    every tree: the real GPU (else one fake GPU) at 1 Hz, and nvitop-exporter
  scrape every tree, the fake GPUs at 10 Hz: 10 scrapers each once a second (client
         processes), the daemon's CPU meanwhile, then 10 scrapers back to back
         (saturation); one subject is scraped at a time
  startup every tree, ``--backend sim``: 1 GPU at 1 Hz, 1 GPU at 10 Hz and 8 GPUs at
         10 Hz (with ``--real`` also the real GPU at 1 Hz and 10 Hz, and with ``--nvitop``
         nvitop-exporter at 1 s and ``nvidia-smi -l 1``), each scraped once a second from its
         first answer, beside a bare sleeper process measured the same way; CPU (utime +
         stime) window by window from start, summed from the first answer to ``STARTUP_S``
         after start (start-up) and from there on for ``--seconds`` (steady state); RSS
         after the third scrape
CPU is summed over threads from /proc/PID/task/*/schedstat (ns) and named through the
thread map daemon_under_test writes on SIGUSR1; wake-ups are voluntary context
switches. ``--profile`` runs py-spy (non-blocking, idle samples dropped) on the subjects
of the 10hz and 1hz phases during their windows, and on the new tree's start-up subjects
from their start to ``STARTUP_S``, and keeps a summary of where the samples fell.

Usage: python3 bench/daemon_cost.py --out DIR [--real] [--fake-gpus 8] [--baseline DIR]
           [--nvitop] [--pace] [--arena-variant] [--profile] [--seconds 40]
           [--phases 10hz,1hz,scrape,startup]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from scrape_latency import Load, percentile, scrape_concurrently  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
SETTLE_S = 6.0  # after /metrics first answers: imports done, first slow reads in
PHASES = ("10hz", "1hz", "scrape", "startup")
STARTUP_S = 15.0  # start-up is judged from the first answer to this long after start
STARTUP_S_WINDOWS = 20  # per-second windows printed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Subject:
    """One process under measurement."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    threads_file: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    log: Any = None
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"


def gpuwatchd_subject(
    name: str,
    tree: str,
    scratch: Path,
    interval: float,
    fake_gpus: int,
    fake_costs: str = "hot",
    env: dict[str, str] | None = None,
) -> Subject:
    """``gpuwatchd run --backend nvml`` from ``tree``: tuning and drift off, quiet logs."""
    home = scratch / name.replace(" ", "_")
    home.mkdir(parents=True)
    config = home / "config.toml"
    config.write_text("[tuning]\nenabled = false\n\n[drift]\nenabled = false\n")
    port = free_port()
    threads = str(home / "threads.json")
    argv = [
        sys.executable,
        str(BENCH / "daemon_under_test.py"),
        "--fake-gpus", str(fake_gpus), "--fake-costs", fake_costs,
        "--threads-file", threads,
        "--",
        "run", "--config", str(config), "--backend", "nvml",
        "--poll-interval", str(interval), "--listen", f"127.0.0.1:{port}",
        "--log-level", "warning", "--state-dir", str(home),
        "--control-socket", str(home / "control.sock"),
    ]  # fmt: skip
    path = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)
    return Subject(name, argv, {"PYTHONPATH": path, **(env or {})}, port, threads)


def sim_subject(name: str, tree: str, scratch: Path, interval: float, gpus: int) -> Subject:
    """``gpuwatchd run --backend sim --gpus N`` from ``tree``: tuning and drift off."""
    subject = gpuwatchd_subject(name, tree, scratch, interval, 0)
    # through daemon_under_test.py, whose path holds no gpuwatchd: PYTHONPATH picks the tree
    subject.argv[subject.argv.index("nvml")] = "sim"
    subject.argv += ["--gpus", str(gpus)]
    return subject


def sleeper_subject() -> Subject:
    """A bare Python process that only sleeps: the floor every figure is read against."""
    argv = [sys.executable, "-c", "import time\nwhile True: time.sleep(3600)"]
    return Subject("bare sleeper", argv, {}, 0)


def nvidia_smi_subject() -> Subject:
    """``nvidia-smi`` in its own loop (``-l 1``), printing the fields a dashboard reads."""
    query = "timestamp,power.draw,temperature.gpu,clocks.sm,clocks_event_reasons.active,"
    query += "utilization.gpu,memory.used"
    argv = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", "-l", "1"]
    return Subject("nvidia-smi -l 1", argv, {}, 0)


def nvitop_subject(interval: float) -> Subject:
    port = free_port()
    argv = [sys.executable, "-m", "nvitop_exporter", "--interval", str(interval),
            "--bind-address", "127.0.0.1", "--port", str(port), "--hostname", "bench"]  # fmt: skip
    return Subject(f"nvitop-exporter {1 / interval:g}Hz", argv, {}, port)


# -- /proc readers --------------------------------------------------------------------


def task_stats(pid: int) -> dict[int, tuple[int, int, int]]:
    """tid -> (on-CPU ns, voluntary switches, involuntary switches) of every live thread."""
    out: dict[int, tuple[int, int, int]] = {}
    for tid_text in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid_text}"
        try:
            with open(f"{base}/schedstat") as f:
                cpu_ns = int(f.read().split()[0])
            vol = invol = 0
            with open(f"{base}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        vol = int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        invol = int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended while we read
        out[int(tid_text)] = (cpu_ns, vol, invol)
    return out


def process_ticks(pid: int) -> int:
    """utime + stime of the whole process (threads that ended included), in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def memory_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "Threads"):
                out[key] = int(line.split()[1])
    return out


def thread_names(subject: Subject) -> dict[int, str]:
    """Native thread id -> Python thread name (gpuwatchd subjects), else the comm name.

    A gpuwatchd subject's module list lands in ``subject.result["modules"]``.
    """
    names: dict[int, str] = {}
    for tid in os.listdir(f"/proc/{subject.pid}/task"):
        try:
            with open(f"/proc/{subject.pid}/task/{tid}/comm") as f:
                names[int(tid)] = f.read().strip()
        except FileNotFoundError:
            continue
    if subject.threads_file is None:
        return names
    with contextlib.suppress(FileNotFoundError):
        os.unlink(subject.threads_file)
    os.kill(subject.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            with open(subject.threads_file) as f:
                doc = json.load(f)
            names.update({int(k): v for k, v in doc["threads"].items()})
            subject.result["modules"] = doc["modules"]
            break
        except (FileNotFoundError, json.JSONDecodeError):
            time.sleep(0.02)
    return names


# -- lifecycle --------------------------------------------------------------------------


def start(subjects: list[Subject], out: Path) -> None:
    for s in subjects:
        s.log = open(out / f"{s.name.replace(' ', '_')}.log", "wb")  # noqa: SIM115
        s.proc = subprocess.Popen(
            s.argv, env={**os.environ, **s.env}, stdout=s.log, stderr=subprocess.STDOUT, cwd=ROOT
        )
    deadline = time.monotonic() + 60
    for s in subjects:
        while True:
            assert s.proc is not None
            if s.proc.poll() is not None:
                raise RuntimeError(f"{s.name} exited with {s.proc.returncode}; see its log")
            try:
                urllib.request.urlopen(s.url, timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{s.name}: /metrics never answered") from None
                time.sleep(0.2)
    time.sleep(SETTLE_S)


def stop(subjects: list[Subject]) -> None:
    for s in subjects:
        if s.proc is not None and s.proc.poll() is None:
            s.proc.terminate()
    for s in subjects:
        if s.proc is not None:
            try:
                s.proc.wait(10)
            except subprocess.TimeoutExpired:
                s.proc.kill()
        if s.log is not None:
            s.log.close()


def py_spy(
    subject: Subject, seconds: float, out: Path, rate: int, tag: str = ""
) -> subprocess.Popen[bytes]:
    path = out / f"{subject.name.replace(' ', '_')}{tag}.pyspy.txt"
    argv = ["py-spy", "record", "--pid", str(subject.pid), "--rate", str(rate),
            "--duration", str(int(seconds)), "--nonblocking", "--threads", "--format", "raw",
            "-o", str(path)]  # fmt: skip
    log = open(out / f"{subject.name.replace(' ', '_')}{tag}.pyspy.log", "wb")  # noqa: SIM115
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def summarize_profile(path: Path, top: int = 25) -> dict[str, Any]:
    """Where py-spy's samples fell: per thread, per leaf function (self) and inclusive."""
    by_thread: collections.Counter[str] = collections.Counter()
    self_time: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    if not path.exists():
        return {"error": f"no profile at {path.name}"}
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        n = int(count_text)
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread ")), "?")
        funcs = [f for f in frames if not f.startswith(("thread ", "process "))]
        total += n
        root = " > ".join(f.split(" (")[0] for f in funcs[:3]) or thread
        by_thread[root] += n
        if funcs:
            self_time[funcs[-1]] += n
        for f in set(funcs):
            inclusive[f] += n
    return {
        "samples": total,
        "by_thread_root": by_thread.most_common(top),
        "self": self_time.most_common(top),
        "inclusive": inclusive.most_common(top),
    }


def measure(subjects: list[Subject], seconds: float, out: Path, profile_rate: int) -> None:
    """CPU per thread, wake-ups and memory of every subject over one shared window."""
    before = {s.name: (task_stats(s.pid), process_ticks(s.pid)) for s in subjects}
    spies = [py_spy(s, seconds, out, profile_rate) for s in subjects] if profile_rate else []
    t0 = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    for s in subjects:
        tasks0, ticks0 = before[s.name]
        tasks1, ticks1 = task_stats(s.pid), process_ticks(s.pid)
        names = thread_names(s)
        threads = []
        for tid, (cpu1, vol1, inv1) in tasks1.items():
            cpu0, vol0, inv0 = tasks0.get(tid, (0, 0, 0))
            threads.append(
                {
                    "tid": tid,
                    "name": names.get(tid, "?"),
                    "cpu_pct": 100 * (cpu1 - cpu0) / 1e9 / elapsed,
                    "wakeups_per_s": (vol1 - vol0) / elapsed,
                    "preempted_per_s": (inv1 - inv0) / elapsed,
                }
            )
        threads.sort(key=lambda r: -r["cpu_pct"])
        s.result.update(
            seconds=elapsed,
            cpu_pct=sum(t["cpu_pct"] for t in threads),
            cpu_pct_ticks=100 * (ticks1 - ticks0) / CLK_TCK / elapsed,
            wakeups_per_s=sum(t["wakeups_per_s"] for t in threads),
            memory_kib=memory_kib(s.pid),
            threads=threads,
        )
    for spy in spies:
        try:
            spy.wait(seconds)
        except subprocess.TimeoutExpired:
            spy.kill()
    if profile_rate:
        for s in subjects:
            s.result["profile"] = summarize_profile(out / f"{s.name.replace(' ', '_')}.pyspy.txt")


def scrape_phase(subject: Subject, seconds: float, saturation_s: float) -> dict[str, Any]:
    """10 scrapers once a second each (Prometheus-like), then 10 back to back."""
    address = ("127.0.0.1", subject.port)
    ticks0, t0 = process_ticks(subject.pid), time.monotonic()
    tasks0 = task_stats(subject.pid)
    paced, size = scrape_concurrently(address, Load("/metrics", 1.0), 10, seconds, True)
    elapsed = time.monotonic() - t0
    tasks1 = task_stats(subject.pid)
    cpu_ns = sum(c - tasks0.get(tid, (0, 0, 0))[0] for tid, (c, _, _) in tasks1.items())
    ticks1 = process_ticks(subject.pid)
    saturated, _ = scrape_concurrently(address, Load("/metrics", 0.0), 10, saturation_s, True)
    paced.sort()
    saturated.sort()
    return {
        "body_bytes": size,
        "paced_scrapes": len(paced),
        "paced_p50_ms": percentile(paced, 50) * 1e3,
        "paced_p99_ms": percentile(paced, 99) * 1e3,
        "paced_max_ms": paced[-1] * 1e3,
        "cpu_pct_while_paced": 100 * cpu_ns / 1e9 / elapsed,
        "cpu_pct_ticks_while_paced": 100 * (ticks1 - ticks0) / CLK_TCK / elapsed,
        "saturation_scrapes_per_s": len(saturated) / saturation_s,
        "saturation_p50_ms": percentile(saturated, 50) * 1e3,
        "saturation_p99_ms": percentile(saturated, 99) * 1e3,
    }


def windows_from_start(subject: Subject, t_start: float, seconds: float) -> None:
    """Scrape once a second from the first answer (a sleeper: from start), reading the
    process's CPU ticks at every scrape: per-second windows, start-up and steady state."""
    pid, tck = subject.pid, CLK_TCK
    first = t_start
    if subject.port:
        while True:
            try:
                urllib.request.urlopen(subject.url, timeout=2).read()
                break
            except OSError:
                if time.monotonic() - t_start > 60:
                    raise RuntimeError(f"{subject.name}: /metrics never answered") from None
                time.sleep(0.02)
        first = time.monotonic()
    ticks_first = process_ticks(pid)
    windows: list[tuple[float, float]] = []  # (seconds after start, CPU s in the window)
    prev, n, at_startup, rss_after_3 = ticks_first, 0, None, None
    while True:
        n += 1
        target = first + n
        if target - t_start > STARTUP_S + seconds:
            break
        if at_startup is None and target - t_start > STARTUP_S:
            time.sleep(max(0.0, t_start + STARTUP_S - time.monotonic()))
            at_startup = (process_ticks(pid), time.monotonic(), task_stats(pid))
        time.sleep(max(0.0, target - time.monotonic()))
        if subject.port:
            urllib.request.urlopen(subject.url, timeout=5).read()
        ticks = process_ticks(pid)
        windows.append((round(time.monotonic() - t_start, 2), (ticks - prev) / tck))
        prev = ticks
        if n == 3:
            rss_after_3 = memory_kib(pid).get("VmRSS", 0)
    end_ticks, end_t, end_tasks = process_ticks(pid), time.monotonic(), task_stats(pid)
    assert at_startup is not None
    ticks_15, t_15, tasks_15 = at_startup
    ns = sum(c - tasks_15.get(tid, (0, 0, 0))[0] for tid, (c, _, _) in end_tasks.items())
    subject.result.update(
        first_answer_s=first - t_start,
        cpu_before_first_answer_s=ticks_first / tck,
        startup_cpu_s=(ticks_15 - ticks_first) / tck,
        steady_seconds=end_t - t_15,
        steady_cpu_pct_ticks=100 * (end_ticks - ticks_15) / tck / (end_t - t_15),
        steady_cpu_pct=100 * ns / 1e9 / (end_t - t_15),
        rss_after_3_scrapes_mib=(rss_after_3 or 0) / 1024,
        memory_kib=memory_kib(pid),
        windows=windows,
    )


def startup_phase(subjects: list[Subject], seconds: float, out: Path, profile_rate: int) -> None:
    """Start every subject at once and follow each on its own thread from its start;
    with ``profile_rate``, py-spy each new-tree gpuwatchd subject until ``STARTUP_S``."""
    import threading

    errors: list[str] = []

    def follow(s: Subject, t_start: float) -> None:
        try:
            windows_from_start(s, t_start, seconds)
        except (OSError, RuntimeError) as exc:
            errors.append(f"{s.name}: {exc}")

    threads = []
    for s in subjects:
        s.log = open(out / f"{s.name.replace(' ', '_')}.log", "wb")  # noqa: SIM115
        s.proc = subprocess.Popen(
            s.argv, env={**os.environ, **s.env}, stdout=s.log, stderr=subprocess.STDOUT, cwd=ROOT
        )
        threads.append(threading.Thread(target=follow, args=(s, time.monotonic())))
        threads[-1].start()
    profiled = [s for s in subjects if profile_rate and s.threads_file and s.name.startswith("new")]
    spies = [py_spy(s, STARTUP_S, out, profile_rate, ".startup") for s in profiled]
    for t in threads:
        t.join()
    for spy in spies:
        try:
            spy.wait(5)
        except subprocess.TimeoutExpired:
            spy.kill()
    for s in profiled:
        name = f"{s.name.replace(' ', '_')}.startup.pyspy.txt"
        s.result["startup_profile"] = summarize_profile(out / name)
    if errors:
        raise RuntimeError("; ".join(errors))


# -- the plan -----------------------------------------------------------------------------


def trees(args: argparse.Namespace) -> list[tuple[str, str]]:
    out = [("new", str(ROOT))]
    if args.baseline:
        out.append(("baseline", str(Path(args.baseline).resolve())))
    return out


def run_phase(name: str, subjects: list[Subject], args: argparse.Namespace, out: Path) -> None:
    print(f"## phase {name}: {', '.join(s.name for s in subjects)}", flush=True)
    try:
        if name == "startup":
            startup_phase(subjects, args.seconds, out, args.profile_rate if args.profile else 0)
            return
        start(subjects, out)
        rate = args.profile_rate if args.profile and name != "scrape" else 0
        if name == "scrape":
            for s in subjects:
                s.result.update(scrape_phase(s, args.seconds, args.saturation_seconds))
        else:
            measure(subjects, args.seconds, out, rate)
    finally:
        stop(subjects)


def print_startup(subjects: list[Subject]) -> None:
    sleeper = next((s.result for s in subjects if s.name == "bare sleeper"), None)
    print(
        f"\n| subject (scraped 1/s) | first answer s | CPU s from it to {STARTUP_S:g} s "
        "| steady % of a core (ticks) | above the sleeper | RSS MiB after 3 scrapes |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for s in subjects:
        r = s.result
        if "steady_cpu_pct" not in r:
            continue
        above = r["steady_cpu_pct"] - sleeper["steady_cpu_pct"] if sleeper else float("nan")
        print(f"| {s.name} | {r['first_answer_s']:.2f} | {r['startup_cpu_s']:.2f} | "
              f"{r['steady_cpu_pct']:.3f} ({r['steady_cpu_pct_ticks']:.2f}) | {above:+.3f} | "
              f"{r['rss_after_3_scrapes_mib']:.1f} |")  # fmt: skip
    for s in subjects:
        prof = s.result.get("startup_profile")
        if prof and "self" in prof:
            top = "; ".join(f"{frame} {n}" for frame, n in prof["self"][:8])
            print(f"{s.name}: start-up py-spy, {prof['samples']} samples, most self time: {top}")
    for s in subjects:
        w = s.result.get("windows", [])[:STARTUP_S_WINDOWS]
        print(f"{s.name}: first windows (s after start: CPU s) "
              + " ".join(f"{t:.0f}:{c:.2f}" for t, c in w))  # fmt: skip


def print_tables(phases: dict[str, list[Subject]]) -> None:
    if "startup" in phases:
        print_startup(phases["startup"])
    print("\n| phase | subject | CPU % of a core | (ticks) | wake-ups/s | RSS MiB | threads |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for phase, subjects in phases.items():
        for s in subjects:
            r = s.result
            if "cpu_pct" not in r:
                continue
            mem = r["memory_kib"]
            print(f"| {phase} | {s.name} | {r['cpu_pct']:.3f} | {r['cpu_pct_ticks']:.2f} | "
                  f"{r['wakeups_per_s']:.1f} | {mem.get('VmRSS', 0) / 1024:.1f} | "
                  f"{mem.get('Threads', 0)} |")  # fmt: skip
    for subjects in phases.values():
        for s in subjects:
            r = s.result
            if "paced_p99_ms" in r:
                print(f"\nscrape {s.name}: body {r['body_bytes']} B; 10 scrapers at 1/s: "
                      f"{r['paced_scrapes']} scrapes, p50 {r['paced_p50_ms']:.2f} ms, p99 "
                      f"{r['paced_p99_ms']:.2f} ms, max {r['paced_max_ms']:.2f} ms, daemon CPU "
                      f"{r['cpu_pct_while_paced']:.2f}%; saturation "
                      f"{r['saturation_scrapes_per_s']:.0f}/s, p50 "
                      f"{r['saturation_p50_ms']:.2f} ms, p99 "
                      f"{r['saturation_p99_ms']:.2f} ms")  # fmt: skip
    for phase, subjects in phases.items():
        for s in subjects:
            threads = s.result.get("threads")
            if not threads:
                continue
            busy = [t for t in threads if t["cpu_pct"] >= 0.005 or t["wakeups_per_s"] >= 0.5]
            print(f"\n{phase} / {s.name}: " + "; ".join(
                f"{t['name']} {t['cpu_pct']:.3f}% {t['wakeups_per_s']:.1f}/s" for t in busy
            ))  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for logs, profiles, results.json")
    ap.add_argument("--real", action="store_true", help="include the real GPU (needs NVML)")
    ap.add_argument("--fake-gpus", type=int, default=8, help="fake GPUs (0: none)")
    ap.add_argument("--baseline", help="another tree holding a gpuwatchd package to compare")
    ap.add_argument("--nvitop", action="store_true", help="nvitop-exporter beside the 1 Hz phase")
    ap.add_argument(
        "--pace", action="store_true", help="also the fake at its 10 Hz-pace costs (new tree)"
    )
    ap.add_argument(
        "--arena-variant", action="store_true", help="also the 1 Hz subject with MALLOC_ARENA_MAX=2"
    )
    ap.add_argument("--profile", action="store_true", help="py-spy the 10hz and 1hz subjects")
    ap.add_argument("--profile-rate", type=int, default=1000, help="py-spy samples per second")
    ap.add_argument("--seconds", type=float, default=40.0, help="measurement window per phase")
    ap.add_argument("--saturation-seconds", type=float, default=10.0)
    ap.add_argument("--phases", default=",".join(PHASES), help=f"subset of {','.join(PHASES)}")
    args = ap.parse_args()
    wanted = [p for p in args.phases.split(",") if p]
    unknown = sorted(set(wanted) - set(PHASES))
    if unknown:
        ap.error(f"--phases: unknown phase(s) {unknown}; known: {', '.join(PHASES)}")
    if args.fake_gpus < 0 or args.seconds <= 0 or args.saturation_seconds <= 0:
        ap.error("--fake-gpus must be >= 0 and --seconds, --saturation-seconds > 0")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpuwatchd-cost-"))
    plan: dict[str, list[Subject]] = {}
    for tree_name, tree in trees(args):
        if "10hz" in wanted:
            if args.real:
                plan.setdefault("10hz", []).append(
                    gpuwatchd_subject(f"{tree_name} real 10Hz", tree, scratch, 0.1, 0)
                )
            if args.fake_gpus:
                plan.setdefault("10hz", []).append(
                    gpuwatchd_subject(
                        f"{tree_name} fake{args.fake_gpus} 10Hz", tree, scratch, 0.1,
                        args.fake_gpus,
                    )
                )  # fmt: skip
                if args.pace and tree_name == "new":
                    plan["10hz"].append(
                        gpuwatchd_subject(
                            f"{tree_name} fake{args.fake_gpus}-pace 10Hz", tree, scratch, 0.1,
                            args.fake_gpus, "pace",
                        )
                    )  # fmt: skip
        if "1hz" in wanted:
            label, fake = ("real", 0) if args.real else ("fake1", 1)
            plan.setdefault("1hz", []).append(
                gpuwatchd_subject(f"{tree_name} {label} 1Hz", tree, scratch, 1.0, fake)
            )
            if args.arena_variant and tree_name == "new":
                plan["1hz"].append(
                    gpuwatchd_subject(
                        f"{tree_name} {label} 1Hz MALLOC_ARENA_MAX=2", tree, scratch, 1.0, fake,
                        env={"MALLOC_ARENA_MAX": "2"},
                    )
                )  # fmt: skip
        if "scrape" in wanted and args.fake_gpus:
            plan.setdefault("scrape", []).append(
                gpuwatchd_subject(
                    f"{tree_name} fake{args.fake_gpus} scraped", tree, scratch, 0.1, args.fake_gpus
                )
            )
    if "startup" in wanted:
        for tree_name, tree in trees(args):
            for gpus, interval in ((1, 1.0), (1, 0.1), (8, 0.1)):
                name = f"{tree_name} sim{gpus} {1 / interval:g}Hz"
                plan.setdefault("startup", []).append(
                    sim_subject(name, tree, scratch, interval, gpus)
                )
            if args.real:
                for interval in (1.0, 0.1):
                    name = f"{tree_name} real {1 / interval:g}Hz (start-up)"
                    plan["startup"].append(gpuwatchd_subject(name, tree, scratch, interval, 0))
        if args.nvitop:
            nvitop = nvitop_subject(1.0)
            nvitop.name += " (start-up)"
            plan["startup"] += [nvitop, nvidia_smi_subject()]
        plan["startup"].append(sleeper_subject())
    if args.nvitop and "1hz" in plan:
        plan["1hz"].append(nvitop_subject(1.0))
    for phase, subjects in plan.items():
        run_phase(phase, subjects, args, out)
    results = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "args": vars(args),
        "phases": {p: [{"name": s.name, **s.result} for s in ss] for p, ss in plan.items()},
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"# {results['host']}, {results['cpus']} CPUs, Python {results['python']}")
    print_tables(plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
