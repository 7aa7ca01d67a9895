"""Tuning's settings: the ``[tuning]`` table and its ``[tuning.protocol]`` sub-table.

Shared vocabulary: the config loader builds them, the daemon's scheduler and planner
read :class:`TuningSetup`, the session spec carries :class:`ProtocolConfig` and the worker's
protocol applies it. Kept apart from the protocol so the daemon side never imports
the worker package, and apart from the config package so tuning never imports it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from gpuwatchd.telemetry.sim.settings import SimConfig
from gpuwatchd.tuning.submitted.trust import parse_allowed_modules
from gpuwatchd.tuning.types import Regime, Workload
from gpuwatchd.tuning.windows import parse_windows
from gpuwatchd.tuning.worker_isolation import resolve_worker_user
from gpuwatchd.tuning.workloads import DEFAULT_WORKLOADS, find_workload
from gpuwatchd.validate import check, fail, need_bool, need_int, need_number, require

FLUSH_MODES = ("auto", "always", "never")


@dataclass(frozen=True, slots=True)
class ProtocolConfig:
    """Knobs of the protocol. Times are seconds on the session's clock.

    Defaults follow nvbench where it has an opinion (recovery pause, clock threshold),
    but the clock threshold is 0.9 rather than 0.75: an H200 at its power cap runs at
    ~0.73 of max, which a 0.75 threshold would wave through as "unthrottled". Short
    batches at a 29% duty cycle keep a heavy kernel inside the ~0.2 s the H200's power
    limiter takes to engage (docs/design.md), so it is timed at full clock.
    """

    #: One timed batch lasts about this long: short, so that a power-hungry kernel finishes
    #: a batch before the power limiter reacts (about 0.2 s on an H200).
    batch_target_s: float = 0.01
    warmup_s: float = 0.2  # back-to-back warm-up per candidate (ramps clocks, calibrates)
    #: A warm-up ends after this long once its calibration has converged (the last two
    #: batch-size estimates within 5%); ``warmup_s`` is then only the longest it may last.
    warmup_min_s: float = 0.05
    min_calls: int = 1
    max_calls: int = 100_000
    #: Unthrottled: idle between batches so the power limiter never engages. The limiter
    #: acts on filtered power (its time constant is in bench/RESULTS.md, "Tuning GEMMs in
    #: two regimes"), so short batches at this duty cycle keep even the heaviest GEMM's
    #: filtered power under the limit; a batch rejected for power or clock doubles the pause
    #: for the rest of the regime, up to ``max_pause_s`` (or ``pause_s`` if longer), in
    #: case a limiter reacts faster.
    pause_s: float = 0.025
    max_pause_s: float = 0.2
    #: Unthrottled: no pauses (and no cool-down pause) once the power probe showed the
    #: candidates cannot be limited at all (the evidence that skips the sustained regime):
    #: a pause then protects nothing.
    unpaused_when_unlimited: bool = True
    #: Unthrottled: recovery pause after a rejected batch. On an H200 the clock is back
    #: the moment the load stops (docs/design.md), so a quarter second is plenty.
    cool_pause_s: float = 0.25
    max_retries: int = 5  # unthrottled: retries of one rejected batch before skipping it
    clock_ratio_min: float = 0.9  # unthrottled: reject a batch under this fraction of max
    #: Rounds every candidate gets; with ``race`` on, those still in the race then go on
    #: to ``contender_rounds``, the others stop once clearly out (see below).
    min_rounds: int = 3
    max_rounds: int = 200
    spread_target: float = 0.02  # stop once every candidate's IQR/median is under this
    time_budget_s: float = 120.0  # per regime, warm-up and settling included
    #: Sustained: rolling window judged for settling, and the least time settling takes.
    settle_window_s: float = 0.5
    settle_clock_rel: float = 0.01  # sustained: max relative change of mean SM clock
    settle_power_rel: float = 0.02  # sustained: max relative change of mean power
    settle_timeout_s: float = 30.0  # sustained: time anyway after this long
    #: Sustained: settled when the least-squares trend of SM clock and power over the last
    #: window, carried this far ahead (about as long as the timed rounds last), moves them
    #: less than ``settle_clock_rel`` / ``settle_power_rel``; power only counts while not
    #: pinned at the cap (a capped board reads its limit whatever happens). 0: the older
    #: rule, the two half-window means agree (needs a longer window for the same safety).
    settle_horizon_s: float = 1.0
    #: Sustained, in a queue (tune_queue): the settle window of a regime that starts on a
    #: device the previous workload's sustained regime just left at temperature.
    warm_settle_window_s: float = 0.5
    flush_l2: str = "auto"  # auto: when the working set fits in l2_bytes; always; never
    l2_bytes: int = 50 * 2**20  # H100/H200 L2 size
    noise_k: float = 1.0  # multiplier on the combined relative CI half-width
    min_margin: float = 0.005  # a margin under this is a tie even when it is real
    confidence: float = 0.95  # of each median's CI
    seed: int = 0  # of the per-round interleaving order
    #: Racing (unthrottled regime): after ``min_rounds``, a candidate whose median's CI lies
    #: wholly above the leader's, and more than ``min_margin`` behind it, is out of the race
    #: and no longer timed; the rest go on to ``contender_rounds`` rounds and a stable spread.
    race: bool = True
    contender_rounds: int = 5
    #: Race in the sustained regime too. Safe because a sustained batch timed during a
    #: transient hardware slowdown (HW slowdown or power brake, see ``transient_max_s``)
    #: is rejected there, so a throttle episode cannot make a dropped candidate look fast.
    race_sustained: bool = True
    #: Sustained: a batch during a transient hardware slowdown is rejected and retried
    #: back-to-back (the heat is kept) until that state has lasted this long; after that
    #: it is the steady state and its batches count. 0: keep every sustained batch.
    transient_max_s: float = 2.0
    #: Stop a regime once more rounds cannot change the verdict: against every contender
    #: the pick is decided (margin over :func:`stats.decide`'s noise) or that noise is at
    #: its ``min_margin`` floor (a tie within it); a runner-up that launches the same
    #: kernels as the pick counts as the pick. Otherwise rounds go on until the spread
    #: target is met.
    stop_when_decided: bool = True
    #: A regime after the first reuses the first one's batch sizes instead of warming
    #: every candidate up again (settling warms them in the sustained regime).
    reuse_calibration: bool = True
    #: Skip the sustained regime after the unthrottled one (its result then repeats the
    #: unthrottled one, marked) when that regime showed the kernels cannot be power- or
    #: thermally limited: after ``power_probe_s`` of back-to-back load (NVML averages power
    #: over 1 s) power stayed under ``skip_power_ratio`` of the limit, no power or thermal
    #: reason was ever seen and the SM clock never left its maximum.
    skip_sustained: bool = True
    skip_power_ratio: float = 0.85
    power_probe_s: float = 1.0
    #: End the power probe early once a sample after half of it shows a power or thermal
    #: reason or a clock well under max: the sustained regime is then measured anyway.
    probe_ends_on_limit: bool = True
    #: The worker tunes a job's workloads this many at a time through ``tune_queue``: every
    #: one's unthrottled regime, then their sustained regimes back to back on carried heat
    #: (``warm_settle_window_s``). 1: one workload at a time. Bounded because every
    #: candidate of a group is set up (inputs allocated, kernels compiled) before timing.
    queue_workloads: int = 4

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int":
                need_int(value, f"protocol.{f.name}")
            elif f.type == "float":
                need_number(value, f"protocol.{f.name}")
            elif f.type == "bool":
                need_bool(value, f"protocol.{f.name}")
        _check(self.batch_target_s > 0, "batch_target_s", "must be > 0", self.batch_target_s)
        for name in ("warmup_s", "warmup_min_s", "pause_s", "max_pause_s", "cool_pause_s",
                     "settle_timeout_s", "settle_horizon_s", "transient_max_s"):  # fmt: skip
            _check(getattr(self, name) >= 0, name, "must be >= 0", getattr(self, name))
        _check(self.min_calls >= 1, "min_calls", "must be >= 1", self.min_calls)
        _check(
            self.max_calls >= self.min_calls, "max_calls", "must be >= min_calls", self.max_calls
        )
        _check(self.max_retries >= 0, "max_retries", "must be >= 0", self.max_retries)
        _check(0 <= self.clock_ratio_min <= 1, "clock_ratio_min", "must be in [0, 1]",
               self.clock_ratio_min)  # fmt: skip
        _check(self.min_rounds >= 1, "min_rounds", "must be >= 1", self.min_rounds)
        _check(self.max_rounds >= self.min_rounds, "max_rounds", "must be >= min_rounds",
               self.max_rounds)  # fmt: skip
        for name in ("spread_target", "time_budget_s", "settle_window_s", "warm_settle_window_s"):
            _check(getattr(self, name) > 0, name, "must be > 0", getattr(self, name))
        for name in ("settle_clock_rel", "settle_power_rel", "noise_k", "min_margin"):
            _check(getattr(self, name) >= 0, name, "must be >= 0", getattr(self, name))
        _check(self.flush_l2 in FLUSH_MODES, "flush_l2", f"must be one of {FLUSH_MODES}",
               self.flush_l2)  # fmt: skip
        _check(self.l2_bytes >= 0, "l2_bytes", "must be >= 0", self.l2_bytes)
        _check(0 < self.confidence < 1, "confidence", "must be in (0, 1)", self.confidence)
        _check(self.contender_rounds >= 1, "contender_rounds", "must be >= 1",
               self.contender_rounds)  # fmt: skip
        _check(0 < self.skip_power_ratio <= 1, "skip_power_ratio", "must be in (0, 1]",
               self.skip_power_ratio)  # fmt: skip
        _check(self.power_probe_s >= 0, "power_probe_s", "must be >= 0", self.power_probe_s)
        _check(self.queue_workloads >= 1, "queue_workloads", "must be >= 1",
               self.queue_workloads)  # fmt: skip

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> ProtocolConfig:
        """Build from config-file data; unknown keys and bad values name the key."""
        if not isinstance(m, Mapping):
            raise fail("protocol", "expected a table", m)
        known = {f.name for f in fields(cls)}
        for key in m:
            if key not in known:
                raise ValueError(
                    f"protocol.{key}: unknown setting (known: {', '.join(sorted(known))})"
                )
        values = dict(m)
        for f in fields(cls):  # integral floats from YAML/TOML ("2") are fine for floats
            v = values.get(f.name)
            if f.type == "float" and isinstance(v, int) and not isinstance(v, bool):
                values[f.name] = float(v)
        return cls(**values)


def _check(ok: bool, name: str, what: str, value: object) -> None:
    require(ok, f"protocol.{name}", what, value)


_REGIMES = tuple(r.value for r in Regime)


def _valid_windows(windows: tuple[str, ...]) -> bool:
    parse_windows(windows)  # raises ValueError naming the bad window
    return True


def _executable(path: str) -> bool:
    """``""`` (the daemon's own interpreter) or an executable file; ValueError naming it."""
    if path and not (os.path.isfile(path) and os.access(path, os.X_OK)):
        why = "no such file" if not os.path.exists(path) else "not an executable file"
        raise ValueError(f"tuning.worker_python: {path}: {why}")
    return True


def _worker_user(name: str) -> bool:
    resolve_worker_user(name)  # raises ValueError naming the missing user
    return True


def _module_prefixes(prefixes: tuple[str, ...]) -> bool:
    parse_allowed_modules(list(prefixes))  # raises ValueError naming the bad entry
    return True


#: How old a preempted session's result may be and still be reused (6 h): older ones were
#: measured under conditions worth measuring again.
DEFAULT_RESUME_MAX_AGE_S = 6 * 3600.0


@dataclass(frozen=True, slots=True)
class TuningConfig:
    """When and how the daemon tunes (``[tuning]``; ``[tuning.protocol]`` holds the protocol)."""

    #: Tune automatically whenever a GPU's gate opens and work is pending.
    enabled: bool = True
    #: How often the scheduler looks for pending work and open gates.
    #: At least 0.1 s: a scheduler tick more often than 10 Hz would only spin.
    check_interval_s: float = field(
        default=5.0, metadata=check(lambda v: v >= 0.1, "must be >= 0.1")
    )
    #: A worker running longer than this is killed and the session marked failed.
    session_timeout_s: float = field(default=1800.0, metadata=check(lambda v: v > 0, "must be > 0"))
    regimes: tuple[str, ...] = field(
        default=_REGIMES,
        metadata=check(lambda v: v and set(v) <= set(_REGIMES), f"must be a subset of {_REGIMES}"),
    )
    #: Workloads the daemon tunes on its own (empty: every one whose device fits the backend).
    workloads: tuple[str, ...] = ()
    #: Local-time windows in which tuning may start, e.g. ["22:00-06:00"]; empty: any time.
    windows: tuple[str, ...] = field(default=(), metadata=check(_valid_windows, "bad window"))
    #: How many GPUs may be tuned at the same time.
    max_concurrent: int = field(default=1, metadata=check(lambda v: v >= 1, "must be >= 1"))
    #: After a failed session, wait this long before trying that GPU again.
    retry_failed_after_s: float = field(
        default=3600.0, metadata=check(lambda v: v > 0, "must be > 0")
    )
    #: The interpreter that runs the tuning worker ("": the daemon's own). Users' kernels
    #: are imported by it, so it is the jobs' Python environment (torch, Triton, their code).
    worker_python: str = field(default="", metadata=check(_executable, "bad interpreter"))
    #: The user a daemon running as root starts the worker as ("": the daemon's own).
    #: It needs the GPU device nodes (usually world-usable), the jobs' Python environment
    #: and a writable home (Triton's and Inductor's compile caches live there).
    worker_user: str = field(default="", metadata=check(_worker_user, "bad user"))
    #: Module prefixes whose kernels a job may ask the worker to import and tune
    #: (``["mylab.kernels"]`` allows ``mylab.kernels.attn``). Empty: nothing is imported.
    allowed_modules: tuple[str, ...] = field(
        default=(), metadata=check(_module_prefixes, "bad module prefix")
    )
    #: Where jobs leave tuning requests while no daemon runs, read at start
    #: ("": ``spool`` in the state directory).
    spool_dir: str = ""
    #: The most workloads jobs and operators may add (``add_workloads``) in all; an add
    #: beyond it is refused, naming this key.
    max_added_workloads: int = field(
        default=1024, metadata=check(lambda v: 1 <= v <= 100_000, "must be in [1, 100000]")
    )
    #: A session preempted by a real job keeps its finished (workload, regime) results;
    #: the next session on the same GPU reuses those at most this old (seconds; 0: never).
    resume_max_age_s: float = field(
        default=DEFAULT_RESUME_MAX_AGE_S, metadata=check(lambda v: v >= 0, "must be >= 0")
    )
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)

    @property
    def worker_executable(self) -> str:
        """The interpreter the tuning worker runs under."""
        return self.worker_python or sys.executable


@dataclass(frozen=True, slots=True)
class TuningSetup:
    """Everything daemon-side tuning reads from the configuration, and nothing more.

    The scheduler and the planner take this instead of the whole configuration: the
    ``[tuning]`` table, the workload catalogue (shipped plus ``[[workload]]``) and the
    ``[sim]`` GPU that a ``sim`` job's worker must simulate too.
    """

    tuning: TuningConfig = field(default_factory=TuningConfig)
    workloads: tuple[Workload, ...] = DEFAULT_WORKLOADS
    sim: SimConfig = field(default_factory=SimConfig)

    def workload(self, name: str) -> Workload:
        """The workload called ``name``; ValueError listing the known ones otherwise."""
        return find_workload(self.workloads, name)
