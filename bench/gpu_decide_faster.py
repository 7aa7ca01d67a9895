"""Deciding faster on a real GPU: the protocol before issue 13 against today's, same workloads.

Runs the shipped GPU workloads (two bf16 GEMMs, two convs) through the measurement
protocol in this process, over the real candidate families on a ``CudaSession`` with
NVML telemetry (as ``gpuwatchd.tuning.worker.main`` does), under three settings:

- ``classic``: racing off, every regime warmed up afresh, the sustained regime always
  measured, five rounds for everyone, 0.2 s warm-ups, 50 ms pauses, a 3 s settle window
  (the protocol before issue 13, ``bench/protocol_history.py``);
- ``fast``: today's defaults (racing in both regimes, a stop once more rounds cannot
  change the pick by 0.5%, warm-ups that end once calibrated, 25 ms pauses and none for
  kernels that cannot reach the power limit, reused calibration, the sustained regime
  skipped when the unthrottled one shows no power or thermal limit and otherwise started
  once the clock's trend is flat), one workload at a time;
- ``fast.queued``: the same through ``tune_queue``: every workload's unthrottled regime,
  then the sustained regimes back to back, each after the first settling on the heat
  the previous one left;
- ``do_bench``: the common reference, ``triton.testing.do_bench`` (25 ms warm-up, 100 ms
  of repetitions, the median) once per candidate, one regime: its pick is judged in both.

Reported per workload and setting: the seconds the protocol held the GPU (candidate
set-up, i.e. compiling and checking, left out: it is the same for every setting), the
seconds the GPU spent in timed batches, and the energy the GPU drew meanwhile (NVML's
total-energy counter; also net of the idle power measured before the run). Regret: each
``fast`` pick judged by the ``classic`` run's own medians, in each regime. Settings
alternate their order from one repeat to the next, and every run starts on a GPU that
has cooled back to its idle temperature.

It only reads GPU state and runs kernels; it never changes a GPU setting. About 3-6
minutes on an H100 or H200 with the default single repeat.

    python3 bench/gpu_decide_faster.py --out bench/data/h100-decide-faster.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocol_history import CLASSIC

from gpuwatchd.telemetry.nvml import NvmlBackend
from gpuwatchd.telemetry.types import Sample
from gpuwatchd.tuning.settings import ProtocolConfig
from gpuwatchd.tuning.types import Regime, RegimeResult, Workload
from gpuwatchd.tuning.worker.candidate import Candidate
from gpuwatchd.tuning.worker.cuda_session import CudaSession, cuda_identities, normalize_uuid
from gpuwatchd.tuning.worker.families import candidates_for
from gpuwatchd.tuning.worker.protocol import tune_queue
from gpuwatchd.tuning.workloads import DEFAULT_WORKLOADS

GPU_WORKLOADS = (
    "gemm-bf16-8192",
    "gemm-bf16-4096x4096x16384",
    "conv-l4-report",
    "conv-fp16-channels-last",
)
REGIMES = (Regime.UNTHROTTLED, Regime.SUSTAINED)
SETTINGS = ("classic", "fast", "fast.queued", "do_bench")


class Meters:
    """Wall time, device-timed batch time and energy, with set-up time kept apart."""

    def __init__(self, nvml: NvmlBackend, gpu: int) -> None:
        self._nvml = nvml
        self._gpu = gpu
        self.busy_s = 0.0
        self.setup_s = 0.0
        self.setup_j = 0.0

    def energy_j(self) -> float:
        e = self._nvml.read_energy(self._gpu)
        if e is None:
            raise RuntimeError("NVML gives no total-energy counter on this GPU")
        return e


class MeteredSession:
    """The CUDA session, summing the device time of every timed batch."""

    def __init__(self, inner: CudaSession, meters: Meters) -> None:
        self._inner = inner
        self._meters = meters
        self.info = inner.info
        self.l2_bytes = inner.l2_bytes
        self.device = inner.device  # what the GPU families allocate on

    def time_batch(self, candidate: Candidate, calls: int) -> float:
        t = self._inner.time_batch(candidate, calls)
        self._meters.busy_s += t
        return t

    def sample(self) -> Sample:
        return self._inner.sample()

    def flush_l2(self) -> None:
        self._inner.flush_l2()

    def pause(self, seconds: float) -> None:
        self._inner.pause(seconds)

    def now(self) -> float:
        return self._inner.now()


class MeteredCandidate:
    """A candidate whose set-up (compile, correctness check) is timed and kept apart."""

    def __init__(self, inner: Candidate, meters: Meters) -> None:
        self._inner = inner
        self._meters = meters
        self.name = inner.name
        self.family = inner.family

    def setup(self) -> None:
        e0, t0 = self._meters.energy_j(), time.monotonic()
        try:
            self._inner.setup()
        finally:
            self._meters.setup_s += time.monotonic() - t0
            self._meters.setup_j += self._meters.energy_j() - e0

    def run(self, calls: int) -> None:
        self._inner.run(calls)

    def meta(self) -> dict[str, Any]:
        return self._inner.meta()

    def teardown(self) -> None:
        self._inner.teardown()


@dataclass
class Run:
    """One setting over every workload: its results and what it cost."""

    setting: str
    repeat: int
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    held_s: float = 0.0  # wall time in the protocol, set-ups left out
    busy_s: float = 0.0
    energy_j: float = 0.0
    energy_over_idle_j: float = 0.0
    per_workload: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(
        self, names: Sequence[str], held: float, busy: float, energy: float, idle_w: float
    ) -> None:
        """What measuring ``names`` together cost, shared evenly among them, and the totals."""
        cost = {
            "held_s": held,
            "busy_s": busy,
            "energy_j": energy,
            "energy_over_idle_j": energy - idle_w * held,
        }
        for name in names:
            self.per_workload[name] = {k: v / len(names) for k, v in cost.items()}
        for key, value in cost.items():
            setattr(self, key, getattr(self, key) + value)


def pick(r: RegimeResult) -> str | None:
    """The winner, or on a tie the fastest median: what a job would use either way."""
    return next((c.name for c in r.candidates if c.median_s is not None), None)


def cool_down(nvml: NvmlBackend, gpu: int, idle_temp_c: float, limit_s: float) -> float:
    """Wait until the GPU is back within 2 C of its idle temperature; seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        s = nvml.read(gpu)
        if s.temp_c is not None and s.temp_c <= idle_temp_c + 2.0:
            break
        time.sleep(0.5)
    return time.monotonic() - t0


def run_setting(
    setting: str,
    repeat: int,
    workloads: Sequence[Workload],
    cuda: CudaSession,
    nvml: NvmlBackend,
    gpu: int,
    idle_w: float,
    budget_s: float,
) -> Run:
    meters = Meters(nvml, gpu)
    session = MeteredSession(cuda, meters)
    base = CLASSIC if setting == "classic" else ProtocolConfig()
    cfg = ProtocolConfig(**{**asdict(base), "time_budget_s": budget_s})
    queue: list[tuple[Workload, Sequence[Candidate]]] = [
        (w, [MeteredCandidate(c, meters) for c in candidates_for(w, session)]) for w in workloads
    ]
    run = Run(setting, repeat)
    # One job for the queued setting; otherwise one workload at a time (tune_queue of one
    # workload is tune).
    groups = [queue] if setting == "fast.queued" else [[item] for item in queue]
    for group in groups:
        setup_s0, setup_j0, busy0 = meters.setup_s, meters.setup_j, meters.busy_s
        e0, t0 = meters.energy_j(), time.monotonic()
        outcome = tune_queue(group, session, REGIMES, cfg)
        held = time.monotonic() - t0 - (meters.setup_s - setup_s0)
        energy = meters.energy_j() - e0 - (meters.setup_j - setup_j0)
        busy = meters.busy_s - busy0
        for (w, _), results in zip(group, outcome, strict=True):
            run.results[w.name] = [
                {
                    "regime": r.regime.value,
                    "pick": pick(r),
                    "winner": r.winner,
                    "medians_s": {c.name: c.median_s for c in r.candidates},
                    "samples": {c.name: c.samples for c in r.candidates},
                    "skipped": r.candidates[0].meta.get("sustained_skipped"),
                    "settle_s": r.candidates[0].meta.get("settle_s"),
                    "rounds": r.candidates[0].meta.get("rounds"),
                    "rejected": {c.name: c.rejected for c in r.candidates},
                    "spread": {c.name: c.spread for c in r.candidates},
                    "out_after": {
                        c.name: c.meta.get("out_of_race_after_rounds") for c in r.candidates
                    },
                    **{
                        key: r.candidates[0].meta.get(key)
                        for key in ("unpaused", "probe_ended", "pause_s", "settled")
                    },
                }
                for r in results
            ]
        run.add([w.name for w, _ in group], held, busy, energy, idle_w)
    return run


def run_do_bench(
    repeat: int,
    workloads: Sequence[Workload],
    cuda: CudaSession,
    nvml: NvmlBackend,
    gpu: int,
    idle_w: float,
) -> Run:
    """Each candidate timed by ``triton.testing.do_bench`` alone, set-up kept apart."""
    from triton.testing import do_bench

    meters = Meters(nvml, gpu)
    session = MeteredSession(cuda, meters)
    run = Run("do_bench", repeat)
    for w in workloads:
        medians: dict[str, float | None] = {}
        held = energy = 0.0
        for c in candidates_for(w, session):
            mc = MeteredCandidate(c, meters)
            try:
                mc.setup()
            except Exception as e:  # a candidate that cannot run is left out, as the protocol does
                print(f"  {w.name} {c.name}: set-up failed: {type(e).__name__}: {e}", flush=True)
                medians[c.name] = None
                continue
            try:
                e0, t0 = meters.energy_j(), time.monotonic()
                ms = float(
                    do_bench(lambda c=mc: c.run(1), warmup=25, rep=100, return_mode="median")
                )
                held += time.monotonic() - t0
                energy += meters.energy_j() - e0
                medians[c.name] = ms * 1e-3
            finally:
                mc.teardown()
        timed = {k: v for k, v in medians.items() if v is not None}
        best = min(timed, key=lambda k: timed[k]) if timed else None
        run.results[w.name] = [
            {"regime": r.value, "pick": best, "winner": best, "medians_s": medians} for r in REGIMES
        ]
        run.add([w.name], held, 0.0, energy, idle_w)
    return run


def regrets(classic: Run, other: Run) -> dict[str, dict[str, float | None]]:
    """Each of ``other``'s picks judged by the classic run's medians, per regime."""
    out: dict[str, dict[str, float | None]] = {}
    for name, results in other.results.items():
        ref = {r["regime"]: r for r in classic.results.get(name, [])}
        out[name] = {}
        for r in results:
            base = ref.get(r["regime"])
            if base is None or r["pick"] is None or base["pick"] is None:
                out[name][r["regime"]] = None
                continue
            medians = base["medians_s"]
            mine, best = medians.get(r["pick"]), medians.get(base["pick"])
            out[name][r["regime"]] = mine / best - 1.0 if mine and best else None
    return out


def telemetry_index(nvml: NvmlBackend) -> int:
    """The NVML index of the GPU CUDA calls device 0 (honours CUDA_VISIBLE_DEVICES)."""
    want = cuda_identities()[0].uuid
    for i in nvml.devices():
        uuid = nvml.device_info(i).uuid
        if want and uuid and normalize_uuid(uuid) == normalize_uuid(want):
            return int(i)
    raise RuntimeError(f"no NVML device has CUDA device 0's uuid {want}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="*", default=list(GPU_WORKLOADS))
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=SETTINGS)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=60.0, help="per workload and regime")
    ap.add_argument("--cool-limit-s", type=float, default=60.0, help="longest cool-down wait")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if "classic" not in args.settings:
        ap.error("--settings: classic is the reference the others are judged by")
    by_name = {w.name: w for w in DEFAULT_WORKLOADS}
    unknown = [n for n in args.workloads if n not in by_name]
    if unknown:
        ap.error(f"--workloads: unknown {unknown} (shipped: {', '.join(by_name)})")
    workloads = [by_name[n] for n in args.workloads]
    nvml = NvmlBackend()
    try:
        gpu = telemetry_index(nvml)
        cuda = CudaSession(gpu, nvml)
        idle = []
        for _ in range(5):
            idle.append(nvml.read(gpu))
            time.sleep(0.2)
        idle_w = sorted(s.power_w or 0.0 for s in idle)[2]
        idle_temp = min((s.temp_c for s in idle if s.temp_c is not None), default=100.0)
        runs: list[Run] = []
        for rep in range(args.repeats):
            order = args.settings if rep % 2 == 0 else list(reversed(args.settings))
            for setting in order:
                waited = cool_down(nvml, gpu, idle_temp, args.cool_limit_s)
                print(f"[{rep}] {setting} (cooled {waited:.1f} s)", flush=True)
                if setting == "do_bench":
                    runs.append(run_do_bench(rep, workloads, cuda, nvml, gpu, idle_w))
                else:
                    runs.append(
                        run_setting(setting, rep, workloads, cuda, nvml, gpu, idle_w, args.budget_s)
                    )
        report = summarize(runs, args.workloads)
        print(report["table"])
        doc = {
            "command": " ".join(["python3", "bench/gpu_decide_faster.py", *sys.argv[1:]]),
            "device": cuda.info.name,
            "driver": cuda.info.driver_version,
            "software": cuda.software(),
            "idle_power_w": idle_w,
            "runs": [asdict(r) for r in runs],
            "summary": report["summary"],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        cuda.close()
    finally:
        nvml.close()
    return 0


def summarize(runs: Sequence[Run], names: Sequence[str]) -> dict[str, Any]:
    """Mean cost per tuned workload per setting, the ratios to classic, and the regrets."""
    refs = [r for r in runs if r.setting == "classic"]
    summary: dict[str, Any] = {}
    for setting in SETTINGS:
        mine = [r for r in runs if r.setting == setting]
        if not mine:
            continue
        n = len(mine) * len(names)
        entry: dict[str, Any] = {
            key: sum(getattr(r, key) for r in mine) / n
            for key in ("held_s", "busy_s", "energy_j", "energy_over_idle_j")
        }
        entry["regret"] = [regrets(ref, r) for ref, r in zip(refs, mine, strict=True)]
        found = [
            v
            for rep in entry["regret"]
            for per in rep.values()
            for v in per.values()
            if v is not None
        ]
        entry["worst_regret"] = max(found, default=None)
        summary[setting] = entry
    classic = summary["classic"]
    ref = summary.get("do_bench")
    lines = [
        "| setting | GPU held per workload | GPU busy | energy | over idle | classic / this"
        " (time, energy) | this / do_bench (time) | worst regret vs classic |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for setting, s in summary.items():
        worst = "—" if s["worst_regret"] is None else f"{s['worst_regret']:.2%}"
        vs_ref = "—" if ref is None else f"{s['held_s'] / ref['held_s']:.2f}x"
        lines.append(
            f"| {setting} | {s['held_s']:.1f} s | {s['busy_s']:.1f} s | {s['energy_j']:.0f} J"
            f" | {s['energy_over_idle_j']:.0f} J | {classic['held_s'] / s['held_s']:.2f}x,"
            f" {classic['energy_j'] / s['energy_j']:.2f}x | {vs_ref} | {worst} |"
        )
    return {"summary": summary, "table": "\n".join(lines)}


if __name__ == "__main__":
    raise SystemExit(main())
