"""The software stack installed now, read without importing torch, and how to compare stacks.

The daemon never imports torch (seconds and gigabytes), so library versions come from
the installed distributions' metadata; the worker that runs the kernels uses the same
interpreter, so it loads exactly these. The worker reports versions differently
(``torch.__version__`` carries a ``+cu128`` suffix that PyPI's metadata lacks, and
``torch.backends.cudnn.version()`` is an integer such as ``91900``), so versions are
normalised before they are compared (:mod:`gpuwatchd.tuning.versions`, the one rule).

Which CUDA torch was built for decides the cuBLAS and cuDNN kernels on offer, and PyPI's
metadata often does not say it: the CUDA version and torch's full version string are
read from the installed ``torch/version.py`` as text (the file ``torch.version`` is
built from), so a ``+cu130`` build and a ``+cu128`` build count as different stacks.
"""

from __future__ import annotations

import ast
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.types import Versions
from gpuwatchd.tuning.versions import COMPARED_FIELDS, changed_versions, normalize

__all__ = ["COMPARED_FIELDS", "TorchBuild", "changed_versions", "current_versions", "normalize"]

#: Distributions that ship cuDNN for torch's wheels, newest CUDA first.
CUDNN_DISTRIBUTIONS: tuple[str, ...] = (
    "nvidia-cudnn-cu13",
    "nvidia-cudnn-cu12",
    "nvidia-cudnn-cu11",
)
#: Triton's distribution names: releases, then the one torch nightlies pull in.
TRITON_DISTRIBUTIONS: tuple[str, ...] = ("triton", "pytorch-triton")

Lookup = Callable[[str], "str | None"]


@dataclass(frozen=True, slots=True)
class TorchBuild:
    """What ``torch.__version__`` and ``torch.version.cuda`` say, read without torch."""

    version: str | None
    cuda: str | None


TorchBuildLookup = Callable[[], "TorchBuild | None"]


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _literal_assignments(source: str) -> dict[str, object]:
    """Module-level ``name = <literal>`` (and annotated) assignments of Python source."""
    out: dict[str, object] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            try:
                out[target.id] = ast.literal_eval(value)
            except (ValueError, TypeError):  # not a literal: not one of the values wanted
                continue
    return out


def installed_torch_build() -> TorchBuild | None:
    """torch's ``version.py`` as installed, parsed as text; None when torch is not
    installed or the file cannot be read."""
    try:
        located = importlib.metadata.distribution("torch").locate_file("torch/version.py")
        found = _literal_assignments(Path(str(located)).read_text(encoding="utf-8"))
    except (importlib.metadata.PackageNotFoundError, OSError, SyntaxError, ValueError):
        return None
    version, cuda = found.get("__version__"), found.get("cuda")
    return TorchBuild(
        version if isinstance(version, str) else None, cuda if isinstance(cuda, str) else None
    )


def current_versions(
    info: DeviceInfo | None = None,
    *,
    lookup: Lookup = installed_version,
    torch_build: TorchBuildLookup = installed_torch_build,
) -> Versions:
    """Driver (from ``info``), CUDA, torch, Triton and cuDNN as installed now; unknown
    ones None.

    torch's version and CUDA come from its ``version.py`` (``torch_build``) when that
    describes the installed distribution (same public version as its metadata), else
    the metadata's version and no CUDA. cuDNN counts only when the installed
    ``nvidia-cudnn-*`` distributions agree on one version: with two CUDA majors
    installed side by side it cannot tell which one torch loads, and a guess would
    report changes that did not happen.
    """
    triton = next((v for d in TRITON_DISTRIBUTIONS if (v := lookup(d)) is not None), None)
    cudnn_found = {normalize("cudnn", v) for d in CUDNN_DISTRIBUTIONS if (v := lookup(d))}
    torch = lookup("torch")
    cuda = None
    build = torch_build() if torch is not None else None
    # Trusted only as the file of the installed distribution (same public version).
    if build is not None and build.version and _public(build.version) == _public(torch):
        torch, cuda = build.version, build.cuda
    return Versions(
        driver=info.driver_version if info is not None else None,
        cuda=cuda,
        torch=torch,
        triton=triton,
        cudnn=cudnn_found.pop() if len(cudnn_found) == 1 else None,
    )


def _public(version: str | None) -> str:
    """A version without its local part: ``2.13.0+cu128`` -> ``2.13.0``."""
    return (normalize("torch", version) or "").partition("+")[0]
