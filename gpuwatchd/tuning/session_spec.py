"""The wire format between the daemon and the tuning worker, validated strictly both ways.

The daemon writes one :class:`SessionSpec` as JSON to the worker's stdin; the worker answers
with JSON lines on stdout (:data:`Message`): one ``hello``, ``progress`` now and then, a
``result`` per (workload, regime), or an ``error`` before exiting non-zero.

Anything from the other process is outside input: :func:`decode_message` and
:meth:`SessionSpec.loads` reject wrong types, missing or unknown keys, non-finite numbers and
inconsistent results with a one-line :class:`SessionSpecError` naming the field. This
module never imports torch: the daemon uses it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from gpuwatchd.tuning.settings import ProtocolConfig
from gpuwatchd.tuning.submitted.trust import TrustError, parse_allowed_modules
from gpuwatchd.tuning.types import CandidateStats, Regime, RegimeResult, Versions, Workload
from gpuwatchd.validate import (
    field_error,
    need_bool,
    need_int,
    need_number,
    need_object,
    need_text,
    one_line,
)

#: Where the worker's candidates run: a CUDA GPU, the host CPU, or a simulated GPU.
DEVICES = ("cuda", "cpu", "sim")
#: The largest session spec the worker reads and the longest message line the daemon accepts.
MAX_SPEC_BYTES = 16 * 2**20
MAX_LINE_BYTES = 16 * 2**20


class SessionSpecError(ValueError):
    """A session spec or a worker message is malformed; the text is one line naming the field."""


# -- field checks ----------------------------------------------------------------------------


def _fail(where: str, what: str, value: Any) -> SessionSpecError:
    return SessionSpecError(field_error(where, what, value))


def _obj(
    value: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    return need_object(value, where, required, optional, error=SessionSpecError)


def _str(value: Any, where: str) -> str:
    return need_text(value, where, error=SessionSpecError)


def _int(value: Any, where: str, minimum: int = 0) -> int:
    return need_int(value, where, minimum=minimum, error=SessionSpecError)


def _num(value: Any, where: str, *, nonneg: bool = False) -> float:
    return need_number(value, where, minimum=0 if nonneg else None, error=SessionSpecError)


def _opt_num(value: Any, where: str, *, nonneg: bool = False) -> float | None:
    return None if value is None else _num(value, where, nonneg=nonneg)


def _bool(value: Any, where: str) -> bool:
    return need_bool(value, where, error=SessionSpecError)


def _list(value: Any, where: str, *, nonempty: bool = True) -> list[Any]:
    if not isinstance(value, list) or (nonempty and not value):
        raise _fail(where, "expected a non-empty list" if nonempty else "expected a list", value)
    return value


def _regime(value: Any, where: str) -> Regime:
    try:
        return Regime(value)
    except (ValueError, TypeError):
        known = ", ".join(r.value for r in Regime)
        raise _fail(where, f"expected one of {known}", value) from None


def _json_safe(value: Any) -> Any:
    """``value`` as strict JSON data: non-finite floats become null, tuples lists, and
    anything else unknown its ``str``; candidate meta is informative, never worth a crash."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return str(value)


def _loads(text: str | bytes, what: str) -> Any:
    def no_constant(name: str) -> Any:
        raise SessionSpecError(f"{what}: {name} is not allowed in JSON")

    try:
        return json.loads(text, parse_constant=no_constant)
    except SessionSpecError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise SessionSpecError(f"{what}: not valid JSON ({one_line(e)})") from None


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


# -- workloads, results ----------------------------------------------------------------------


def workload_from_json(d: Any, where: str) -> Workload:
    """A :class:`Workload` from JSON, every field type-checked."""
    d = _obj(d, where, ("name", "op", "shape", "dtype", "families"), ("params",))
    shape, params = d["shape"], d.get("params", {})
    if not isinstance(shape, dict):
        raise _fail(f"{where}.shape", "expected an object", shape)
    if not isinstance(params, dict):
        raise _fail(f"{where}.params", "expected an object", params)
    families = _list(d["families"], f"{where}.families")
    return Workload(
        name=_str(d["name"], f"{where}.name"),
        op=_str(d["op"], f"{where}.op"),
        shape=shape,
        dtype=_str(d["dtype"], f"{where}.dtype"),
        families=tuple(_str(f, f"{where}.families[{i}]") for i, f in enumerate(families)),
        params=params,
    )


_STATS_FIELDS = (
    "name",
    "family",
    "regime",
    "median_s",
    "spread",
    "samples",
    "rejected",
    "sm_clock_hz",
    "power_w",
    "temp_c",
    "energy_j_per_call",
    "reasons",
    "meta",
)
_RESULT_FIELDS = ("workload", "regime", "candidates", "winner", "tie", "margin", "noise")


def stats_to_json(c: CandidateStats) -> dict[str, Any]:
    d = {name: getattr(c, name) for name in _STATS_FIELDS}
    d["regime"] = c.regime.value
    d["meta"] = _json_safe(c.meta)
    for name in ("median_s", "spread", "sm_clock_hz", "power_w", "temp_c", "energy_j_per_call"):
        d[name] = _json_safe(d[name])
    return d


def stats_from_json(d: Any, where: str) -> CandidateStats:
    d = _obj(d, where, _STATS_FIELDS)
    meta = d["meta"]
    if not isinstance(meta, dict):
        raise _fail(f"{where}.meta", "expected an object", meta)
    nonneg = {
        name: _opt_num(d[name], f"{where}.{name}", nonneg=True)
        for name in ("median_s", "spread", "sm_clock_hz", "power_w", "energy_j_per_call")
    }
    return CandidateStats(
        name=_str(d["name"], f"{where}.name"),
        family=_str(d["family"], f"{where}.family"),
        regime=_regime(d["regime"], f"{where}.regime"),
        samples=_int(d["samples"], f"{where}.samples"),
        rejected=_int(d["rejected"], f"{where}.rejected"),
        temp_c=_opt_num(d["temp_c"], f"{where}.temp_c"),
        reasons=_int(d["reasons"], f"{where}.reasons"),
        meta=meta,
        **nonneg,
    )


def result_to_json(r: RegimeResult) -> dict[str, Any]:
    return {
        "workload": r.workload,
        "regime": r.regime.value,
        "candidates": [stats_to_json(c) for c in r.candidates],
        "winner": r.winner,
        "tie": r.tie,
        "margin": _json_safe(r.margin),
        "noise": _json_safe(r.noise),
    }


def result_from_json(d: Any, where: str = "result") -> RegimeResult:
    """A :class:`RegimeResult` from JSON; also checks it is consistent with itself."""
    d = _obj(d, where, _RESULT_FIELDS)
    regime = _regime(d["regime"], f"{where}.regime")
    raw = _list(d["candidates"], f"{where}.candidates", nonempty=False)
    cands = tuple(stats_from_json(c, f"{where}.candidates[{i}]") for i, c in enumerate(raw))
    names: set[str] = set()
    for i, c in enumerate(cands):
        if c.name in names:
            raise _fail(f"{where}.candidates[{i}].name", "duplicate candidate", c.name)
        if c.regime is not regime:
            raise _fail(f"{where}.candidates[{i}].regime", f"expected {regime.value}", c.regime)
        names.add(c.name)
    winner = d["winner"]
    if winner is not None and winner not in names:
        raise _fail(f"{where}.winner", "expected null or one of its candidates", winner)
    tie = _bool(d["tie"], f"{where}.tie")
    if tie and winner is not None:
        raise _fail(f"{where}.winner", "expected null on a tie", winner)
    return RegimeResult(
        workload=_str(d["workload"], f"{where}.workload"),
        regime=regime,
        candidates=cands,
        winner=winner,
        tie=tie,
        margin=_opt_num(d["margin"], f"{where}.margin"),
        noise=_opt_num(d["noise"], f"{where}.noise", nonneg=True),
    )


# -- the session spec ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SimSpec:
    """The simulated GPU a ``sim`` session runs on; the same values as the daemon's sim backend
    give the same GPU (UUID, model, scenario). ``start_t`` is the daemon's simulated time
    (its sim backend's clock): the worker's GPU starts at that point of the scenario.
    ``speed`` (the daemon's simulated seconds per real second) paces the worker's clock so
    the session lasts as long in the daemon's time as it simulates; None runs unpaced."""

    scenario: str
    seed: int = 0
    gpus: int = 1
    start_t: float = 0.0
    speed: float | None = None


@dataclass(frozen=True, slots=True)
class SessionSpec:
    """One tuning session for one GPU: what the worker measures, and how.

    ``gpu_index`` is the telemetry (NVML) index, ``gpu_uuid`` the UUID the runner pins
    the worker to with ``CUDA_VISIBLE_DEVICES``. ``time_budget_s`` is the whole session's
    measuring time on the device session's clock (simulated time on ``sim``): the
    worker shares what is left equally between the remaining (workload, regime) pairs,
    each capped at ``protocol.time_budget_s``. ``workload_regimes`` narrows the regimes
    of the workloads it names (a resumed session measures only what is still missing);
    every other workload gets all of ``regimes``. ``allowed_modules`` is the daemon's
    ``[tuning] allowed_modules``: the only list the worker imports user code under.
    """

    gpu_index: int
    gpu_uuid: str
    device: str
    workloads: tuple[Workload, ...]
    regimes: tuple[Regime, ...]
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    time_budget_s: float = 600.0
    sim: SimSpec | None = None
    workload_regimes: Mapping[str, tuple[Regime, ...]] = field(default_factory=dict)
    allowed_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _int(self.gpu_index, "spec.gpu_index")
        _str(self.gpu_uuid, "spec.gpu_uuid")
        if self.device not in DEVICES:
            raise _fail("spec.device", f"expected one of {', '.join(DEVICES)}", self.device)
        if not self.workloads:
            raise _fail("spec.workloads", "expected at least one workload", self.workloads)
        seen: set[str] = set()
        for i, w in enumerate(self.workloads):
            if not isinstance(w, Workload):
                raise _fail(f"spec.workloads[{i}]", "expected a Workload", w)
            if w.name in seen:
                raise _fail(f"spec.workloads[{i}].name", "duplicate workload", w.name)
            seen.add(w.name)
        if not self.regimes:
            raise _fail("spec.regimes", "expected at least one regime", self.regimes)
        for i, r in enumerate(self.regimes):
            if not isinstance(r, Regime):
                raise _fail(f"spec.regimes[{i}]", "expected a Regime", r)
        if len(set(self.regimes)) != len(self.regimes):
            raise _fail(
                "spec.regimes", "expected each regime once", [r.value for r in self.regimes]
            )
        if not isinstance(self.protocol, ProtocolConfig):
            raise _fail("spec.protocol", "expected a ProtocolConfig", self.protocol)
        if _num(self.time_budget_s, "spec.time_budget_s") <= 0:
            raise _fail("spec.time_budget_s", "expected a number > 0", self.time_budget_s)
        if (self.sim is None) != (self.device != "sim"):
            what = "required for device sim" if self.sim is None else "only for device sim"
            raise _fail("spec.sim", what, self.sim)
        if self.sim is not None:
            _str(self.sim.scenario, "spec.sim.scenario")
            _int(self.sim.seed, "spec.sim.seed", minimum=-(2**63))
            _int(self.sim.gpus, "spec.sim.gpus", minimum=1)
            _num(self.sim.start_t, "spec.sim.start_t", nonneg=True)
            if self.sim.speed is not None and not _num(self.sim.speed, "spec.sim.speed") > 0:
                raise _fail("spec.sim.speed", "expected a number > 0", self.sim.speed)
        self._check_workload_regimes(seen)
        try:
            parse_allowed_modules(self.allowed_modules, "spec.allowed_modules")
        except TrustError as e:
            raise SessionSpecError(str(e)) from None

    def _check_workload_regimes(self, names: set[str]) -> None:
        """Each named workload is in the spec; its regimes a non-empty, ordered subset."""
        if not isinstance(self.workload_regimes, Mapping):
            raise _fail("spec.workload_regimes", "expected an object", self.workload_regimes)
        for name, regimes in self.workload_regimes.items():
            where = f"spec.workload_regimes.{name}"
            if name not in names:
                raise _fail("spec.workload_regimes", "expected names of the spec's workloads", name)
            if not isinstance(regimes, tuple) or not regimes:
                raise _fail(where, "expected a non-empty tuple of regimes", regimes)
            if any(r not in self.regimes for r in regimes) or list(regimes) != [
                r for r in self.regimes if r in regimes
            ]:
                ours = [r.value for r in self.regimes]
                got = [getattr(r, "value", r) for r in regimes]
                raise _fail(where, f"expected some of {ours}, each once, in that order", got)

    def regimes_of(self, workload: str) -> tuple[Regime, ...]:
        """The regimes the worker measures ``workload`` in."""
        return self.workload_regimes.get(workload, self.regimes)

    def pairs(self) -> list[tuple[str, Regime]]:
        """Every (workload, regime) the worker must report a result for, in order."""
        return [(w.name, r) for w in self.workloads for r in self.regimes_of(w.name)]

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu_index": self.gpu_index,
            "gpu_uuid": self.gpu_uuid,
            "device": self.device,
            "sim": asdict(self.sim) if self.sim is not None else None,
            "workloads": [w.to_json() for w in self.workloads],
            "regimes": [r.value for r in self.regimes],
            "protocol": asdict(self.protocol),
            "time_budget_s": self.time_budget_s,
            "allowed_modules": list(self.allowed_modules),
            **(
                {
                    "workload_regimes": {
                        n: [r.value for r in rs] for n, rs in self.workload_regimes.items()
                    }
                }
                if self.workload_regimes
                else {}
            ),
        }

    def dumps(self) -> str:
        return _dumps(self.to_json())

    @classmethod
    def from_json(cls, d: Any) -> SessionSpec:
        d = _obj(
            d,
            "spec",
            ("gpu_index", "gpu_uuid", "device", "workloads", "regimes", "protocol"),
            ("time_budget_s", "sim", "workload_regimes", "allowed_modules"),
        )
        sim = None
        if d.get("sim") is not None:
            s = _obj(d["sim"], "spec.sim", ("scenario",), ("seed", "gpus", "start_t", "speed"))
            sim = SimSpec(
                scenario=_str(s["scenario"], "spec.sim.scenario"),
                seed=_int(s.get("seed", 0), "spec.sim.seed", minimum=-(2**63)),
                gpus=_int(s.get("gpus", 1), "spec.sim.gpus", minimum=1),
                start_t=_num(s.get("start_t", 0.0), "spec.sim.start_t", nonneg=True),
                speed=_opt_num(s.get("speed"), "spec.sim.speed"),
            )
        workloads = _list(d["workloads"], "spec.workloads")
        regimes = _list(d["regimes"], "spec.regimes")
        by_workload = d.get("workload_regimes", {})
        if not isinstance(by_workload, dict):
            raise _fail("spec.workload_regimes", "expected an object", by_workload)
        if not isinstance(d["protocol"], dict):
            raise _fail("spec.protocol", "expected an object", d["protocol"])
        try:
            protocol = ProtocolConfig.from_mapping(d["protocol"])
        except (ValueError, TypeError) as e:
            raise SessionSpecError(f"spec.{one_line(e)}") from None
        return cls(
            gpu_index=d["gpu_index"],
            gpu_uuid=d["gpu_uuid"],
            device=d["device"],
            workloads=tuple(
                workload_from_json(w, f"spec.workloads[{i}]") for i, w in enumerate(workloads)
            ),
            regimes=tuple(_regime(r, f"spec.regimes[{i}]") for i, r in enumerate(regimes)),
            protocol=protocol,
            time_budget_s=_num(d.get("time_budget_s", 600.0), "spec.time_budget_s"),
            sim=sim,
            workload_regimes={
                str(name): tuple(
                    _regime(r, f"spec.workload_regimes.{name}[{i}]")
                    for i, r in enumerate(_list(rs, f"spec.workload_regimes.{name}"))
                )
                for name, rs in by_workload.items()
            },
            allowed_modules=tuple(
                _list(d.get("allowed_modules", []), "spec.allowed_modules", nonempty=False)
            ),
        )

    @classmethod
    def loads(cls, text: str | bytes) -> SessionSpec:
        """Parse a session spec; any problem is one :class:`SessionSpecError` line."""
        if len(text) > MAX_SPEC_BYTES:
            raise SessionSpecError(f"spec: larger than {MAX_SPEC_BYTES} bytes")
        return cls.from_json(_loads(text, "spec"))


# -- worker -> daemon messages ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """First line from a worker: who it is and the software stack its timings depend on."""

    pid: int
    versions: Versions


@dataclass(frozen=True, slots=True)
class Progress:
    """Where the worker is: ``done`` of ``total`` (workload, regime) pairs are finished;
    ``batches`` timed so far in this one; ``candidates_done`` of ``candidates_total`` of
    its candidates have their minimum of accepted batches; the telemetry read after the
    latest batch; ``round`` of the regime (the most accepted batches of any candidate) and
    ``elapsed_s`` of its ``budget_s`` on the device's clock, for a progress display."""

    workload: str
    regime: Regime
    candidate: str
    done: int
    total: int
    batches: int = 0
    sm_clock_mhz: float | None = None
    power_w: float | None = None
    temp_c: float | None = None
    candidates_done: int = 0
    candidates_total: int = 0
    round: int = 0
    elapsed_s: float | None = None
    budget_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "progress",
            "workload": self.workload,
            "regime": self.regime.value,
            "candidate": self.candidate,
            "done": self.done,
            "total": self.total,
            "batches": self.batches,
            "candidates_done": self.candidates_done,
            "candidates_total": self.candidates_total,
            "sm_clock_mhz": _json_safe(self.sm_clock_mhz),
            "power_w": _json_safe(self.power_w),
            "temp_c": _json_safe(self.temp_c),
            "round": self.round,
            "elapsed_s": _json_safe(self.elapsed_s),
            "budget_s": _json_safe(self.budget_s),
        }


@dataclass(frozen=True, slots=True)
class ResultMessage:
    """One (workload, regime) measured."""

    result: RegimeResult


@dataclass(frozen=True, slots=True)
class ErrorMessage:
    """The worker gives up; it exits non-zero right after."""

    message: str


Message = Hello | Progress | ResultMessage | ErrorMessage


def encode_message(msg: Message) -> str:
    """One JSON line (without the newline) for ``msg``."""
    if isinstance(msg, Hello):
        d: dict[str, Any] = {"type": "hello", "pid": msg.pid, "versions": asdict(msg.versions)}
    elif isinstance(msg, Progress):
        d = msg.to_json()
    elif isinstance(msg, ResultMessage):
        d = {"type": "result", "result": result_to_json(msg.result)}
    elif isinstance(msg, ErrorMessage):
        d = {"type": "error", "message": one_line(msg.message) or "unknown error"}
    else:
        raise TypeError(f"not a worker message: {type(msg).__name__}")
    return _dumps(d)


def decode_message(line: str | bytes) -> Message:
    """Parse one line from a worker; anything malformed is a :class:`SessionSpecError`."""
    d = _loads(line, "message")
    if not isinstance(d, dict):
        raise _fail("message", "expected an object", d)
    kind = d.get("type")
    if kind == "hello":
        _obj(d, "hello", ("type", "pid", "versions"))
        try:
            versions = Versions.from_json(d["versions"])
        except ValueError as e:
            raise SessionSpecError(f"hello.{e}") from None
        return Hello(pid=_int(d["pid"], "hello.pid", minimum=1), versions=versions)
    if kind == "progress":
        optional = (
            "batches",
            "candidates_done",
            "candidates_total",
            "sm_clock_mhz",
            "power_w",
            "temp_c",
            "round",
            "elapsed_s",
            "budget_s",
        )
        _obj(d, "progress", ("type", "workload", "regime", "candidate", "done", "total"), optional)
        total = _int(d["total"], "progress.total", minimum=1)
        done = _int(d["done"], "progress.done")
        if done > total:
            raise _fail("progress.done", f"expected at most total ({total})", done)
        cand_total = _int(d.get("candidates_total", 0), "progress.candidates_total")
        cand_done = _int(d.get("candidates_done", 0), "progress.candidates_done")
        if cand_done > cand_total:
            raise _fail("progress.candidates_done", f"expected at most {cand_total}", cand_done)
        return Progress(
            workload=_str(d["workload"], "progress.workload"),
            regime=_regime(d["regime"], "progress.regime"),
            candidate=_str(d["candidate"], "progress.candidate"),
            done=done,
            total=total,
            batches=_int(d.get("batches", 0), "progress.batches"),
            candidates_done=cand_done,
            candidates_total=cand_total,
            sm_clock_mhz=_opt_num(d.get("sm_clock_mhz"), "progress.sm_clock_mhz", nonneg=True),
            power_w=_opt_num(d.get("power_w"), "progress.power_w", nonneg=True),
            temp_c=_opt_num(d.get("temp_c"), "progress.temp_c"),
            round=_int(d.get("round", 0), "progress.round"),
            elapsed_s=_opt_num(d.get("elapsed_s"), "progress.elapsed_s", nonneg=True),
            budget_s=_opt_num(d.get("budget_s"), "progress.budget_s", nonneg=True),
        )
    if kind == "result":
        _obj(d, "result message", ("type", "result"))
        return ResultMessage(result_from_json(d["result"]))
    if kind == "error":
        _obj(d, "error", ("type", "message"))
        if not isinstance(d["message"], str):
            raise _fail("error.message", "expected a string", d["message"])
        return ErrorMessage(one_line(d["message"]) or "unknown error")
    raise _fail("message.type", "expected hello, progress, result or error", kind)
