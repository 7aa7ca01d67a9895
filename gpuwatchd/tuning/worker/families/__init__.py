"""Candidate family registry: built-ins by their specs plus user families from entry points.

A built-in's spec (:mod:`gpuwatchd.tuning.families`) names its module here and the
function that builds its candidates; the module is imported only when asked for, so
listing families never imports torch or Triton. Third-party packages add families
through the entry-point group ``gpuwatchd.families`` (entry-point name = family name,
value = a :data:`~gpuwatchd.tuning.worker.candidate.Family` callable). A built-in name always
wins over an entry point of the same name, so a plugin cannot silently replace one.

Families that import users' code (their spec's ``user_code``) are also handed the job's
``allowed_modules`` (the daemon's configuration, :mod:`gpuwatchd.tuning.submitted.trust`), never a
list a workload carries.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from gpuwatchd.tuning.families import ENTRY_POINT_GROUP, SPECS
from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.worker.candidate import Candidate, DeviceSession, Family
from gpuwatchd.validate import describe

__all__ = ["ENTRY_POINT_GROUP", "UnknownFamily", "candidates_for", "family_names", "get_family"]


class UnknownFamily(ValueError):
    """A workload names a family that is neither built in nor installed."""


def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def family_names() -> list[str]:
    """Every family that :func:`get_family` can load, sorted."""
    return sorted(set(SPECS) | set(_entry_points()))


def get_family(name: str) -> Family:
    """Load one family by name; raises :class:`UnknownFamily` naming it."""
    spec = SPECS.get(name)
    if spec is not None:
        module, _, attr = spec.implementation.partition(":")
        fn = getattr(importlib.import_module(module), attr)
    else:
        ep = _entry_points().get(name)
        if ep is None:
            known = ", ".join(family_names())
            raise UnknownFamily(f"unknown candidate family {name!r} (known: {known})")
        try:
            fn = ep.load()
        except Exception as e:  # a broken plugin must not take the worker down
            detail = describe(e, with_type=False)
            raise UnknownFamily(
                f"candidate family {name!r} from {ep.value} failed to load: {detail}"
            ) from e
    if not callable(fn):
        raise UnknownFamily(f"candidate family {name!r} is not callable")
    return fn


def candidates_for(
    workload: Workload, session: DeviceSession, allowed_modules: Sequence[str] = ()
) -> list[Candidate]:
    """Every candidate of every family the workload names; names must be unique.

    ``allowed_modules`` is the job's (the daemon's configured) allow-list of user code.
    """
    if not workload.families:
        raise ValueError(f"workload {workload.name}: families is empty")
    out: list[Candidate] = []
    seen: set[str] = set()
    for fam in workload.families:
        family: Any = get_family(fam)
        spec = SPECS.get(fam)
        if spec is not None and spec.user_code:
            cands: Sequence[Candidate] = family(workload, session, tuple(allowed_modules))
        else:
            cands = family(workload, session)
        for c in cands:
            if c.name in seen:
                raise ValueError(
                    f"workload {workload.name}: candidate name {c.name!r} appears twice"
                )
            seen.add(c.name)
            out.append(c)
    return out
