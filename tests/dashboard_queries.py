"""The PromQL queries of a Grafana dashboard, with Grafana's template variables filled in.

Grafana sends a panel's ``expr`` to Prometheus only after replacing ``$instance``,
``${gpu}``, ``$__rate_interval`` and friends; to check a query with promtool or run it
against a real Prometheus, the tests have to do the same replacement. An unknown
variable is an error, not left in place: it would be a typo that Grafana leaves
unexpanded and Prometheus then rejects.

Also the helpers both dashboards' tests (tests/test_dashboard.py, per host, and
tests/test_fleet_dashboard.py) share: loading a generator script, finding panels,
checking and evaluating queries with promtool.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

GRAFANA = Path(__file__).resolve().parent.parent / "grafana"
#: How every panel and query names its data source: the ``datasource`` variable.
DS_VAR = {"type": "prometheus", "uid": "${datasource}"}
#: Grafana's own annotations' data source, the one other allowed.
BUILTIN_DS = {"type": "grafana", "uid": "-- Grafana --"}
GRID_WIDTH = 24
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")

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


# -- shared by the dashboard tests -------------------------------------------------------


def load_generator(script: str) -> ModuleType:
    """A grafana/ generator script (``build_dashboard.py``...), loaded by path: not a package."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, GRAFANA / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_mode_round_trip(gen: ModuleType, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """Run ``gen.main``: --check says stale, a write makes it current; the JSON written."""
    assert gen.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().out
    assert gen.main([]) == 0
    assert gen.main(["--check"]) == 0
    return load_dashboard(gen.OUTPUT)


def data_panels(dash: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every panel but the row headers."""
    return [p for p in iter_panels(dash) if p.get("type") != "row"]


def panel(dash: Mapping[str, Any], title: str) -> dict[str, Any]:
    """The one panel titled ``title``."""
    matches = [p for p in iter_panels(dash) if p.get("title") == title]
    assert len(matches) == 1, f"expected one panel titled {title!r}, found {len(matches)}"
    return matches[0]


def filled(expr: str) -> str:
    """``expr`` as Grafana sends it with every variable on "All" and default intervals."""
    return substitute(expr, {**DEFAULT_VARIABLES, **builtin_variables()})


def datasource_refs(node: Any, path: str = "$") -> Iterator[tuple[str, Any]]:
    """(where, value) of every ``datasource`` key anywhere in ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield f"{path}.datasource", value
            yield from datasource_refs(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from datasource_refs(value, f"{path}[{index}]")


def overlap(a: Mapping[str, int], b: Mapping[str, int]) -> bool:
    """Whether two gridPos rectangles share any cell."""
    return (
        a["x"] < b["x"] + b["w"]
        and b["x"] < a["x"] + a["w"]
        and a["y"] < b["y"] + b["h"]
        and b["y"] < a["y"] + a["h"]
    )


def promtool_check(
    exprs: Sequence[str], tmp_path: Path, group: str
) -> subprocess.CompletedProcess[str]:
    """``promtool check rules`` on the exprs as recording rules (promtool parses PromQL)."""
    rules = [{"record": f"gpuwatchd_{group}:query_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / f"{group}_rules.yml"
    # JSON is YAML: no YAML library needed to write it.
    path.write_text(json.dumps({"groups": [{"name": group, "rules": rules}]}))
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )


def expr_test(
    tmp_path: Path,
    expr: str,
    series: list[dict[str, str]],
    expected: list[tuple[str, float]],
    interval: str = "1m",
) -> None:
    """Evaluate ``expr`` on ``series`` (one sample per ``interval``) at 5m with promtool."""
    (tmp_path / "empty_rules.yml").write_text('{"groups": []}')
    test = {
        "rule_files": ["empty_rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": interval,
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "5m",
                        "exp_samples": [{"labels": lbl, "value": v} for lbl, v in expected],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "query_test.yml"
    path.write_text(json.dumps(test))
    assert PROMTOOL is not None
    result = subprocess.run(
        [PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
