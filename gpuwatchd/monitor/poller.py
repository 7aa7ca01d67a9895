"""Polls every GPU, runs its gate, and publishes snapshots.

Each GPU's sample window and gate state live in a
:class:`~gpuwatchd.monitor.watch.GpuWatch`; the poller adds what only a live reader
has: the reads, their health, throttle seconds, static facts and the energy counter.

One sweeper thread reads all GPUs in turn each period: a Python thread wake-up costs
about as much as a whole poll, so one wake-up per period instead of one per GPU is what
keeps 8 GPUs at 10 Hz under 0.5% of a core. A read that hangs must not stall the other
GPUs, so the supervisor check (``check_stalls``, run by the daemon's main loop) notices
a read in flight longer than ``stall_periods`` periods (every backend call a poll makes,
the static facts it reads first and after a GPU answers again included), quarantines
that GPU and starts a fresh sweeper for the rest. When the stuck call finally returns,
its old sweeper publishes that reading, releases the GPU back to the current sweeper and
exits. ``stall_check_due_in`` tells that loop when to look next, so it wakes once per
stall limit rather than every period, counted from the sweeper's next sweep while no
read is in flight (no read of the sweeper's can begin before it). Slow fields (energy
counter, static facts) are read off the hot path by a dispatch that never blocks: a GPU
whose previous slow read is still running is skipped, not queued. The sweeper starts
that dispatch itself every ``energy_period_s`` (no scheduler thread wakes for it);
``dispatch_slow_reads`` also starts one at once and restarts that clock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from gpuwatchd.gate import GateConfig
from gpuwatchd.monitor.board import GpuSnapshot, PollHealth, StateBoard
from gpuwatchd.monitor.stop_signal import StopSignal
from gpuwatchd.monitor.watch import GpuWatch, OwnPids
from gpuwatchd.telemetry.backend import Backend, GpuLost
from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason

log = logging.getLogger(__name__)

SnapshotListener = Callable[[GpuSnapshot], None]

#: Mask -> its reasons, so the per-sample accounting does no enum arithmetic.
_REASONS_OF: tuple[tuple[ThrottleReason, ...], ...] = tuple(
    tuple(r for r in ThrottleReason if mask & r.value) for mask in range(1 << len(ThrottleReason))
)


@dataclass(slots=True)
class _GpuTrack:
    """Mutable per-GPU bookkeeping, touched only by that GPU's thread (and the supervisor)."""

    index: int
    watch: GpuWatch  # the sample window and the gate's state
    info: DeviceInfo | None = None
    throttle_s: dict[ThrottleReason, float] = field(default_factory=dict)  # copy on write
    prev_sample: Sample | None = None
    energy_j: float | None = None
    last_health: PollHealth = field(default_factory=lambda: PollHealth(False, 0.0))
    in_flight_since: float | None = None  # time.monotonic() when the current read began
    stall_logged: bool = False
    quarantined: bool = False  # a stuck sweeper owns this GPU until its read returns
    slow_busy: bool = False
    info_read_at: float = 0.0  # time.monotonic()


class Poller:
    """Owns the per-GPU poll threads. ``start``/``stop`` are idempotent."""

    def __init__(
        self,
        backend: Backend,
        board: StateBoard,
        gate_cfg: GateConfig,
        period_s: float = 0.5,
        energy_period_s: float = 5.0,
        info_refresh_s: float = 300.0,
        stall_periods: float = 2.0,
        own_pids: OwnPids = frozenset,
    ) -> None:
        self.backend = backend
        self.board = board
        self._gate_cfg = gate_cfg
        self.period_s = period_s
        self.energy_period_s = energy_period_s
        self.info_refresh_s = info_refresh_s
        self.stall_periods = stall_periods
        self._own_pids = own_pids
        self._listeners: list[SnapshotListener] = []
        self._stop = StopSignal()  # the sweeper sleeps on it between sweeps
        self._threads: list[threading.Thread] = []
        self._generation = 0  # bumped whenever a stuck sweeper is replaced
        self._sweep_lock = threading.Lock()
        self._tracks: dict[int, _GpuTrack] = {}
        self._slow_pool: ThreadPoolExecutor | None = None
        self._next_slow_at = float("inf")  # time.monotonic() of the sweeper's next dispatch
        self._next_sweep_at = 0.0  # time.monotonic() the sweeper's next sweep begins

    # -- configuration -------------------------------------------------------------

    @property
    def gate_cfg(self) -> GateConfig:
        return self._gate_cfg

    def reconfigure(self, gate_cfg: GateConfig, period_s: float | None = None) -> None:
        """Apply a reloaded configuration; threads pick it up at their next poll."""
        self._gate_cfg = gate_cfg
        for track in list(self._tracks.values()):
            track.watch.cfg = gate_cfg
        if period_s is not None:
            self.period_s = period_s

    def add_listener(self, fn: SnapshotListener) -> None:
        """``fn`` is called on the GPU's thread after each poll; it must be quick."""
        self._listeners.append(fn)

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        if self._threads:
            return
        gpus = self.backend.devices()
        if not gpus:
            log.warning("backend %s reports no GPUs; nothing to poll", self.backend.name)
        self._slow_pool = ThreadPoolExecutor(
            max_workers=max(2, min(16, len(gpus))), thread_name_prefix="gpuwatchd-slow"
        )
        for gpu in gpus:
            self._tracks[gpu] = self._new_track(gpu)
        self._next_slow_at = time.monotonic() + self.energy_period_s
        self._start_sweeper()

    def _new_track(self, gpu: int) -> _GpuTrack:
        return _GpuTrack(index=gpu, watch=GpuWatch(self._gate_cfg, self._own_pids))

    def _start_sweeper(self) -> None:
        generation = self._generation
        t = threading.Thread(
            target=self._sweep, args=(generation,), name=f"gpuwatchd-poll-{generation}", daemon=True
        )
        self._threads.append(t)
        t.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop polling. A thread stuck inside a driver call is abandoned (daemon thread)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self._slow_pool is not None:
            self._slow_pool.shutdown(wait=False, cancel_futures=True)

    # -- supervision (called from the daemon's main loop) -------------------------------

    def check_stalls(self) -> list[int]:
        """Mark GPUs whose read has been in flight too long; return their indices.

        The first time a GPU stalls, it is quarantined and a new sweeper takes over
        the other GPUs, so they keep their poll period.
        """
        now = time.monotonic()
        limit = self.stall_periods * self.period_s
        stalled = []
        for track in list(self._tracks.values()):
            since = track.in_flight_since
            if since is None or now - since <= limit:
                continue
            stalled.append(track.index)
            if not track.stall_logged:
                track.stall_logged = True
                log.error(
                    "GPU %d: telemetry read stuck for %.1f s (limit %.1f s); "
                    "other GPUs keep polling",
                    track.index,
                    now - since,
                    limit,
                )
            with self._sweep_lock:
                if not track.quarantined and not self._stop.is_set():
                    track.quarantined = True
                    self._generation += 1
                    self._start_sweeper()
            health = replace(track.last_health, success=False, stalled=True, error="read stalled")
            self._publish(track, sample=None, health=health)
        return stalled

    def stall_check_due_in(self) -> float:
        """Seconds until :meth:`check_stalls` can next find something new.

        A read in flight becomes a stall ``stall_periods`` periods after it began; one
        not yet begun cannot stall sooner than that after the sweeper's next sweep
        begins (or from now, where that is past). A GPU already stalled is re-published
        once per limit, as the gate's unavailable spell goes on.
        """
        limit = self.stall_periods * self.period_s
        now = time.monotonic()
        due = max(limit, self._next_sweep_at + limit - now)
        for track in list(self._tracks.values()):
            since = track.in_flight_since
            if track.stall_logged or track.quarantined:  # its next read may begin any time
                due = min(due, limit)
            elif since is not None:
                due = min(due, since + limit - now)
        return max(0.01, due)

    def longest_stall_s(self) -> float:
        """How long the oldest in-flight read has been running (0 when none is)."""
        now = time.monotonic()
        starts = [t.in_flight_since for t in self._tracks.values() if t.in_flight_since]
        return max((now - s for s in starts), default=0.0)

    def dispatch_slow_reads(self) -> None:
        """Start slow-field reads for GPUs that have none running. Never blocks."""
        pool = self._slow_pool
        if pool is None or self._stop.is_set():
            return
        self._next_slow_at = time.monotonic() + self.energy_period_s
        for track in list(self._tracks.values()):
            if track.slow_busy:
                log.debug("GPU %d: previous slow read still running; skipped", track.index)
                continue
            track.slow_busy = True
            pool.submit(self._read_slow, track)

    # -- per-GPU work --------------------------------------------------------------

    def _sweep(self, generation: int) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            for track in list(self._tracks.values()):
                if track.quarantined:
                    continue
                self.poll_once(track)
                if generation != self._generation:
                    # Replaced while stuck in this GPU's read: hand the GPU back and go.
                    with self._sweep_lock:
                        track.quarantined = False
                    return
            self._prune_threads()
            if time.monotonic() >= self._next_slow_at:
                self.dispatch_slow_reads()
            next_at += self.period_s
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind (a slow read): don't burst to catch up
                next_at = time.monotonic()
                delay = 0.0
            self._next_sweep_at = next_at
            if self._stop.wait(delay):
                return

    def _prune_threads(self) -> None:
        if len(self._threads) > 1:
            self._threads = [t for t in self._threads if t.is_alive()]

    def poll(self, gpu: int) -> GpuSnapshot:
        """Poll one GPU now from the caller's thread (``gpuwatchd tune`` drives its own loop)."""
        track = self._tracks.get(gpu)
        if track is None:
            track = self._tracks[gpu] = self._new_track(gpu)
        return self.poll_once(track)

    def poll_once(self, track: _GpuTrack) -> GpuSnapshot:
        """Read one GPU once, evaluate its gate and publish. Public for tests."""
        gpu = track.index
        if track.info is None:
            self._read_info_in_flight(track)
        started = time.monotonic()
        track.in_flight_since = started
        sample: Sample | None = None
        lost = False
        error: str | None = None
        try:
            sample = self.backend.read(gpu)
        except GpuLost as exc:
            lost, error = True, str(exc)
        except Exception as exc:  # a backend bug or driver error must not kill the thread
            error = f"{type(exc).__name__}: {exc}"
        finally:
            track.in_flight_since = None
        duration = time.monotonic() - started
        if track.stall_logged:
            self._log_returned(track, duration)
        if error is not None and track.last_health.error != error:
            log.warning("GPU %d: poll failed: %s", gpu, error)
        if sample is not None and track.last_health.lost:
            log.warning("GPU %d: answering again", gpu)
            self._read_info_in_flight(track)  # it may have been replaced or reset
        if sample is not None:
            self._accumulate_throttle(track, sample)
            track.watch.add(sample)
        else:
            track.prev_sample = None  # don't attribute the gap to any reason
        health = PollHealth(
            success=sample is not None,
            duration_s=duration,
            stalled=False,
            lost=lost,
            error=error,
            last_success_t=sample.t if sample else track.last_health.last_success_t,
            last_success_unix=time.time() if sample else track.last_health.last_success_unix,
        )
        return self._publish(track, sample=sample, health=health)

    def _publish(self, track: _GpuTrack, sample: Sample | None, health: PollHealth) -> GpuSnapshot:
        if sample is not None:
            decision = track.watch.judge(track.info)
        else:  # no fresh sample (lost, stalled or failed): the gate cannot vouch for the GPU
            why = None
            if not health.lost:
                why = "telemetry read stalled" if health.stalled else f"read failed: {health.error}"
            decision = track.watch.judge(track.info, lost=True, why=why)
        track.last_health = health
        snap = GpuSnapshot(
            index=track.index,
            info=track.info,
            sample=sample,
            gate=decision,
            health=health,
            energy_j=track.energy_j,
            throttle_seconds=track.throttle_s,  # replaced, never changed, once published
        )
        self.board.put(snap)
        for fn in self._listeners:
            try:
                fn(snap)
            except Exception:
                log.exception("snapshot listener %r failed", fn)
        return snap

    def _accumulate_throttle(self, track: _GpuTrack, sample: Sample) -> None:
        """Credit the interval since the previous sample to the reasons that sample showed."""
        prev = track.prev_sample
        track.prev_sample = sample
        if prev is None or not prev.reasons:
            return
        dt = sample.t - prev.t
        if dt <= 0:
            return
        acc = dict(track.throttle_s)  # a snapshot holds the previous one
        for reason in _REASONS_OF[prev.reasons._value_]:
            acc[reason] = acc.get(reason, 0.0) + dt
        track.throttle_s = acc

    def _read_info_in_flight(self, track: _GpuTrack) -> None:
        """Re-read static facts as part of a poll: a read in flight, so a hang is a stall."""
        started = time.monotonic()
        track.in_flight_since = started
        try:
            self._read_info(track, refresh=True)
        finally:
            track.in_flight_since = None
        if track.stall_logged:
            self._log_returned(track, time.monotonic() - started)

    @staticmethod
    def _log_returned(track: _GpuTrack, duration: float) -> None:
        track.stall_logged = False
        log.warning("GPU %d: telemetry read returned after %.1f s", track.index, duration)

    def _read_info(self, track: _GpuTrack, refresh: bool = False) -> None:
        try:
            track.info = self.backend.device_info(track.index, refresh=refresh)
            track.info_read_at = time.monotonic()
        except GpuLost:
            pass  # the poll itself reports the GPU lost
        except Exception as exc:
            log.warning("GPU %d: cannot read static facts: %s", track.index, exc)

    def _read_slow(self, track: _GpuTrack) -> None:
        try:
            if time.monotonic() - track.info_read_at >= self.info_refresh_s:
                self._read_info(track, refresh=True)
            track.energy_j = self.backend.read_energy(track.index)
        except GpuLost:
            pass
        except Exception as exc:
            log.warning("GPU %d: slow-field read failed: %s", track.index, exc)
        finally:
            track.slow_busy = False
