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
  whose Python function's ``__module__`` is allowed; an args factory is a plain Python
  function whose ``__module__`` is allowed; a qualname may pass through classes defined
  in an allowed module, never through a module object or anything else;
- nothing a request or a workload carries widens the list: a workload whose ``params``
  hold ``allowed_modules`` is refused, and the worker takes the list from its session spec
  (written by the daemon from its configuration), never from a workload.

The daemon checks the names (:func:`check_request`, :func:`check_workload`) where work
arrives: the control socket, the spool, the config, the added workloads replayed at
start. The worker applies the whole rule as it imports (:func:`import_kernel`,
:func:`import_function`). Torch-free and Triton-free: both sides import this.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from typing import Any

from gpuwatchd.tuning.kernels import (
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


def _import_module(module: str, where: str) -> Any:
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # user code: a syntax error, a missing dependency, anything
        raise TrustError(f"{where}: cannot import {module}: {describe(e)}") from None
    if getattr(mod, "__name__", None) != module:  # an alias planted in sys.modules
        raise TrustError(f"{where}: {module} is not a module of that name")
    return mod


def _defined_in(obj: Any) -> str:
    return str(getattr(obj, "__module__", None) or "?")


def _check_passage(obj: Any, name: str, prefixes: Sequence[str], where: str) -> None:
    """A qualname goes on only through a class defined in an allowed module."""
    if not inspect.isclass(obj):
        raise TrustError(
            f"{where}: {name} is a {type(obj).__name__}, not a class; a name passes "
            "through classes of allowed modules only"
        )
    if not module_allowed(_defined_in(obj), prefixes):
        raise TrustError(
            f"{where}: {name} is a class defined in {_defined_in(obj)}, which is not under "
            f"[tuning] allowed_modules ({_allowed_text(prefixes)})"
        )


def _walk(module: str, qualname: str, prefixes: Sequence[str], where: str) -> Any:
    """The object ``module:qualname`` names, through classes defined in allowed modules."""
    check_name(module, qualname, prefixes, where)
    obj = _import_module(module, where)
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
    return obj


def import_function(path: str, prefixes: Sequence[str], where: str) -> Any:
    """The plain Python function ``path`` (``module:qualname``) names, under the rule."""
    try:
        module, qualname = parse_import_path(path, where)
    except KernelRequestError as e:
        raise TrustError(str(e)) from None
    obj = _walk(module, qualname, prefixes, where)
    if not inspect.isfunction(obj):
        raise TrustError(f"{where}: {path} is a {type(obj).__name__}, not a Python function")
    if not module_allowed(_defined_in(obj), prefixes):
        raise TrustError(
            f"{where}: {path} is defined in {_defined_in(obj)}, which is not under "
            f"[tuning] allowed_modules ({_allowed_text(prefixes)})"
        )
    return obj


def import_kernel(module: str, qualname: str, prefixes: Sequence[str], where: str) -> Any:
    """The Triton kernel ``module:qualname`` names, under the rule."""
    obj = _walk(module, qualname, prefixes, where)
    names = {c.__name__ for c in type(obj).__mro__}
    if not names & KERNEL_TYPES:
        raise TrustError(
            f"{where}: {module}:{qualname} is a {type(obj).__name__}, not a Triton kernel"
        )
    try:
        fn = base_function(obj)
    except KernelRequestError as e:
        raise TrustError(f"{where}: {e}") from None
    if not module_allowed(_defined_in(fn), prefixes):
        raise TrustError(
            f"{where}: {module}:{qualname} wraps a function defined in {_defined_in(fn)}, "
            f"which is not under [tuning] allowed_modules ({_allowed_text(prefixes)})"
        )
    return obj
