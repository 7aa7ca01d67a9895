"""Reader and writer of recorded GPU traces, format ``gpuwatchd-trace/1`` (JSON Lines).

Line 1 is a header object::

    {"format": "gpuwatchd-trace/1",
     "device": {...} | [{...}, ...],   # static facts, one object per GPU
     "sample_period_s": 0.05,
     "events": [{"t": 4.796, "what": "matmul loop starts"}, ...],
     "fields": {"t": "seconds since trace start", ...}}

Every other line is one sample: ``t``, ``gpu`` and each traced field of the field
table (:data:`~gpuwatchd.telemetry.fields.FIELDS`, its ``trace`` key; docs/fields.md
lists them). Required keys (``temp_c``, ``power_w``, ``sm_clock_mhz``, ``reasons``) are
on every line, ``null`` for a field the GPU does not support; optional ones only where
known. A key this reader does not know is accepted when the header's ``fields`` names
it: numeric values land in :attr:`Sample.extra`, other values are ignored. Anything
else is a :class:`TraceError` naming file, line and field, because a trace that
silently reads wrong would make every replay-based test lie.

Each key's ``decode`` maps it onto :class:`Sample` (``util``/``mem_util`` percent become
0-1 ratios, ``reasons`` is decoded with :meth:`ThrottleReason.decode`, ``procs``, a count,
becomes that many synthetic PIDs: :func:`~gpuwatchd.telemetry.fields.synthetic_pids`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any, TextIO

from gpuwatchd.telemetry.backend import TraceError as TraceError  # raised here
from gpuwatchd.telemetry.fields import (
    FIELDS,
    MAX_PROCS,
    SYNTHETIC_PID_BASE,
    Field,
    TraceKey,
    synthetic_pids,
)
from gpuwatchd.telemetry.types import DeviceInfo, Sample
from gpuwatchd.validate import one_line

log = logging.getLogger(__name__)

FORMAT = "gpuwatchd-trace/1"

__all__ = ["MAX_PROCS", "SYNTHETIC_PID_BASE", "synthetic_pids"]  # re-exported: trace facts

#: The order ``gpuwatchd-trace/1`` writers have always written these keys in (a key not
#: listed follows them, in table order), so a recording reads the same byte for byte.
_V1_ORDER = (
    "temp_c",
    "power_w",
    "sm_clock_mhz",
    "reasons",
    "util",
    "mem_util",
    "mem_temp_c",
    "mem_clock_mhz",
    "pstate",
    "procs",
)


def _traced() -> tuple[tuple[TraceKey, Field], ...]:
    """Every traced field with its key: required keys first, then :data:`_V1_ORDER`."""
    pairs = [(f.trace, f) for f in FIELDS if f.trace is not None]

    def rank(pair: tuple[TraceKey, Field]) -> tuple[bool, int]:
        key = pair[0].key
        return (not pair[0].required, _V1_ORDER.index(key) if key in _V1_ORDER else len(pairs))

    return tuple(sorted(pairs, key=rank))


#: (trace key, field) of every field a trace carries, in writing order.
_TRACED = _traced()
REQUIRED_SAMPLE_KEYS = ("t", "gpu", *(k.key for k, _ in _TRACED if k.required))
OPTIONAL_SAMPLE_KEYS = tuple(k.key for k, _ in _TRACED if not k.required)
_KNOWN_SAMPLE_KEYS = frozenset(REQUIRED_SAMPLE_KEYS + OPTIONAL_SAMPLE_KEYS)

#: Meaning of every key the writer may emit; copied into the header's ``fields``.
FIELD_DOCS: dict[str, str] = {
    "t": "seconds since trace start",
    "gpu": "GPU index",
    **{k.key: k.doc for k, _ in _TRACED},
}

# Header ``device`` keys -> DeviceInfo attributes. ``driver`` and ``mem_clock_mhz`` are
# the names the recorded H200 trace uses.
_DEVICE_NUMBER_KEYS = {
    "max_sm_clock_mhz": "max_sm_clock_mhz",
    "mem_clock_mhz": "max_mem_clock_mhz",
    "power_limit_w": "power_limit_w",
    "slowdown_temp_c": "slowdown_temp_c",
    "shutdown_temp_c": "shutdown_temp_c",
}
_DEVICE_STRING_KEYS = {
    "driver": "driver_version",
    "pci_bus_id": "pci_bus_id",
    "cuda_capability": "cuda_capability",
}


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """What the GPU was doing from time ``t`` (trace seconds) on."""

    t: float
    what: str


@dataclass(frozen=True, slots=True)
class Trace:
    """A loaded trace: static facts per GPU and each GPU's samples sorted by ``t``."""

    path: str
    devices: dict[int, DeviceInfo]
    period_s: float
    events: tuple[TraceEvent, ...]
    fields: dict[str, str]
    samples: dict[int, tuple[Sample, ...]] = field(repr=False)

    @property
    def start(self) -> float:
        """Time of the earliest sample of any GPU."""
        return min(s[0].t for s in self.samples.values())

    @property
    def end(self) -> float:
        """Time of the latest sample of any GPU."""
        return max(s[-1].t for s in self.samples.values())


# ---------------------------------------------------------------------------- reading


_ABSENT = object()


class _Line:
    """Field accessors for one parsed line that raise a :class:`TraceError` naming it."""

    __slots__ = ("lineno", "obj", "path", "prefix")

    def __init__(self, path: str, lineno: int, obj: dict[str, Any], prefix: str = "") -> None:
        self.path = path
        self.lineno = lineno
        self.obj = obj
        self.prefix = prefix  # names nested fields, e.g. "device." or "events[2]."

    def fail(self, key: str, message: str) -> TraceError:
        return TraceError(self.path, self.lineno, f"field '{self.prefix}{key}': {message}")

    def _given(self, key: str, required: bool, nullable: bool) -> Any:
        """The value at ``key``, or :data:`_ABSENT` when it is optional and missing, or
        null and nullable; a missing required one raises."""
        if key not in self.obj:
            if required:
                raise self.fail(key, "missing")
            return _ABSENT
        value = self.obj[key]
        return _ABSENT if value is None and nullable else value

    def number(
        self,
        key: str,
        *,
        required: bool = True,
        minimum: float | None = None,
        maximum: float | None = None,
        nullable: bool = False,
    ) -> float | None:
        value = self._given(key, required, nullable)
        if value is _ABSENT:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"expected a number, got {json.dumps(value)}")
        if not math.isfinite(value):
            raise self.fail(key, f"expected a finite number, got {value}")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be >= {minimum:g}, got {value:g}")
        if maximum is not None and value > maximum:
            raise self.fail(key, f"must be <= {maximum:g}, got {value:g}")
        return float(value)

    def integer(
        self, key: str, *, required: bool = True, nullable: bool = False, maximum: int | None = None
    ) -> int | None:
        value = self._given(key, required, nullable)
        if value is _ABSENT:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected a whole number, got {json.dumps(value)}")
        if value < 0:
            raise self.fail(key, f"must be >= 0, got {value}")
        if maximum is not None and value > maximum:
            raise self.fail(key, f"must be <= {maximum}, got {value}")
        return value

    def string(self, key: str, *, required: bool = True) -> str | None:
        if key not in self.obj or self.obj[key] is None:
            if required:
                raise self.fail(key, "missing")
            return None
        value = self.obj[key]
        if not isinstance(value, str):
            raise self.fail(key, f"expected a string, got {json.dumps(value)}")
        return value


def _parse_json(path: str, lineno: int, text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(
            path, lineno, f"not valid JSON ({exc.msg} at column {exc.colno})"
        ) from None
    except RecursionError:  # json recurses once per level of nesting
        raise TraceError(path, lineno, "not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer longer than Python converts (4300 digits)
        raise TraceError(path, lineno, f"not valid JSON ({one_line(exc, 120)})") from None
    if not isinstance(obj, dict):
        raise TraceError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _parse_device(line: _Line, obj: Any, where: str, default_index: int | None) -> DeviceInfo:
    if not isinstance(obj, dict):
        raise line.fail(where, "expected an object of device facts")
    sub = _Line(line.path, line.lineno, obj, prefix=f"{where}.")
    index = sub.integer("index", required=default_index is None)
    kwargs: dict[str, Any] = {
        attr: sub.number(key, required=False, minimum=0, nullable=True)
        for key, attr in _DEVICE_NUMBER_KEYS.items()
    }
    kwargs.update(
        {attr: sub.string(key, required=False) for key, attr in _DEVICE_STRING_KEYS.items()}
    )
    uuid, name = sub.string("uuid"), sub.string("name")
    assert uuid is not None and name is not None
    if index is None:
        assert default_index is not None
        index = default_index
    return DeviceInfo(
        index=index,
        uuid=uuid,
        name=name,
        memory_total_bytes=sub.integer("memory_total_bytes", required=False, nullable=True),
        **kwargs,
    )


def _parse_header(
    path: str, obj: dict[str, Any]
) -> tuple[dict[int, DeviceInfo], float, tuple[TraceEvent, ...], dict[str, str]]:
    line = _Line(path, 1, obj)
    fmt = obj.get("format")
    if fmt != FORMAT:
        raise line.fail("format", f"expected {json.dumps(FORMAT)}, got {json.dumps(fmt)}")
    if "device" not in obj:
        raise line.fail("device", "missing")
    raw_devices = obj["device"]
    devices: dict[int, DeviceInfo] = {}
    if isinstance(raw_devices, list):
        if not raw_devices:
            raise line.fail("device", "empty device list")
        for i, raw in enumerate(raw_devices):
            info = _parse_device(line, raw, f"device[{i}]", None)
            if info.index in devices:
                raise line.fail(f"device[{i}].index", f"GPU {info.index} listed twice")
            devices[info.index] = info
    else:
        info = _parse_device(line, raw_devices, "device", 0)
        devices[info.index] = info

    period = line.number("sample_period_s")
    assert period is not None
    if period <= 0:
        raise line.fail("sample_period_s", f"must be > 0, got {period:g}")

    raw_events = obj.get("events", [])
    if not isinstance(raw_events, list):
        raise line.fail("events", "expected a list of {t, what}")
    events = []
    for i, raw in enumerate(raw_events):
        if not isinstance(raw, dict):
            raise line.fail(f"events[{i}]", "expected an object {t, what}")
        ev = _Line(path, 1, raw, prefix=f"events[{i}].")
        t, what = ev.number("t"), ev.string("what")
        assert t is not None and what is not None
        events.append(TraceEvent(t, what))

    raw_fields = obj.get("fields", {})
    if not isinstance(raw_fields, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw_fields.items()
    ):
        raise line.fail("fields", "expected an object mapping each key to its meaning")
    return devices, period, tuple(sorted(events, key=lambda e: e.t)), dict(raw_fields)


def _parse_sample(
    line: _Line, devices: Mapping[int, DeviceInfo], declared: frozenset[str]
) -> Sample:
    obj = line.obj
    for key in obj:
        if key not in _KNOWN_SAMPLE_KEYS and key not in declared:
            raise line.fail(key, "unknown key not listed in the header's fields")
    t = line.number("t")
    gpu = line.integer("gpu")
    assert t is not None and gpu is not None
    if gpu not in devices:
        raise line.fail("gpu", f"GPU {gpu} is not in the header's device list")
    values: dict[str, Any] = {}
    for spec, f in _TRACED:
        value = _read_key(line, spec)
        if value is not None and spec.decode is not None:
            value = spec.decode(value)
        values[f.attr] = value
    extra: dict[str, float] = {}
    for key, value in obj.items():
        if key in _KNOWN_SAMPLE_KEYS or isinstance(value, bool):
            continue
        if isinstance(value, int | float) and math.isfinite(value):
            extra[key] = float(value)
    return Sample(gpu=gpu, t=t, extra=extra, **values)


def _read_key(line: _Line, spec: TraceKey) -> float | int | None:
    """One traced field's value as written (a number, or null), checked."""
    if spec.integer:
        maximum = None if spec.maximum is None else int(spec.maximum)
        return line.integer(spec.key, required=spec.required, nullable=True, maximum=maximum)
    return line.number(
        spec.key,
        required=spec.required,
        minimum=spec.minimum,
        maximum=spec.maximum,
        nullable=True,
    )


def parse_trace(lines: Iterable[str], path: str = "<trace>") -> Trace:
    """Parse trace text; ``path`` only labels error messages."""
    header: tuple[dict[int, DeviceInfo], float, tuple[TraceEvent, ...], dict[str, str]] | None
    header = None
    per_gpu: dict[int, list[Sample]] = {}
    declared: frozenset[str] = frozenset()
    lineno = 0
    for lineno, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        obj = _parse_json(path, lineno, text)
        if header is None:
            if lineno != 1:
                raise TraceError(path, lineno, "the header must be on line 1")
            header = _parse_header(path, obj)
            declared = frozenset(header[3])
            per_gpu = {gpu: [] for gpu in header[0]}
            continue
        sample = _parse_sample(_Line(path, lineno, obj), header[0], declared)
        seq = per_gpu[sample.gpu]
        if seq and sample.t < seq[-1].t:
            raise TraceError(
                path,
                lineno,
                f"field 't': time goes backwards for GPU {sample.gpu} "
                f"({sample.t:g} after {seq[-1].t:g})",
            )
        seq.append(sample)
    if header is None:
        raise TraceError(path, max(lineno, 1), "empty file (no header line)")
    devices, period, events, fields = header
    for gpu, seq in per_gpu.items():
        if not seq:
            raise TraceError(path, lineno, f"no samples for GPU {gpu} listed in the header")
    return Trace(
        path=path,
        devices=devices,
        period_s=period,
        events=events,
        fields=fields,
        samples={gpu: tuple(seq) for gpu, seq in sorted(per_gpu.items())},
    )


def load_trace(path: str | Path) -> Trace:
    """Read a trace file; any problem raises one :class:`TraceError`."""
    p = Path(path)
    try:
        with p.open(encoding="utf-8") as fh:
            return parse_trace(fh, str(p))
    except OSError as exc:
        raise TraceError(p, 0, f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(p, 0, f"not UTF-8 text ({exc.reason})") from None


# ---------------------------------------------------------------------------- writing


def _device_json(info: DeviceInfo) -> dict[str, Any]:
    out: dict[str, Any] = {"index": info.index, "name": info.name, "uuid": info.uuid}
    for key, attr in {**_DEVICE_STRING_KEYS, **_DEVICE_NUMBER_KEYS}.items():
        value = getattr(info, attr)
        if value is not None:
            out[key] = value
    if info.memory_total_bytes is not None:
        out["memory_total_bytes"] = info.memory_total_bytes
    return out


#: Optional header key: the unix time of the trace's t = 0.
T0_UNIX_KEY = "t0_unix"


class TraceWriter:
    """Writes samples as a ``gpuwatchd-trace/1`` file that :func:`load_trace` reads back.

    The header (devices, period, events) is written at construction, so events must be
    known up front; they may be :class:`TraceEvent` or ``{"t", "what"}`` mappings.
    ``extra_fields`` declares the keys of :attr:`Sample.extra` that will be written; an
    undeclared extra key, an unknown GPU or time going backwards raises ``ValueError``
    at ``write`` instead of producing a file the reader rejects.
    """

    def __init__(
        self,
        path: str | Path,
        devices: Sequence[DeviceInfo],
        period: float,
        events: Sequence[TraceEvent | Mapping[str, object]] = (),
        *,
        extra_fields: Mapping[str, str] | None = None,
        t0_unix: float | None = None,
    ) -> None:
        if not devices:
            raise ValueError("devices: at least one DeviceInfo is required")
        if not (period > 0 and math.isfinite(period)):
            raise ValueError(f"period: must be > 0 seconds, got {period}")
        extra = dict(extra_fields or {})
        clash = sorted(set(extra) & _KNOWN_SAMPLE_KEYS)
        if clash:
            raise ValueError(f"extra_fields: {clash[0]!r} is a standard key")
        self._devices = {d.index: d for d in devices}
        if len(self._devices) != len(devices):
            raise ValueError("devices: the same GPU index appears twice")
        self._extra = frozenset(extra)
        self._last_t: dict[int, float] = {}
        dev_json = [_device_json(d) for d in devices]
        header = {
            "format": FORMAT,
            "device": dev_json[0] if len(dev_json) == 1 else dev_json,
            "sample_period_s": period,
            "events": [
                {"t": e.t, "what": e.what}
                for e in sorted((_as_event(i, e) for i, e in enumerate(events)), key=_event_t)
            ],
            "fields": {**FIELD_DOCS, **extra},
        }
        if t0_unix is not None:  # wall time of t = 0: aligns the trace with stored sessions
            header[T0_UNIX_KEY] = t0_unix
        target = Path(path)
        if not target.parent.is_dir():  # created, and said so (as for the store)
            target.parent.mkdir(parents=True, exist_ok=True)
            log.warning("created the missing directory %s for trace %s", target.parent, target.name)
        # The writer owns the handle until close(); a context manager cannot span calls.
        self._fh: TextIO | None = target.open("w", encoding="utf-8")
        self._fh.write(json.dumps(header) + "\n")

    def write(self, sample: Sample, *, t: float | None = None) -> None:
        """Append one sample; ``t``, when given, replaces ``sample.t`` (e.g. rebased to 0)."""
        if t is not None:
            sample = dataclasses.replace(sample, t=t)
        if not math.isfinite(sample.t):
            raise ValueError(f"sample.t: expected a finite number, got {sample.t}")
        if self._fh is None:
            raise ValueError("write on a closed TraceWriter")
        if sample.gpu not in self._devices:
            raise ValueError(f"sample.gpu: GPU {sample.gpu} is not in the header's devices")
        last = self._last_t.get(sample.gpu)
        if last is not None and sample.t < last:
            raise ValueError(f"sample.t: {sample.t} is before {last} for GPU {sample.gpu}")
        undeclared = sorted(set(sample.extra) - self._extra)
        if undeclared:
            raise ValueError(f"sample.extra: key {undeclared[0]!r} not declared in extra_fields")
        self._last_t[sample.gpu] = sample.t
        self._fh.write(json.dumps(_sample_json(sample)) + "\n")

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _event_t(e: TraceEvent) -> float:
    return e.t


def _as_event(i: int, e: TraceEvent | Mapping[str, object]) -> TraceEvent:
    """Accept a TraceEvent or a ``{"t", "what"}`` mapping (as stored in the header)."""
    t: object
    what: object
    if isinstance(e, TraceEvent):
        t, what = e.t, e.what
    else:
        t, what = e.get("t"), e.get("what")
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        raise ValueError(f"events[{i}].t: expected a finite number, got {t!r}")
    if not isinstance(what, str):
        raise ValueError(f"events[{i}].what: expected a string, got {what!r}")
    return TraceEvent(float(t), what)


#: (key, Sample attribute getter, encoder, required) of each traced field, writing order.
_WRITE = tuple((k.key, attrgetter(f.attr), k.encode, k.required) for k, f in _TRACED)


def _sample_json(s: Sample) -> dict[str, Any]:
    out: dict[str, Any] = {"t": s.t, "gpu": s.gpu}
    for key, get, encode, required in _WRITE:
        value = get(s)
        if value is not None:
            out[key] = value if encode is None else encode(value)
        elif required:
            out[key] = None
    out.update(s.extra)
    return out
