"""``[exporter]``: which per-GPU metric families /metrics exports.

``fields`` lists families by the names docs/metrics.md gives (``gpuwatchd_gpu_power_watts``,
``gpuwatchd_gpu_energy_joules_total``), chosen from the ``gpu``, ``gpu_health`` and
``gpu_mig`` collectors; empty (the default) exports all of them. The daemon's own families
(build info, scrape, pods, tuning, drift, store, fleet) are always exported. The names
are checked against the collectors' declarations only when the list is not empty, so a
config without it loads no collector.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gpuwatchd.validate import check


def check_fields(names: Sequence[str]) -> bool:
    """True, or ValueError naming the first unknown family (and the nearest known one)."""
    if not names:
        return True
    import difflib

    from gpuwatchd.exporter.registry import selectable_fields

    known = selectable_fields()
    for i, name in enumerate(names):
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(
                f"exporter.fields[{i}]: unknown metric {name!r} ({hint}the per-GPU families "
                "are listed in docs/metrics.md)"
            )
    return True


@dataclass(frozen=True, slots=True)
class ExporterConfig:
    """What /metrics exports."""

    fields: tuple[str, ...] = field(default=(), metadata=check(check_fields, ""))
