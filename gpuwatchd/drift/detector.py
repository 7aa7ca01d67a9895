"""Per-GPU drift detection: when the tuned winners no longer describe the GPU.

The poller calls :meth:`DriftDetector.observe` with every snapshot (cheap: one lock,
one deque append). A periodic job calls :meth:`DriftDetector.evaluate`, which compares
each GPU with its *reference*, the conditions its winners were measured under (see
:func:`gpuwatchd.drift.seed.reference_from_store`), and returns the re-tune reasons
raised since the last call. A reason is raised once per reference: it stays pending
(exported as ``gpuwatchd_retune_pending``) until a new reference arrives, normally
from the re-tune it asked for.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from gpuwatchd.drift.config import DriftConfig
from gpuwatchd.drift.versions import changed_versions
from gpuwatchd.drift.window import LoadWindow
from gpuwatchd.monitor.board import GpuSnapshot
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.types import Versions

log = logging.getLogger(__name__)

_MHZ = 1e6
#: NVML reports the power limit in milliwatts and clocks in whole MHz: anything
#: beyond these is a real change, not rounding.
POWER_LIMIT_TOLERANCE_W = 0.5
MAX_CLOCK_TOLERANCE_HZ = 0.5 * _MHZ


class RetuneReason(enum.StrEnum):
    """Why a GPU's winners should be measured again; the ``reason`` label value."""

    CLOCK_DRIFT = "clock_drift"
    POWER_LIMIT_CHANGED = "power_limit_changed"
    MAX_CLOCK_CHANGED = "max_clock_changed"
    VERSIONS_CHANGED = "versions_changed"
    WINNERS_STALE = "winners_stale"
    NO_WINNERS = "no_winners"


@dataclass(frozen=True, slots=True)
class Reference:
    """What a GPU's winners were measured under. None fields are unknown and not checked."""

    uuid: str
    sustained_clock_hz: float | None
    power_limit_w: float | None
    max_clock_hz: float | None
    versions: Versions
    measured_at: float  # unix seconds

    def __post_init__(self) -> None:
        for key in ("sustained_clock_hz", "power_limit_w", "max_clock_hz"):
            v = getattr(self, key)
            if v is not None and not (_is_number(v) and v > 0):
                raise ValueError(f"reference.{key}: must be a finite number > 0 or None, got {v!r}")
        if not _is_number(self.measured_at):
            raise ValueError(
                f"reference.measured_at: must be a unix time, got {self.measured_at!r}"
            )
        if not isinstance(self.versions, Versions):
            raise ValueError(f"reference.versions: must be Versions, got {self.versions!r}")


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _differs(now: float | None, then: float | None, tolerance: float) -> bool:
    """Both known and further apart than ``tolerance``."""
    return now is not None and then is not None and abs(now - then) > tolerance


@dataclass(frozen=True, slots=True)
class GpuDriftView:
    """What the exporter and the JSON API show about one GPU, replaced whole."""

    uuid: str
    ratio: float | None  # (learned - reference) / reference, signed; None when unknown
    learned_clock_hz: float | None
    reference_clock_hz: float | None
    pending: frozenset[RetuneReason]


@dataclass(slots=True)
class _Track:
    """Everything known about one GPU; guarded by the detector's lock."""

    window: LoadWindow
    info: DeviceInfo | None = None
    reference: Reference | None = None
    raised: set[RetuneReason] = field(default_factory=set)
    ratio: float | None = None
    learned_hz: float | None = None
    held_s: float = 0.0  # evidence-backed seconds beyond the threshold, this episode
    beyond_at: float | None = None  # unix time of the last evaluate that saw drift


class DriftDetector:
    """Tracks every GPU's learned sustained clock and re-tune reasons. Thread-safe.

    ``versions_now`` returns the library versions installed now (driver may be None:
    each GPU's comes from its :class:`DeviceInfo`); it is called once per
    :meth:`evaluate`, outside the lock, and a failure skips the versions check.
    """

    def __init__(self, cfg: DriftConfig, versions_now: Callable[[], Versions]) -> None:
        self._cfg = cfg
        self._versions_now = versions_now
        self._lock = threading.Lock()
        self._tracks: dict[int, _Track] = {}
        self._view: dict[int, GpuDriftView] = {}

    @property
    def cfg(self) -> DriftConfig:
        return self._cfg

    def reconfigure(self, cfg: DriftConfig) -> None:
        """Apply a reloaded ``[drift]`` table; learned evidence and references are kept."""
        with self._lock:
            self._cfg = cfg
            for track in self._tracks.values():
                w = track.window
                w.window_s, w.settle_s, w.util_min = cfg.window_s, cfg.settle_s, cfg.util_min

    # -- inputs ------------------------------------------------------------------------

    def observe(self, snap: GpuSnapshot) -> None:
        """Take one poll's snapshot (a poller listener): O(1) amortised, no I/O."""
        with self._lock:
            track = self._tracks.get(snap.index)
            if track is None:
                track = self._tracks[snap.index] = self._new_track()
            info = snap.info
            if info is not None and info is not track.info:
                if track.info is not None and info.uuid != track.info.uuid:
                    log.warning(
                        "GPU %d: now %s (was %s); its learned clock starts over",
                        snap.index,
                        info.uuid,
                        track.info.uuid,
                    )
                    track.window.reset()
                track.info = info
            sample = snap.sample
            if sample is None:
                track.window.gap()
            else:
                track.window.add(sample.t, sample.util_gpu, sample.reasons, sample.sm_clock_mhz)

    def set_reference(
        self,
        gpu: int,
        uuid: str,
        sustained_clock_hz: float | None,
        power_limit_w: float | None,
        max_clock_hz: float | None,
        versions: Versions,
        measured_at: float,
    ) -> bool:
        """Set what ``gpu``'s winners were measured under; clears its pending reasons.

        Setting the reference it already has changes nothing (returns False), so a
        periodic re-seed from the store does not re-raise reasons every time.
        """
        ref = Reference(
            uuid, sustained_clock_hz, power_limit_w, max_clock_hz, versions, measured_at
        )
        with self._lock:
            track = self._tracks.get(gpu)
            if track is None:
                track = self._tracks[gpu] = self._new_track()
            if track.reference == ref:
                return False
            track.reference = ref
            track.raised.clear()
            track.held_s, track.beyond_at = 0.0, None
            self._publish()
        log.info(
            "GPU %d: drift reference set: sustained clock %s, power limit %s, measured at %.0f",
            gpu,
            "unknown" if sustained_clock_hz is None else f"{sustained_clock_hz / _MHZ:.0f} MHz",
            "unknown" if power_limit_w is None else f"{power_limit_w:g} W",
            measured_at,
        )
        return True

    def _new_track(self) -> _Track:
        c = self._cfg
        return _Track(window=LoadWindow(c.window_s, c.settle_s, c.util_min))

    # -- decisions ---------------------------------------------------------------------

    def evaluate(self, now_unix: float) -> dict[int, list[RetuneReason]]:
        """Update every GPU's drift and return the reasons raised by this call, per GPU."""
        try:
            libraries: Versions | None = self._versions_now()
        except Exception as exc:  # a broken metadata entry must not stop drift checks
            log.warning("cannot read installed library versions: %s", exc)
            libraries = None
        raised: dict[int, list[RetuneReason]] = {}
        with self._lock:
            for gpu, track in sorted(self._tracks.items()):
                new = self._evaluate_one(gpu, track, now_unix, libraries)
                if new:
                    track.raised.update(new)
                    raised[gpu] = new
            self._publish()
        never = [g for g, reasons in raised.items() if RetuneReason.NO_WINNERS in reasons]
        if never:  # a first start: expected, so one line for all GPUs, not a warning each
            gpus = ", ".join(map(str, never))
            log.info("GPU %s: never tuned; first tuning requested (no_winners)", gpus)
        return raised

    def _evaluate_one(
        self, gpu: int, track: _Track, now: float, libraries: Versions | None
    ) -> list[RetuneReason]:
        self._update_drift(track, now)
        ref = track.reference
        if ref is None:
            found = [] if track.info is None else [(RetuneReason.NO_WINNERS, "never tuned")]
        else:
            found = [*self._changes(track, ref, libraries), *self._ageing(track, ref, now)]
        return self._keep_new(gpu, track, found)

    @staticmethod
    def _changes(
        track: _Track, ref: Reference, libraries: Versions | None
    ) -> Iterator[tuple[RetuneReason, str]]:
        """What changed on the GPU or in the stack since the winners were measured."""
        info = track.info
        if info is not None:
            limit = info.power_limit_w
            if _differs(limit, ref.power_limit_w, POWER_LIMIT_TOLERANCE_W):
                yield (
                    RetuneReason.POWER_LIMIT_CHANGED,
                    f"power limit {limit:g} W, winners measured at {ref.power_limit_w:g} W",
                )
            mhz = info.max_sm_clock_mhz
            max_hz = None if mhz is None else mhz * _MHZ
            if _differs(max_hz, ref.max_clock_hz, MAX_CLOCK_TOLERANCE_HZ):
                assert ref.max_clock_hz is not None
                yield (
                    RetuneReason.MAX_CLOCK_CHANGED,
                    f"max SM clock {mhz:.0f} MHz, winners measured at "
                    f"{ref.max_clock_hz / _MHZ:.0f} MHz",
                )
        if libraries is not None:
            driver = info.driver_version if info is not None else None
            current = Versions(driver=driver).merge(libraries)
            changed = changed_versions(ref.versions, current)
            if changed:
                was, now = ref.versions, current
                yield (
                    RetuneReason.VERSIONS_CHANGED,
                    ", ".join(f"{f} {getattr(was, f)} -> {getattr(now, f)}" for f in changed),
                )

    def _ageing(
        self, track: _Track, ref: Reference, now: float
    ) -> Iterator[tuple[RetuneReason, str]]:
        """What time did to the winners: their age, and the clock drifting away from them."""
        cfg = self._cfg
        age = now - ref.measured_at
        if cfg.max_winner_age_s > 0 and age > cfg.max_winner_age_s:
            yield RetuneReason.WINNERS_STALE, f"winners are {age / 86400:.1f} days old"
        ratio = track.ratio
        if ratio is None or abs(ratio) <= cfg.threshold:
            return
        if track.held_s >= cfg.dwell_s and age >= cfg.cooldown_s:
            assert ref.sustained_clock_hz is not None and track.learned_hz is not None
            yield (
                RetuneReason.CLOCK_DRIFT,
                f"sustained SM clock {track.learned_hz / _MHZ:.0f} MHz is {ratio:+.1%} from "
                f"the {ref.sustained_clock_hz / _MHZ:.0f} MHz the winners were measured at, "
                f"for {track.held_s:.0f} s",
            )

    @staticmethod
    def _keep_new(
        gpu: int, track: _Track, found: Iterable[tuple[RetuneReason, str]]
    ) -> list[RetuneReason]:
        new = []
        for reason, detail in found:
            if reason not in track.raised:
                if reason is not RetuneReason.NO_WINNERS:  # logged once for all by evaluate
                    log.warning("GPU %d: re-tune needed (%s): %s", gpu, reason.value, detail)
                new.append(reason)
        return new

    def _update_drift(self, track: _Track, now: float) -> None:
        """Learned clock, signed ratio and the dwell count; unknown drift pauses the count."""
        cfg = self._cfg
        mhz = track.window.estimate_mhz(cfg.min_samples, cfg.min_load_s)
        track.learned_hz = None if mhz is None else mhz * _MHZ
        ref = track.reference
        ref_hz = ref.sustained_clock_hz if ref is not None else None
        if track.learned_hz is None or ref_hz is None:
            track.ratio = None
            track.beyond_at = None  # the unknown stretch does not count towards dwell_s
            return
        track.ratio = (track.learned_hz - ref_hz) / ref_hz
        if abs(track.ratio) <= cfg.threshold:
            track.held_s, track.beyond_at = 0.0, None
            return
        if track.beyond_at is not None:
            track.held_s += max(0.0, now - track.beyond_at)
        track.beyond_at = now

    # -- outputs -----------------------------------------------------------------------

    def _publish(self) -> None:
        """Replace the read-only view (called with the lock held)."""
        self._view = {
            gpu: GpuDriftView(
                uuid=t.info.uuid
                if t.info is not None
                else (t.reference.uuid if t.reference else ""),
                ratio=t.ratio,
                learned_clock_hz=t.learned_hz,
                reference_clock_hz=t.reference.sustained_clock_hz if t.reference else None,
                pending=frozenset(t.raised),
            )
            for gpu, t in self._tracks.items()
        }

    def view(self) -> dict[int, GpuDriftView]:
        """Every tracked GPU as of the last evaluate or reference change; never blocks."""
        return self._view

    def drift_ratio(self, gpu: int) -> float | None:
        """Signed ``(learned - reference) / reference`` at the last evaluate; None if unknown."""
        v = self._view.get(gpu)
        return None if v is None else v.ratio

    def pending(self, gpu: int) -> set[RetuneReason]:
        """Reasons raised for ``gpu`` and not yet cleared by a new reference."""
        v = self._view.get(gpu)
        return set() if v is None else set(v.pending)
