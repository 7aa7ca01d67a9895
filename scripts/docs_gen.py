"""Render the reference lists in docs/ from their declarations.

Each list lives between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->``
in a document; the prose around it is hand-written and left alone. The lists and what
they are rendered from:

- docs/metrics.md ``metrics:<collector>``: every family each sub-collector emits, read
  from the daemon's registry with every sub-collector populated (tests/daemon_registry.py),
  families without series included (a telemetry field the simulated GPU does not
  report); the meaning is the family's HELP text.
- docs/fields.md ``fields``: the telemetry field table, ``FIELDS``.
- docs/threat-model.md ``control-ops``: the control socket's operations, ``wire.OPS``.
- docs/configuration.md ``workload-ops`` and ``workload-families``: the ops, their shape
  keys and the built-in families, from ``tuning.ops.SHAPES`` and the family specs.
- docs/cli.md ``commands``: the subcommands, ``cli.main.COMMANDS`` with their help.

``python3 scripts/docs_gen.py`` rewrites the blocks; ``--check`` exits 1 naming every
stale block (tests/test_generated_docs.py runs the same comparison). A dev tool: nothing
in gpuwatchd imports it.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from prometheus_client.exposition import generate_latest  # noqa: E402
from prometheus_client.metrics_core import Metric  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from prometheus_client.registry import CollectorRegistry  # noqa: E402

from gpuwatchd.telemetry.fields import FIELDS, Field, Getter  # noqa: E402

REGENERATE = "python3 scripts/docs_gen.py"
DOCS = ROOT / "docs"
_BLOCK = re.compile(
    r"(<!-- generated: (?P<name>[\w:.-]+) -->\n)(?P<body>.*?)(<!-- end generated: (?P=name) -->)",
    re.DOTALL,
)
_GPU_LABELS = ("gpu", "uuid")
_UNITS = {
    "_celsius": "°C",
    "_watts": "W",
    "_hertz": "Hz",
    "_seconds": "s",
    "_bytes": "bytes",
    "_joules": "J",
    "_ratio": "ratio",
}


@dataclass(frozen=True)
class Family:
    """One exposed metric family as a doc row shows it."""

    name: str  # as exposed (counters with _total)
    type: str
    labels: tuple[str, ...]
    help: str

    def row(self) -> str:
        base = self.name.removesuffix("_total")
        unit = next((u for suffix, u in _UNITS.items() if base.endswith(suffix)), "")
        labels = ", ".join(f"`{label}`" for label in self.labels)
        text = self.help.replace("|", "\\|")
        return f"| `{self.name}` | {self.type} | {unit} | {labels} | {text} |"


def _families(metrics: Iterable[Metric]) -> list[Family]:
    """Each family as exposed; one without series (a field no simulated GPU reports, a
    process list that is empty) from its declared label names."""
    out = []
    for metric in metrics:
        if not metric.samples:
            name = f"{metric.name}_total" if metric.type == "counter" else metric.name
            labels = tuple(getattr(metric, "_labelnames", ()))
            out.append(Family(name, metric.type, _ordered(labels), metric.documentation))
            continue
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Fixed([metric]))
        for fam in text_string_to_metric_families(generate_latest(registry).decode()):
            name = f"{fam.name}_total" if fam.type == "counter" else fam.name
            found = tuple(dict.fromkeys(k for s in fam.samples for k in s.labels))
            out.append(Family(name, fam.type, _ordered(found), fam.documentation))
    return out


def _ordered(labels: tuple[str, ...]) -> tuple[str, ...]:
    """``gpu`` and ``uuid`` first, the rest in their order."""
    return tuple(k for k in _GPU_LABELS if k in labels) + tuple(
        k for k in labels if k not in _GPU_LABELS
    )


class _Fixed:
    """Given families as a prometheus_client collector."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> list[Metric]:
        return self._metrics


class _Store:
    """A store view with every family present (reachable, writable, schema known)."""

    up = True
    writable = True

    @property
    def schema(self) -> object:
        from gpuwatchd.store.schema import SchemaState

        return SchemaState(database=3, own=3)


class _Cert:
    source, subject_cn, serial_number, not_after = "cert.pem", "gpu-host", "0a1b", 1.8e9


class _Pods:
    """A kubelet that answers and maps no GPU (per-GPU rows show the labels off Kubernetes)."""

    up = True
    pods: ClassVar[dict[str, object]] = {}

    def lookup(self, uuid: str) -> None:
        return None


def metric_sections() -> dict[str, list[Family]]:
    """Collector name -> the families it emits, in its order: every entry of the exporter's
    ``COLLECTORS`` (``exporter``: the aggregator's own and the daemon's facts)."""
    from builders import mig_h200_board
    from daemon_registry import daemon_registry

    from gpuwatchd.exporter.collectors.base import GpuwatchdCollector, SubCollector
    from gpuwatchd.exporter.collectors.tls import TlsCertificateCollector
    from gpuwatchd.exporter.registry import COLLECTORS, Sources

    daemon = daemon_registry(2)
    populated = {sub.name: sub for sub in daemon.extra}  # tuning, drift, fleet with series
    sources = Sources(
        daemon.board,
        store=_Store(),  # type: ignore[arg-type]
        periodic=lambda: {"tune": 1},
        control=lambda: 3,
    )
    subs: list[SubCollector] = []
    for name, make in COLLECTORS:
        if name == "pods":
            made = make(replace(sources, pods=_Pods()))
        elif name == "gpu_mig":  # MIG series exist only for a GPU in MIG mode
            made = make(replace(sources, board=mig_h200_board()))
        else:
            made = make(sources)
        sub = populated.get(name, made)
        if sub is not None:
            subs.append(sub)
    # A board collector's every family, also those it drops for want of series.
    sections = {sub.name: _families(getattr(sub, "_families", sub.collect)()) for sub in subs}
    seen = {fam.name for fams in sections.values() for fam in fams}
    daemon.registry.register(GpuwatchdCollector(subs))
    daemon.registry.register(TlsCertificateCollector(lambda: [_Cert()]))
    rest = _families(m for part in daemon.registry.parts for m in part.collect())
    sections["exporter"] = list({f.name: f for f in rest if f.name not in seen}.values())
    return sections


def _sections() -> tuple[str, ...]:
    from gpuwatchd.exporter.registry import COLLECTORS

    return (*(name for name, _ in COLLECTORS), "exporter")


_METRIC_HEADER = "| metric | type | unit | labels | meaning |\n| --- | --- | --- | --- | --- |\n"


def _metrics_block(section: str) -> Callable[[], str]:
    def render() -> str:
        rows = [fam.row() for fam in metric_sections()[section]]
        return _METRIC_HEADER + "\n".join(rows) + "\n"

    return render


def fields_table() -> str:
    def metric(f: Field) -> str:
        m = f.metric
        name = f"{m.name}_total" if m.type == "counter" else m.name
        return f"`{name}`" + (f" ({', '.join(m.labels)})" if m.labels else "")

    def nvml(f: Field) -> str:
        if isinstance(f.read, Getter):
            args = "".join(f", {name}" for name, _ in f.read.args)
            return f"`{f.read.functions[0]}(handle{args})`"
        return f"field `{f.read.field_id}`"

    def trace(f: Field) -> str:
        if f.trace is None:
            return "-"
        return f"**{f.trace.key}**" if f.trace.required else f.trace.key

    head = (
        "| Sample field | Metric | Unit | Type | NVML | Cadence | Sim | Trace key |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    rows = [
        f"| `{f.attr}` | {metric(f)} | {f.metric.unit or '-'} | {f.metric.type} | {nvml(f)} "
        f"| {f.cadence} | {'yes' if f.sim else 'no'} | {trace(f)} |"
        for f in FIELDS
    ]
    helps = [f"- `{f.metric.name}`: {f.metric.help}" for f in FIELDS]
    return head + "\n".join(rows) + "\n\n## What each metric says\n\n" + "\n".join(helps) + "\n"


def control_ops() -> str:
    from gpuwatchd.control.wire import OPS

    rows = [
        f"| `{spec.name}` | {', '.join(f'`{k}`' for k in sorted(spec.keys)) or '-'} |"
        for spec in OPS.values()
    ]
    return "| op | request keys besides `op` |\n| --- | --- |\n" + "\n".join(rows) + "\n"


def workload_ops() -> str:
    from gpuwatchd.tuning.ops import SHAPES

    by_rule: dict[int, list[str]] = {}
    for op, rule in SHAPES.items():
        by_rule.setdefault(id(rule), []).append(op)
    rows = []
    for ops in by_rule.values():
        rule = SHAPES[ops[0]]
        names = " (or ".join(f"`{op}`" for op in ops) + ")" * (len(ops) - 1)
        keys = ", ".join(f"`{k}`" for k in rule.keys) if rule.keys else "-"
        where = "a job" if rule.from_jobs else "the config"
        rows.append(f"| {names} | {keys} | {where} |")
    return "| op | shape keys | defined by |\n| --- | --- | --- |\n" + "\n".join(rows) + "\n"


def workload_families() -> str:
    from gpuwatchd.tuning.families import SPECS

    rows = [
        f"| `{s.name}` | {', '.join(f'`{op}`' for op in s.ops)} "
        f"| {', '.join(f'`{p}`' for p in s.params) or '-'} | {s.device} "
        f"| {', '.join(s.needs) or '-'} |"
        for s in SPECS.values()
    ]
    head = "| family | ops | params | runs on | needs |\n| --- | --- | --- | --- | --- |\n"
    return head + "\n".join(rows) + "\n"


def commands() -> str:
    import argparse as ap

    from gpuwatchd.cli.main import COMMANDS, build_parser

    parser = build_parser()
    (action,) = (a for a in parser._actions if isinstance(a, ap._SubParsersAction))
    helps = {a.dest: a.help for a in action._choices_actions}
    rows = [f"| `{name}` | {helps[name]} |" for name in COMMANDS]
    return "| command | what it does |\n| --- | --- |\n" + "\n".join(rows) + "\n"


#: Document -> block name -> its renderer.
BLOCKS: dict[str, dict[str, Callable[[], str]]] = {
    "metrics.md": {f"metrics:{s}": _metrics_block(s) for s in _sections()},
    "fields.md": {"fields": fields_table},
    "threat-model.md": {"control-ops": control_ops},
    "configuration.md": {
        "workload-ops": workload_ops,
        "workload-families": workload_families,
    },
    "cli.md": {"commands": commands},
}


def render(doc: str, text: str) -> str:
    """``text`` (the document ``doc``) with every generated block rendered afresh;
    ValueError naming a declared block the text lacks or one it has undeclared."""
    renderers = BLOCKS[doc]
    found = [m.group("name") for m in _BLOCK.finditer(text)]
    missing = sorted(set(renderers) - set(found))
    unknown = sorted(set(found) - set(renderers))
    if missing or unknown:
        raise ValueError(f"docs/{doc}: blocks missing {missing}, undeclared {unknown}")
    return _BLOCK.sub(lambda m: m.group(1) + renderers[m.group("name")]() + m.group(4), text)


def stale() -> list[str]:
    """``docs/NAME.md: block`` for every block whose text differs from its rendering."""
    out = []
    for doc in BLOCKS:
        text = (DOCS / doc).read_text(encoding="utf-8")
        fresh = {m.group("name"): m.group("body") for m in _BLOCK.finditer(render(doc, text))}
        for m in _BLOCK.finditer(text):
            if m.group("body") != fresh[m.group("name")]:
                out.append(f"docs/{doc}: {m.group('name')}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a block is stale")
    args = parser.parse_args()
    if args.check:
        old = stale()
        for block in old:
            print(f"{block} is stale: run {REGENERATE}", file=sys.stderr)
        return 1 if old else 0
    for doc in BLOCKS:
        path = DOCS / doc
        text = path.read_text(encoding="utf-8")
        new = render(doc, text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
