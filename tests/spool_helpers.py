"""Read a spool folder whole in a test: one :class:`Spool` scan of one kind, then closed."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.tuning.intake.spool import KERNEL, Kind, Rejected, Spool, SpoolEntry


@dataclass
class Scanned:
    entries: list[SpoolEntry[Any]] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    left: int = 0


def scan_all(directory: str | os.PathLike[str], kind: Kind[Any] = KERNEL, **budget: int) -> Scanned:
    """Every item one scan of ``kind`` in the spool ``directory`` yields."""
    spool = Spool(directory, **budget)
    try:
        scan = spool.scan(kind)
        out = Scanned(left=scan.left)
        for item in scan:
            (out.rejected if isinstance(item, Rejected) else out.entries).append(item)
        return out
    finally:
        spool.close()
