"""Client API for jobs: is my GPU ready to tune on, and which kernel won?

Talks to a running daemon's read-only JSON endpoints (``/api/v1/state``,
``/api/v1/winners``) and, for winners, falls back to reading the store file directly
(read-only). Importable without torch: a training job can ask before it touches CUDA.

Why the client re-runs the gate itself (:meth:`Client.wait_until_stable`): a job that
already holds a CUDA context is in NVML's compute-process list, so the daemon's gate
calls the GPU ``busy`` because of the very job that is waiting for it. When this
process is among the GPU's compute processes, the client feeds the daemon's samples
through the same gate logic with its own PIDs excluded.

Defaults: ``$GPUWATCHD_URL``, else the daemon config's listen address, else
``http://127.0.0.1:9844``; ``$GPUWATCHD_STORE``, else ``gpuwatchd.db`` in the daemon's
state directory (config ``state_dir``, ``$STATE_DIRECTORY``, ``/var/lib/gpuwatchd``,
``~/.local/state/gpuwatchd``: the first that holds a store).
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpuwatchd.gate import GateConfig, GateDecision, evaluate
from gpuwatchd.store import Store, StoreError, WinnerRow
from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason
from gpuwatchd.tuning.types import CandidateStats, Regime, Versions
from gpuwatchd.tuning.worker.cuda_session import normalize_uuid

DEFAULT_URL = "http://127.0.0.1:9844"
STATE_PATH = "/api/v1/state"
WINNERS_PATH = "/api/v1/winners"
#: Identifies the winners document shape; bump on an incompatible change.
WINNERS_FORMAT = "gpuwatchd-winners/1"
URL_ENV = "GPUWATCHD_URL"
STORE_ENV = "GPUWATCHD_STORE"
_SYSTEM_STATE_DIR = Path("/var/lib/gpuwatchd")
_WINNER_FILTERS = ("gpu_model", "workload", "regime")
_REASON_BY_LABEL = {r.label: r for r in ThrottleReason}


class GpuwatchdError(Exception):
    """Something the daemon or the store said could not be used; one line."""


class GpuwatchdUnavailable(GpuwatchdError):
    """Neither the daemon nor (for winners) the store file could be reached."""


class _NotServed(GpuwatchdError):
    """The daemon answered 404: an older daemon without this endpoint."""


# -- GPU state -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuState:
    """One GPU as the daemon sees it: the gate's verdict plus the latest reading.

    ``state`` is the gate state (``cool_stable``, ``warming``, ``throttled``, ``busy``,
    ``unavailable``); only ``cool_stable`` is ``open``. ``t_s`` is the sample's time on
    the daemon's clock. ``judged_by`` is ``"client"`` when :meth:`Client.wait_until_stable`
    re-ran the gate with this process's PIDs excluded.
    """

    gpu: int
    uuid: str | None
    name: str | None
    state: str
    open: bool
    reasons: tuple[str, ...]
    in_state_s: float | None
    t_s: float | None
    temp_c: float | None
    power_w: float | None
    sm_clock_mhz: float | None
    util_gpu_ratio: float | None
    throttle_reasons: tuple[str, ...] | None
    compute_pids: tuple[int, ...] | None
    max_sm_clock_mhz: float | None
    power_limit_w: float | None
    slowdown_temp_c: float | None
    stalled: bool
    lost: bool
    sample_age_s: float | None
    tuning: bool  # the daemon is running a tuning session on this GPU
    judged_by: str = "daemon"

    @property
    def ready(self) -> bool:
        """Gate open and the reading fresh: safe to run a first call that tunes."""
        return self.open and not self.stalled and not self.lost

    def describe(self) -> str:
        """One line: state, why, and the reading behind it."""
        facts = [
            f"{self.temp_c:.0f}C" if self.temp_c is not None else None,
            f"SM {self.sm_clock_mhz:.0f}MHz" if self.sm_clock_mhz is not None else None,
            f"{self.power_w:.0f}W" if self.power_w is not None else None,
        ]
        if self.throttle_reasons:
            facts.append("throttle " + "+".join(self.throttle_reasons))
        if self.lost or self.stalled:
            facts.append("GPU lost" if self.lost else "poll stalled")
        why = "; ".join(self.reasons) or "no reason given"
        shown = ", ".join(f for f in facts if f)
        return f"gpu {self.gpu} {self.state}: {why}" + (f" ({shown})" if shown else "")

    def to_sample(self) -> Sample | None:
        """The reading as a telemetry :class:`Sample` (None when there is none yet)."""
        if self.t_s is None:
            return None
        reasons = None
        if self.throttle_reasons is not None:
            reasons = ThrottleReason(0)
            for label in self.throttle_reasons:
                reasons |= _REASON_BY_LABEL.get(label, ThrottleReason(0))
        return Sample(
            gpu=self.gpu,
            t=self.t_s,
            temp_c=self.temp_c,
            power_w=self.power_w,
            sm_clock_mhz=self.sm_clock_mhz,
            reasons=reasons,
            util_gpu=self.util_gpu_ratio,
            procs=self.compute_pids,
        )

    def to_info(self) -> DeviceInfo:
        """The static facts the gate needs, as a :class:`DeviceInfo`."""
        return DeviceInfo(
            index=self.gpu,
            uuid=self.uuid or "",
            name=self.name or "",
            max_sm_clock_mhz=self.max_sm_clock_mhz,
            power_limit_w=self.power_limit_w,
            slowdown_temp_c=self.slowdown_temp_c,
        )


class _Doc:
    """Typed reads from a JSON document; a wrong type is a one-line GpuwatchdError."""

    def __init__(self, source: str, kind: str) -> None:
        self.source = source
        self.kind = kind

    def bad(self, where: str, want: str, got: object) -> GpuwatchdError:
        shown = repr(got)[:80]
        return GpuwatchdError(
            f"{self.source}: bad {self.kind} document: {where}: expected {want}, got {shown}"
        )

    def obj(self, d: Any, key: str, where: str, *, optional: bool = False) -> dict[str, Any]:
        v = d.get(key) if isinstance(d, dict) else None
        if v is None and optional:
            return {}
        if not isinstance(v, dict):
            raise self.bad(f"{where}.{key}", "an object", v)
        return v

    def num(self, d: Mapping[str, Any], key: str, where: str) -> float | None:
        v = d.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise self.bad(f"{where}.{key}", "a number or null", v)
        return float(v)

    def text(self, d: Mapping[str, Any], key: str, where: str, *, optional: bool = False) -> str:
        v = d.get(key)
        if v is None and optional:
            return ""
        if not isinstance(v, str):
            raise self.bad(f"{where}.{key}", "a string", v)
        return v

    def flag(self, d: Mapping[str, Any], key: str, where: str) -> bool:
        v = d.get(key, False)
        if not isinstance(v, bool):
            raise self.bad(f"{where}.{key}", "true or false", v)
        return v

    def integer(self, d: Mapping[str, Any], key: str, where: str) -> int:
        v = d.get(key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.bad(f"{where}.{key}", "an integer", v)
        return v

    def texts(self, d: Mapping[str, Any], key: str, where: str) -> tuple[str, ...] | None:
        v = d.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self.bad(f"{where}.{key}", "a list of strings", v)
        return tuple(v)

    def ints(self, d: Mapping[str, Any], key: str, where: str) -> tuple[int, ...] | None:
        v = d.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in v
        ):
            raise self.bad(f"{where}.{key}", "a list of integers", v)
        return tuple(v)


def parse_gpu_state(entry: Any, running: Iterable[int] = (), source: str = "state") -> GpuState:
    """One ``gpus[i]`` entry of the ``/api/v1/state`` document as a :class:`GpuState`."""
    doc = _Doc(source, "state")
    if not isinstance(entry, dict):
        raise doc.bad("gpus[]", "an object", entry)
    gpu = doc.integer(entry, "gpu", "gpus[]")
    where = f"gpus[gpu={gpu}]"
    info = doc.obj(entry, "info", where, optional=True)
    sample = doc.obj(entry, "sample", where, optional=True)
    gate = doc.obj(entry, "gate", where, optional=True)
    poll = doc.obj(entry, "poll", where, optional=True)
    if gate:
        state = doc.text(gate, "state", f"{where}.gate")
        is_open = doc.flag(gate, "open", f"{where}.gate")
        reasons = doc.texts(gate, "reasons", f"{where}.gate") or ()
        in_state = doc.num(gate, "in_state_s", f"{where}.gate")
    else:
        state, is_open, reasons, in_state = "unavailable", False, ("no gate decision yet",), None
    uuid = entry.get("uuid")
    return GpuState(
        gpu=gpu,
        uuid=uuid if isinstance(uuid, str) else None,
        name=doc.text(info, "name", f"{where}.info", optional=True) or None,
        state=state,
        open=is_open,
        reasons=reasons,
        in_state_s=in_state,
        t_s=doc.num(sample, "t_s", f"{where}.sample"),
        temp_c=doc.num(sample, "temp_c", f"{where}.sample"),
        power_w=doc.num(sample, "power_w", f"{where}.sample"),
        sm_clock_mhz=doc.num(sample, "sm_clock_mhz", f"{where}.sample"),
        util_gpu_ratio=doc.num(sample, "util_gpu_ratio", f"{where}.sample"),
        throttle_reasons=doc.texts(sample, "throttle_reasons", f"{where}.sample"),
        compute_pids=doc.ints(sample, "compute_pids", f"{where}.sample"),
        max_sm_clock_mhz=doc.num(info, "max_sm_clock_mhz", f"{where}.info"),
        power_limit_w=doc.num(info, "power_limit_w", f"{where}.info"),
        slowdown_temp_c=doc.num(info, "slowdown_temp_c", f"{where}.info"),
        stalled=doc.flag(poll, "stalled", f"{where}.poll"),
        lost=doc.flag(poll, "lost", f"{where}.poll"),
        sample_age_s=doc.num(poll, "last_success_age_s", f"{where}.poll"),
        tuning=gpu in set(running),
    )


class _OwnProcessGate:
    """The daemon's gate re-run on the daemon's samples, with this process's PIDs excluded."""

    def __init__(self, cfg: GateConfig, own_pids: frozenset[int]) -> None:
        self._cfg = cfg
        self._own = own_pids
        self._window: list[Sample] = []
        self._prev: GateDecision | None = None

    @property
    def max_poll_s(self) -> float:
        """Poll at least this often, or the window never holds ``min_samples`` samples."""
        return self._cfg.window_s / (self._cfg.min_samples + 1)

    def judge(self, st: GpuState) -> GpuState:
        sample = st.to_sample()
        if sample is not None and (not self._window or sample.t > self._window[-1].t):
            self._window.append(sample)
        if sample is not None:
            cutoff = sample.t - self._cfg.window_s
            self._window = [s for s in self._window if s.t >= cutoff]
        stale = st.sample_age_s is not None and st.sample_age_s > self._cfg.stale_after_s
        d = evaluate(self._window, st.to_info(), self._cfg, self._prev, self._own, st.lost or stale)
        self._prev = d
        return replace(
            st,
            state=d.state.value,
            open=d.open,
            reasons=d.reasons,
            in_state_s=max(0.0, d.t - d.since),
            judged_by="client",
        )


# -- winners ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankedCandidate:
    """One candidate of the result a winner came from, fastest first."""

    name: str
    family: str
    median_s: float | None
    spread: float | None
    samples: int
    sm_clock_hz: float | None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Winner:
    """The recorded pick for one (GPU model, workload, regime), newest stack.

    On a tie ``candidate`` is the nominal fastest and ``tie`` is true. ``meta`` is the
    winning candidate's (``kernels``, ``config`` for Triton, ...); ``ranked`` is every
    candidate of the same result, fastest first. ``source`` says where it was read.
    """

    gpu_model: str
    workload: str
    regime: Regime
    candidate: str
    family: str
    median_s: float | None
    sm_clock_hz: float | None
    margin: float | None
    tie: bool
    versions: Versions
    session_id: int
    gpu_uuid: str
    measured_at: float
    meta: dict[str, Any]
    ranked: tuple[RankedCandidate, ...]
    source: str

    @property
    def kernels(self) -> tuple[str, ...]:
        """GPU kernel names the winner launched, where the family recorded them."""
        names = self.meta.get("kernels")
        return tuple(str(n) for n in names) if isinstance(names, list) else ()

    @property
    def config(self) -> dict[str, Any] | None:
        """The family's config of the winner (a Triton tile config), if it has one."""
        cfg = self.meta.get("config")
        return cfg if isinstance(cfg, dict) else None


def _ranked_json(c: CandidateStats) -> dict[str, Any]:
    return {
        "name": c.name,
        "family": c.family,
        "median_s": c.median_s,
        "spread": c.spread,
        "samples": c.samples,
        "sm_clock_hz": c.sm_clock_hz,
        "meta": c.meta,
    }


def _winner_json(row: WinnerRow, candidates: list[CandidateStats]) -> dict[str, Any]:
    ranked = sorted(candidates, key=lambda c: (c.median_s is None, c.median_s or 0.0))
    meta = next((c.meta for c in candidates if c.name == row.candidate), {})
    return {
        "gpu_model": row.gpu_model,
        "workload": row.workload,
        "regime": row.regime.value,
        "candidate": row.candidate,
        "family": row.family,
        "median_s": row.median_s,
        "sm_clock_hz": row.sm_clock_hz,
        "margin": row.margin,
        "tie": row.tie,
        "versions": json.loads(row.versions.key()),
        "session_id": row.session_id,
        "gpu_uuid": row.gpu_uuid,
        "measured_at": row.measured_at,
        "meta": meta,
        "ranked": [_ranked_json(c) for c in ranked],
    }


def winners_json(
    store: Store,
    *,
    gpu_model: str | None = None,
    workload: str | None = None,
    regime: Regime | str | None = None,
    now: Callable[[], float] = time.time,
) -> dict[str, Any]:
    """The ``/api/v1/winners`` document: the newest winner per (GPU model, workload, regime).

    Each winner carries its candidate's meta and every candidate of the result it came
    from, fastest first (what :mod:`gpuwatchd.triton_configs` turns into configs).
    Read-only; safe on the daemon's store from HTTP threads.
    """
    rows = store.winners(gpu_model, workload, _regime(regime), latest=True)
    by_session: dict[int, dict[tuple[str, Regime], list[CandidateStats]]] = {}
    out = []
    for row in rows:
        if row.session_id not in by_session:
            by_session[row.session_id] = {
                (s.result.workload, s.result.regime): list(s.result.candidates)
                for s in store.results(row.session_id)
            }
        cands = by_session[row.session_id].get((row.workload, row.regime), [])
        out.append(_winner_json(row, cands))
    return {"format": WINNERS_FORMAT, "generated_unix": now(), "winners": out}


def parse_winners_query(target: str) -> dict[str, Any]:
    """``/api/v1/winners?workload=W&regime=R&gpu_model=M`` -> keyword arguments of
    :func:`winners_json`. ValueError naming the bad parameter (answer it with a 400)."""
    query = urllib.parse.urlsplit(target).query
    out: dict[str, Any] = {}
    for key, values in urllib.parse.parse_qs(query, keep_blank_values=True).items():
        if key not in _WINNER_FILTERS:
            raise ValueError(f"query parameter {key!r} is not one of {', '.join(_WINNER_FILTERS)}")
        if len(values) != 1 or not values[0]:
            raise ValueError(f"query parameter {key!r} must be given once, non-empty")
        out[key] = values[0]
    if "regime" in out:
        out["regime"] = _regime(out["regime"])
    return out


def parse_winners(doc: Any, source: str = "winners") -> list[Winner]:
    """The winners of a ``gpuwatchd-winners/1`` document."""
    d = _Doc(source, "winners")
    if not isinstance(doc, dict) or doc.get("format") != WINNERS_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else doc
        raise d.bad("format", repr(WINNERS_FORMAT), got)
    items = doc.get("winners")
    if not isinstance(items, list):
        raise d.bad("winners", "a list", items)
    return [_parse_winner(d, item, f"winners[{i}]") for i, item in enumerate(items)]


def _parse_winner(d: _Doc, w: Any, where: str) -> Winner:
    if not isinstance(w, dict):
        raise d.bad(where, "an object", w)
    raw_regime = w.get("regime")
    if raw_regime not in tuple(r.value for r in Regime):
        raise d.bad(f"{where}.regime", "one of " + ", ".join(r.value for r in Regime), raw_regime)
    regime = Regime(raw_regime)
    try:
        versions = Versions.from_json(w.get("versions"))
    except ValueError as e:
        raise GpuwatchdError(f"{d.source}: bad winners document: {where}.{e}") from None
    ranked_raw = w.get("ranked", [])
    if not isinstance(ranked_raw, list):
        raise d.bad(f"{where}.ranked", "a list", ranked_raw)
    ranked = []
    for i, c in enumerate(ranked_raw):
        here = f"{where}.ranked[{i}]"
        if not isinstance(c, dict):
            raise d.bad(here, "an object", c)
        ranked.append(
            RankedCandidate(
                name=d.text(c, "name", here),
                family=d.text(c, "family", here),
                median_s=d.num(c, "median_s", here),
                spread=d.num(c, "spread", here),
                samples=d.integer(c, "samples", here),
                sm_clock_hz=d.num(c, "sm_clock_hz", here),
                meta=d.obj(c, "meta", here, optional=True),
            )
        )
    measured = d.num(w, "measured_at", where)
    if measured is None:
        raise d.bad(f"{where}.measured_at", "a number", None)
    return Winner(
        gpu_model=d.text(w, "gpu_model", where),
        workload=d.text(w, "workload", where),
        regime=regime,
        candidate=d.text(w, "candidate", where),
        family=d.text(w, "family", where),
        median_s=d.num(w, "median_s", where),
        sm_clock_hz=d.num(w, "sm_clock_hz", where),
        margin=d.num(w, "margin", where),
        tie=d.flag(w, "tie", where),
        versions=versions,
        session_id=d.integer(w, "session_id", where),
        gpu_uuid=d.text(w, "gpu_uuid", where),
        measured_at=measured,
        meta=d.obj(w, "meta", where, optional=True),
        ranked=tuple(ranked),
        source=d.source,
    )


def _regime(value: Regime | str | None) -> Regime | None:
    if value is None or isinstance(value, Regime):
        return value
    try:
        return Regime(value)
    except ValueError:
        allowed = ", ".join(r.value for r in Regime)
        raise ValueError(f"regime: expected one of {allowed}, got {value!r}") from None


# -- defaults --------------------------------------------------------------------------------


def _daemon_config() -> tuple[str | None, str]:
    """(listen, state_dir) from the daemon's config file; (None, "") when there is none."""
    from gpuwatchd.config import DEFAULT_CONFIG_PATH, ConfigError, load_config

    if not DEFAULT_CONFIG_PATH.is_file():
        return None, ""
    try:
        cfg = load_config(DEFAULT_CONFIG_PATH)
    except (ConfigError, ValueError, OSError):
        return None, ""  # the daemon would refuse it too; fall back to the built-in defaults
    return cfg.daemon.listen, cfg.daemon.state_dir


def default_url() -> str:
    """``$GPUWATCHD_URL``, else the daemon config's listen address, else the default."""
    env = os.environ.get(URL_ENV)
    if env:
        return env
    listen, _ = _daemon_config()
    if listen is None:
        return DEFAULT_URL
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def default_store_paths() -> list[Path]:
    """Where the daemon keeps its store, most likely first (the client uses the first that
    exists): the state-dir rule of :func:`gpuwatchd.config.resolve_state_dir` for the
    configured ``state_dir``, then the system daemon's ``/var/lib/gpuwatchd``."""
    from gpuwatchd.config import STORE_NAME, store_path

    _, configured = _daemon_config()
    paths = [store_path(configured), _SYSTEM_STATE_DIR / STORE_NAME]
    return list(dict.fromkeys(paths))


def _check_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"url: expected http://HOST:PORT, got {url!r}")
    return url.rstrip("/")


# -- the client ------------------------------------------------------------------------------


class Client:
    """Reads a gpuwatchd daemon (``url``) and its tuning store (``store``).

    ``url=None``/``store=None`` pick the defaults (module docstring). Winners come from
    the daemon when it serves ``/api/v1/winners``, else from the store file; with
    ``store`` given (or ``$GPUWATCHD_STORE`` set) the file is read directly.
    """

    def __init__(
        self,
        url: str | None = None,
        store: str | os.PathLike[str] | None = None,
        timeout: float = 2.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"timeout: expected a number of seconds > 0, got {timeout!r}")
        if not math.isfinite(timeout):
            raise ValueError(f"timeout: expected a finite number of seconds, got {timeout!r}")
        self.url = _check_url(url if url is not None else default_url())
        store = store if store is not None else os.environ.get(STORE_ENV) or None
        self._store_given = store is not None
        self._store: Path | None = Path(store) if store is not None else None
        self.timeout = float(timeout)
        self._clock = clock
        self._sleep = sleep
        # Local daemon URLs must not go through an http_proxy set for the job.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __repr__(self) -> str:
        return f"Client(url={self.url!r}, store={str(self._store) if self._store else None!r})"

    # -- HTTP --------------------------------------------------------------------------

    def _get_json(self, path: str, query: Mapping[str, str] | None = None) -> Any:
        url = self.url + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        request = urllib.request.Request(url, headers={"Accept": "application/json"})
        try:
            with self._opener.open(request, timeout=self.timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise _NotServed(f"{url}: not served by this daemon (HTTP 404)") from None
            raise GpuwatchdError(f"{url}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise GpuwatchdUnavailable(
                f"gpuwatchd daemon not reachable at {self.url}: {reason} "
                f"(is it running? set {URL_ENV} or pass url=)"
            ) from None
        try:
            return json.loads(body)
        except ValueError:
            raise GpuwatchdError(f"{url}: response is not JSON") from None

    def state_document(self) -> dict[str, Any]:
        """The raw ``/api/v1/state`` document."""
        doc = self._get_json(STATE_PATH)
        if not isinstance(doc, dict) or not isinstance(doc.get("gpus"), list):
            raise GpuwatchdError(f"{self.url}{STATE_PATH}: not a gpuwatchd state document")
        return doc

    # -- state -------------------------------------------------------------------------

    def state(self, gpu: int | str) -> GpuState:
        """The daemon's view of one GPU: ``gpu`` is its index or its UUID.

        With this process holding a CUDA context on the GPU the daemon says ``busy``;
        :meth:`wait_until_stable` accounts for that, a single reading cannot.
        """
        return _find_gpu(self.state_document(), gpu, self.url)

    def wait_until_stable(
        self,
        gpu: int | str,
        timeout: float = 600.0,
        poll_s: float = 0.5,
        *,
        own_pids: Iterable[int] | None = None,
        on_poll: Callable[[GpuState], None] | None = None,
    ) -> GpuState:
        """Block until the GPU's gate is open and its reading fresh; return that state.

        ``own_pids`` (default: this process) are left out of the busy check: while one
        of them is on the GPU the gate is re-run here on the daemon's samples (needs
        ``poll_s`` small enough to gather the gate's ``min_samples``; it is lowered to
        fit). Re-run here, the gate first waits its ``settle_s`` (10 s by default) of
        evidence, however long the GPU was quiet before. ``on_poll`` sees every state
        judged (to log why a job waits). Raises TimeoutError naming the last state and
        its reasons, and GpuwatchdUnavailable when the daemon stops answering.
        """
        _check_seconds(timeout, "timeout", allow_zero=True)
        _check_seconds(poll_s, "poll_s", allow_zero=False)
        own = frozenset(own_pids) if own_pids is not None else frozenset({os.getpid()})
        deadline = self._clock() + timeout
        local: _OwnProcessGate | None = None
        while True:
            doc = self.state_document()
            st = _find_gpu(doc, gpu, self.url)
            pause = poll_s
            if own & set(st.compute_pids or ()):
                if local is None:
                    local = _OwnProcessGate(_gate_config(doc, self.url), own)
                st = local.judge(st)
                pause = min(poll_s, local.max_poll_s)
            else:
                local = None
            if on_poll is not None:
                on_poll(st)
            if st.ready:
                return st
            left = deadline - self._clock()
            if left <= 0:
                raise TimeoutError(
                    f"gpu {gpu}: gate not open after {timeout:g}s; last: {st.describe()}"
                )
            self._sleep(min(pause, left))

    # -- winners -----------------------------------------------------------------------

    def winners(
        self,
        *,
        workload: str | None = None,
        regime: Regime | str | None = None,
        gpu_model: str | None = None,
    ) -> list[Winner]:
        """The newest winner per (GPU model, workload, regime) matching the filters."""
        filters: dict[str, Any] = {
            "workload": _opt_name(workload, "workload"),
            "regime": _regime(regime),
            "gpu_model": _opt_name(gpu_model, "gpu_model"),
        }
        problems: list[str] = []
        if not self._store_given:
            query = {k: str(v) for k, v in filters.items() if v is not None}
            try:
                return parse_winners(self._get_json(WINNERS_PATH, query), self.url)
            except GpuwatchdError as exc:  # down, too old to serve winners, or garbage
                problems.append(str(exc))
        try:
            path = self._store_path()
            with Store(path, readonly=True) as store:
                doc = winners_json(store, **filters)
            return parse_winners(doc, str(path))
        except StoreError as exc:
            problems.append(str(exc))
        raise GpuwatchdUnavailable("no winners source: " + "; ".join(problems))

    def winner(
        self, workload: str, regime: Regime | str, gpu_model: str | None = None
    ) -> Winner | None:
        """The recorded winner of ``workload`` in ``regime``; None when none is recorded.

        ``gpu_model=None`` takes the most recently measured of any GPU model: pass it on
        a host whose GPUs are of several models.
        """
        if not isinstance(workload, str) or not workload:
            raise ValueError(f"workload: expected a workload name, got {workload!r}")
        if regime is None:
            raise ValueError("regime: expected one of unthrottled, sustained, got None")
        rows = self.winners(workload=workload, regime=regime, gpu_model=gpu_model)
        return max(rows, key=lambda w: w.measured_at) if rows else None

    def _store_path(self) -> Path:
        if self._store is not None:
            return self._store
        candidates = default_store_paths()
        for path in candidates:
            if path.is_file():
                return path
        raise StoreError(
            "no store file at " + " or ".join(map(str, candidates)) + f" (set {STORE_ENV})"
        )


def _find_gpu(doc: dict[str, Any], gpu: int | str, url: str) -> GpuState:
    if isinstance(gpu, bool) or not isinstance(gpu, int | str):
        raise ValueError(f"gpu: expected a GPU index or UUID, got {gpu!r}")
    tuning = doc.get("tuning")
    running = tuning.get("running_gpus", []) if isinstance(tuning, dict) else []
    running = [g for g in running if isinstance(g, int)] if isinstance(running, list) else []
    want = normalize_uuid(gpu) if isinstance(gpu, str) else None
    seen = []
    for entry in doc["gpus"]:
        index = entry.get("gpu") if isinstance(entry, dict) else None
        uuid = entry.get("uuid") if isinstance(entry, dict) else None
        seen.append(f"{index} ({uuid})" if uuid else str(index))
        if (want is None and index == gpu) or (
            want is not None and isinstance(uuid, str) and normalize_uuid(uuid) == want
        ):
            return parse_gpu_state(entry, running, url)
    watched = ", ".join(seen) or "none"
    raise ValueError(f"gpu {gpu!r}: not watched by the daemon at {url} (GPUs: {watched})")


def _gate_config(doc: dict[str, Any], source: str) -> GateConfig:
    """The daemon's gate thresholds when it publishes them (``gate_config``), else defaults."""
    raw = doc.get("gate_config")
    if raw is None:
        return GateConfig()
    if not isinstance(raw, dict):
        raise GpuwatchdError(f"{source}: bad state document: gate_config: expected an object")
    try:
        return GateConfig.from_mapping(raw)
    except ValueError as e:
        raise GpuwatchdError(f"{source}: bad state document: {e}") from None


def _check_seconds(value: float, name: str, *, allow_zero: bool) -> None:
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: expected a finite number of seconds {bound}, got {value!r}")


def _opt_name(value: str | None, name: str) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{name}: expected a non-empty string, got {value!r}")
    return value


# -- module-level shortcuts ------------------------------------------------------------------


def state(gpu: int | str) -> GpuState:
    """:meth:`Client.state` with the default daemon."""
    return Client().state(gpu)


def wait_until_stable(gpu: int | str, timeout: float = 600.0, poll_s: float = 0.5) -> GpuState:
    """:meth:`Client.wait_until_stable` with the default daemon."""
    return Client().wait_until_stable(gpu, timeout, poll_s)


def winner(workload: str, regime: Regime | str, gpu_model: str | None = None) -> Winner | None:
    """:meth:`Client.winner` with the default daemon and store."""
    return Client().winner(workload, regime, gpu_model)
