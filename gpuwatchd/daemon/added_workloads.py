"""The workloads users added (``add_workloads``), kept in one file so a restart keeps them.

``<state_dir>/added-workloads.json`` holds every added workload and where it came from;
it is rewritten atomically (temporary file, fsync, rename) on every change, so a crash
leaves either the old list or the new one. A file that cannot be read is moved aside
(``.bad``) with a log line, never silently overwritten. Workloads the daemon will not run
any more (:meth:`AddedWorkloads.set_aside`) go to ``added-workloads.set-aside.jsonl``,
one JSON line each with the reason, before they leave the list: nothing is lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.workload_requests import check_workload_name
from gpuwatchd.tuning.workloads import parse_workloads
from gpuwatchd.validate import one_line

log = logging.getLogger(__name__)

FILE_NAME = "added-workloads.json"
#: Beside it: workloads taken out of the list, one JSON object per line, reason included.
ASIDE_NAME = "added-workloads.set-aside.jsonl"
FORMAT = "gpuwatchd-added-workloads/1"


@dataclass(frozen=True, slots=True)
class Added:
    """One added workload and the request's ``source`` (job pid, host, torch version...)."""

    workload: Workload
    source: dict[str, Any] = field(default_factory=dict)


class AddedWorkloads:
    """The added workloads by name, backed by ``path``. Not thread-safe: callers lock."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.aside_path = self.path.with_name(ASIDE_NAME)
        self._items: dict[str, Added] = {}

    def load(self) -> None:
        """Read the file (a missing one is an empty list; a bad one is moved aside)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        try:
            self._items = _parse(json.loads(raw.decode("utf-8")))
        except (ValueError, UnicodeDecodeError) as e:
            aside = self.path.with_suffix(self.path.suffix + ".bad")
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            log.error("%s: %s; moved to %s, starting with no added workloads",
                      self.path, one_line(e), aside)  # fmt: skip

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def get(self, name: str) -> Added | None:
        return self._items.get(name)

    def workloads(self) -> tuple[Workload, ...]:
        return tuple(a.workload for a in self._items.values())

    def names(self) -> frozenset[str]:
        return frozenset(self._items)

    def items(self) -> tuple[Added, ...]:
        return tuple(self._items.values())

    def add(self, workloads: Sequence[Workload], source: dict[str, Any]) -> list[str]:
        """Add (or replace) and save; the names that replaced an earlier workload."""
        replaced = [w.name for w in workloads if w.name in self._items]
        for w in workloads:
            self._items[w.name] = Added(w, dict(source))
        self.save()
        return replaced

    def remove(self, names: Iterable[str]) -> list[str]:
        """Remove those present and save; the names removed."""
        gone = [n for n in names if self._items.pop(n, None) is not None]
        if gone:
            self.save()
        return gone

    def set_aside(self, reasons: dict[str, str]) -> None:
        """Move the named workloads out of the list into :attr:`aside_path` with their
        reasons (appended and synced first, then the list saved without them). OSError
        when either file cannot be written; the list is then unchanged."""
        lines = []
        for name, why in reasons.items():
            a = self._items.get(name)
            if a is not None:
                item = {**a.workload.to_json(), "source": a.source, "reason": why}
                lines.append(json.dumps(item, sort_keys=True) + "\n")
        if not lines:
            return
        with open(self.aside_path, "a", encoding="utf-8") as f:
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
        kept = dict(self._items)
        for name in reasons:
            self._items.pop(name, None)
        try:
            self.save()
        except OSError:
            self._items = kept
            raise

    def save(self) -> None:
        """Write the whole list atomically (OSError when the directory is not writable)."""
        items = [{**a.workload.to_json(), "source": a.source} for a in self._items.values()]
        doc = {"format": FORMAT, "workloads": items}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def _parse(doc: Any) -> dict[str, Added]:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} document")
    items = doc.get("workloads")
    if not isinstance(items, list):
        raise ValueError("workloads: expected a list")
    sources = []
    tables = []
    for item in items:
        if not isinstance(item, dict):
            raise ValueError("workloads[]: expected an object")
        table = dict(item)
        source = table.pop("source", {})
        sources.append(source if isinstance(source, dict) else {})
        tables.append(table)
    out: dict[str, Added] = {}
    workloads = parse_workloads(tables, "workloads")
    for i, (w, source) in enumerate(zip(workloads, sources, strict=True)):
        check_workload_name(w.name, f"workloads[{i}].name")
        out[w.name] = Added(w, source)
    return out
