"""The one rule for which user code the tuning worker may import, and where it is checked.

Importing a module or calling a function named in a request is running code as the
daemon's user, so the rule is narrow and its only input is the admin's configuration:

- only modules under ``[tuning] allowed_modules`` (dotted prefixes: ``a.b`` allows
  ``a.b`` and ``a.b.c``, not ``a.bc``); an empty list allows no user code at all;
- an object is named ``module:qualname``; every segment the request chooses (the module
  path below the allowed prefix, and every qualname segment) is a plain public name, never
  ``_private`` or ``__dunder__``;
- what the name reaches must be *defined* in an allowed module: a kernel is a Triton
  kernel object (``JITFunction``, ``Autotuner``, ``Heuristics`` or gpuwatchd's autotuner)
  whose Python function's code is in the named module's file; an args factory is a
  plain Python function whose code is there. "Where the code is" is the function's
  ``__code__.co_filename`` and ``__globals__['__name__']``, never ``__module__``
  (``functools.wraps`` copies that); a qualname may pass through classes defined in an
  allowed module, never through a module object or anything else;
- nothing is imported before its name is checked: the named module's file is found
  without importing below the allowed prefix (:func:`module_origin`), and its source
  must define the name itself, not import it (:func:`check_defined`);
- nothing a request or a workload carries widens the list: a workload whose ``params``
  hold ``allowed_modules`` is refused, and the worker takes the list from its session spec
  (written by the daemon from its configuration), never from a workload.

The daemon checks the names (:func:`check_request`, :func:`check_workload`) where work
arrives: the control socket, the spool, the config, the added workloads replayed at
start. The worker applies the whole rule as it imports (:func:`import_kernel`,
:func:`import_function`). Torch-free and Triton-free: both sides import this.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
from collections.abc import Sequence
from typing import Any

from gpuwatchd.tuning.submitted.kernels import (
    FAMILY,
    KernelRequest,
    KernelRequestError,
    base_function,
    module_name,
    parse_import_path,
    request_from_workload,
)
from gpuwatchd.tuning.types import Workload
from gpuwatchd.validate import describe, fail

#: The configuration key holding the allowed module prefixes; no workload may carry it.
ALLOWED_KEY = "allowed_modules"
#: Class names of Triton kernel objects (and gpuwatchd's autotuner) a kernel name may reach.
KERNEL_TYPES = frozenset(
    {"JITFunction", "InterpretedFunction", "Autotuner", "Heuristics", "GpuwatchdAutotuner"}
)


class TrustError(ValueError):
    """User code outside the rule: one line naming what was refused and why."""


def _allowed_text(prefixes: Sequence[str]) -> str:
    return ", ".join(prefixes) if prefixes else "none: nothing is imported until set"


def parse_allowed_modules(value: Any, where: str = "tuning.allowed_modules") -> tuple[str, ...]:
    """Validate ``[tuning] allowed_modules``: a list of dotted module prefixes."""
    if not isinstance(value, list | tuple):
        raise fail(where, "expected a list of module prefixes", value, TrustError)
    return tuple(module_name(v, f"{where}[{i}]", TrustError) for i, v in enumerate(value))


def allowed_prefix(module: str, prefixes: Sequence[str]) -> str | None:
    """The longest of ``prefixes`` that ``module`` is or lies inside (None: not allowed)."""
    found = [p for p in prefixes if module == p or module.startswith(p + ".")]
    return max(found, key=len) if found else None


def module_allowed(module: str, prefixes: Sequence[str]) -> bool:
    """Whether ``module`` is one of ``prefixes`` or inside one; an empty list allows nothing."""
    return allowed_prefix(module, prefixes) is not None


def check_name(module: str, qualname: str, prefixes: Sequence[str], where: str) -> None:
    """TrustError unless ``module:qualname`` is an allowed module and public names only."""
    prefix = allowed_prefix(module, prefixes)
    if prefix is None:
        raise TrustError(
            f"{where}: module {module!r} is not under [tuning] allowed_modules "
            f"({_allowed_text(prefixes)})"
        )
    chosen = [*module[len(prefix) :].split(".")[1:], *qualname.split(".")]
    for part in chosen:
        if part.startswith("_"):
            raise TrustError(
                f"{where}: {part!r} in {module}:{qualname} is a private or special name; "
                "only public names are imported"
            )


def check_request(request: KernelRequest, prefixes: Sequence[str]) -> None:
    """The names a kernel request would have the worker import: its kernel, its factory."""
    check_name(request.module, request.qualname, prefixes, "request.kernel")
    if request.args_factory is not None:
        module, qualname = parse_import_path(request.args_factory, "request.args_factory")
        check_name(module, qualname, prefixes, "request.args_factory")


def check_workload(workload: Workload, prefixes: Sequence[str], where: str = "workload") -> None:
    """TrustError when a workload carries its own allow-list or names code outside the rule.

    A ``triton.user`` workload's request is parsed here too (a bad one is a TrustError).
    """
    if ALLOWED_KEY in workload.params:
        raise TrustError(
            f"{where}.params.{ALLOWED_KEY}: not accepted; only the daemon's "
            f"[tuning] {ALLOWED_KEY} decides which code is imported"
        )
    if FAMILY not in workload.families and workload.op != FAMILY:
        return
    try:
        request = request_from_workload(workload)
    except KernelRequestError as e:
        raise TrustError(f"{where}: {e}") from None
    try:
        check_request(request, prefixes)
    except TrustError as e:
        raise TrustError(f"{where}.params.{e}") from None


# -- the worker's side: importing under the rule --------------------------------------------

#: The largest module source read to check a name before the module is imported.
MAX_SOURCE_BYTES = 8 * 2**20


def module_origin(module: str, prefix: str, where: str) -> str:
    """The source file of ``module`` (inside the allowed ``prefix``), found without running it.

    Only the prefix itself is looked up by the import system (which imports the packages
    above it); every segment below it is searched on its parent's path without importing
    anything, so naming a submodule runs no code before the name is checked.
    """
    try:
        spec = importlib.util.find_spec(prefix)
    except Exception as e:  # the prefix's parent packages are user code
        raise TrustError(f"{where}: cannot find {prefix}: {describe(e)}") from None
    name = prefix
    for part in module[len(prefix) :].split(".")[1:]:
        locations = None if spec is None else spec.submodule_search_locations
        if locations is None:
            raise TrustError(f"{where}: {name} is not a package, so it has no {part}")
        name = f"{name}.{part}"
        spec = importlib.machinery.PathFinder.find_spec(name, list(locations))
    origin = None if spec is None else spec.origin
    if origin is None or not origin.endswith(".py") or not os.path.isfile(origin):
        raise TrustError(f"{where}: no Python source file for module {module}")
    return os.path.realpath(origin)


def _bound_here(body: Sequence[ast.stmt], name: str) -> ast.stmt | None:
    """The statement of ``body`` that defines ``name`` (def, class or assignment; not an
    import, which brings in code from elsewhere)."""
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        else:
            names = []
        if name in names:
            return node
    return None


def check_defined(origin: str, module: str, qualname: str, where: str) -> None:
    """TrustError unless ``module``'s source defines every segment of ``qualname`` itself
    (at module level, then in the class bodies on the way): checked before importing."""
    try:
        with open(origin, "rb") as f:
            source = f.read(MAX_SOURCE_BYTES + 1)
        if len(source) > MAX_SOURCE_BYTES:
            raise TrustError(f"{where}: {origin} is over {MAX_SOURCE_BYTES} bytes")
        tree = ast.parse(source, origin)
    except (OSError, SyntaxError, ValueError) as e:
        raise TrustError(f"{where}: cannot read {module}: {describe(e)}") from None
    body: Sequence[ast.stmt] = tree.body
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        node = _bound_here(body, part)
        if node is None:
            raise TrustError(
                f"{where}: {module}:{'.'.join(parts[: i + 1])} is not defined in {module} "
                "itself (only code defined there is imported)"
            )
        body = node.body if isinstance(node, ast.ClassDef) else []


def _import_module(module: str, origin: str, where: str) -> Any:
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # user code: a syntax error, a missing dependency, anything
        raise TrustError(f"{where}: cannot import {module}: {describe(e)}") from None
    file = getattr(mod, "__file__", None)
    if getattr(mod, "__name__", None) != module or not _same_file(file, origin):
        raise TrustError(f"{where}: {module} is not the module of that name at {origin}")
    return mod


def _same_file(path: Any, origin: str) -> bool:
    return isinstance(path, str) and os.path.realpath(path) == origin


def _code_of(obj: Any) -> tuple[str, str]:
    """(module name, file) of where a function's code is: its globals and its code object,
    which ``functools.wraps`` does not copy (unlike ``__module__``)."""
    code = getattr(obj, "__code__", None)
    glob = getattr(obj, "__globals__", None)
    name = glob.get("__name__") if isinstance(glob, dict) else None
    file = getattr(code, "co_filename", None)
    return (name if isinstance(name, str) else "?", file if isinstance(file, str) else "?")


def _check_code(fn: Any, module: str, origin: str, what: str, prefixes: Sequence[str]) -> None:
    """TrustError unless the function ``fn``'s code is in ``module``'s file ``origin``."""
    home, file = _code_of(fn)
    if not module_allowed(home, prefixes):
        raise TrustError(
            f"{what} is defined in {home}, which is not under "
            f"[tuning] allowed_modules ({_allowed_text(prefixes)})"
        )
    if home != module or not _same_file(file, origin):
        raise TrustError(f"{what} is code from {home} ({file}), not from {module} ({origin})")


def _check_passage(obj: Any, name: str, prefixes: Sequence[str], where: str) -> None:
    """A qualname goes on only through a class defined in an allowed module."""
    if not inspect.isclass(obj):
        raise TrustError(
            f"{where}: {name} is a {type(obj).__name__}, not a class; a name passes "
            "through classes of allowed modules only"
        )
    defined = str(getattr(obj, "__module__", None) or "?")
    if not module_allowed(defined, prefixes):
        raise TrustError(
            f"{where}: {name} is a class defined in {defined}, which is not under "
            f"[tuning] allowed_modules ({_allowed_text(prefixes)})"
        )


def _walk(module: str, qualname: str, prefixes: Sequence[str], where: str) -> tuple[Any, str]:
    """The object ``module:qualname`` names, through classes defined in allowed modules,
    and the module's file; the names are checked in the source before it is imported."""
    check_name(module, qualname, prefixes, where)
    prefix = allowed_prefix(module, prefixes)
    assert prefix is not None  # check_name refused it otherwise
    origin = module_origin(module, prefix, where)
    check_defined(origin, module, qualname, where)
    obj = _import_module(module, origin, where)
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        if i > 0:
            _check_passage(obj, f"{module}:{'.'.join(parts[:i])}", prefixes, where)
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TrustError(f"{where}: {module} has no {qualname}") from None
        except Exception as e:  # a module's or class's own __getattr__
            raise TrustError(f"{where}: {module}:{qualname}: {describe(e)}") from None
    return obj, origin


def import_function(path: str, prefixes: Sequence[str], where: str) -> Any:
    """The plain Python function ``path`` (``module:qualname``) names, under the rule."""
    try:
        module, qualname = parse_import_path(path, where)
    except KernelRequestError as e:
        raise TrustError(str(e)) from None
    obj, origin = _walk(module, qualname, prefixes, where)
    if not inspect.isfunction(obj):
        raise TrustError(f"{where}: {path} is a {type(obj).__name__}, not a Python function")
    _check_code(obj, module, origin, f"{where}: {path}", prefixes)
    return obj


def import_kernel(module: str, qualname: str, prefixes: Sequence[str], where: str) -> Any:
    """The Triton kernel ``module:qualname`` names, under the rule."""
    obj, origin = _walk(module, qualname, prefixes, where)
    names = {c.__name__ for c in type(obj).__mro__}
    if not names & KERNEL_TYPES:
        raise TrustError(
            f"{where}: {module}:{qualname} is a {type(obj).__name__}, not a Triton kernel"
        )
    try:
        fn = base_function(obj)
    except KernelRequestError as e:
        raise TrustError(f"{where}: {e}") from None
    _check_code(fn, module, origin, f"{where}: {module}:{qualname} wraps a function that", prefixes)
    return obj
