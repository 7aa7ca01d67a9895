"""The tuning worker: ``python -m gpuwatchd.tuning.worker``, one session spec, one GPU, then exit.

It reads one :class:`~gpuwatchd.tuning.session_spec.SessionSpec` (JSON) from stdin, opens the
device with its own telemetry (NVML for ``cuda``, a simulated GPU for ``sim``, none for
``cpu``), runs the measurement protocol on every workload and writes JSON lines to
stdout: ``hello``, throttled ``progress``, a ``result`` per (workload, regime), or an
``error`` and a non-zero exit. The daemon spawns it so that a CUDA crash, a hang or a
10 GB import never takes the daemon down; only this process imports torch.

stdout carries the protocol and nothing else: at start the real stdout is kept for
the messages and file descriptor 1 is pointed at stderr, so prints from libraries
(even C-level ones) land in the log instead of corrupting the stream.

SIGTERM (and the daemon disappearing) stops the protocol at the next batch boundary;
the worker then exits 143 without waiting for a slow interpreter or CUDA teardown.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import BinaryIO, TextIO

from gpuwatchd.tuning.session_spec import (
    MAX_SPEC_BYTES,
    ErrorMessage,
    Hello,
    Message,
    Progress,
    ResultMessage,
    SessionSpec,
    SessionSpecError,
    encode_message,
)
from gpuwatchd.tuning.types import BatchRecord, Regime, RegimeResult, Versions, Workload
from gpuwatchd.tuning.worker.candidate import Candidate, DeviceSession
from gpuwatchd.tuning.worker.families import candidates_for
from gpuwatchd.tuning.worker.protocol import BudgetSpent, Preempted, tune_queue
from gpuwatchd.tuning.worker_isolation import PrivateDirError, ensure_private_dirs
from gpuwatchd.validate import describe

log = logging.getLogger("gpuwatchd.tuning.worker")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_JOB = 2
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, what a shell reports for a SIGTERM death

#: Least wall time between two progress messages.
PROGRESS_INTERVAL_S = 0.25


class WorkerError(Exception):
    """The session cannot go on; the message is sent to the daemon as the session's why."""


class Channel:
    """Writes protocol messages, one JSON line each, flushed at once."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def send(self, msg: Message) -> None:
        self._stream.write(encode_message(msg) + "\n")
        self._stream.flush()


def claim_stdout() -> TextIO:
    """Keep the real stdout for the protocol; point fd 1 and ``sys.stdout`` at stderr."""
    sys.stdout.flush()
    protocol_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(protocol_fd, "w", encoding="utf-8", buffering=1)


class StopFlag:
    """``should_stop`` for the protocol: a SIGTERM arrived or the daemon went away.

    The parent check catches a daemon killed with SIGKILL: the worker is re-parented
    and stops at the next batch instead of loading the GPU as an orphan.
    """

    def __init__(self) -> None:
        self.signalled = False
        self._parent = os.getppid()

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True

    def __call__(self) -> bool:
        return self.signalled or os.getppid() != self._parent


@dataclass(slots=True)
class OpenDevice:
    """A device session, the versions its timings depend on, and how to close it."""

    session: DeviceSession
    versions: Versions
    close: Callable[[], None]


def open_device(spec: SessionSpec) -> OpenDevice:
    """Open the spec's device with its own telemetry and check it is the GPU asked for."""
    if spec.device == "cpu":
        import torch

        from gpuwatchd.tuning.worker.devices import CpuSession

        return OpenDevice(CpuSession(), Versions(torch=torch.__version__), lambda: None)
    if spec.device == "sim":
        from gpuwatchd.telemetry.clocks import ManualClock, PacedClock
        from gpuwatchd.telemetry.sim import SimBackend
        from gpuwatchd.tuning.worker.devices import SimSession

        assert spec.sim is not None  # SessionSpec guarantees it for device sim
        speed = spec.sim.speed  # paced to the daemon's time: its GPU feels the whole session
        clock = ManualClock() if speed is None else PacedClock(speed, spec.sim.start_t)
        try:
            backend = SimBackend(
                gpus=spec.sim.gpus, scenario=spec.sim.scenario, seed=spec.sim.seed, clock=clock
            )
            sim = SimSession(backend, clock, spec.gpu_index, seed=spec.sim.seed)
        except ValueError as e:
            raise WorkerError(f"spec.sim: {e}") from None
        clock.advance(spec.sim.start_t)  # the model catches up on its first read
        _check_uuid(spec, sim.info.uuid)
        return OpenDevice(sim, Versions(driver=sim.info.driver_version), backend.close)
    return _open_cuda(spec)


def _open_cuda(spec: SessionSpec) -> OpenDevice:
    from gpuwatchd.telemetry.backend import BackendUnavailable
    from gpuwatchd.telemetry.nvml import NvmlBackend
    from gpuwatchd.tuning.worker.cuda_session import CudaSession

    try:
        nvml = NvmlBackend()
    except BackendUnavailable as e:
        raise WorkerError(f"NVML: {e}") from None
    try:
        _check_uuid(spec, nvml.device_info(spec.gpu_index).uuid)
        cuda = CudaSession(spec.gpu_index, nvml)
        sw = cuda.software()
    except BaseException:
        nvml.close()
        raise

    def close() -> None:
        cuda.close()
        nvml.close()

    versions = Versions(
        driver=cuda.info.driver_version,
        cuda=sw.get("cuda"),
        torch=sw.get("torch"),
        triton=sw.get("triton"),
        cudnn=sw.get("cudnn"),
    )
    return OpenDevice(cuda, versions, close)


def _check_uuid(spec: SessionSpec, actual: str) -> None:
    if actual.lower() != spec.gpu_uuid.lower():
        raise WorkerError(
            f"spec.gpu_uuid is {spec.gpu_uuid} but GPU {spec.gpu_index} here is {actual};"
            " the daemon and the worker disagree on the GPU"
        )


class ProgressReporter:
    """``on_batch`` for the protocol: a progress message at most every ``interval_s``,
    and always on the first batch of a regime."""

    def __init__(
        self,
        channel: Channel,
        workload: Workload,
        regimes: tuple[Regime, ...],
        done_before: int,
        total: int,
        interval_s: float = PROGRESS_INTERVAL_S,
        candidates: int = 0,
        min_batches: int = 1,
        budget_s: float | None = None,
        now: Callable[[], float] | None = None,
    ) -> None:
        self._channel = channel
        self._workload = workload.name
        self._regimes = regimes
        self._done_before = done_before
        self._total = total
        self._interval = interval_s
        self._last = -float("inf")
        self._regime: Regime | None = None
        self._batches = 0
        self._candidates = candidates
        self._min_batches = min_batches
        self._accepted: dict[str, int] = {}  # per candidate, in the current regime
        self._budget_s = budget_s
        self._now = now  # the device session's clock, which the time budget runs on
        # A regime starts when the previous one's last batch ended; the first one about now.
        self._regime_start = now() if now is not None else None
        self._last_t = self._regime_start
        self._done: int | None = None  # set by begin(): pairs of the spec finished

    def begin(self, regime: Regime, done: int, budget_s: float | None = None) -> None:
        """This workload's ``regime`` starts now, ``done`` pairs of the spec finished.

        In a queue other workloads run between a workload's regimes, so its regime's
        clock, round and place in the session are set here rather than guessed from its
        previous batch.
        """
        now = self._now() if self._now is not None else None
        self._regime, self._batches, self._last = regime, 0, -float("inf")
        self._accepted = {}
        self._regime_start = self._last_t = now
        self._done = done
        if budget_s is not None:
            self._budget_s = budget_s

    def __call__(self, rec: BatchRecord) -> None:
        t = self._now() if self._now is not None else None
        if rec.regime is not self._regime:
            if self._regime is not None:
                self._regime_start = self._last_t
            self._regime, self._batches, self._last = rec.regime, 0, -float("inf")
            self._accepted = {}
            self._done = None
        self._last_t = t
        self._batches += 1
        if not rec.rejected:
            self._accepted[rec.candidate] = self._accepted.get(rec.candidate, 0) + 1
        now = time.monotonic()
        if now - self._last < self._interval:
            return
        self._last = now
        self._channel.send(
            Progress(
                workload=self._workload,
                regime=rec.regime,
                candidate=rec.candidate,
                done=(
                    self._done
                    if self._done is not None
                    else self._done_before + self._regimes.index(rec.regime)
                ),
                total=self._total,
                batches=self._batches,
                candidates_done=min(
                    self._candidates,
                    sum(n >= self._min_batches for n in self._accepted.values()),
                ),
                candidates_total=self._candidates,
                sm_clock_mhz=rec.sm_clock_mhz,
                power_w=rec.power_w,
                temp_c=rec.temp_c,
                round=max(self._accepted.values(), default=0),
                elapsed_s=(
                    None if t is None or self._regime_start is None else t - self._regime_start
                ),
                budget_s=self._budget_s,
            )
        )


def run_spec(spec: SessionSpec, channel: Channel, stop: Callable[[], bool]) -> int:
    """Measure every workload of the spec; returns the exit code.

    Workloads go ``protocol.queue_workloads`` at a time through :func:`tune_queue`, so
    their sustained regimes run back to back on the heat the previous one left. Each
    group gets the share of the session's remaining time budget its pairs are owed, counted
    from before its candidates are built and set up (so a group's set-up cannot carry
    the session past its budget); within it every regime run gets an equal share of what is
    left (at most the protocol's own ``time_budget_s``). Each regime's result goes out as
    soon as it is decided: a preemption later keeps it, and a resumed session measures
    only what is missing.
    """
    if stop():
        return EXIT_TERMINATED
    dev = open_device(spec)
    try:
        channel.send(Hello(pid=os.getpid(), versions=dev.versions))
        session = dev.session
        total = len(spec.pairs())
        sent = 0  # results sent: pairs of the spec finished
        start = session.now()
        size = spec.protocol.queue_workloads
        for g in range(0, len(spec.workloads), size):
            group = spec.workloads[g : g + size]
            if stop():
                return EXIT_TERMINATED
            group_began = session.now()
            left = spec.time_budget_s - (group_began - start)
            if left <= 0:
                raise WorkerError(
                    f"time budget of {spec.time_budget_s:g} s spent before workload {group[0].name}"
                )
            regimes = [spec.regimes_of(w.name) for w in group]
            queue = [(w, _candidates(w, session, spec.allowed_modules)) for w in group]
            events = _QueueEvents(channel, spec, queue, regimes, total, sent, session.now)
            try:
                tune_queue(
                    queue,
                    session,
                    spec.regimes,
                    spec.protocol,
                    events.on_batch,
                    stop,
                    events.on_result,
                    workload_regimes=regimes,
                    on_start=events.on_start,
                    total_budget_s=left * sum(map(len, regimes)) / (total - sent),
                    budget_since=group_began,
                )
            except BudgetSpent as e:
                raise WorkerError(str(e)) from None
            finally:
                sent = events.sent
        return EXIT_OK
    except Preempted as e:
        log.info("stopping: %s", e)
        return EXIT_TERMINATED
    finally:
        dev.close()


class _QueueEvents:
    """The protocol's callbacks for one group of workloads: results go out at once,
    batches to the progress reporter of the workload whose regime runs now."""

    def __init__(
        self,
        channel: Channel,
        spec: SessionSpec,
        queue: list[tuple[Workload, list[Candidate]]],
        regimes: list[tuple[Regime, ...]],
        total: int,
        sent: int,
        now: Callable[[], float],
    ) -> None:
        self._channel = channel
        self.sent = sent  # pairs of the spec finished
        self._reporters = [
            ProgressReporter(
                channel,
                w,
                rs,
                0,
                total,
                candidates=len(cands),
                min_batches=spec.protocol.min_rounds,
                now=now,
            )
            for (w, cands), rs in zip(queue, regimes, strict=True)
        ]
        self._current = self._reporters[0]

    def on_start(self, j: int, regime: Regime, budget_s: float) -> None:
        self._current = self._reporters[j]
        self._current.begin(regime, self.sent, budget_s)

    def on_batch(self, rec: BatchRecord) -> None:
        self._current(rec)

    def on_result(self, j: int, result: RegimeResult) -> None:
        self._channel.send(ResultMessage(result))
        self.sent += 1


def _candidates(
    workload: Workload, session: DeviceSession, allowed_modules: Sequence[str]
) -> list[Candidate]:
    candidates = list(candidates_for(workload, session, allowed_modules))
    if not candidates:
        raise WorkerError(f"workload {workload.name}: its families gave no candidates")
    log.info("tuning %s: %d candidates", workload.name, len(candidates))
    return candidates


def _read_job(stream: BinaryIO) -> SessionSpec:
    data = stream.read(MAX_SPEC_BYTES + 1)
    if not data.strip():
        raise SessionSpecError("spec: stdin was empty; expected one session spec (JSON)")
    return SessionSpec.loads(data)


def main() -> int:
    """Run one session spec from stdin; messages on the real stdout, everything else on stderr."""
    channel = Channel(claim_stdout())
    faulthandler.enable(sys.stderr)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"gpuwatchd-worker[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    stop = StopFlag()
    signal.signal(signal.SIGTERM, stop.handle)
    try:
        ensure_private_dirs(os.environ)  # before torch or Triton reads a cache
    except PrivateDirError as e:
        _send_error(channel, str(e))
        return EXIT_FAILED
    try:
        spec = _read_job(sys.stdin.buffer)
    except SessionSpecError as e:
        _send_error(channel, f"bad session spec: {e}")
        return EXIT_BAD_JOB
    try:
        return run_spec(spec, channel, stop)
    except BrokenPipeError:
        return EXIT_TERMINATED if stop() else EXIT_FAILED  # the daemon stopped listening
    except Exception as e:
        log.exception("tuning failed")
        # Our own errors are written for people already; anything else keeps its type name.
        _send_error(
            channel, describe(e, with_type=not isinstance(e, WorkerError | SessionSpecError))
        )
        return EXIT_FAILED


def _send_error(channel: Channel, message: str) -> None:
    try:
        channel.send(ErrorMessage(message))
    except OSError:
        log.error("cannot report the error to the daemon: %s", message)


def run_and_exit() -> None:
    """Run :func:`main` and exit; a SIGTERM'd run skips interpreter and CUDA teardown."""
    code = main()
    if code == EXIT_TERMINATED:
        # Asked to stop: skip interpreter and CUDA teardown, which can take seconds.
        logging.shutdown()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
