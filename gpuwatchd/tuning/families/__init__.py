"""Candidate families as the daemon knows them: one torch-free spec each.

A module of this package declares ``SPECS``, a tuple of :class:`FamilySpec`: each
family's name, the ops it runs, the params it reads and the function that builds its
candidates in the worker module of the same name under
``gpuwatchd.tuning.worker.families`` (which imports torch; this package never does).
The daemon reads the specs to check ``[[workload]]`` tables (:mod:`gpuwatchd.tuning.ops`);
the worker imports a family's implementation by its spec. Spec modules are found by
listing this package, so a new family is a spec module here and its implementation
there, with no registry to edit.

A family from a plugin (entry point ``gpuwatchd.families``) has no spec: it may run ops
of its own, and the worker loads it from its entry point.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Iterable
from dataclasses import dataclass

#: The entry-point group third-party families register under.
ENTRY_POINT_GROUP = "gpuwatchd.families"

#: The package holding the implementations, one module per spec module.
WORKER_PACKAGE = "gpuwatchd.tuning.worker.families"


@dataclass(frozen=True, slots=True)
class FamilySpec:
    """One built-in family: what the daemon may ask of it and where the worker finds it.

    ``ops`` are the workload ops it runs (each op's shape rule is in
    :mod:`gpuwatchd.tuning.ops`); ``params`` the ``params`` keys it reads; ``needs`` the
    third-party modules its candidates import (the daemon checks the worker's Python has
    them before starting a session that needs them); ``user_code`` whether it imports a
    job's own code (then the worker hands it the configured ``allowed_modules``);
    ``builder`` the attribute of its worker module that builds its candidates; ``device``
    where its candidates run (``cuda``, ``cpu`` or ``sim``). ``module``
    is the spec module's (and the worker module's) name, filled in when the specs are read.
    """

    name: str
    ops: tuple[str, ...]
    params: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    user_code: bool = False
    builder: str = "build"
    device: str = "cuda"
    module: str = ""

    @property
    def implementation(self) -> str:
        """``module:attribute`` of the worker function that builds the candidates."""
        return f"{WORKER_PACKAGE}.{self.module}:{self.builder}"

    def runs(self, op: str) -> bool:
        return op in self.ops

    def require_op(self, workload_name: str, op: str) -> None:
        """ValueError, one line, unless this family runs ``op``."""
        if op not in self.ops:
            raise ValueError(
                f"workload {workload_name}: family {self.name} cannot run op {op!r} "
                f"(it runs {', '.join(self.ops)})"
            )


def _read_specs() -> dict[str, FamilySpec]:
    """Every spec of every module of this package, by family name."""
    specs: dict[str, FamilySpec] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for spec in getattr(module, "SPECS", ()):
            if spec.name in specs:
                raise RuntimeError(f"family {spec.name} is declared twice ({info.name})")
            specs[spec.name] = dataclasses.replace(spec, module=info.name)
    return specs


#: Built-in family name -> its spec.
SPECS: dict[str, FamilySpec] = _read_specs()

#: Every op some built-in family runs, sorted.
KNOWN_OPS: tuple[str, ...] = tuple(sorted({op for s in SPECS.values() for op in s.ops}))


def device_kind(families: Iterable[str]) -> str:
    """Where a workload of ``families`` runs: their specs' common device, else ``cuda``
    (a mix, or a plugin's family)."""
    devices = {SPECS[f].device if f in SPECS else "cuda" for f in families}
    return devices.pop() if len(devices) == 1 else "cuda"


def needs_of(family: str) -> tuple[str, ...]:
    """The modules a family's candidates import; none known for a plugin's family."""
    spec = SPECS.get(family)
    return () if spec is None else spec.needs


def specs_for(worker_module: str) -> tuple[FamilySpec, ...]:
    """The specs a worker module implements (pass its ``__name__``), in declaration order."""
    name = worker_module.rpartition(".")[2]
    return tuple(spec for spec in SPECS.values() if spec.module == name)
