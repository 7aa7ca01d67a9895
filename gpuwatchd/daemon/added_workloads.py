"""The workloads users added (``add_workloads``), kept on disk so a restart keeps them.

``<state_dir>/added-workloads.json`` holds the list (every added workload and where it
came from), written atomically (temporary file, fsync, rename). A change is one line
appended (and fsynced) to ``added-workloads.json.log`` beside it, so an add costs the
size of what is added, not of the whole list; the list is rewritten, and the log
emptied, once the log has grown as big as the list (and at start). Replaying the log
over the list is idempotent, so a crash at any point loses nothing acknowledged; a
torn last line (a crash mid-append) is dropped. A list that cannot be read is moved
aside (``.bad``) with a log line, never silently overwritten. Workloads the daemon will
not run any more (:meth:`AddedWorkloads.set_aside`) go to
``added-workloads.set-aside.jsonl``, one JSON line each with the reason, before they
leave the list: nothing is lost.
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

from gpuwatchd.tuning.intake.workload_requests import check_workload_name
from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.workloads import parse_workloads
from gpuwatchd.validate import one_line

log = logging.getLogger(__name__)

FILE_NAME = "added-workloads.json"
#: Beside it: workloads taken out of the list, one JSON object per line, reason included.
ASIDE_NAME = "added-workloads.set-aside.jsonl"
FORMAT = "gpuwatchd-added-workloads/1"
#: The change log's name: the list's name plus this.
LOG_SUFFIX = ".log"


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
        self.log_path = self.path.with_name(self.path.name + LOG_SUFFIX)
        self._items: dict[str, Added] = {}
        self._list_bytes = 0  # size of the list file last written
        self._log_bytes = 0  # size of the change log since

    def load(self) -> None:
        """Read the list and replay the change log (a missing list is an empty one; a bad
        one is moved aside), then write them as one list."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            raw = None
        if raw is not None:
            try:
                self._items = _parse(json.loads(raw.decode("utf-8")))
            except (ValueError, UnicodeDecodeError) as e:
                aside = self.path.with_suffix(self.path.suffix + ".bad")
                with contextlib.suppress(OSError):
                    os.replace(self.path, aside)
                log.error("%s: %s; moved to %s, starting with no added workloads",
                          self.path, one_line(e), aside)  # fmt: skip
        if self._replay_log():
            self.save()
        else:
            self._list_bytes = len(raw or b"")

    def _replay_log(self) -> bool:
        """Apply the change log's lines; whether there were any."""
        try:
            lines = self.log_path.read_bytes().splitlines()
        except FileNotFoundError:
            return False
        for i, line in enumerate(lines):
            try:
                change = json.loads(line.decode("utf-8"))
                if "remove" in change:
                    for name in change["remove"]:
                        self._items.pop(str(name), None)
                else:
                    self._items.update(_parse({"format": FORMAT, "workloads": change["add"]}))
            except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
                log.error("%s: line %d dropped: %s", self.log_path, i + 1, one_line(e))
        return bool(lines)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)

    def get(self, name: str) -> Added | None:
        return self._items.get(name)

    def workloads(self) -> tuple[Workload, ...]:
        return tuple(a.workload for a in self._items.values())

    def names(self) -> frozenset[str]:
        return frozenset(self._items)

    def items(self) -> tuple[Added, ...]:
        return tuple(self._items.values())

    def add(self, workloads: Sequence[Workload], source: dict[str, Any]) -> list[str]:
        """Add (or replace) and keep; the names that replaced an earlier workload.

        OSError (and nothing changed) when it cannot be written.
        """
        added = [Added(w, dict(source)) for w in workloads]
        self._record({"add": [_table(a) for a in added]})
        replaced = [w.name for w in workloads if w.name in self._items]
        self._items.update((a.workload.name, a) for a in added)
        self._compact_if_due()
        return replaced

    def remove(self, names: Iterable[str]) -> list[str]:
        """Remove those present and keep that; the names removed."""
        gone = list(dict.fromkeys(n for n in names if n in self._items))
        if gone:
            self._record({"remove": gone})
            for name in gone:
                del self._items[name]
            self._compact_if_due()
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

    def _record(self, change: dict[str, Any]) -> None:
        """Append one change to the log, durably (OSError when it cannot)."""
        line = (json.dumps(change, sort_keys=True, separators=(",", ":")) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._log_bytes += len(line)

    def _compact_if_due(self) -> None:
        """Rewrite the list once the log is as big as it: each byte added is written a
        bounded number of times, however long the list grows."""
        if self._log_bytes >= self._list_bytes:
            with contextlib.suppress(OSError):  # the log still holds every change
                self.save()

    def save(self) -> None:
        """Write the whole list atomically, then empty the change log (OSError when the
        directory is not writable)."""
        doc = {"format": FORMAT, "workloads": [_table(a) for a in self._items.values()]}
        data = (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._list_bytes = len(data)
        with contextlib.suppress(FileNotFoundError):
            os.truncate(self.log_path, 0)
        self._log_bytes = 0


def _table(a: Added) -> dict[str, Any]:
    return {**a.workload.to_json(), "source": a.source}


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
