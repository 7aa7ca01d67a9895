"""Candidate family registry: built-ins by name plus user families from entry points.

Built-ins are named as ``module:attribute`` strings and imported only when asked for,
so listing families never imports torch or Triton. Third-party packages add families
through the entry-point group ``gpuwatchd.families`` (entry-point name = family name,
value = a :data:`~gpuwatchd.tuning.worker.candidate.Family` callable). A built-in name always
wins over an entry point of the same name, so a plugin cannot silently replace one.

Families that import users' code (:data:`USER_CODE_FAMILIES`) are also handed the job's
``allowed_modules`` (the daemon's configuration, :mod:`gpuwatchd.tuning.trust`), never a
list a workload carries.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.worker.candidate import Candidate, DeviceSession, Family
from gpuwatchd.validate import describe

ENTRY_POINT_GROUP = "gpuwatchd.families"

#: Family name -> "module:attribute" of its Family callable, imported lazily.
BUILTIN: dict[str, str] = {
    "cpu.matmul": "gpuwatchd.tuning.worker.families.cpu:matmul_family",
    "cpu.conv2d": "gpuwatchd.tuning.worker.families.cpu:conv2d_family",
    "sim": "gpuwatchd.tuning.worker.families.sim:sim_family",
    "torch.matmul": "gpuwatchd.tuning.worker.families.torch_matmul:build",
    "torch.conv2d": "gpuwatchd.tuning.worker.families.torch_conv:build",
    "torch.gemm": "gpuwatchd.tuning.worker.families.torch_gemm:build",
    "inductor.mm": "gpuwatchd.tuning.worker.families.inductor_mm:build",
    "triton.matmul": "gpuwatchd.tuning.worker.families.triton_matmul:build",
    "triton.user": "gpuwatchd.tuning.worker.families.triton_user:build",
}
#: Built-in families that import users' code: called with the job's allowed modules too.
USER_CODE_FAMILIES = frozenset({"triton.user"})

#: Family name -> the third-party modules its candidates import (the daemon checks the
#: worker's interpreter has them before starting a session that needs them).
BUILTIN_MODULES: dict[str, tuple[str, ...]] = {
    "cpu.matmul": ("torch",),
    "cpu.conv2d": ("torch",),
    "sim": (),
    "torch.matmul": ("torch",),
    "torch.conv2d": ("torch",),
    "torch.gemm": ("torch",),
    "inductor.mm": ("torch", "triton"),  # max-autotune's GEMM templates are Triton kernels
    "triton.matmul": ("torch", "triton"),
    "triton.user": ("torch", "triton"),
}


class UnknownFamily(ValueError):
    """A workload names a family that is neither built in nor installed."""


def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def family_names() -> list[str]:
    """Every family that :func:`get_family` can load, sorted."""
    return sorted(set(BUILTIN) | set(_entry_points()))


def get_family(name: str) -> Family:
    """Load one family by name; raises :class:`UnknownFamily` naming it."""
    target = BUILTIN.get(name)
    if target is not None:
        module, _, attr = target.partition(":")
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
        if fam in USER_CODE_FAMILIES:
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
