"""The PromQL queries of a Grafana dashboard, with Grafana's template variables filled in.

Grafana sends a panel's ``expr`` to Prometheus only after replacing ``$instance``,
``${gpu}``, ``$__rate_interval`` and friends; to check a query with promtool or run it
against a real Prometheus, the tests have to do the same replacement. An unknown
variable is an error, not left in place: it would be a typo that Grafana leaves
unexpanded and Prometheus then rejects.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

#: Values for the dashboard's own variables: the "All" value (allValue) of each.
DEFAULT_VARIABLES: Mapping[str, str] = {"instance": ".*", "gpu": ".*"}

# ${name}, ${name:format}, [[name]], [[name:format]], $name (longest \w+ wins, so
# $__range_s is not read as $__range followed by "_s").
_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")


def load_dashboard(path: str | Path) -> dict[str, Any]:
    """The dashboard JSON as a dict; raises ValueError naming the file if it is not one."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: dashboard must be a JSON object, got {type(data).__name__}")
    return data


def iter_panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, with the panels of collapsed rows after their row."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def _duration(seconds: float) -> str:
    """A PromQL duration literal; PromQL durations are integers of one unit."""
    ms = round(seconds * 1000)
    if ms <= 0:
        raise ValueError(f"interval must be positive, got {seconds!r} s")
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def builtin_variables(
    interval_s: float = 15.0, rate_interval_s: float = 60.0, range_s: float = 3600.0
) -> dict[str, str]:
    """Grafana's global variables for a given step, rate window and time range."""
    return {
        "__interval": _duration(interval_s),
        "__interval_ms": str(round(interval_s * 1000)),
        "__rate_interval": _duration(rate_interval_s),
        "__rate_interval_ms": str(round(rate_interval_s * 1000)),
        "__range": _duration(range_s),
        "__range_s": str(round(range_s)),
        "__range_ms": str(round(range_s * 1000)),
    }


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """``expr`` with every template variable replaced; ValueError on an unknown one.

    ``$1``-style names are regex back-references (label_replace), not variables.
    """

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(3)
        if name.isdigit():
            return match.group(0)
        if name not in variables:
            raise ValueError(f"unknown template variable ${name} in query: {expr!r}")
        return variables[name]

    return _VARIABLE.sub(replace, expr)


def panel_queries(
    path: str | Path,
    variables: Mapping[str, str] | None = None,
    *,
    interval_s: float = 15.0,
    rate_interval_s: float = 60.0,
    range_s: float = 3600.0,
) -> list[tuple[str, str]]:
    """``(panel title, expr)`` for every Prometheus query of every panel, in panel order.

    ``variables`` overrides the dashboard variables (default: each one's "All" regex,
    ``.*``); the interval arguments set ``$__interval``, ``$__rate_interval`` and
    ``$__range`` (and their ``_ms``/``_s`` forms) in seconds.
    """
    values = {
        **DEFAULT_VARIABLES,
        **builtin_variables(interval_s, rate_interval_s, range_s),
        **(variables or {}),
    }
    queries: list[tuple[str, str]] = []
    for panel in iter_panels(load_dashboard(path)):
        title = str(panel.get("title", f"panel {panel.get('id')}"))
        for target in panel.get("targets", []):
            expr = target.get("expr")
            if expr:
                queries.append((title, substitute(expr, values)))
    return queries
