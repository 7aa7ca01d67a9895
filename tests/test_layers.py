"""The package layout is the architecture: imports flow one way, torch stays in the worker.

The layers follow the data flow (docs/design.md), lowest first (``LAYERS``): validation,
the control socket's wire, telemetry (NVML, sim, traces), the gate, the monitor that
polls and keeps windows, the tuning vocabulary, the worker process, the store, the
sessions that run tuning, drift detection, the JSON API, the exporter, config, the
daemon, reports and the command line. A module may import
its own layer and the layers below it, never one above; so a new upward import or a new
import cycle fails here. Three process boundaries are checked on top of the order:

* the worker package (``tuning.worker``) runs in its own process: nothing but the worker
  and the job side imports it, so no daemon module can pull its code (and torch) in;
* the job side (``JOB_SIDE``: what a job's process imports) never imports the daemon,
  its command line, its exporter, its servers or its store (``JOB_SIDE_FORBIDDEN``);
* the servers (``serve``) put rendered metrics on the wire and never reach into the
  collectors that make them (``SERVE_FORBIDDEN``): the daemon wires collectors in;
* torch and Triton are imported only by the worker package and the job side.

Inside the tuning layer, the work jobs hand the daemon (``tuning.submitted``) imports only
the vocabulary below it (``SUBMITTED_MAY_IMPORT``), and the way it arrives
(``tuning.intake``) is imported by nothing else in tuning: its sub-packages stay one-way.

Imports are read from the source (``ast``), function-level and ``TYPE_CHECKING`` ones
included (a lazy import is still a dependency), and so are ``importlib.import_module``
and ``__import__`` calls with a literal name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
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
    ("serve",),  # the HTTP server and the control socket, on one event loop
    ("daemon",),
    ("report",),
    ("cli", "__main__"),
)
#: What a job imports. It may use any daemon-free layer; nothing in the daemon uses it.
JOB_SIDE = ("client", "jobside", "torch", "triton", "triton_configs")
#: Layers the job side may not import: the daemon's process, command line, exporter, store.
JOB_SIDE_FORBIDDEN = ("daemon", "cli", "__main__", "exporter", "serve", "store")
#: What the servers may not import, though it sits below them.
SERVE = "serve"
SERVE_FORBIDDEN = ("exporter.collectors",)
#: Job-side imports of a forbidden layer that stay, each with the reason.
JOB_SIDE_EXCEPTIONS = {
    ("client.client", "store"): "the client reads winners from the store, read-only, "
    "when no daemon serves them",
    ("client.client", "store.rows"): "the store's host name, to prefer this host's winners",
    ("client.client", "store.location"): "one store-location rule for the CLI and the client",
    ("jobside.inductor", "store.row_values"): "a stored Inductor entry is checked by the loader "
    "the daemon's readers use (loaded only when a table is built)",
}
#: The worker process's package: only it and the job side import it.
WORKER = "tuning.worker"
#: Work that jobs hand the daemon, as data (its formats and checks): the tuning vocabulary
#: checks job ops with it, so it uses only what lies below that.
SUBMITTED = "tuning.submitted"
SUBMITTED_MAY_IMPORT = ("tuning.types", "tuning.versions", "tuning.families")
#: How that work arrives (spool, control-socket workload ops): above the rest of tuning,
#: which never imports it.
INTAKE = "tuning.intake"
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
    base = module.split(".") if module else []
    package = ".".join(["gpuwatchd", *(base if is_pkg else base[:-1])])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            target = _resolve("." * node.level + (node.module or ""), package)
            yield target
            for alias in node.names:  # `from gpuwatchd.x import submodule`
                yield f"{target}.{alias.name}"
        elif isinstance(node, ast.Call):
            yield from _dynamic_import(node, package)


def _resolve(name: str, package: str) -> str:
    """``name`` made absolute, as ``importlib.import_module(name, package)`` would."""
    level = len(name) - len(name.lstrip("."))
    if not level:
        return name
    parts = package.split(".")
    prefix = ".".join(parts[: len(parts) - (level - 1)])
    rest = name[level:]
    return f"{prefix}.{rest}" if rest else prefix


def _literal(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _dynamic_import(call: ast.Call, package: str) -> Iterator[str]:
    """The module an ``importlib.import_module`` or ``__import__`` call names literally."""
    func = call.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if called not in ("import_module", "__import__") or not call.args:
        return
    name = _literal(call.args[0])
    if name is None:  # a name computed at run time: no source check can follow it
        return
    keywords = {k.arg: k.value for k in call.keywords}
    if called == "import_module":
        given = call.args[1] if len(call.args) > 1 else keywords.get("package")
        yield _resolve(name, _literal(given) or package)
        return
    yield name
    fromlist = call.args[3] if len(call.args) > 3 else keywords.get("fromlist")
    if isinstance(fromlist, ast.List | ast.Tuple):
        for item in fromlist.elts:
            if (sub := _literal(item)) is not None:
                yield f"{name}.{sub}"


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
    return sorted({e for module, path in MODULES.items() for e in _edges(module, path)})


def _edges(module: str, path: Path) -> Iterator[tuple[str, str]]:
    """The gpuwatchd modules the file at ``path`` (module ``module``) imports."""
    for target in _imports(path, module):
        if target != "gpuwatchd" and not target.startswith("gpuwatchd."):
            continue
        rel = target.removeprefix("gpuwatchd").removeprefix(".")
        while rel and rel not in MODULES:  # `from pkg.mod import name`: keep the module
            rel = rel.rpartition(".")[0]
        if rel != module:
            yield module, rel


def _violations(edges: Iterable[tuple[str, str]]) -> list[str]:
    """Every import among ``edges`` that breaks the layer order or a process boundary."""
    out = []
    for src, dst in edges:
        s, d = _owner(src, ALL_UNITS), _owner(dst, ALL_UNITS)
        if s is None or d is None:
            continue
        if _owner(dst, (WORKER,)) and s not in JOB_SIDE and not _owner(src, (WORKER,)):
            out.append(f"{src} -> {dst} (imports the tuning worker, which runs apart)")
        elif s in JOB_SIDE:
            if d in JOB_SIDE_FORBIDDEN and (src, dst) not in JOB_SIDE_EXCEPTIONS:
                out.append(f"{src} -> {dst} (job side imports the daemon's {d})")
        elif s == SERVE and _owner(dst, SERVE_FORBIDDEN):
            out.append(f"{src} -> {dst} (the servers import the collectors)")
        elif _within_tuning(src, dst):
            out.append(_within_tuning(src, dst))
        elif d in JOB_SIDE:
            if s not in TOP:
                out.append(f"{src} -> {dst} (daemon side imports the job side)")
        elif RANK[d] > RANK[s]:
            out.append(f"{src} ({s}) -> {dst} ({d})")
    return out


def _within_tuning(src: str, dst: str) -> str:
    """What is wrong with ``src -> dst`` between tuning's rooms ('' where nothing is)."""
    if (
        _owner(src, (SUBMITTED,))
        and _owner(dst, ("tuning",))
        and not _owner(dst, (SUBMITTED, *SUBMITTED_MAY_IMPORT))
    ):
        return f"{src} -> {dst} (submitted work imports the tuning vocabulary above it)"
    if _owner(dst, (INTAKE,)) and _owner(src, ("tuning",)) and not _owner(src, (INTAKE,)):
        return f"{src} -> {dst} (tuning imports the intake, which sits above it)"
    return ""


def _heavy_imports(module: str, path: Path, heavy: str) -> list[str]:
    """``module imports torch...`` for each import of ``heavy`` where it is not allowed."""
    if _owner(module, HEAVY_OK) is not None:
        return []
    return [
        f"{module} imports {target}"
        for target in _imports(path, module)
        if target == heavy or target.startswith(heavy + ".")
    ]


def test_every_module_belongs_to_a_layer() -> None:
    loose = [m for m in MODULES if m and _owner(m, ALL_UNITS) is None]
    assert loose == [], f"modules outside every layer (add them to LAYERS or JOB_SIDE): {loose}"


def test_no_import_points_up_a_layer_or_crosses_a_process_boundary() -> None:
    bad = _violations(_internal_edges())
    assert bad == [], "imports against the layers:\n" + "\n".join(bad)


def test_each_job_side_exception_is_still_an_import() -> None:
    edges = set(_internal_edges())
    assert [e for e in JOB_SIDE_EXCEPTIONS if e not in edges] == []


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
    offenders = [o for module, path in MODULES.items() for o in _heavy_imports(module, path, heavy)]
    assert offenders == [], "\n".join(offenders)


#: The store is one class composed with its engine: a store class may subclass another
#: only to implement an interface with several implementations, or as an exception.
STORE_BASES_OK = {
    "Engine": "the dialect interface: SQLite's and PostgreSQL's engines implement it",
    "StoreError": "an exception: the store's unreachable kind",
    "StoreUnavailable": "an exception: writes refused, waited out as an outage is",
}


def _store_subclasses(paths: Iterable[Path]) -> list[str]:
    """``module.Class(Base)`` for each class under ``paths`` whose base is a class
    defined under ``paths`` too and not in :data:`STORE_BASES_OK`."""
    trees = {path: ast.parse(path.read_text(), str(path)) for path in paths}
    defined = {
        n.name for tree in trees.values() for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
    }
    out = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                if name in defined and name not in STORE_BASES_OK:
                    out.append(f"{path.stem}.{node.name}({name})")
    return out


def test_no_store_class_is_built_on_another() -> None:
    bad = _store_subclasses(sorted((PKG / "store").rglob("*.py")))
    assert bad == [], f"store classes layered on store classes: {bad}"


def test_the_store_check_sees_a_planted_layer(tmp_path: Path) -> None:
    (tmp_path / "core.py").write_text("class StoreCore:\n    pass\n")
    (tmp_path / "store.py").write_text(
        "from core import StoreCore\nclass SqlStore(StoreCore):\n    pass\n"
    )
    assert _store_subclasses(sorted(tmp_path.glob("*.py"))) == ["store.SqlStore(StoreCore)"]


def test_the_checks_see_a_planted_upward_import_and_cycle(tmp_path: Path) -> None:
    """The helpers read real source: an upward import and a two-module loop are found."""
    planted = tmp_path / "nvml.py"
    planted.write_text("def f():\n    from gpuwatchd.daemon.process import Daemon\n")
    target = next(_imports(planted, "telemetry.nvml"))
    s, d = _owner("telemetry.nvml", ALL_UNITS), _owner(target.removeprefix("gpuwatchd."), ALL_UNITS)
    assert (s, d) == ("telemetry", "daemon") and RANK[d] > RANK[s]
    comps = _strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}})
    assert sorted(sorted(c) for c in comps) == [["a", "b"], ["c"]]


PLANTED = [
    # (the planted module, its source, what the check must say)
    ("daemon.planted", "from gpuwatchd.tuning.worker import stats\n", "imports the tuning worker"),
    ("sessions.planted", "def f():\n    import gpuwatchd.tuning.worker.protocol\n",
     "imports the tuning worker"),
    ("exporter.planted", "from ..tuning.worker.stats import median\n", "imports the tuning worker"),
    ("tuning.planted", "from .worker import stats\n", "imports the tuning worker"),
    ("jobside.planted", "from gpuwatchd.exporter import metrics\n", "daemon's exporter"),
    ("jobside.planted", "from gpuwatchd.serve.control import PeerCred\n", "daemon's serve"),
    ("serve.planted", "from gpuwatchd.exporter.collectors.tls import X\n",
     "the servers import the collectors"),
    ("torch", "from gpuwatchd.store import open_store\n", "daemon's store"),
    ("triton", "import gpuwatchd.store.rows\n", "daemon's store"),
    ("client.planted", "from ..store.rows import host_name\n", "daemon's store"),
    ("daemon.planted", "import importlib\n"
     "importlib.import_module('gpuwatchd.tuning.worker.stats')\n", "imports the tuning worker"),
    ("daemon.planted", "from importlib import import_module\n"
     "import_module('.tuning.worker', 'gpuwatchd')\n", "imports the tuning worker"),
    ("api.planted", "import importlib\n"
     "importlib.import_module('..tuning.worker', package=__package__)\n",
     "imports the tuning worker"),
    ("jobside.planted", "__import__('gpuwatchd.exporter')\n", "daemon's exporter"),
    ("jobside.planted", "__import__('gpuwatchd', fromlist=['store'])\n", "daemon's store"),
    ("telemetry.planted", "importlib.import_module('gpuwatchd.daemon.process')\n",
     "(telemetry) -> daemon.process (daemon)"),
    ("tuning.submitted.planted", "from gpuwatchd.tuning.workloads import parse_workloads\n",
     "submitted work imports the tuning vocabulary above it"),
    ("tuning.ops", "def f():\n    from gpuwatchd.tuning.intake import spool\n",
     "tuning imports the intake"),
]  # fmt: skip


@pytest.mark.parametrize(("module", "source", "said"), PLANTED)
def test_the_checks_see_each_planted_violation(
    tmp_path: Path, module: str, source: str, said: str
) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(source)
    bad = _violations(_edges(module, planted))
    assert bad and all(said in b for b in bad), bad


def test_the_checks_see_torch_imported_by_name(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("import importlib\ntorch = importlib.import_module('torch.cuda')\n")
    assert _heavy_imports("daemon.planted", planted, "torch") == [
        "daemon.planted imports torch.cuda"
    ]
    assert _heavy_imports("jobside.planted", planted, "torch") == []


def test_a_name_computed_at_run_time_is_not_guessed(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("import importlib\nname = 'x'\nimportlib.import_module(name)\n")
    assert list(_imports(planted, "daemon.planted")) == ["importlib"]


def test_the_job_side_may_import_the_worker() -> None:
    assert _violations([("jobside.inductor", "tuning.worker.inductor")]) == []
    assert _violations([("tuning.worker.stats", "tuning.worker.protocol")]) == []


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
