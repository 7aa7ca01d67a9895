"""When two software stacks differ: the one rule, for drift, resuming and the fleet.

The worker reports versions differently from the installed distributions' metadata
(``torch.__version__`` carries a ``+cu128`` suffix that PyPI's metadata lacks, and
``torch.backends.cudnn.version()`` is an integer such as ``91900``), so versions are
normalised before they are compared. Pure Python, so any layer may ask.
"""

from __future__ import annotations

from collections.abc import Callable

from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.types import Versions

#: The stack installed now for a GPU (its driver from the DeviceInfo), as
#: :func:`gpuwatchd.drift.versions.current_versions` reads it.
VersionsNow = Callable[[DeviceInfo], Versions]

#: Fields whose change makes the winners suspect: they decide which kernels exist.
COMPARED_FIELDS: tuple[str, ...] = ("driver", "cuda", "torch", "triton", "cudnn")


def _cudnn(text: str) -> str:
    """``91900`` (cuDNN 9's integer) / ``8907`` (cuDNN 8's) / ``9.19.0.56`` -> ``9.19.0``."""
    if text.isdigit():
        n = int(text)
        major, rest = (n // 10000, n % 10000) if n >= 90000 else (n // 1000, n % 1000)
        return f"{major}.{rest // 100}.{rest % 100}"
    parts = text.split(".")
    return ".".join(parts[:3])


def normalize(field: str, value: str | None) -> str | None:
    """``value`` in a form both the worker's and the metadata's spelling map to."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if field == "cudnn":
        return _cudnn(value)
    return value


def same_version(field: str, a: str | None, b: str | None) -> bool:
    """Whether ``a`` and ``b`` name the same version of ``field`` (unknown is only the
    same as unknown)."""
    a_norm, b_norm = normalize(field, a), normalize(field, b)
    if field in ("torch", "triton"):
        # PyPI's metadata drops the local part (+cu128) that torch.__version__ keeps:
        # compare it only when both sides carry one (then +cu130 is not +cu128).
        a_pub, _, a_local = (a_norm or "").partition("+")
        b_pub, _, b_local = (b_norm or "").partition("+")
        return a_pub == b_pub and (not a_local or not b_local or a_local == b_local)
    return a_norm == b_norm


def changed_versions(reference: Versions, current: Versions) -> tuple[str, ...]:
    """The compared fields known on both sides whose versions differ (a field unknown on
    either side never counts as a change)."""
    changed = []
    for field in COMPARED_FIELDS:
        a, b = getattr(reference, field), getattr(current, field)
        if normalize(field, a) is None or normalize(field, b) is None:
            continue
        if not same_version(field, a, b):
            changed.append(field)
    return tuple(changed)
