"""``gpuwatchd tune``: wait for the gate, tune in a worker, print the winners.

Runs without a daemon: it polls the chosen GPU itself, so its gate is the same logic
the daemon uses. With the sim backend, waiting fast-forwards simulated time (a
simulated GPU has nothing to wait for in real time); the session itself runs on a
clock that moves on its own, as on real hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from gpuwatchd.cli.main import EXIT_CONFIG, CliError, load_with_overrides
from gpuwatchd.cli.progress import make_progress
from gpuwatchd.config import Config, store_path
from gpuwatchd.monitor.board import GpuSnapshot, StateBoard
from gpuwatchd.monitor.poller import Poller
from gpuwatchd.report.text import format_report, report_from
from gpuwatchd.sessions.plan import PlanError, build_jobs, preempt_reason, select_workloads
from gpuwatchd.sessions.runner import TuneRunner
from gpuwatchd.store import Store, StoreError
from gpuwatchd.telemetry.backend import Backend, BackendUnavailable
from gpuwatchd.telemetry.clocks import FastForwardClock
from gpuwatchd.telemetry.factory import open_backend
from gpuwatchd.tuning.types import Regime, SessionStatus

EXIT_NOT_OPEN = 3  # --no-wait and the gate is shut


def open_store(path: Path, readonly: bool = False) -> Store:
    if not readonly:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CliError(
                f"cannot create {path.parent}: {exc.strerror or exc} (use --store PATH)"
            ) from None
    try:
        return Store(path, readonly=readonly)
    except StoreError as exc:
        raise CliError(str(exc)) from None


class GateWatch:
    """Polls one GPU; waits for its gate, fast-forwarding a simulated clock."""

    def __init__(self, poller: Poller, gpu: int, out: TextIO, ff: FastForwardClock | None) -> None:
        self.poller = poller
        self.gpu = gpu
        self.out = out
        self.ff = ff
        self._last_poll = 0.0
        self._snap: GpuSnapshot | None = None
        self.session_states: dict[str, int] = {}

    def poll(self) -> GpuSnapshot:
        self._snap = self.poller.poll(self.gpu)
        self._last_poll = time.monotonic()
        return self._snap

    def latest(self) -> GpuSnapshot:
        """A fresh snapshot at most one poll period old (the runner asks every 50 ms).

        Counts the gate states seen meanwhile: under our own sustained load the gate
        shows ``throttled`` or ``warming`` (our heat), which must not preempt us.
        """
        if self._snap is None or time.monotonic() - self._last_poll >= self.poller.period_s:
            snap = self.poll()
            if snap.gate is not None:
                state = snap.gate.state.value
                self.session_states[state] = self.session_states.get(state, 0) + 1
            return snap
        return self._snap

    def report_session_states(self) -> None:
        total = sum(self.session_states.values())
        if total:
            parts = ", ".join(
                f"{state} {100 * n / total:.0f}%"
                for state, n in sorted(self.session_states.items(), key=lambda kv: -kv[1])
            )
            print(f"GPU {self.gpu}: gate while tuning: {parts} of {total} polls",
                  file=self.out, flush=True)  # fmt: skip
        self.session_states.clear()

    def wait_open(self, no_wait: bool, timeout_s: float | None) -> GpuSnapshot:
        period = self.poller.period_s
        cfg = self.poller.gate_cfg
        evidence_s = cfg.settle_s + cfg.window_s + 2 * period  # the gate's own warm-up
        start = self.poller.backend.clock.now()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        shown = None
        while True:
            snap = self.poll()
            gate = snap.gate
            if gate is not None and gate.open:
                if shown is not None:
                    print(f"GPU {self.gpu}: gate open", file=self.out, flush=True)
                return snap
            text = f"{gate.state.value}: {'; '.join(gate.reasons)}" if gate else "no reading"
            if gate is not None and gate.state.value != shown:
                shown = gate.state.value
                print(f"GPU {self.gpu}: waiting for the gate ({text})", file=self.out, flush=True)
            elapsed = self.poller.backend.clock.now() - start
            if no_wait and elapsed > evidence_s:
                raise CliError(f"GPU {self.gpu}: gate is shut ({text})", EXIT_NOT_OPEN)
            if deadline is not None and time.monotonic() > deadline:
                raise CliError(f"GPU {self.gpu}: gate still shut after {timeout_s:g} s ({text})")
            if self.ff is not None:
                self.ff.skip(period)
            else:
                time.sleep(period)


def run_tune(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    cfg, _ = load_with_overrides(args)
    if args.budget is not None:
        try:
            proto = dataclasses.replace(cfg.tuning.protocol, time_budget_s=args.budget)
        except ValueError as exc:
            raise CliError(f"--budget: {exc}", EXIT_CONFIG) from None
        cfg = dataclasses.replace(cfg, tuning=dataclasses.replace(cfg.tuning, protocol=proto))
    try:
        workloads = select_workloads(cfg, cfg.daemon.backend, args.workload or [])
    except PlanError as exc:
        raise CliError(str(exc), EXIT_CONFIG) from None
    regimes = tuple(Regime) if args.regime == "both" else (Regime(args.regime),)
    ff = FastForwardClock(cfg.sim.speed) if cfg.daemon.backend == "sim" else None
    try:
        backend: Backend = open_backend(cfg, sim_clock=ff)
    except BackendUnavailable as exc:
        raise CliError(str(exc)) from None
    try:
        return _tune(args, cfg, backend, workloads, regimes, ff, out)
    finally:
        backend.close()


def _tune(
    args: argparse.Namespace,
    cfg: Config,
    backend: Backend,
    workloads: tuple[Any, ...],
    regimes: tuple[Regime, ...],
    ff: FastForwardClock | None,
    out: TextIO,
) -> int:
    gpus = backend.devices()
    if args.gpu not in gpus:
        raise CliError(f"--gpu {args.gpu}: no such GPU (have {gpus})", EXIT_CONFIG)
    store = open_store(Path(args.store) if args.store else store_path(cfg.daemon.state_dir))
    runner = TuneRunner(store)
    poller = Poller(
        backend,
        StateBoard(),
        cfg.gate,
        period_s=cfg.daemon.poll_interval_s,
        own_pids=runner.pids,
    )
    watch = GateWatch(poller, args.gpu, out, ff)
    results = []
    try:
        snap = watch.wait_open(args.no_wait, args.wait_timeout)
        info = snap.info
        if info is None:
            raise CliError(f"GPU {args.gpu}: static facts unavailable")
        pending = build_jobs(cfg, info, workloads, regimes, sim_start_t=backend.clock.now())
        while pending:
            job = pending[0]
            names = ", ".join(w.name for w in job.workloads)
            print(f"GPU {args.gpu}: tuning {names} ({job.device}) in "
                  f"{'/'.join(r.value for r in regimes)}", file=out, flush=True)  # fmt: skip
            progress = make_progress(out)
            try:
                outcome = runner.run_session(
                    job,
                    info,
                    backend.name,
                    should_preempt=lambda: preempt_reason(watch.latest()),
                    on_progress=progress,
                    timeout_s=cfg.tuning.session_timeout_s,
                    sample=snap.sample,
                )
            finally:
                progress.finish()  # end a live status line before printing more
            status = outcome.status
            watch.report_session_states()
            print(f"session {outcome.session_id}: {status.value}"
                  f"{': ' + outcome.why if outcome.why else ''}", file=out, flush=True)  # fmt: skip
            if status is SessionStatus.COMPLETED:
                results.extend(store.results(outcome.session_id))
                pending.pop(0)
            elif status is SessionStatus.PREEMPTED:
                if args.no_wait:
                    raise CliError(f"preempted: {outcome.why}", EXIT_NOT_OPEN)
                snap = watch.wait_open(False, args.wait_timeout)
                pending[0] = build_jobs(
                    cfg, info, job.workloads, regimes, sim_start_t=backend.clock.now()
                )[0]
            else:
                raise CliError(f"tuning failed: {outcome.why}")
    finally:
        store.close()
    print(file=out)
    print(format_report(report_from(results)), file=out, flush=True)
    return 0


def run_report(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    import json

    from gpuwatchd.report.text import build_report

    if args.store:
        path = Path(args.store)
    else:
        cfg, _ = load_with_overrides(args)
        path = store_path(cfg.daemon.state_dir)
    store = open_store(path, readonly=True)
    try:
        doc = build_report(store, gpu_model=args.gpu_model)
    except StoreError as exc:
        raise CliError(str(exc)) from None
    finally:
        store.close()
    if args.plot:
        from gpuwatchd.report.plots import PlotError, plot_report

        try:
            plot_report(doc, args.plot)
        except PlotError as exc:
            raise CliError(str(exc)) from None
    if args.format == "json":
        print(json.dumps(doc, indent=2, sort_keys=True), file=out)
    else:
        print(format_report(doc), file=out)
    return 0


def run_plot_timeline(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Clock, temperature and power of a recorded trace, with tuning sessions and the gate."""
    from gpuwatchd.report.plots import PlotError, plot_timeline, trace_t0_unix
    from gpuwatchd.telemetry.trace import TraceError, load_trace

    cfg, _ = load_with_overrides(args)
    try:
        trace = load_trace(args.trace)
    except TraceError as exc:
        raise CliError(str(exc)) from None
    if args.gpu not in trace.devices:
        raise CliError(f"--gpu {args.gpu}: not in {args.trace} (has {sorted(trace.devices)})", 2)
    t0 = args.t0_unix if args.t0_unix is not None else trace_t0_unix(args.trace)
    sessions = []
    if args.store:
        if t0 is None:
            raise CliError(
                "--t0-unix: the trace has no t0_unix; give the unix time of its t=0", EXIT_CONFIG
            )
        store = open_store(Path(args.store), readonly=True)
        try:
            sessions = store.sessions(limit=10_000, gpu_uuid=trace.devices[args.gpu].uuid)
        finally:
            store.close()
    try:
        plot_timeline(
            trace,
            args.out,
            sessions,
            gpu=args.gpu,
            unix_at_t0=t0,
            gate_cfg=None if args.no_gate else cfg.gate,
        )
    except PlotError as exc:
        raise CliError(str(exc)) from None
    print(f"wrote {args.out}", file=out)
    return 0
