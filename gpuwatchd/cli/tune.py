"""``gpuwatchd tune``: wait for the gate, tune in a worker, print the winners.

Runs without a daemon: it polls the chosen GPU itself, so its gate is the same logic
the daemon uses. With the sim backend, waiting fast-forwards simulated time (a
simulated GPU has nothing to wait for in real time); the session itself runs on a
clock that moves on its own, as on real hardware. Sessions run through the daemon's
own :class:`TuneRunner` and land in the same store, so ``gpuwatchd report`` reads them.
The poller, the sessions and the backends are imported when the command runs (see
:mod:`gpuwatchd.cli.common`).

Exit codes: 0 tuned, 1 runtime failure, 2 bad arguments, 3 gate shut or session
preempted under ``--no-wait``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from gpuwatchd.cli.common import (
    EXIT_CONFIG,
    CliError,
    Subparsers,
    add_backend_args,
    add_command,
    load_with_overrides,
    open_configured_store,
    open_store,
)

if TYPE_CHECKING:
    from gpuwatchd.cli.progress import GateWait, ProgressDisplay
    from gpuwatchd.config import Config
    from gpuwatchd.gate import GateDecision
    from gpuwatchd.monitor.board import GpuSnapshot
    from gpuwatchd.monitor.poller import Poller
    from gpuwatchd.telemetry.backend import Backend
    from gpuwatchd.telemetry.clocks import FastForwardClock
    from gpuwatchd.tuning.types import Regime

EXIT_NOT_OPEN = 3  # --no-wait and the gate is shut
#: The shipped workloads by where they run, for ``--workload``'s help (a test keeps it
#: current; building the parser must not import the workloads).
SHIPPED_WORKLOADS: dict[str, tuple[str, ...]] = {
    "a CUDA GPU": (
        "gemm-bf16-8192",
        "gemm-bf16-4096x4096x16384",
        "conv-l4-report",
        "conv-fp16-channels-last",
    ),
    "--backend sim": ("sim-gemm",),
    "any backend": ("cpu-matmul", "cpu-conv2d"),
}
#: Fast-forwarding a simulated gate: at most this many simulated seconds per real second,
#: so a gate that never opens costs a sleeping process, not a spinning core.
FAST_FORWARD_SPEEDUP = 50.0


class GateWatch:
    """Polls one GPU; waits for its gate (showing why it is shut), fast-forwarding a
    simulated clock."""

    def __init__(
        self,
        poller: Poller,
        gpu: int,
        out: TextIO,
        ff: FastForwardClock | None,
        display: ProgressDisplay | None = None,
    ) -> None:
        self.poller = poller
        self.gpu = gpu
        self.out = out
        self.ff = ff
        if display is None:
            from gpuwatchd.cli.progress import make_progress

            display = make_progress(out)
        self.display = display
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

    def _wait_view(self, snap: GpuSnapshot, waited_s: float) -> GateWait:
        from gpuwatchd.cli.progress import GateWait

        gate, sample = snap.gate, snap.sample
        return GateWait(
            gpu=self.gpu,
            state=gate.state.value if gate is not None else None,
            reasons=tuple(gate.reasons) if gate is not None else (),
            sm_clock_mhz=sample.sm_clock_mhz if sample is not None else None,
            temp_c=sample.temp_c if sample is not None else None,
            power_w=sample.power_w if sample is not None else None,
            waited_s=waited_s,
        )

    def wait_open(self, no_wait: bool, timeout_s: float | None) -> GpuSnapshot:
        """Poll until the gate opens, showing live what it waits for; never spins."""
        period = self.poller.period_s
        cfg = self.poller.gate_cfg
        evidence_s = cfg.settle_s + cfg.window_s + 2 * period  # the gate's own warm-up
        start = self.poller.backend.clock.now()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        first_t: float | None = None
        while True:
            snap = self.poll()
            gate = snap.gate
            if first_t is None and snap.sample is not None:
                first_t = snap.sample.t
            elapsed = self.poller.backend.clock.now() - start
            view = self._wait_view(snap, elapsed)
            if gate is not None and gate.open:
                self.display.gate_open(view)
                return snap
            self.display.waiting(view)
            text = f"{gate.state.value}: {'; '.join(gate.reasons)}" if gate else "no reading"
            if no_wait and (elapsed > evidence_s or _in_use(gate, first_t)):
                self.display.finish()
                raise CliError(f"GPU {self.gpu}: gate is shut ({text})", EXIT_NOT_OPEN)
            if deadline is not None and time.monotonic() > deadline:
                self.display.finish()
                raise CliError(f"GPU {self.gpu}: gate still shut after {timeout_s:g} s ({text})")
            if self.ff is not None:
                self.ff.skip(period)
                time.sleep(period / FAST_FORWARD_SPEEDUP)
            else:
                time.sleep(period)


def _in_use(gate: GateDecision | None, first_t: float | None) -> bool:
    """The gate is shut by what it saw (a process, load, throttling, heat, a lost GPU),
    not merely by the evidence it still gathers: ``--no-wait`` gives up at once."""
    if gate is None or gate.open:
        return False
    if gate.state != "warming":  # a StrEnum: the gate module is not imported for --help
        return True
    return gate.disturbed_at is not None and first_t is not None and gate.disturbed_at > first_t


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "tune",
        "wait for an open gate, tune, print the winners",
        "Without a daemon: poll one GPU, wait until its gate opens (showing what it waits\n"
        "for), measure every candidate of each workload in each regime (unthrottled first,\n"
        "then sustained) in a worker process, and print the winners. Results go to the\n"
        "same store as the daemon's, so `gpuwatchd report` shows them.\n"
        "Exit codes: 0 tuned, 1 runtime failure, 2 bad arguments, 3 gate shut (--no-wait).",
        (
            "gpuwatchd tune --backend sim --scenario power-cap --workload sim-gemm",
            "gpuwatchd tune --workload gemm-bf16-8192 --regime sustained --budget 60",
            "gpuwatchd tune --no-wait || echo 'GPU busy, try later'",
        ),
    )
    add_backend_args(p)
    p.add_argument("--gpu", type=int, default=0, metavar="N", help="GPU index (default 0)")
    p.add_argument(
        "--workload",
        action="append",
        metavar="W",
        help="workload to tune, repeatable (default: every configured one the backend can run). "
        "Shipped: "
        + "; ".join(f"{', '.join(names)} ({on})" for on, names in SHIPPED_WORKLOADS.items())
        + "; plus the config's [[workload]] tables",
    )
    p.add_argument(
        "--regime",
        choices=("unthrottled", "sustained", "both"),
        default="both",
        help="thermal regime(s) to measure",
    )
    p.add_argument(
        "--store",
        metavar="PATH|URL",
        help="SQLite store file, or a PostgreSQL URL or key=value string without a password "
        "(libpq reads it from PGPASSWORD or ~/.pgpass; default: [store] url, else "
        "STATE_DIR/gpuwatchd.db)",
    )
    p.add_argument("--state-dir", metavar="DIR", help="state directory holding the store")
    p.add_argument(
        "--poll-interval",
        type=float,
        metavar="S",
        help="gate poll period in seconds (default daemon.poll_interval_s)",
    )
    p.add_argument(
        "--no-wait", action="store_true", help="fail at once (exit 3) if the gate is shut"
    )
    p.add_argument(
        "--wait-timeout", type=float, metavar="S", help="give up waiting after S s (default never)"
    )
    p.add_argument(
        "--budget",
        type=float,
        metavar="S",
        help="measuring time per workload and regime (default tuning.protocol.time_budget_s)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    from gpuwatchd.sessions.plan import PlanError, select_workloads
    from gpuwatchd.store import StoreError
    from gpuwatchd.telemetry.backend import BackendUnavailable
    from gpuwatchd.telemetry.clocks import FastForwardClock
    from gpuwatchd.telemetry.factory import open_backend
    from gpuwatchd.telemetry.trace import TraceError
    from gpuwatchd.tuning.types import Regime
    from gpuwatchd.validate import need_duration

    cfg, _ = load_with_overrides(args)
    for flag, value in (("--budget", args.budget), ("--wait-timeout", args.wait_timeout)):
        if value is not None:
            try:
                need_duration(value, flag)
            except ValueError as exc:
                raise CliError(str(exc), EXIT_CONFIG) from None
    if args.budget is not None:
        try:
            proto = dataclasses.replace(cfg.tuning.protocol, time_budget_s=args.budget)
        except ValueError as exc:
            raise CliError(f"--budget: {exc}", EXIT_CONFIG) from None
        cfg = dataclasses.replace(cfg, tuning=dataclasses.replace(cfg.tuning, protocol=proto))
    try:
        workloads = select_workloads(cfg.tuning_setup(), cfg.daemon.backend, args.workload or [])
    except PlanError as exc:
        raise CliError(str(exc), EXIT_CONFIG) from None
    regimes = tuple(Regime) if args.regime == "both" else (Regime(args.regime),)
    ff = FastForwardClock(cfg.sim.speed) if cfg.daemon.backend == "sim" else None
    try:
        backend: Backend = open_backend(cfg.backend_spec(), sim_clock=ff)
    except TraceError as exc:  # a bad --trace is a bad argument
        raise CliError(str(exc), EXIT_CONFIG) from None
    except BackendUnavailable as exc:
        raise CliError(str(exc)) from None
    try:
        return _tune(args, cfg, backend, workloads, regimes, ff, out)
    except StoreError as exc:  # a full disk, a store gone read-only under us: one line
        raise CliError(str(exc)) from None
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
    from gpuwatchd.cli.progress import make_progress
    from gpuwatchd.monitor.board import StateBoard
    from gpuwatchd.monitor.poller import Poller
    from gpuwatchd.report.text import format_report, report_from
    from gpuwatchd.sessions.plan import build_specs, preempt_reason
    from gpuwatchd.sessions.runner import TuneRunner
    from gpuwatchd.tuning.types import SessionStatus

    gpus = backend.devices()
    if args.gpu not in gpus:
        raise CliError(f"--gpu {args.gpu}: no such GPU (have {gpus})", EXIT_CONFIG)
    store = (
        open_store(args.store, call_timeout_s=cfg.store.call_timeout_s)
        if args.store
        else open_configured_store(cfg)
    )
    try:
        store.abandon_running()  # sessions a killed `tune` or daemon left running
    except BaseException:
        store.close()
        raise
    runner = TuneRunner(store, worker_user=cfg.tuning.worker_user)
    poller = Poller(
        backend,
        StateBoard(),
        cfg.gate,
        period_s=cfg.daemon.poll_interval_s,
        own_pids=runner.pids,
    )
    display = make_progress(out)
    watch = GateWatch(poller, args.gpu, out, ff, display)
    results = []
    try:
        snap = watch.wait_open(args.no_wait, args.wait_timeout)
        info = snap.info
        if info is None:
            raise CliError(f"GPU {args.gpu}: static facts unavailable")
        pending = build_specs(
            cfg.tuning_setup(), info, workloads, regimes, sim_start_t=backend.clock.now()
        )
        while pending:
            spec = pending[0]
            names = ", ".join(w.name for w in spec.workloads)
            print(f"GPU {args.gpu}: tuning {names} ({spec.device}) in "
                  f"{'/'.join(r.value for r in regimes)}", file=out, flush=True)  # fmt: skip
            try:
                outcome = runner.run_session(
                    spec,
                    info,
                    backend.name,
                    should_preempt=lambda: preempt_reason(watch.latest()),
                    on_progress=display,
                    timeout_s=cfg.tuning.session_timeout_s,
                    sample=snap.sample,
                )
            finally:
                display.finish()  # end the live display before printing more
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
                pending[0] = build_specs(
                    cfg.tuning_setup(),
                    info,
                    spec.workloads,
                    regimes,
                    sim_start_t=backend.clock.now(),
                )[0]
            else:
                raise CliError(f"tuning failed: {outcome.why}")
    finally:
        store.close()
    print(file=out)
    print(format_report(report_from(results)), file=out, flush=True)
    return 0
