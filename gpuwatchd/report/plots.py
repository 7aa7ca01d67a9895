"""Pictures for operators: each candidate's time per regime, and a GPU timeline.

matplotlib is optional (``pip install 'gpuwatchd[plot]'``): it is imported here, only
when a picture is asked for, so the daemon and the other commands never pay for it.
Figures are built on the Agg canvas directly, never through pyplot: no display, no
global backend switch, safe to call from any thread.

Times in a trace are seconds since its first sample; the store keeps unix seconds. The
two are joined by ``unix_at_t0``, the unix time of trace ``t = 0``: given explicitly,
or read from the trace header's optional ``t0_unix`` key.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwatchd.gate import GateConfig, GateDecision, GateState, evaluate
from gpuwatchd.report.text import REPORT_FORMAT
from gpuwatchd.store.rows import SessionRow
from gpuwatchd.telemetry.trace import T0_UNIX_KEY, Trace, TraceError, load_trace
from gpuwatchd.telemetry.types import DeviceInfo, Sample
from gpuwatchd.tuning.types import Regime

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

INSTALL_HINT = "pip install 'gpuwatchd[plot]'"
DPI = 120

REGIME_COLORS = {Regime.UNTHROTTLED.value: "#1f77b4", Regime.SUSTAINED.value: "#d62728"}
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


class PlotError(ValueError):
    """Input a picture cannot be made from; the message is one line naming the field."""


def _matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError(f"matplotlib is not installed ({INSTALL_HINT})") from None


def _new_figure(width: float, height: float) -> Figure:
    """A Figure on its own Agg canvas: no pyplot state, no display."""
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, path: str | Path, dpi: int = DPI) -> Path:
    """Write ``fig`` to ``path``; the suffix picks the format (.png, .svg, .pdf, ...)."""
    p = Path(path)
    fmt = p.suffix.lstrip(".").lower()
    supported = fig.canvas.get_supported_filetypes()
    if fmt not in supported:
        raise PlotError(
            f"path: cannot tell the image format of {str(p)!r} "
            f"(end it in .png, .svg or .pdf; known: {', '.join(sorted(supported))})"
        )
    if not p.parent.is_dir():  # before rendering, which takes a second
        raise PlotError(f"path: cannot write {p}: no such directory {p.parent}")
    try:
        fig.savefig(p, format=fmt, dpi=dpi)
    except OSError as exc:
        raise PlotError(f"path: cannot write {p}: {exc.strerror or exc}") from None
    return p


# ------------------------------------------------------------------- report picture


@dataclass(frozen=True, slots=True)
class _Timing:
    name: str
    median_s: float | None
    spread: float | None


@dataclass(frozen=True, slots=True)
class _RegimeRun:
    regime: str
    timings: tuple[_Timing, ...]
    winner: str | None
    tie: bool
    margin: float | None


@dataclass(slots=True)
class _Panel:
    workload: str
    gpu_model: str
    differ: bool
    runs: list[_RegimeRun]


def _get(obj: Any, key: str, where: str) -> Any:
    if not isinstance(obj, dict):
        raise PlotError(f"report: {where}: expected an object, got {type(obj).__name__}")
    if key not in obj:
        raise PlotError(f"report: {where}.{key}: missing")
    return obj[key]


def _text(obj: Any, key: str, where: str) -> str:
    value = _get(obj, key, where)
    if not isinstance(value, str) or not value:
        raise PlotError(f"report: {where}.{key}: expected a non-empty string, got {value!r}")
    return value


def _opt_number(
    obj: Any, key: str, where: str, *, minimum: float | None = 0.0, positive: bool = False
) -> float | None:
    """An optional finite number (absent or null: None), ``>= minimum`` or ``> 0``."""
    value = obj.get(key) if isinstance(obj, dict) else _get(obj, key, where)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PlotError(f"report: {where}.{key}: expected a finite number or null, got {value!r}")
    if positive and value <= 0:
        raise PlotError(f"report: {where}.{key}: must be > 0, got {value!r}")
    if minimum is not None and value < minimum:
        raise PlotError(f"report: {where}.{key}: must be >= {minimum:g}, got {value!r}")
    return float(value)


def _panels(doc: Any) -> list[_Panel]:
    """Validate a ``gpuwatchd-report/1`` document and group it per (workload, GPU model)."""
    fmt = _get(doc, "format", "document")
    if fmt != REPORT_FORMAT:
        raise PlotError(f"report: format: expected {REPORT_FORMAT!r}, got {fmt!r}")
    results = _get(doc, "results", "document")
    if not isinstance(results, list):
        raise PlotError(f"report: results: expected a list, got {type(results).__name__}")
    if not results:
        raise PlotError("report: results: empty, nothing to plot (run `gpuwatchd tune` first)")
    differ = doc.get("winners_differ", {})
    if not isinstance(differ, dict):
        raise PlotError("report: winners_differ: expected an object of workload -> bool")
    panels: dict[tuple[str, str], _Panel] = {}
    for i, r in enumerate(results):
        where = f"results[{i}]"
        workload = _text(r, "workload", where)
        gpu_model = r.get("gpu_model") if isinstance(r, dict) else None
        gpu_model = gpu_model if isinstance(gpu_model, str) and gpu_model else "unknown GPU"
        raw = _get(r, "candidates", where)
        if not isinstance(raw, list):
            raise PlotError(f"report: {where}.candidates: expected a list")
        timings = []
        for j, c in enumerate(raw):
            cw = f"{where}.candidates[{j}]"
            timings.append(
                _Timing(
                    _text(c, "name", cw),
                    _opt_number(c, "median_s", cw, positive=True),
                    _opt_number(c, "spread", cw),
                )
            )
        winner = r.get("winner")
        if winner is not None and not isinstance(winner, str):
            raise PlotError(f"report: {where}.winner: expected a string or null, got {winner!r}")
        run = _RegimeRun(
            regime=_text(r, "regime", where),
            timings=tuple(timings),
            winner=winner,
            tie=bool(r.get("tie", False)),
            margin=_opt_number(r, "margin", where, minimum=None),
        )
        key = (workload, gpu_model)
        if key not in panels:
            panels[key] = _Panel(workload, gpu_model, bool(differ.get(workload)), [])
        panels[key].runs.append(run)
    order = {r.value: i for i, r in enumerate(Regime)}
    for panel in panels.values():
        panel.runs.sort(key=lambda run: (order.get(run.regime, len(order)), run.regime))
    return list(panels.values())


def _relative(run: _RegimeRun) -> dict[str, float]:
    """Each timed candidate's median over the regime's fastest (1.0 = fastest)."""
    times = {t.name: t.median_s for t in run.timings if t.median_s is not None}
    if not times:
        return {}
    best = min(times.values())
    return {name: m / best for name, m in times.items()}


def _legend_label(run: _RegimeRun, fastest: str | None) -> str:
    if fastest is None:
        return f"{run.regime}: no accepted timings"
    if run.tie or run.winner is None:
        return f"{run.regime}: tie within noise (fastest {fastest})"
    margin = f" by {run.margin:.1%}" if run.margin is not None else ""
    return f"{run.regime}: winner {run.winner}{margin}"


def _draw_panel(ax: Axes, panel: _Panel) -> None:
    from matplotlib.patches import Patch

    rel = {run.regime: _relative(run) for run in panel.runs}
    names: list[str] = []
    for run in panel.runs:
        names.extend(t.name for t in run.timings if t.name not in names)
    # Fastest first: by the first regime's time, then the next one's.
    names.sort(key=lambda n: tuple(rel[run.regime].get(n, math.inf) for run in panel.runs))
    row = {name: i for i, name in enumerate(names)}
    k = len(panel.runs)
    height = 0.8 / k
    left = 0.0  # leftmost error bar end
    handles: list[Patch] = []  # one per regime, even one without a single timing
    for j, run in enumerate(panel.runs):
        color = REGIME_COLORS.get(run.regime, f"C{j + 2}")
        offset = (j - (k - 1) / 2) * height
        r = rel[run.regime]
        fastest = min(r, key=r.__getitem__) if r else None
        marked = fastest if (run.tie or run.winner is None) else run.winner
        handles.append(Patch(color=color, label=_legend_label(run, fastest)))
        for t in run.timings:
            y = row[t.name] + offset
            if t.median_s is None:
                ax.text(0, y, " no accepted batches", va="center", fontsize=7, color="grey")
                continue
            pct = (r[t.name] - 1.0) * 100.0
            err = r[t.name] * (t.spread or 0.0) / 2 * 100.0
            ax.barh(
                y,
                pct,
                height=height * 0.9,
                color=color,
                xerr=err if t.spread is not None else None,
                error_kw={"elinewidth": 0.8, "capsize": 2, "ecolor": "0.3"},
                gid=f"bar:{run.regime}:{t.name}",
            )
            left = min(left, pct - err)
            ax.text(
                pct + err,
                y,
                f"  {t.median_s * 1e3:.4g} ms",
                va="center",
                fontsize=7,
                color="0.25",
            )
            if t.name == marked:
                tie = run.tie or run.winner is None
                ax.plot(
                    [pct],
                    [y],
                    marker="*",
                    markersize=11,
                    color=color,
                    markerfacecolor="white" if tie else color,
                    markeredgecolor="black",
                    linestyle="none",
                    gid=f"{'tie' if tie else 'winner'}:{run.regime}",
                )
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(len(names) - 0.5, -0.5)  # fastest on top
    ax.margins(x=0.2)  # room for the time labels on the right
    right = ax.get_xlim()[1]
    ax.set_xlim(min(-0.03 * right, left * 1.2), right)  # the star at 0 stays whole
    ax.axvline(0, color="0.4", linewidth=0.8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlabel(
        "% slower than the regime's fastest"
        "  (error bar: ± half the IQR;  ★ winner, ☆ fastest of a tie)"
    )
    flag = "  —  WINNERS DIFFER BETWEEN REGIMES" if panel.differ else ""
    ax.set_title(f"{panel.workload} on {panel.gpu_model}{flag}", loc="left",
                 color="#b00000" if panel.differ else "black", fontweight="bold")  # fmt: skip
    ax.legend(handles=handles, loc="upper right", fontsize=8)  # slow ones sit at the bottom


def build_report_figure(doc: dict[str, Any]) -> Figure:
    """One panel per (workload, GPU model): candidates' median times in each regime.

    Horizontal bars, fastest on top, measured against each regime's fastest so a
    dozen candidates a few percent apart stay readable; the absolute time is printed
    next to each bar.
    """
    panels = _panels(doc)
    rows = [max(1, len({t.name for run in p.runs for t in run.timings})) for p in panels]
    weights = [1.0 + 0.22 * n * len(p.runs) for n, p in zip(rows, panels, strict=True)]
    fig = _new_figure(10.0, sum(weights) + 0.5)
    axes = fig.subplots(len(panels), 1, squeeze=False, gridspec_kw={"height_ratios": weights})
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        _draw_panel(ax, panel)
    fig.suptitle("gpuwatchd: candidates per thermal regime")
    return fig


def plot_report(doc: dict[str, Any], path: str | Path) -> Path:
    """Write the ``report --plot`` picture of a report document to ``path``."""
    return save_figure(build_report_figure(doc), path)


# ----------------------------------------------------------------- timeline picture


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
    window: deque[Sample] = deque()
    prev: GateDecision | None = None
    spans: list[GateSpan] = []
    start = 0.0
    for s in samples:
        window.append(s)
        while len(window) > 1 and window[0].t < s.t - cfg.window_s:
            window.popleft()
        mine = frozenset(s.procs or ()) if _inside(s.t, own) else frozenset()
        prev_state = prev.state if prev is not None else None
        prev = evaluate(list(window), info, cfg, prev, mine)
        if prev.state is not prev_state:
            if prev_state is not None:
                spans.append(GateSpan(start, s.t, prev_state))
            start = s.t
    if prev is not None and samples:
        spans.append(GateSpan(start, samples[-1].t, prev.state))
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
) -> Figure:
    """SM clock, temperature and power of one GPU over time, sessions and gate shaded.

    ``source``: a trace file, a loaded :class:`Trace`, or samples of one GPU (then
    ``info`` gives the max clock, slowdown temperature and power limit). ``sessions``
    are store rows, placed with ``unix_at_t0`` (default: the trace header's
    ``t0_unix``). The gate strip shows ``gate_spans``, or the gate replayed over the
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

    fig = _new_figure(11.0, 9.0 if gate_spans is not None else 8.0)
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


def plot_timeline(
    source: str | Path | Trace | Sequence[Sample],
    path: str | Path,
    sessions: Sequence[SessionRow] = (),
    *,
    gate_cfg: GateConfig | None = None,
    gate_spans: Sequence[GateSpan] | None = None,
    gpu: int | None = None,
    info: DeviceInfo | None = None,
    unix_at_t0: float | None = None,
) -> Path:
    """Write the timeline picture (see :func:`build_timeline_figure`) to ``path``."""
    fig = build_timeline_figure(
        source,
        sessions,
        gate_cfg=gate_cfg,
        gate_spans=gate_spans,
        gpu=gpu,
        info=info,
        unix_at_t0=unix_at_t0,
    )
    return save_figure(fig, path)
