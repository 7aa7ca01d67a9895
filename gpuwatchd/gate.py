"""The stability gate: is a GPU idle, cool and steady enough to tune on?

Pure logic: a window of recent samples in, a :class:`GateDecision` out. No I/O, no
clocks, no threads, so it is tested on recorded traces sample by sample, and
:class:`gpuwatchd.monitor.watch.GpuWatch` (which keeps the window and the previous
decision between calls) can call it for every sample of every GPU. Over a plain
sequence the window's spans cost O(window) in C-level passes (map + sort); over a
:class:`SampleWindow` (what ``GpuWatch`` keeps) each field is kept in order as samples
enter and leave, so a judgement reads its spans in O(1) and costs a few checks on the
latest sample (``bench/gate_cost.py``). Both give the same decision, byte for byte.

States, highest priority first (only ``cool_stable`` opens the gate):

``unavailable``  GPU lost, no samples, the latest sample stale, or no temperature /
                 SM clock reading.
``busy``         a compute process that is not ours, or utilization over
                 ``util_max`` while none of our own processes is on the GPU (our tuning
                 worker's load must not close the gate as "busy" by itself).
``throttled``    a throttle reason other than GPU_IDLE in the latest sample, or an SM
                 clock well under max while the GPU draws real power.
``warming``      temperature within the margin of slowdown, temperature / clock / power
                 not steady over the window, clock under max while not idle, power over
                 the idle ratio, too few samples, or less than ``settle_s`` since the last
                 disturbance.

A *disturbance* is anything above except the last two (too few samples, settling): it
restarts the settle timer. An ``unavailable`` spell lasts, as a disturbance, until the
next reading: the time without readings (a lost GPU, a stalled or failed read) is
never counted as quiet. Hysteresis: while the gate is shut every limit is tightened
(temperature by ``hyst_temp_c``, ratio limits by the fraction ``hyst_ratio``), so a
reading hovering at a limit keeps the gate shut instead of flapping. Only crossing the
nominal limit counts as a disturbance, so the band delays opening without resetting
the settle timer.
"""

from __future__ import annotations

import bisect
import enum
import functools
import itertools
import math
import operator
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import NoReturn

from gpuwatchd.telemetry.types import LIMITING_REASONS, DeviceInfo, Sample, ThrottleReason
from gpuwatchd.validate import check_durations, key_path

_IDLE_BIT = int(ThrottleReason.GPU_IDLE)
_LIMITING_BITS = int(LIMITING_REASONS)
_T = operator.attrgetter("t")
_TEMP = operator.attrgetter("temp_c")
_CLOCK = operator.attrgetter("sm_clock_mhz")
_POWER = operator.attrgetter("power_w")


#: Why a GPU in MIG mode is never opened: tuning measures a whole GPU, not a slice.
MIG_REASON = "MIG mode is on: tuning a slice is not supported"


class GateState(enum.StrEnum):
    """Per-GPU gate state. Only ``COOL_STABLE`` means the gate is open."""

    COOL_STABLE = "cool_stable"
    WARMING = "warming"
    THROTTLED = "throttled"
    BUSY = "busy"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class GateDecision:
    """The gate's verdict for one GPU at time ``t`` (backend clock).

    ``since`` is when the current state began; ``disturbed_at`` the last time anything
    kept the gate shut (used for the settle time); ``reasons`` are short human-readable
    strings, e.g. ``"SM clock 885 MHz = 45% of max 1980 MHz; needs ≥ 95% (clock_ratio_min)"``.
    """

    state: GateState
    reasons: tuple[str, ...]
    t: float
    since: float
    disturbed_at: float | None = None

    @property
    def open(self) -> bool:
        return self.state is GateState.COOL_STABLE


@dataclass(frozen=True, slots=True)
class GateConfig:
    """Gate thresholds. Times in seconds (backend clock), temperatures in °C, ratios 0-1.

    Defaults fit the measured H200 (idle 40 °C / 125 W of 700 W at 1980 MHz; under
    load 61 °C, power-capped, 1410-1515 MHz) and leave room for smaller GPUs.
    """

    #: History examined: samples with ``t >= latest.t - window_s``.
    window_s: float = 5.0
    #: Fewer samples than this in the window: not enough evidence, stay shut.
    min_samples: int = 5
    #: With ``now`` given, a latest sample older than this means unavailable.
    stale_after_s: float = 2.0
    #: Quiet time required after the last disturbance before the gate opens.
    settle_s: float = 10.0
    #: Temperature must stay this far below the GPU's slowdown temperature.
    temp_margin_c: float = 15.0
    #: Temperature limit when the slowdown temperature is unknown.
    max_temp_c: float = 75.0
    #: Largest temperature spread (max - min) over the window; NVML reports whole °C.
    temp_jitter_max_c: float = 3.0
    #: SM clock must be at least this fraction of max, unless the GPU reports GPU_IDLE
    #: (many GPUs park their clock when idle; an H200 sits at 885 MHz right after start).
    clock_ratio_min: float = 0.95
    #: Under load (power over ``power_ratio_max``), a clock below this fraction of max
    #: is throttling even when no reason bit says so (nvbench uses 0.75).
    clock_ratio_throttled: float = 0.75
    #: Largest SM clock spread, (max - min) / max, over the window's non-idle samples.
    clock_jitter_max: float = 0.02
    #: Utilization ratio above which another user is assumed (when none of ours runs).
    util_max: float = 0.05
    #: Power / power limit above which the GPU is not idle.
    power_ratio_max: float = 0.4
    #: Largest power spread over the window, as a fraction of the power limit (of the
    #: window's peak power when the limit is unknown).
    power_jitter_max: float = 0.05
    #: While shut, the temperature limit is lowered by this much to reopen.
    hyst_temp_c: float = 3.0
    #: While shut, every ratio limit's allowance is shrunk by this fraction to reopen.
    hyst_ratio: float = 0.2

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            want_int = f.name in _INT_FIELDS
            if isinstance(value, bool) or not isinstance(value, int if want_int else int | float):
                kind = "a whole number" if want_int else "a number"
                raise ValueError(f"gate.{f.name}: expected {kind}, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"gate.{f.name}: expected a finite number, got {value!r}")
            lo, lo_open, hi, hi_open = _RANGES[f.name]
            if (lo is not None and (value <= lo if lo_open else value < lo)) or (
                hi is not None and (value >= hi if hi_open else value > hi)
            ):
                raise ValueError(f"gate.{f.name}: must be {_range_text(f.name)}, got {value!r}")
        check_durations(self, "gate")
        if self.clock_ratio_throttled > self.clock_ratio_min:
            raise ValueError(
                f"gate.clock_ratio_throttled: must be <= clock_ratio_min "
                f"({self.clock_ratio_min}), got {self.clock_ratio_throttled}"
            )

    @classmethod
    def from_mapping(cls, d: Mapping[str, object]) -> GateConfig:
        """Build from a ``[gate]`` TOML table; ``ValueError`` names the bad key."""
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, float | int] = {}
        for key, value in d.items():
            if key not in known:
                known_keys = ", ".join(sorted(known))
                raise ValueError(f"{key_path('gate', key)}: unknown key (known: {known_keys})")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"gate.{key}: expected a number, got {value!r}")
            if key in _INT_FIELDS:
                if not isinstance(value, int):
                    raise ValueError(f"gate.{key}: expected a whole number, got {value!r}")
                kwargs[key] = value
            else:
                kwargs[key] = float(value)
        return cls(**kwargs)  # type: ignore[arg-type]


_INT_FIELDS = frozenset({"min_samples"})
# name -> (low, low is exclusive, high, high is exclusive). Temperatures stay within what a
# GPU can reach; durations are bounded by check_durations (at most a year).
_RANGES: dict[str, tuple[float | None, bool, float | None, bool]] = {
    "window_s": (0, True, None, False),
    "min_samples": (1, False, 10_000, False),
    "stale_after_s": (0, True, None, False),
    "settle_s": (0, False, None, False),
    "temp_margin_c": (0, False, 100, False),
    "max_temp_c": (0, True, 150, False),
    "temp_jitter_max_c": (0, False, 100, False),
    "clock_ratio_min": (0, True, 1, False),
    "clock_ratio_throttled": (0, True, 1, False),
    "clock_jitter_max": (0, False, 1, False),
    "util_max": (0, False, 1, False),
    "power_ratio_max": (0, True, 1, False),
    "power_jitter_max": (0, False, 1, False),
    "hyst_temp_c": (0, False, 50, False),
    "hyst_ratio": (0, False, 1, True),
}


def _range_text(name: str) -> str:
    lo, lo_open, hi, hi_open = _RANGES[name]
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi}")
    return " and ".join(parts)


@functools.cache
def _needs(op: str, limit: str, key: str, configured: str, shut: bool, cfg: GateConfig) -> str:
    """What a reading must reach, and the config key it comes from:
    ``; needs ≤ 4.0% to reopen (util_max 5.0%)`` while the gate is shut (the configured
    limit tightened by ``hyst_ratio``), ``; needs ≤ 5.0% (util_max)`` while it is open.
    """
    if shut and cfg.hyst_ratio:
        return f"; needs {op} {limit} to reopen ({key} {configured})"
    return f"; needs {op} {limit} ({key})"


def _limiting_names(mask: int) -> str:
    """``sw_power_cap+hw_slowdown`` for a raw mask; cached (decoding an IntFlag is slow)."""
    return "+".join(ThrottleReason.decode(mask & _LIMITING_BITS).names())


def _decide(
    state: GateState,
    reasons: tuple[str, ...],
    t: float,
    prev: GateDecision | None,
    disturbed_at: float | None,
) -> GateDecision:
    since = prev.since if prev is not None and prev.state is state else t
    return GateDecision(state, reasons, t, since, disturbed_at)


def _recent(window: Sequence[Sample], cutoff: float) -> Sequence[Sample]:
    """The samples with ``t >= cutoff``; usually the whole window, so check that first."""
    if window[0].t >= cutoff:
        return window
    start = bisect.bisect_left(window, cutoff, key=_T)
    return list(itertools.islice(window, start, None))


def _span(
    window: Sequence[Sample], field: operator.attrgetter[float | None]
) -> tuple[float, float] | None:
    """(min, max) of a field over the window, skipping None; None when all are None."""
    try:
        # One C-level sort beats min() + max(): telemetry is nearly constant, and
        # timsort is linear on such runs.
        ordered: list[float] = sorted(map(field, window))  # type: ignore[arg-type]
    except TypeError:  # a None among the floats: the rare slow path
        ordered = sorted(v for v in map(field, window) if v is not None)
    return (ordered[0], ordered[-1]) if ordered else None


def _working(sample: Sample) -> bool:
    """Not parked by GPU_IDLE (an unread reason counts as working): its clock spread counts."""
    return sample.reasons is None or not sample.reasons._value_ & _IDLE_BIT


_push = deque.append
_pop_oldest = deque.popleft
_insort = bisect.insort
_find = bisect.bisect_left


def _move(ordered: list[float], leaving: float | None, entering: float | None) -> None:
    """Replace one value of a sorted list by another (None: nothing leaves, or enters)."""
    if leaving is not None:
        del ordered[_find(ordered, leaving)]
    if entering is not None:
        _insort(ordered, entering)


class SampleWindow(deque[Sample]):
    """A gate window, oldest first, that keeps the fields the gate spans in sorted order.

    The gate needs the min and max of temperature, SM clock (of every sample, and of
    those not parked by GPU_IDLE) and power over the window at every poll: sorting the
    columns anew was ~30% of a poll's Python. Here a sample's values are inserted in
    order when it enters and removed when it leaves, and a span is two index reads. A
    poll's step (:meth:`advance`: one sample in, one out) touches only the fields whose
    value changed; telemetry is nearly constant, so that is usually one. Equal values
    are interchangeable in an order, so each span equals what sorting the window gives.
    A NaN has no place in an order: while one is in the window, :attr:`ordered` is
    False and :func:`evaluate` sorts the window as it does for any other sequence.

    A deque, so indexing and ``len`` cost what they cost on any window; every other
    way to change it than :meth:`append`, :meth:`popleft` and :meth:`advance` raises
    ``TypeError`` (it would leave the orders behind).
    """

    __slots__ = ("_clocks", "_nans", "_powers", "_temps", "_working")

    def __init__(self, samples: Iterable[Sample] = ()) -> None:
        super().__init__()
        self._temps: list[float] = []
        self._clocks: list[float] = []
        self._working: list[float] = []  # SM clocks of samples not parked by GPU_IDLE
        self._powers: list[float] = []
        self._nans = 0  # samples in the window holding a NaN in a spanned field
        for sample in samples:
            self.append(sample)

    def append(self, sample: Sample) -> None:
        """Add the newest sample (the caller keeps the window in time order)."""
        _push(self, sample)
        self._enter(sample)

    def popleft(self) -> Sample:
        """Remove and return the oldest sample; IndexError when empty."""
        sample: Sample = _pop_oldest(self)
        self._leave(sample)
        return sample

    def advance(self, sample: Sample, horizon: float) -> None:
        """Add the newest sample and drop those older than ``horizon`` (a poll's step)."""
        _push(self, sample)
        if self[0].t >= horizon:
            self._enter(sample)
            return
        old: Sample = _pop_oldest(self)
        if self[0].t < horizon:  # more than one leaves: a gap in the readings
            self._enter(sample)
            self._leave(old)
            while self[0].t < horizon:
                self._leave(_pop_oldest(self))
            return
        # One in, one out: only a field whose value changed moves in its order.
        t0, c0, p0 = old.temp_c, old.sm_clock_mhz, old.power_w
        t1, c1, p1 = sample.temp_c, sample.sm_clock_mhz, sample.power_w
        if t0 != t0 or c0 != c0 or p0 != p0 or t1 != t1 or c1 != c1 or p1 != p1:  # a NaN
            self._enter(sample)
            self._leave(old)
            return
        if t0 != t1:  # None != a number: one side only
            _move(self._temps, t0, t1)
        if c0 != c1:
            _move(self._clocks, c0, c1)
        r0, r1 = old.reasons, sample.reasons
        w0 = c0 is not None and (r0 is None or not r0._value_ & _IDLE_BIT)
        w1 = c1 is not None and (r1 is None or not r1._value_ & _IDLE_BIT)
        if w0 != w1 or (w0 and c0 != c1):
            _move(self._working, c0 if w0 else None, c1 if w1 else None)
        if p0 != p1:
            _move(self._powers, p0, p1)

    def _enter(self, sample: Sample) -> None:
        temp, clock, power = sample.temp_c, sample.sm_clock_mhz, sample.power_w
        if temp != temp or clock != clock or power != power:  # only NaN differs from itself
            self._nans += 1
            return
        if temp is not None:
            _insort(self._temps, temp)
        if clock is not None:
            _insort(self._clocks, clock)
            reasons = sample.reasons
            if reasons is None or not reasons._value_ & _IDLE_BIT:
                _insort(self._working, clock)
        if power is not None:
            _insort(self._powers, power)

    def _leave(self, sample: Sample) -> None:
        temp, clock, power = sample.temp_c, sample.sm_clock_mhz, sample.power_w
        if temp != temp or clock != clock or power != power:
            self._nans -= 1
            return
        if temp is not None:
            _move(self._temps, temp, None)
        if clock is not None:
            _move(self._clocks, clock, None)
            reasons = sample.reasons
            if reasons is None or not reasons._value_ & _IDLE_BIT:
                _move(self._working, clock, None)
        if power is not None:
            _move(self._powers, power, None)

    @property
    def ordered(self) -> bool:
        """Whether the spans below hold (no NaN in the window)."""
        return not self._nans

    def temp_span(self) -> tuple[float, float] | None:
        return (self._temps[0], self._temps[-1]) if self._temps else None

    def clock_span(self, working_only: bool = False) -> tuple[float, float] | None:
        """SM clock (min, max); ``working_only``: of samples not parked by GPU_IDLE."""
        values = self._working if working_only else self._clocks
        return (values[0], values[-1]) if values else None

    def power_span(self) -> tuple[float, float] | None:
        return (self._powers[0], self._powers[-1]) if self._powers else None

    def _refuse(self, *_args: object, **_kw: object) -> NoReturn:
        raise TypeError("SampleWindow: only append(), popleft() and advance() keep its orders")

    appendleft = extend = extendleft = insert = pop = remove = rotate = clear = _refuse  # type: ignore[assignment]
    reverse = __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse  # type: ignore[assignment]
    __add__ = __mul__ = __rmul__ = _refuse  # type: ignore[assignment]

    def __copy__(self) -> SampleWindow:
        return SampleWindow(self)

    copy = __copy__  # type: ignore[assignment]


def evaluate(
    window: Sequence[Sample],
    info: DeviceInfo | None,
    cfg: GateConfig,
    prev: GateDecision | None,
    own_pids: frozenset[int] = frozenset(),
    lost: bool = False,
    *,
    now: float | None = None,
) -> GateDecision:
    """Judge one GPU from its recent samples (oldest first; the last is the latest).

    ``prev`` is this GPU's previous decision (None at start: the gate then waits
    ``settle_s`` from the first sample it sees). ``own_pids`` are the daemon's own
    processes (the tuning worker). ``now`` (backend clock), when given, enables the
    staleness check and stamps the decision; otherwise the latest sample's ``t`` does.
    Reasons are given for the winning state only.
    """
    # -- unavailable -------------------------------------------------------------
    if lost or not window:
        t = now if now is not None else (prev.t if prev is not None else 0.0)
        why = "GPU lost" if lost else "no samples"
        return _decide(GateState.UNAVAILABLE, (why,), t, prev, t)
    latest = window[-1]
    t = now if now is not None else latest.t
    if now is not None and now - latest.t > cfg.stale_after_s:
        why = f"last sample {now - latest.t:.1f}s old (> {cfg.stale_after_s:g}s)"
        return _decide(GateState.UNAVAILABLE, (why,), t, prev, t)
    if info is not None and info.mig_mode:  # read with the static facts, before any poll
        return _decide(GateState.UNAVAILABLE, (MIG_REASON,), t, prev, t)
    temp, clock, power = latest.temp_c, latest.sm_clock_mhz, latest.power_w
    if temp is None or clock is None:
        why = "no temperature reading" if temp is None else "no SM clock reading"
        return _decide(GateState.UNAVAILABLE, (why,), t, prev, t)

    # Limits: nominal, or tightened by hysteresis while the gate is shut.
    shut = prev is None or prev.state is not GateState.COOL_STABLE
    keep = 1.0 - cfg.hyst_ratio if shut else 1.0  # share of each ratio allowance kept
    disturbed = False
    max_clock = info.max_sm_clock_mhz if info is not None else None
    limit_w = info.power_limit_w if info is not None else None
    if prev is not None and prev.state is GateState.UNAVAILABLE:
        # No reading vouched for the GPU until this one (lost, a stalled or failed read,
        # a stale sample): the outage is a disturbance that lasted until now, not quiet.
        disturbed_at: float = t
    elif prev is not None and prev.disturbed_at is not None:
        disturbed_at = prev.disturbed_at
    else:
        disturbed_at = window[0].t  # nothing is known before the first sample seen

    # -- busy: the latest sample only --------------------------------------------
    busy: list[str] = []
    procs = latest.procs
    if procs:
        foreign = [p for p in procs if p not in own_pids]
        if foreign:
            shown = ", ".join(map(str, foreign[:3])) + (", ..." if len(foreign) > 3 else "")
            busy.append(f"{len(foreign)} foreign compute process(es) (pid {shown})")
            disturbed = True
    util = latest.util_gpu
    if util is not None and util > cfg.util_max * keep:
        own_active = bool(own_pids) and (procs is None or any(p in own_pids for p in procs))
        if not own_active:
            limit, configured = f"{cfg.util_max * keep:.1%}", f"{cfg.util_max:.1%}"
            needs = _needs("≤", limit, "util_max", configured, shut, cfg)
            busy.append(f"util {util:.1%}{needs}")
            disturbed = disturbed or util > cfg.util_max
    if disturbed:  # busy (and a disturbance): nothing below can change the verdict
        return _decide(GateState.BUSY, tuple(busy), t, prev, t)

    # -- throttled: the latest sample only ---------------------------------------
    throttled: list[str] = []
    mask = -1 if latest.reasons is None else latest.reasons._value_
    idle = mask > 0 and bool(mask & _IDLE_BIT)
    if mask > 0 and mask & _LIMITING_BITS:
        watts = f", {power:.0f} W" if power is not None else ""
        throttled.append(f"throttle {_limiting_names(mask)} (SM clock {clock:.0f} MHz{watts})")
    loaded = power is not None and limit_w and power > cfg.power_ratio_max * limit_w
    if max_clock and loaded and clock < cfg.clock_ratio_throttled * max_clock:
        throttled.append(
            f"SM clock {clock:.0f} MHz < {cfg.clock_ratio_throttled:.0%} of max "
            f"{max_clock:.0f} MHz under load ({power:.0f} W)"
        )
    if throttled:  # always a disturbance, so nothing below can change the verdict
        state = GateState.BUSY if busy else GateState.THROTTLED
        return _decide(state, tuple(busy or throttled), t, prev, t)

    # -- warming: the latest sample and the window -------------------------------
    warming: list[str] = []
    slowdown = info.slowdown_temp_c if info is not None else None
    temp_limit = slowdown - cfg.temp_margin_c if slowdown is not None else cfg.max_temp_c
    lim = temp_limit - cfg.hyst_temp_c if shut else temp_limit
    if temp > lim:
        basis = (
            f"temp_margin_c {cfg.temp_margin_c:g} C below slowdown {slowdown:g} C"
            if slowdown is not None
            else f"max_temp_c {cfg.max_temp_c:g} C"
        )
        if shut and cfg.hyst_temp_c:
            warming.append(f"temp {temp:.0f} C; needs ≤ {lim:g} C to reopen ({basis})")
        else:
            warming.append(f"temp {temp:.0f} C; needs ≤ {lim:g} C ({basis})")
        disturbed = disturbed or temp > temp_limit

    if max_clock and not idle:
        ratio = clock / max_clock
        lim = 1.0 - (1.0 - cfg.clock_ratio_min) * keep
        if ratio < lim:
            needs = _needs(
                "≥", f"{lim:.0%}", "clock_ratio_min", f"{cfg.clock_ratio_min:.0%}", shut, cfg
            )
            warming.append(
                f"SM clock {clock:.0f} MHz = {ratio:.0%} of max {max_clock:.0f} MHz{needs}"
            )
            disturbed = disturbed or ratio < cfg.clock_ratio_min

    if power is not None and limit_w:
        ratio = power / limit_w
        lim = cfg.power_ratio_max * keep
        if ratio > lim:
            needs = _needs(
                "≤", f"{lim:.0%}", "power_ratio_max", f"{cfg.power_ratio_max:.0%}", shut, cfg
            )
            warming.append(f"power {power:.0f} W = {ratio:.0%} of limit {limit_w:.0f} W{needs}")
            disturbed = disturbed or ratio > cfg.power_ratio_max

    cutoff = latest.t - cfg.window_s
    # A SampleWindow trimmed to window_s keeps its spans in order; else sort the window.
    # (Its lists are read in place: a method call per span costs more than the read.)
    kept = window if isinstance(window, SampleWindow) and not window._nans else None
    if kept is not None and window[0].t >= cutoff:
        recent: Sequence[Sample] = window
        values = kept._temps
        span = (values[0], values[-1]) if values else None
    else:
        kept = None
        recent = _recent(window, cutoff)
        span = _span(recent, _TEMP)
    if span is not None:
        lo, hi = span
        lim = cfg.temp_jitter_max_c * keep
        if hi - lo > lim:
            needs = _needs(
                "≤", f"{lim:.3g} C", "temp_jitter_max_c", f"{cfg.temp_jitter_max_c:g} C", shut, cfg
            )
            warming.append(f"temp spread {lo:.0f}-{hi:.0f} C{needs}")
            disturbed = disturbed or hi - lo > cfg.temp_jitter_max_c

    if kept is not None:
        values = kept._clocks
        span = (values[0], values[-1]) if values else None
    else:
        span = _span(recent, _CLOCK)
    lim = cfg.clock_jitter_max * keep
    if span is not None and span[1] and (span[1] - span[0]) / span[1] > lim:
        # Parked clocks of GPU_IDLE samples are not instability: look again without them.
        if kept is not None:
            span = kept.clock_span(working_only=True)
        else:
            span = _span([s for s in recent if _working(s)], _CLOCK)
        if span is not None and span[1] and (span[1] - span[0]) / span[1] > lim:
            lo, hi = span
            jitter = (hi - lo) / hi
            needs = _needs(
                "≤", f"{lim:.1%}", "clock_jitter_max", f"{cfg.clock_jitter_max:.1%}", shut, cfg
            )
            warming.append(f"SM clock spread {lo:.0f}-{hi:.0f} MHz = {jitter:.1%}{needs}")
            disturbed = disturbed or jitter > cfg.clock_jitter_max

    if kept is not None:
        values = kept._powers
        span = (values[0], values[-1]) if values else None
    else:
        span = _span(recent, _POWER)
    if span is not None and span[1]:
        lo, hi = span
        scale = limit_w or hi
        lim = cfg.power_jitter_max * keep
        if (hi - lo) / scale > lim:
            needs = _needs(
                "≤", f"{lim * scale:.0f} W", "power_jitter_max", f"{cfg.power_jitter_max:.0%}",
                shut, cfg,
            )  # fmt: skip
            warming.append(f"power spread {lo:.0f}-{hi:.0f} W{needs}")
            disturbed = disturbed or (hi - lo) / scale > cfg.power_jitter_max

    # -- verdict -----------------------------------------------------------------
    if disturbed:
        disturbed_at = t
    if busy:  # utilization inside the hysteresis band: shut, but not a disturbance
        return _decide(GateState.BUSY, tuple(busy), t, prev, disturbed_at)
    if warming:
        return _decide(GateState.WARMING, tuple(warming), t, prev, disturbed_at)
    if len(recent) < cfg.min_samples:
        why = f"{len(recent)} sample(s) in {cfg.window_s:g}s window (need {cfg.min_samples})"
        return _decide(GateState.WARMING, (why,), t, prev, disturbed_at)
    quiet = t - disturbed_at
    if quiet < cfg.settle_s:
        why = f"settling: {quiet:.1f}s since last disturbance (need {cfg.settle_s:g}s)"
        return _decide(GateState.WARMING, (why,), t, prev, disturbed_at)
    watts = f", {power:.0f} W" if power is not None else ""
    why = f"temp {temp:.0f} C, SM clock {clock:.0f} MHz{watts}, quiet {quiet:.1f} s"
    return _decide(GateState.COOL_STABLE, (why,), t, prev, disturbed_at)
