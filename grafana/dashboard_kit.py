"""The building blocks both Grafana dashboards are written with.

grafana/build_dashboard.py (per host) and grafana/build_fleet_dashboard.py (the fleet)
hold only their own panels; the query, panel, layout, variable and file-writing code
they share lives here, so both dashboards look, validate and regenerate alike. Every
panel reads its data source from the ``datasource`` template variable, so a dashboard
works imported through Grafana's UI and provisioned from a file or a ConfigMap.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

Panel = dict[str, Any]
#: A section of a dashboard: its row title and its panels with their (width, height).
Section = tuple[str, list[tuple[Panel, int, int]]]

GRID_WIDTH = 24
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
INSTANCE_SEL = 'instance=~"$instance"'
GPU_LEGEND = "{{instance}} GPU {{gpu}}"


def inst(metric: str, extra: str = "") -> str:
    """``metric`` filtered by the instance variable, plus ``extra`` matchers."""
    return f"{metric}{{{INSTANCE_SEL}{', ' + extra if extra else ''}}}"


# -- targets and field settings -------------------------------------------------------


def target(
    expr: str, legend: str = GPU_LEGEND, *, instant: bool = False, table: bool = False
) -> dict[str, Any]:
    """One Prometheus query; its refId is set when the panel is built."""
    t: dict[str, Any] = {
        "datasource": DATASOURCE,
        "refId": "",
        "editorMode": "code",
        "expr": expr,
        "legendFormat": legend,
        "range": not instant,
        "instant": instant,
    }
    if table:
        t["format"] = "table"
    return t


def value_mappings(texts: Mapping[str, tuple[str, str]]) -> list[dict[str, Any]]:
    """Grafana value mappings: value -> (text, colour), in the given order."""
    options = {
        value: {"text": text, "color": color, "index": i}
        for i, (value, (text, color)) in enumerate(texts.items())
    }
    return [{"type": "value", "options": options}]


def dashed(ref_id: str, color: str) -> dict[str, Any]:
    """The override drawing one query (a limit: max clock, power limit) as a dashed line."""
    return {
        "matcher": {"id": "byFrameRefID", "options": ref_id},
        "properties": [
            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
            {"id": "custom.lineWidth", "value": 2},
            {"id": "color", "value": {"mode": "fixed", "fixedColor": color}},
        ],
    }


def thresholds(*steps: tuple[str, float | None]) -> dict[str, Any]:
    """Absolute thresholds: ``(colour, from value)`` steps, the first from ``None``."""
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in steps]}


def panel(
    kind: str,
    title: str,
    description: str,
    targets: Sequence[dict[str, Any]],
    defaults: dict[str, Any],
    options: dict[str, Any],
    overrides: Sequence[dict[str, Any]] = (),
) -> Panel:
    """A panel of ``kind`` with its queries lettered A, B, ... in order."""
    numbered = [{**t, "refId": chr(ord("A") + i)} for i, t in enumerate(targets)]
    return {
        "id": 0,  # numbered by layout()
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {},
        "fieldConfig": {"defaults": defaults, "overrides": list(overrides)},
        "options": options,
        "targets": numbered,
    }


# -- panel kinds ----------------------------------------------------------------------


def timeseries(
    title: str,
    description: str,
    targets: Sequence[dict[str, Any]],
    unit: str,
    *,
    limits: Mapping[str, str] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
) -> Panel:
    """Lines over time; ``limits`` maps a refId to the colour of its dashed line."""
    defaults: dict[str, Any] = {
        "unit": unit,
        "color": {"mode": "palette-classic"},
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 0,
            "showPoints": "never",
            "spanNulls": False,
        },
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    options = {
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    overrides = [dashed(ref, color) for ref, color in (limits or {}).items()]
    return panel("timeseries", title, description, targets, defaults, options, overrides)


def state_timeline(
    title: str,
    description: str,
    targets: Sequence[dict[str, Any]],
    mappings: Mapping[str, tuple[str, str]],
) -> Panel:
    """Coded states over time; ``mappings``: code -> (text, colour)."""
    defaults = {
        "color": {"mode": "thresholds"},
        "thresholds": thresholds(("text", None)),
        "mappings": value_mappings(mappings),
        "custom": {
            "fillOpacity": 80,
            "lineWidth": 0,
            "hideFrom": {"legend": False, "tooltip": False, "viz": False},
        },
    }
    options = {
        "mergeValues": True,
        "showValue": "auto",
        "alignValue": "left",
        "rowHeight": 0.9,
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": False},
        "tooltip": {"mode": "single", "sort": "none"},
    }
    return panel("state-timeline", title, description, targets, defaults, options)


def bargauge(
    title: str,
    description: str,
    targets: Sequence[dict[str, Any]],
    unit: str,
    *,
    maximum: float | None = None,
    decimals: int | None = None,
) -> Panel:
    """One bar per series: the value at the end of the range (instant queries)."""
    defaults: dict[str, Any] = {
        "unit": unit,
        "min": 0,
        "color": {"mode": "palette-classic"},
        "thresholds": thresholds(("green", None)),
    }
    if maximum is not None:
        defaults["max"] = maximum
    if decimals is not None:
        defaults["decimals"] = decimals
    options = {
        "orientation": "horizontal",
        "displayMode": "basic",
        "showUnfilled": True,
        "valueMode": "color",
        "namePlacement": "auto",
        "sizing": "auto",
        "minVizHeight": 16,
        "minVizWidth": 8,
        "maxVizHeight": 300,
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
    }
    return panel("bargauge", title, description, targets, defaults, options)


def stat(
    title: str,
    description: str,
    targets: Sequence[dict[str, Any]],
    unit: str,
    steps: Sequence[tuple[str, float | None]],
    steps_of: Mapping[str, Sequence[tuple[str, float | None]]] | None = None,
) -> Panel:
    """Big numbers, coloured by ``steps`` (colour from value); ``steps_of`` maps a refId
    to steps of its own (a count beside flags)."""
    defaults = {"unit": unit, "color": {"mode": "thresholds"}, "thresholds": thresholds(*steps)}
    options = {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "colorMode": "value",
        "graphMode": "none",
        "justifyMode": "auto",
        "textMode": "value_and_name",
        "orientation": "auto",
        "wideLayout": True,
        "showPercentChange": False,
    }
    overrides = [
        {
            "matcher": {"id": "byFrameRefID", "options": ref},
            "properties": [{"id": "thresholds", "value": thresholds(*own)}],
        }
        for ref, own in (steps_of or {}).items()
    ]
    return panel("stat", title, description, targets, defaults, options, overrides)


def row(title: str) -> Panel:
    """A row header; layout() places it above its panels."""
    return {
        "id": 0,
        "type": "row",
        "title": title,
        "collapsed": False,
        "gridPos": {},
        "panels": [],
    }


def table(
    title: str,
    description: str,
    targets: Sequence[dict[str, Any]],
    *,
    columns: Sequence[str],
    rename: Mapping[str, str],
    units: Mapping[str, str] | None = None,
    overrides: Sequence[dict[str, Any]] = (),
    sort_by: str | None = None,
    merge: bool = False,
) -> Panel:
    """An instant-query table showing ``columns`` in order (renamed by ``rename``).

    ``units`` sets a column's unit (by its shown name); ``sort_by`` is the shown column
    sorted on (default: the first); ``merge`` joins the queries' rows into one table.
    """
    by_unit = [
        {"matcher": {"id": "byName", "options": name}, "properties": [{"id": "unit", "value": u}]}
        for name, u in (units or {}).items()
    ]
    p = panel(
        "table",
        title,
        description,
        targets,
        {
            "custom": {"align": "auto", "cellOptions": {"type": "auto"}, "inspect": False},
            "thresholds": thresholds(("green", None)),
            "color": {"mode": "thresholds"},
        },
        {
            "showHeader": True,
            "cellHeight": "sm",
            "footer": {"show": False, "reducer": ["sum"], "fields": "", "countRows": False},
            "sortBy": [
                {"displayName": sort_by or rename.get(columns[0], columns[0]), "desc": False}
            ],
        },
        [*by_unit, *overrides],
    )
    keep = {name: i for i, name in enumerate(columns)}
    steps: list[dict[str, Any]] = [{"id": "merge", "options": {}}] if merge else []
    steps.append(
        {
            "id": "organize",
            "options": {
                "excludeByName": {"Time": True, "job": True, "__name__": True},
                "indexByName": keep,
                "renameByName": dict(rename),
            },
        }
    )
    p["transformations"] = steps
    return p


# -- layout, variables and the dashboard ----------------------------------------------


def layout(rows: Iterable[Section]) -> list[Panel]:
    """Number the panels and place them left to right, wrapping at the grid's width."""
    placed: list[Panel] = []
    y = 0
    for title, panels in rows:
        header = row(title)
        header["gridPos"] = {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}
        placed.append(header)
        y += 1
        x, line_h = 0, 0
        for panel, w, h in panels:
            if x + w > GRID_WIDTH:
                y, x, line_h = y + line_h, 0, 0
            panel["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
            placed.append(panel)
            x, line_h = x + w, max(line_h, h)
        y += line_h
    for i, panel in enumerate(placed, 1):
        panel["id"] = i
    return placed


def datasource_variable() -> dict[str, Any]:
    """The data source picker every panel's queries go through."""
    return {
        "name": "datasource",
        "label": "Data source",
        "description": "The Prometheus that scrapes gpuwatchd",
        "type": "datasource",
        "query": "prometheus",
        "regex": "",
        "current": {},
        "options": [],
        "refresh": 1,
        "multi": False,
        "includeAll": False,
        "hide": 0,
        "skipUrlSync": False,
    }


def label_values_variable(name: str, label: str, description: str, query: str) -> dict[str, Any]:
    """A multi-value variable filled by a ``label_values(...)`` query, "All" being ``.*``."""
    return {
        "name": name,
        "label": label,
        "description": description,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": {
            "qryType": 1,
            "query": query,
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
        },
        "refresh": 2,
        "regex": "",
        "sort": 3,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {},
        "options": [],
        "hide": 0,
        "skipUrlSync": False,
    }


def instance_variable() -> dict[str, Any]:
    """The gpuwatchd daemons (scrape targets) shown."""
    return label_values_variable(
        "instance",
        "Instance",
        "gpuwatchd daemons (scrape targets)",
        "label_values(gpuwatchd_build_info, instance)",
    )


def builtin_annotation() -> dict[str, Any]:
    """Grafana's own annotations and alerts, as every new dashboard has them."""
    return {
        "builtIn": 1,
        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
        "enable": True,
        "hide": True,
        "iconColor": "rgba(0, 211, 255, 1)",
        "name": "Annotations & Alerts",
        "type": "dashboard",
    }


def requires(panels: Iterable[Panel]) -> list[dict[str, str]]:
    """``__requires``: Grafana, Prometheus and every panel kind the dashboard uses."""
    names = {
        "bargauge": "Bar gauge",
        "stat": "Stat",
        "state-timeline": "State timeline",
        "table": "Table",
        "timeseries": "Time series",
    }
    kinds = sorted({p["type"] for p in panels if p["type"] != "row"})
    return [
        {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.4.0"},
        {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
        *({"type": "panel", "id": k, "name": names[k], "version": ""} for k in kinds),
    ]


def dashboard(
    *,
    uid: str,
    title: str,
    description: str,
    sections: Iterable[Section],
    annotations: list[dict[str, Any]],
    variables: list[dict[str, Any]],
    tags: list[str],
    refresh: str,
    time_from: str,
    links: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The whole dashboard as a JSON-ready dict, its ``sections`` laid out top to bottom."""
    panels = layout(sections)
    return {
        "__elements": {},
        "__requires": requires(panels),
        "annotations": {"list": annotations},
        "description": description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": links or [],
        "liveNow": False,
        "panels": panels,
        "refresh": refresh,
        "schemaVersion": 39,
        "tags": tags,
        "templating": {"list": variables},
        "time": {"from": time_from, "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": title,
        "uid": uid,
        "version": 1,
        "weekStart": "",
    }


def render(dashboard: Mapping[str, Any]) -> str:
    """The file's exact text: 2-space indented JSON, non-ASCII kept, final newline."""
    return json.dumps(dashboard, indent=2, ensure_ascii=False) + "\n"


def write_or_check(output: Path, text: str, script: str, argv: Sequence[str]) -> int:
    """Write ``text`` to ``output`` (``--check``: only say whether the file is current).

    ``script`` names the generator in the message for a stale file.
    """
    if "--check" in argv:
        current = output.exists() and output.read_text(encoding="utf-8") == text
        print(f"{output}: {'up to date' if current else 'stale: run ' + script}")
        return 0 if current else 1
    output.write_text(text, encoding="utf-8")
    print(f"wrote {output}")
    return 0
