"""The ``plot-timeline`` picture: one GPU's clock, temperature and power over time.

Tuning sessions from the store are shaded, the regime each one was measuring is marked
in a band along the top of the clock panel, and the gate, replayed over the samples,
runs in a strip below. Times in a trace are seconds since its first sample; the store
keeps unix seconds. The two are joined by ``unix_at_t0``, the unix time of trace
``t = 0``: given explicitly, or read from the trace header's optional ``t0_unix`` key.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from gpuwatchd.gate import GateConfig, GateState
from gpuwatchd.monitor.watch import GpuWatch
from gpuwatchd.report.figure import PlotError, new_figure
from gpuwatchd.store.rows import SessionRow, StoredResult
from gpuwatchd.telemetry.trace import T0_UNIX_KEY, Trace, TraceError, load_trace
from gpuwatchd.telemetry.types import DeviceInfo, Sample

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

STATUS_COLORS = {
    "completed": "#2ca02c",
    "preempted": "#ff7f0e",
    "failed": "#d62728",
    "running": "#1f77b4",
    "deferred": "#7f7f7f",
}
GATE_COLORS = {
    GateState.COOL_STABLE: "#2ca02c",
    GateState.WARMING: "#ffbf00",
    GateState.THROTTLED: "#d62728",
    GateState.BUSY: "#9467bd",
    GateState.UNAVAILABLE: "#7f7f7f",
}


@dataclass(frozen=True, slots=True)
class GateSpan:
    """The gate held ``state`` from ``start`` to ``end`` (trace seconds)."""

    start: float
    end: float
    state: GateState


@dataclass(frozen=True, slots=True)
class SessionSpan:
    """A tuning session on the trace's time axis; ``end`` None: still running."""

    id: int
    start: float
    end: float | None
    status: str


@dataclass(frozen=True, slots=True)
class RegimeSpan:
    """A session measuring ``regime`` of ``workload`` from ``start`` to ``end`` (trace s)."""

    session_id: int
    start: float
    end: float
    regime: str
    workload: str


def regime_spans(
    rows: Iterable[SessionRow],
    results: Mapping[int, Sequence[StoredResult]],
    unix_at_t0: float,
) -> list[RegimeSpan]:
    """When each session measured each regime, on the trace's time axis.

    The store keeps when each (workload, regime) result arrived; a session measures them
    one after another, so each ran from the previous result (or the session's start, the
    worker's start-up included) to its own.
    """
    spans: list[RegimeSpan] = []
    for row in rows:
        start = row.started_at
        for res in sorted(results.get(row.id, ()), key=lambda r: r.recorded_at):
            end = max(res.recorded_at, start)
            r = res.result
            spans.append(
                RegimeSpan(row.id, start - unix_at_t0, end - unix_at_t0, r.regime.value, r.workload)
            )
            start = end
    return spans


def trace_t0_unix(path: str | Path) -> float | None:
    """The header's ``t0_unix`` (unix seconds at ``t = 0``), or None when absent."""
    try:
        with Path(path).open(encoding="utf-8") as fh:
            header = json.loads(fh.readline())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # load_trace reports an unreadable file properly
    value = header.get(T0_UNIX_KEY) if isinstance(header, dict) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise PlotError(f"{path}:1: field '{T0_UNIX_KEY}': expected unix seconds, got {value!r}")
    return float(value)


def session_spans(rows: Iterable[SessionRow], unix_at_t0: float) -> list[SessionSpan]:
    """Store sessions (unix seconds) moved onto the trace's time axis, oldest first."""
    spans = [
        SessionSpan(
            id=r.id,
            start=r.started_at - unix_at_t0,
            end=None if r.ended_at is None else r.ended_at - unix_at_t0,
            status=r.status.value,
        )
        for r in rows
    ]
    return sorted(spans, key=lambda s: (s.start, s.id))


def replay_gate(
    samples: Sequence[Sample],
    info: DeviceInfo | None,
    cfg: GateConfig,
    own: Sequence[SessionSpan] = (),
) -> list[GateSpan]:
    """What the gate decided, sample by sample, as the poller feeds it (O(n · window)).

    Compute processes seen during one of the ``own`` spans are taken as the tuning
    worker (as the live poller knows its own PIDs), so our own load shows as
    throttled or warming rather than busy.
    """
    mine: frozenset[int] = frozenset()  # read by the watch at each judgement
    watch = GpuWatch(cfg, own_pids=lambda: mine)
    spans: list[GateSpan] = []
    start = 0.0
    for s in samples:
        watch.add(s)
        mine = frozenset(s.procs or ()) if _inside(s.t, own) else frozenset()
        prev_state = watch.decision.state if watch.decision is not None else None
        state = watch.judge(info).state
        if state is not prev_state:
            if prev_state is not None:
                spans.append(GateSpan(start, s.t, prev_state))
            start = s.t
    if watch.decision is not None and samples:
        spans.append(GateSpan(start, samples[-1].t, watch.decision.state))
    return spans


def _inside(t: float, spans: Sequence[SessionSpan]) -> bool:
    return any(sp.start <= t <= (sp.end if sp.end is not None else math.inf) for sp in spans)


@dataclass(frozen=True, slots=True)
class _Series:
    label: str
    info: DeviceInfo | None
    samples: tuple[Sample, ...]
    events: tuple[tuple[float, str], ...]
    t0_unix: float | None


def _series(
    source: str | Path | Trace | Sequence[Sample], gpu: int | None, info: DeviceInfo | None
) -> _Series:
    if isinstance(source, str | Path):
        try:
            trace = load_trace(source)
        except TraceError as exc:
            raise PlotError(str(exc)) from None
        return _from_trace(trace, gpu, trace_t0_unix(source))
    if isinstance(source, Trace):
        return _from_trace(source, gpu, None)
    samples = tuple(s for s in source if gpu is None or s.gpu == gpu)
    if not samples:
        raise PlotError("samples: none to plot" + (f" for GPU {gpu}" if gpu is not None else ""))
    if len({s.gpu for s in samples}) > 1:
        raise PlotError("gpu: the samples cover several GPUs; pick one with gpu=")
    if any(b.t < a.t for a, b in itertools.pairwise(samples)):
        raise PlotError("samples: time goes backwards; give them oldest first")
    return _Series(f"GPU {samples[0].gpu}", info, samples, (), None)


def _from_trace(trace: Trace, gpu: int | None, t0_unix: float | None) -> _Series:
    if gpu is None:
        gpu = min(trace.samples)
    if gpu not in trace.samples:
        raise PlotError(f"gpu: GPU {gpu} is not in {trace.path} (it has {sorted(trace.samples)})")
    events = tuple((e.t, e.what) for e in trace.events)
    return _Series(Path(trace.path).name, trace.devices.get(gpu), trace.samples[gpu], events,
                   t0_unix)  # fmt: skip


def _values(samples: Sequence[Sample], field: str) -> list[float]:
    return [math.nan if (v := getattr(s, field)) is None else v for s in samples]


def build_timeline_figure(
    source: str | Path | Trace | Sequence[Sample],
    sessions: Sequence[SessionRow] = (),
    *,
    gate_cfg: GateConfig | None = None,
    gate_spans: Sequence[GateSpan] | None = None,
    gpu: int | None = None,
    info: DeviceInfo | None = None,
    unix_at_t0: float | None = None,
    results: Mapping[int, Sequence[StoredResult]] | None = None,
) -> Figure:
    """SM clock, temperature and power of one GPU over time, sessions and gate shaded.

    ``source``: a trace file, a loaded :class:`Trace`, or samples of one GPU (then
    ``info`` gives the max clock, slowdown temperature and power limit). ``sessions``
    are store rows, placed with ``unix_at_t0`` (default: the trace header's
    ``t0_unix``). ``results`` (session id -> its stored results) marks the regimes each
    session measured. The gate strip shows ``gate_spans``, or the gate replayed over the
    samples with ``gate_cfg``.
    """
    if gate_cfg is not None and gate_spans is not None:
        raise PlotError("gate: give gate_cfg (replay the gate) or gate_spans, not both")
    series = _series(source, gpu, info)
    if unix_at_t0 is not None and not (math.isfinite(unix_at_t0) and unix_at_t0 > 0):
        raise PlotError(f"unix_at_t0: expected unix seconds, got {unix_at_t0!r}")
    t0 = unix_at_t0 if unix_at_t0 is not None else series.t0_unix
    if sessions and t0 is None:
        raise PlotError(
            f"unix_at_t0: the trace header has no '{T0_UNIX_KEY}', so the sessions cannot "
            "be placed on it; give the unix time of trace t=0"
        )
    samples = series.samples
    t_lo, t_hi = samples[0].t, samples[-1].t
    spans = session_spans(sessions, t0) if t0 is not None else []
    shown = [s for s in spans if s.start <= t_hi and (s.end is None or s.end >= t_lo)]
    if gate_cfg is not None:
        gate_spans = replay_gate(samples, series.info, gate_cfg, own=shown)

    fig = new_figure(11.0, 9.0 if gate_spans is not None else 8.0)
    ratios = [3.0, 3.0, 3.0] + ([0.7] if gate_spans is not None else [])
    axes = list(fig.subplots(len(ratios), 1, sharex=True, gridspec_kw={"height_ratios": ratios}))
    t = [s.t for s in samples]
    dev = series.info
    panels = (
        ("SM clock", "SM clock (MHz)", "sm_clock_mhz", "C0",
         dev.max_sm_clock_mhz if dev else None, "max {:.0f} MHz", "max_sm_clock"),
        ("Temperature", "temperature (°C)", "temp_c", "C3",
         dev.slowdown_temp_c if dev else None, "slowdown {:.0f} °C", "slowdown_temp"),
        ("Power", "power (W)", "power_w", "C2",
         dev.power_limit_w if dev else None, "limit {:.0f} W", "power_limit"),
    )  # fmt: skip
    for ax, (title, ylabel, field, color, ref, ref_fmt, ref_gid) in zip(axes, panels, strict=False):
        ax.plot(t, _values(samples, field), color=color, linewidth=1.0, label=title,
                gid=f"series:{field}")  # fmt: skip
        if ref is not None:
            ax.axhline(ref, color=color, linestyle="--", linewidth=1.0,
                       label=ref_fmt.format(ref), gid=f"ref:{ref_gid}")  # fmt: skip
        ax.set_title(title, loc="left", fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    _draw_events(axes[:3], series.events, t_lo, t_hi)
    _draw_sessions(axes[:3], shown, t_hi)
    if results and t0 is not None:
        ids = {s.id for s in shown}
        rows = [r for r in sessions if r.id in ids]
        _draw_regimes(axes[0], regime_spans(rows, results, t0), t_lo, t_hi)
    for ax in axes[:3]:
        ax.legend(loc="upper right", fontsize=7)
    if gate_spans is not None:
        _draw_gate(axes[3], gate_spans)
    axes[-1].set_xlim(t_lo, t_hi)
    axes[-1].set_xlabel(
        "seconds since trace start"
        + (f" ({datetime.fromtimestamp(t0, UTC):%Y-%m-%d %H:%M:%S} UTC)" if t0 else "")
    )
    name = f"GPU {dev.index} {dev.name}" if dev else series.label
    hidden = len(spans) - len(shown)
    note = f"{len(shown)} tuning session(s) shown" + (
        f", {hidden} outside the trace not shown" if hidden else ""
    )
    fig.suptitle(f"{name}: {series.label}\n{note}", fontsize=11)
    return fig


def _draw_events(
    axes: Sequence[Axes], events: Sequence[tuple[float, str]], lo: float, hi: float
) -> None:
    for t, what in events:
        if not lo <= t <= hi:
            continue
        for ax in axes:
            ax.axvline(t, color="0.5", linestyle=":", linewidth=0.8, gid="event")
        label = what if len(what) <= 40 else what[:39] + "…"
        axes[0].annotate(label, (t, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                         va="top", ha="right", fontsize=6, color="0.35")  # fmt: skip


def _draw_sessions(axes: Sequence[Axes], spans: Sequence[SessionSpan], t_end: float) -> None:
    from matplotlib.patches import Patch

    seen: dict[str, None] = {}
    for sp in spans:
        color = STATUS_COLORS.get(sp.status, "#17becf")
        end = sp.end if sp.end is not None else t_end
        for ax in axes:
            if end > sp.start:
                ax.axvspan(sp.start, end, color=color, alpha=0.15, gid=f"session:{sp.id}")
            else:  # zero length (a deferred session): a line, not an invisible span
                ax.axvline(sp.start, color=color, linewidth=1.5, gid=f"session:{sp.id}")
        axes[0].annotate(f"#{sp.id} {sp.status}", (sp.start, 0.02),
                         xycoords=("data", "axes fraction"), fontsize=7, color=color)  # fmt: skip
        seen[sp.status] = None
    if seen:
        handles = [
            Patch(color=STATUS_COLORS.get(s, "#17becf"), alpha=0.3, label=f"tuning {s}")
            for s in seen
        ]
        axes[0].add_artist(axes[0].legend(handles=handles, loc="lower right", fontsize=7))


def _draw_regimes(ax: Axes, spans: Sequence[RegimeSpan], lo: float, hi: float) -> None:
    """A band along the top of ``ax``: which regime each session was measuring, when."""
    from gpuwatchd.report.results_plot import REGIME_COLORS

    band = ax.get_xaxis_transform()  # x in data, y in axes fraction
    several = len({s.workload for s in spans}) > 1
    for sp in spans:
        start, end = max(sp.start, lo), min(sp.end, hi)
        if end <= start:
            continue
        color = REGIME_COLORS.get(sp.regime, "#17becf")
        ax.broken_barh(
            [(start, end - start)],
            (0.92, 0.08),
            transform=band,
            facecolors=color,
            alpha=0.6,
            gid=f"regime:{sp.session_id}:{sp.regime}",
        )
        label = f"{sp.workload} {sp.regime}" if several else sp.regime
        ax.text((start + end) / 2, 0.96, label, transform=band, ha="center", va="center",
                fontsize=6, color="white", clip_on=True)  # fmt: skip


def _draw_gate(ax: Axes, spans: Sequence[GateSpan]) -> None:
    from matplotlib.patches import Patch

    by_state: dict[GateState, list[tuple[float, float]]] = defaultdict(list)
    for sp in spans:
        by_state[sp.state].append((sp.start, max(sp.end - sp.start, 0.0)))
    for state, bars in by_state.items():
        ax.broken_barh(bars, (0.0, 1.0), facecolors=GATE_COLORS[state], gid=f"gate:{state.value}")
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_ylabel("gate", rotation=0, ha="right", va="center")
    handles = [Patch(color=GATE_COLORS[s], label=s.value) for s in GateState if s in by_state]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.9),
              ncol=len(handles), fontsize=7, frameon=False)  # fmt: skip
