"""The ``report --plot`` picture: each candidate's time per thermal regime.

One panel per (workload, GPU model), drawn from a ``gpuwatchd-report/1`` document
(validated here, each bad field named in one line), so the picture shows exactly
what ``gpuwatchd report --format json`` prints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwatchd.report.figure import PlotError, new_figure, save_figure
from gpuwatchd.report.text import REPORT_FORMAT
from gpuwatchd.tuning.types import Regime

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

REGIME_COLORS = {Regime.UNTHROTTLED.value: "#1f77b4", Regime.SUSTAINED.value: "#d62728"}
#: The axis always shows at least this much (percent slower than the fastest).
MIN_AXIS_PCT = 5.0
#: A candidate slower than this many times the panel's median slowdown is an outlier:
#: its bar is cut at the axis end (value printed) so 1-5% differences stay visible.
OUTLIER_FACTOR = 3.0


def axis_cap(pcts: list[float]) -> float | None:
    """Where to end the x axis when slow outliers would flatten the rest; None: no cut.

    ``pcts``: every bar's percent slower than its regime's fastest.
    """
    slower = sorted(p for p in pcts if p > 0)
    if not slower:
        return None
    cap = max(MIN_AXIS_PCT, OUTLIER_FACTOR * slower[len(slower) // 2])
    return cap if slower[-1] > cap else None


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
    cap = axis_cap([(v - 1.0) * 100.0 for r in rel.values() for v in r.values()])
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
            end = min(pct, cap) if cap is not None else pct
            cut = end < pct
            ax.barh(
                y,
                end,
                height=height * 0.9,
                color=color,
                hatch="//" if cut else None,
                xerr=err if t.spread is not None and not cut else None,
                error_kw={"elinewidth": 0.8, "capsize": 2, "ecolor": "0.3"},
                gid=f"bar:{run.regime}:{t.name}",
            )
            left = min(left, pct - err)
            label = f"  {t.median_s * 1e3:.4g} ms" + (f" (+{pct:.0f}%, cut)" if cut else "")
            ax.text(
                end if cut else pct + err,
                y,
                label,
                va="center",
                fontsize=7,
                color="0.25",
                gid=f"cut:{run.regime}:{t.name}" if cut else None,
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
    right = ax.get_xlim()[1] if cap is None else cap * 1.35
    ax.set_xlim(min(-0.03 * right, left * 1.2), right)  # the star at 0 stays whole
    ax.axvline(0, color="0.4", linewidth=0.8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlabel(
        "% slower than the regime's fastest"
        "  (error bar: ± half the IQR;  ★ winner, ☆ fastest of a tie"
        + (";  hatched: slower, cut at the axis end)" if cap is not None else ")")
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
    fig = new_figure(10.0, sum(weights) + 0.5)
    axes = fig.subplots(len(panels), 1, squeeze=False, gridspec_kw={"height_ratios": weights})
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        _draw_panel(ax, panel)
    fig.suptitle("gpuwatchd: candidates per thermal regime")
    return fig


def plot_report(doc: dict[str, Any], path: str | Path) -> Path:
    """Write the ``report --plot`` picture of a report document to ``path``."""
    return save_figure(build_report_figure(doc), path)
