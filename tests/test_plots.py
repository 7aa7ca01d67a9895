"""Pictures: the report per regime and the GPU timeline (matplotlib, Agg, no display)."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from builders import session_meta

pytest.importorskip("matplotlib")

from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from gpuwatchd.gate import GateConfig, GateState
from gpuwatchd.report.figure import PlotError, save_figure
from gpuwatchd.report.results_plot import axis_cap, build_report_figure, plot_report
from gpuwatchd.report.text import report_from
from gpuwatchd.report.timeline_plot import (
    GateSpan,
    build_timeline_figure,
    regime_spans,
    replay_gate,
    session_spans,
)
from gpuwatchd.store import sqlite_store
from gpuwatchd.store.rows import SessionRow, StoredResult, Versions
from gpuwatchd.telemetry.trace import load_trace
from gpuwatchd.telemetry.types import DeviceInfo, Sample
from gpuwatchd.tuning.types import (
    CandidateStats,
    Regime,
    RegimeResult,
    SessionStatus,
)

DATA = Path(__file__).parent / "data"
BURN = DATA / "h200-matmul-burn.jsonl"  # 5 s idle, 60 s power-capped matmul, 45 s idle
DAEMON_BURN = DATA / "h200-daemon-burn.jsonl"  # has process counts
GEMM_REPORT = Path(__file__).parent.parent / "bench" / "data" / "h200-gemm-report.json"
T0 = 1_750_000_000.0
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def gids(fig: Figure, prefix: str) -> list[str]:
    """The gid of every artist in the figure whose gid starts with ``prefix``."""
    found = fig.findobj(lambda a: (a.get_gid() or "").startswith(prefix))
    return [a.get_gid() or "" for a in found]


def with_gid(fig: Figure, gid: str) -> list[Any]:
    """Every artist in the figure whose gid is exactly ``gid``."""
    return fig.findobj(lambda a: a.get_gid() == gid)


def x_extent(artist: Any) -> tuple[float, float]:
    """(left, right) of an axvspan: a Rectangle since matplotlib 3.9, a Polygon before."""
    if hasattr(artist, "get_width"):
        return artist.get_x(), artist.get_x() + artist.get_width()
    xs = [x for x, _ in artist.get_xy()]
    return min(xs), max(xs)


# ------------------------------------------------------------------------ report


def cand(name: str, median_ms: float | None, spread: float | None = 0.02) -> CandidateStats:
    return CandidateStats(
        name=name,
        family="test",
        regime=Regime.UNTHROTTLED,
        median_s=None if median_ms is None else median_ms / 1e3,
        spread=spread,
        samples=10,
        rejected=0,
        sm_clock_hz=1.98e9,
        power_w=300.0,
        temp_c=50.0,
        energy_j_per_call=None,
        reasons=0,
    )


def stored(workload: str, regime: Regime, cands: list[CandidateStats], **kw: Any) -> StoredResult:
    result = RegimeResult(
        workload=workload,
        regime=regime,
        candidates=tuple(cands),
        winner=kw.get("winner", cands[0].name),
        tie=kw.get("tie", False),
        margin=kw.get("margin", 0.03),
        noise=0.01,
    )
    return StoredResult(1, "NVIDIA H200", "GPU-1", Versions(), T0, result)


def twelve(regime: Regime) -> list[CandidateStats]:
    """12 candidates; cuBLAS is fastest when cool, triton[0] when hot."""
    names = ["cublas", *(f"triton[{i}]" for i in range(11))]
    if regime is Regime.UNTHROTTLED:
        times = [1.00 + 0.01 * i for i in range(12)]
    else:
        times = [1.30, 1.25, *(1.40 + 0.01 * i for i in range(10))]
    return sorted((cand(n, t) for n, t in zip(names, times, strict=True)),
                  key=lambda c: c.median_s or 0)  # fmt: skip


@pytest.fixture(scope="module")
def flip_doc() -> dict[str, Any]:
    return report_from(
        [
            stored("gemm", Regime.UNTHROTTLED, twelve(Regime.UNTHROTTLED), winner="cublas"),
            stored("gemm", Regime.SUSTAINED, twelve(Regime.SUSTAINED), winner="triton[0]"),
        ]
    )


def test_report_panel_shows_each_regime_with_winner_and_flip(flip_doc: dict[str, Any]) -> None:
    assert flip_doc["winners_differ"] == {"gemm": True}
    fig = build_report_figure(flip_doc)
    (ax,) = fig.axes
    assert "gemm on NVIDIA H200" in ax.get_title(loc="left")
    assert "WINNERS DIFFER" in ax.get_title(loc="left")
    assert len(gids(fig, "bar:unthrottled:")) == 12 and len(gids(fig, "bar:sustained:")) == 12
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[:3] == ["cublas", "triton[0]", "triton[1]"]  # fastest (cool) first
    assert ax.yaxis_inverted()  # ... and on top
    # The winner of each regime is starred on its own row, at 0 % slower.
    for regime, row in (("unthrottled", 0), ("sustained", 1)):
        (star,) = with_gid(fig, f"winner:{regime}")
        assert star.get_xdata()[0] == pytest.approx(0.0)
        assert round(star.get_ydata()[0]) == row
    # cuBLAS is 1.30 / 1.25 - 1 = 4 % slower than triton[0] when hot.
    (hot_cublas,) = with_gid(fig, "bar:sustained:cublas")
    assert hot_cublas.get_width() == pytest.approx(4.0)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]  # type: ignore[union-attr]
    assert legend == ["unthrottled: winner cublas by 3.0%", "sustained: winner triton[0] by 3.0%"]
    texts = {t.get_text().strip() for t in ax.texts}
    assert "1.3 ms" in texts and "1 ms" in texts  # absolute times next to the bars


def test_a_slow_outlier_is_cut_so_small_differences_stay_readable() -> None:
    cands = [cand("fast", 1.00), cand("a", 1.01), cand("b", 1.03), cand("c", 1.05),
             cand("eager-fallback", 4.0)]  # fmt: skip
    fig = build_report_figure(report_from([stored("gemm", Regime.UNTHROTTLED, cands)]))
    (ax,) = fig.axes
    right = ax.get_xlim()[1]
    assert right < 25  # not stretched to the outlier's +300%
    (slow,) = with_gid(fig, "bar:unthrottled:eager-fallback")
    assert slow.get_width() < right and slow.get_hatch() == "//"  # cut, and marked as cut
    (label,) = with_gid(fig, "cut:unthrottled:eager-fallback")
    assert "4 ms (+300%, cut)" in label.get_text()
    (b,) = with_gid(fig, "bar:unthrottled:b")
    assert b.get_width() == pytest.approx(3.0) and b.get_width() / right > 0.1  # visible
    assert "cut at the axis end" in ax.get_xlabel()


def test_axis_cap_only_cuts_real_outliers() -> None:
    assert axis_cap([0.0, 1.0, 2.0, 3.0, 5.0, 300.0]) == pytest.approx(9.0)
    assert axis_cap([0.0, 1.0, 2.0, 3.0]) is None  # nothing far out
    assert axis_cap([0.0, 20.0, 40.0, 60.0]) is None  # wide, but even
    assert axis_cap([0.0, 0.5, 4.9]) is None  # within the 5 % the axis always shows
    assert axis_cap([0.0]) is None and axis_cap([]) is None


def test_report_png_is_written(flip_doc: dict[str, Any], tmp_path: Path) -> None:
    out = plot_report(flip_doc, tmp_path / "report.png")
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000


def test_ties_and_candidates_without_timings() -> None:
    cands = [cand("a", 1.0), cand("b", 1.001), cand("c", None, spread=None)]
    doc = report_from([stored("conv", Regime.SUSTAINED, cands, winner=None, tie=True)])
    fig = build_report_figure(doc)
    (ax,) = fig.axes
    assert "DIFFER" not in ax.get_title(loc="left")
    assert gids(fig, "tie:") == ["tie:sustained"] and gids(fig, "winner:") == []
    assert len(gids(fig, "bar:")) == 2
    assert any("no accepted batches" in t.get_text() for t in ax.texts)
    (label,) = ax.get_legend().get_texts()  # type: ignore[union-attr]
    assert label.get_text() == "sustained: tie within noise (fastest a)"


def test_regime_without_any_timing_still_has_its_legend(recwarn: pytest.WarningsRecorder) -> None:
    empty = [cand("a", None, spread=None), cand("b", None, spread=None)]
    doc = report_from([stored("gemm", Regime.SUSTAINED, empty, winner=None, tie=False)])
    fig = build_report_figure(doc)
    (ax,) = fig.axes
    assert gids(fig, "bar:") == [] and gids(fig, "tie:") == []
    (label,) = ax.get_legend().get_texts()  # type: ignore[union-attr]
    assert label.get_text() == "sustained: no accepted timings"
    assert [str(w.message) for w in recwarn] == []


def test_real_h200_report_is_one_panel_per_workload() -> None:
    doc = json.loads(GEMM_REPORT.read_text())
    fig = build_report_figure(doc)
    assert len(fig.axes) == 2
    assert len(gids(fig, "bar:")) == 2 * 2 * 12
    assert [ax.get_title(loc="left") for ax in fig.axes] == [
        "gemm-bf16-4096x4096x16384 on NVIDIA H200",
        "gemm-bf16-8192 on NVIDIA H200",
    ]


def _doc_with(path: str, value: object) -> dict[str, Any]:
    doc = report_from([stored("gemm", Regime.UNTHROTTLED, [cand("a", 1.0), cand("b", 2.0)])])
    target: Any = doc
    *parents, last = path.split(".")
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    target[last] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        ("format", "gpuwatchd-report/9", "format: expected 'gpuwatchd-report/1'"),
        ("results", [], "results: empty, nothing to plot"),
        ("results.0.candidates.1.median_s", "fast", "results[0].candidates[1].median_s"),
        ("results.0.candidates.0.median_s", 0, "results[0].candidates[0].median_s: must be > 0"),
        ("results.0.candidates.1.spread", -1, "results[0].candidates[1].spread: must be >= 0"),
        ("results.0.workload", 3, "results[0].workload: expected a non-empty string"),
        ("results.0.winner", 1, "results[0].winner: expected a string or null"),
    ],
)
def test_bad_report_fields_are_named(path: str, value: object, needle: str) -> None:
    with pytest.raises(PlotError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        build_report_figure(_doc_with(path, value))


def test_bad_output_paths(flip_doc: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(PlotError, match=r"path: cannot tell the image format .*\.png"):
        plot_report(flip_doc, tmp_path / "report.pgn")
    with pytest.raises(PlotError, match=r"path: cannot write .*: no such directory"):
        plot_report(flip_doc, tmp_path / "missing" / "report.png")


def test_missing_matplotlib_is_one_clear_line(
    flip_doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotError, match=r"^matplotlib is not installed \(pip install"):
        build_report_figure(flip_doc)


# ---------------------------------------------------------------------- timeline


def session(sid: int, start: float, end: float | None, status: SessionStatus) -> SessionRow:
    meta = session_meta(gpu_uuid="GPU-1", workloads=(), regimes=(), started_at=T0 + start)
    return SessionRow(sid, meta, status, None, None if end is None else T0 + end)


SESSIONS = [
    session(1, 4.0, 66.0, SessionStatus.COMPLETED),
    session(2, 80.0, 88.0, SessionStatus.PREEMPTED),
    session(3, 95.0, 95.0, SessionStatus.DEFERRED),
    session(4, 500.0, 600.0, SessionStatus.FAILED),  # after the trace: not drawn
]


@pytest.fixture(scope="module")
def timeline() -> Figure:
    return build_timeline_figure(BURN, SESSIONS, gate_cfg=GateConfig(), unix_at_t0=T0)


def test_timeline_panels_series_and_limits(timeline: Figure) -> None:
    clock, temp, power, gate = timeline.axes
    assert [ax.get_ylabel() for ax in timeline.axes] == [
        "SM clock (MHz)", "temperature (°C)", "power (W)", "gate",
    ]  # fmt: skip
    assert [ax.get_title(loc="left") for ax in (clock, temp, power)] == [
        "SM clock", "Temperature", "Power",
    ]  # fmt: skip
    (sm,) = with_gid(timeline, "series:sm_clock_mhz")
    assert len(sm.get_xdata()) == 2176
    assert min(sm.get_ydata()) < 1450 < 1980 == max(sm.get_ydata())
    refs = [with_gid(timeline, f"ref:{g}")[0] for g in ("max_sm_clock", "slowdown_temp",
                                                         "power_limit")]  # fmt: skip
    assert [r.get_ydata()[0] for r in refs] == [1980, 89, 700]
    assert all(r.get_linestyle() == "--" for r in refs)
    assert clock.get_xlim() == pytest.approx((0.0, 109.98))
    assert gate.get_xlabel() == "seconds since trace start (2025-06-15 15:06:40 UTC)"


def test_timeline_shades_sessions_on_every_panel(timeline: Figure) -> None:
    assert gids(timeline, "session:1") == ["session:1"] * 3
    assert gids(timeline, "session:2") == ["session:2"] * 3
    assert gids(timeline, "session:3") == ["session:3"] * 3  # zero length: a line
    assert gids(timeline, "session:4") == []
    (span, *_) = with_gid(timeline, "session:1")
    assert x_extent(span) == pytest.approx((4.0, 66.0))  # aligned by wall time
    title = timeline.get_suptitle()
    assert "GPU 0 NVIDIA H200: h200-matmul-burn.jsonl" in title
    assert "3 tuning session(s) shown, 1 outside the trace not shown" in title


def test_timeline_gate_strip_is_the_replayed_gate(timeline: Figure) -> None:
    strips = {a.get_gid(): a for a in timeline.axes[3].collections if isinstance(a, PolyCollection)}
    assert {"gate:throttled", "gate:warming", "gate:cool_stable"} <= set(strips)
    spans = replay_gate(load_trace(BURN).samples[0], load_trace(BURN).devices[0], GateConfig())
    throttled = [s for s in spans if s.state is GateState.THROTTLED]
    # The power-capped matmul (t 4.8-64.8 s) is one throttled stretch; open only after.
    assert len(throttled) == 1 and 4.8 < throttled[0].start < 5.2
    assert 64.5 < throttled[0].end < 66.0
    assert spans[-1].state is GateState.COOL_STABLE and spans[-1].start > 74.8
    assert all(a.end == b.start for a, b in itertools.pairwise(spans))  # no gaps


def test_timeline_png_is_written(tmp_path: Path) -> None:
    gate = [GateSpan(0.0, 50.0, GateState.WARMING), GateSpan(50.0, 110.0, GateState.COOL_STABLE)]
    out = save_figure(build_timeline_figure(BURN, gate_spans=gate), tmp_path / "t.png")
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000


def test_start_time_from_the_trace_header(tmp_path: Path) -> None:
    lines = BURN.read_text().splitlines()
    header = json.loads(lines[0])
    header["t0_unix"] = T0 + 10.0  # the recording began 10 s after T0
    trace = tmp_path / "with-t0.jsonl"
    trace.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    fig = build_timeline_figure(trace, SESSIONS[:1])
    assert len(fig.axes) == 3  # no gate strip asked for
    (span, *_) = with_gid(fig, "session:1")
    assert x_extent(span) == pytest.approx((-6.0, 56.0))
    header["t0_unix"] = "yesterday"
    trace.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    with pytest.raises(PlotError, match=r"with-t0.jsonl:1: field 't0_unix'"):
        build_timeline_figure(trace)


def test_sessions_from_a_real_store(tmp_path: Path) -> None:
    store = sqlite_store(tmp_path / "s.db", now=lambda: T0 + 20.0)
    try:
        meta = session_meta(gpu_uuid="GPU-1", workloads=(), regimes=(Regime.SUSTAINED,))
        sid = store.start_session(meta)
        store.finish_session(sid, SessionStatus.PREEMPTED, "busy", ended_at=T0 + 30.0)
        running = store.start_session(meta)
        rows = store.sessions()
    finally:
        store.close()
    spans = session_spans(rows, T0)
    assert [(s.id, s.start, s.end, s.status) for s in spans] == [
        (sid, 20.0, 30.0, "preempted"),
        (running, 20.0, None, "running"),
    ]
    fig = build_timeline_figure(BURN, rows, unix_at_t0=T0)
    (span, *_) = with_gid(fig, f"session:{running}")
    assert x_extent(span)[1] == pytest.approx(109.98)  # still running: shaded to the trace's end


def test_own_worker_is_not_busy_during_its_session() -> None:
    trace = load_trace(DAEMON_BURN)
    samples, info = trace.samples[0], trace.devices[0]
    plain = replay_gate(samples, info, GateConfig())
    assert GateState.BUSY in {s.state for s in plain}  # the recorded process counts
    whole = session_spans([session(1, 0.0, 80.0, SessionStatus.COMPLETED)], T0)
    own = replay_gate(samples, info, GateConfig(), own=whole)
    assert GateState.BUSY not in {s.state for s in own}
    assert GateState.THROTTLED in {s.state for s in own}


def test_timeline_marks_the_regime_each_session_measured() -> None:
    def result(regime: Regime, at: float) -> StoredResult:
        res = RegimeResult("gemm", regime, (cand("a", 1.0),), "a", False, 0.03, 0.01)
        return StoredResult(1, "NVIDIA H200", "GPU-1", Versions(), T0 + at, res)

    results = {1: [result(Regime.SUSTAINED, 66.0), result(Regime.UNTHROTTLED, 30.0)]}
    spans = regime_spans(SESSIONS[:1], results, T0)
    assert [(s.regime, s.start, s.end) for s in spans] == [
        ("unthrottled", 4.0, 30.0),  # from the session's start (worker start-up included)
        ("sustained", 30.0, 66.0),
    ]
    fig = build_timeline_figure(BURN, SESSIONS, unix_at_t0=T0, results=results)
    clock = fig.axes[0]
    assert gids(fig, "regime:") == ["regime:1:unthrottled", "regime:1:sustained"]
    texts = {t.get_text() for t in clock.texts}
    assert {"unthrottled", "sustained"} <= texts
    plain = build_timeline_figure(BURN, SESSIONS, unix_at_t0=T0)  # no results: no band
    assert gids(plain, "regime:") == []


def test_plain_samples_with_device_info() -> None:
    info = DeviceInfo(index=1, uuid="GPU-2", name="Sim GPU", max_sm_clock_mhz=1500.0)
    samples = [Sample(gpu=1, t=float(i), temp_c=40.0 + i, power_w=None, sm_clock_mhz=1500.0)
               for i in range(10)]  # fmt: skip
    fig = build_timeline_figure(samples, info=info)
    assert "GPU 1 Sim GPU" in fig.get_suptitle()
    assert gids(fig, "ref:") == ["ref:max_sm_clock"]  # no slowdown or limit known
    (power,) = with_gid(fig, "series:power_w")
    assert all(v != v for v in power.get_ydata())  # NaN: a gap
    two = [*samples, Sample(gpu=2, t=20.0)]
    with pytest.raises(PlotError, match="gpu: the samples cover several GPUs"):
        build_timeline_figure(two)
    with pytest.raises(PlotError, match="samples: none to plot for GPU 5"):
        build_timeline_figure(two, gpu=5)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"sessions": SESSIONS}, "unix_at_t0: the trace header has no 't0_unix'"),
        ({"gpu": 3}, r"gpu: GPU 3 is not in .*h200-matmul-burn.jsonl \(it has \[0\]\)"),
        ({"unix_at_t0": float("nan")}, "unix_at_t0: expected unix seconds"),
        ({"gate_cfg": GateConfig(), "gate_spans": []}, "gate: give gate_cfg .* not both"),
    ],
)
def test_bad_timeline_inputs(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(PlotError, match=needle):
        build_timeline_figure(BURN, **kwargs)


def test_bad_trace_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(PlotError, match=r"nope.jsonl: cannot read"):
        build_timeline_figure(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "other"}\n')
    with pytest.raises(PlotError, match=r"bad.jsonl:1: field 'format'") as exc:
        build_timeline_figure(bad)
    assert "\n" not in str(exc.value)
