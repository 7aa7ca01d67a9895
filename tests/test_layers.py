"""The package layout is the architecture: imports flow one way, torch stays in the worker.

docs/design.md's data flow, lowest layer first. A module may import its own layer and the
layers below it, never one above; so a new upward import or a new import cycle fails
here, and so does torch or Triton imported anywhere but the worker package and the
modules a job imports. Imports are read from the source (``ast``), function-level
and ``TYPE_CHECKING`` ones included: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "gpuwatchd"

#: Lowest first. Each entry is a package or module under gpuwatchd/.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("validate",),
    ("control",),  # the control socket's wire: names and limits both ends import
    ("telemetry",),
    ("gate",),
    ("monitor",),
    ("tuning",),  # the shared vocabulary; tuning.worker is its own layer below
    ("tuning.worker",),  # the worker process: the only place torch/Triton may be imported
    ("store",),
    ("sessions",),
    ("drift",),
    ("api",),
    ("exporter",),
    ("config",),
    ("daemon",),
    ("report",),
    ("cli", "__main__"),
)
#: What a job imports. It may use any daemon-free layer; nothing in the daemon uses it.
JOB_SIDE = ("client", "jobside", "torch", "triton", "triton_configs")
#: Layers the job side may not import: the daemon's process and command line.
JOB_SIDE_FORBIDDEN = ("daemon", "cli", "__main__")
#: The command line sits above everything: it is a client of the daemon like a job is.
TOP = ("cli", "__main__")
#: Modules allowed to import torch or triton.
HEAVY_OK = ("tuning.worker", "jobside", "torch", "triton", "triton_configs")
HEAVY = ("torch", "triton")


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _imports(path: Path, module: str) -> Iterator[str]:
    """Absolute dotted names this file imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if module else []
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(["gpuwatchd", *base])
                target = f"{prefix}.{node.module}" if node.module else prefix
            else:
                target = node.module or ""
            yield target
            for alias in node.names:  # `from gpuwatchd.x import submodule`
                yield f"{target}.{alias.name}"


def _owner(name: str, units: tuple[str, ...]) -> str | None:
    """The longest unit (package or module) that ``name`` (relative to gpuwatchd) is in."""
    best = None
    for unit in units:
        if (name == unit or name.startswith(unit + ".")) and (
            best is None or len(unit) > len(best)
        ):
            best = unit
    return best


ALL_UNITS = tuple(u for layer in LAYERS for u in layer) + JOB_SIDE
RANK = {u: i for i, layer in enumerate(LAYERS) for u in layer}
MODULES = dict(_modules())


def _internal_edges() -> list[tuple[str, str]]:
    """(importer, imported) pairs of gpuwatchd modules, names relative to gpuwatchd."""
    return sorted(set(_edges()))


def _edges() -> Iterator[tuple[str, str]]:
    for module, path in MODULES.items():
        for target in _imports(path, module):
            if target != "gpuwatchd" and not target.startswith("gpuwatchd."):
                continue
            rel = target.removeprefix("gpuwatchd").removeprefix(".")
            while rel and rel not in MODULES:  # `from pkg.mod import name`: keep the module
                rel = rel.rpartition(".")[0]
            if rel != module:
                yield module, rel


def test_every_module_belongs_to_a_layer() -> None:
    loose = [m for m in MODULES if m and _owner(m, ALL_UNITS) is None]
    assert loose == [], f"modules outside every layer (add them to LAYERS or JOB_SIDE): {loose}"


def test_no_import_points_up_a_layer() -> None:
    upward = []
    for src, dst in _internal_edges():
        s, d = _owner(src, ALL_UNITS), _owner(dst, ALL_UNITS)
        if s is None or d is None:
            continue
        if s in JOB_SIDE:
            if d in JOB_SIDE_FORBIDDEN:
                upward.append(f"{src} -> {dst} (job side imports the daemon)")
            continue
        if d in JOB_SIDE:
            if s not in TOP:
                upward.append(f"{src} -> {dst} (daemon side imports the job side)")
        elif RANK[d] > RANK[s]:
            upward.append(f"{src} ({s}) -> {dst} ({d})")
    assert upward == [], "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_import_graph_has_no_cycle() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for src, dst in _internal_edges():
        graph[src].add(dst)
    # A package's __init__ re-exporting its own submodules is not a dependency of
    # theirs on it; drop those edges, then look for strongly connected components.
    for src, dsts in graph.items():
        graph[src] = {d for d in dsts if not (d.startswith(src + ".") or not src)}
    cycles = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    assert cycles == [], f"import cycles: {cycles}"


@pytest.mark.parametrize("heavy", HEAVY)
def test_torch_and_triton_only_in_the_worker_and_job_side(heavy: str) -> None:
    offenders = []
    for module, path in MODULES.items():
        if _owner(module, HEAVY_OK) is not None:
            continue
        for target in _imports(path, module):
            if target == heavy or target.startswith(heavy + "."):
                offenders.append(f"{module} imports {target}")
    assert offenders == [], "\n".join(offenders)


def test_the_checks_see_a_planted_upward_import_and_cycle(tmp_path: Path) -> None:
    """The helpers read real source: an upward import and a two-module loop are found."""
    planted = tmp_path / "nvml.py"
    planted.write_text("def f():\n    from gpuwatchd.daemon.process import Daemon\n")
    target = next(_imports(planted, "telemetry.nvml"))
    s, d = _owner("telemetry.nvml", ALL_UNITS), _owner(target.removeprefix("gpuwatchd."), ALL_UNITS)
    assert (s, d) == ("telemetry", "daemon") and RANK[d] > RANK[s]
    comps = _strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}})
    assert sorted(sorted(c) for c in comps) == [["a", "b"], ["c"]]


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (the graph has a few hundred nodes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[set[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    n = stack.pop()
                    on_stack.discard(n)
                    comp.add(n)
                    if n == node:
                        break
                out.append(comp)
    return out
