"""Configured workloads a GPU has no winners for, requested once they are configured.

The drift detector asks for the whole configured set only when something changes on a
GPU (never tuned, clock drift, new stack, stale winners). A workload added to the
config (by a reload, or in the file before a restart) changes nothing it watches, so
on a GPU already tuned it would never be measured. :class:`ConfiguredWorkloads` keeps
the names not yet looked at (every one at start, the new ones at each reload) and, at
the daemon's next drift check, requests on each GPU those its model has no winners for
in every regime tuned. GPUs waiting for their first tuning are left to the drift
detector, which asks for everything; a store that cannot say is asked again next check.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from gpuwatchd.drift.job import RequestFn
from gpuwatchd.store import StoreError
from gpuwatchd.tuning.types import Workload

log = logging.getLogger(__name__)

#: The reason such work is requested (logged with the request).
REASON = "config_added"


class ConfiguredWorkloads:
    """``runnable()``: the configured set now; ``gpus()``: (index, model) of each GPU
    that has been tuned before (the others wait for the drift detector); ``tuned(model)``:
    the workloads with winners for ``model`` in every regime (StoreError when the store
    cannot say)."""

    def __init__(
        self,
        runnable: Callable[[], Sequence[Workload]],
        gpus: Callable[[], Iterable[tuple[int, str]]],
        tuned: Callable[[str], frozenset[str]],
        request: RequestFn,
    ) -> None:
        self._runnable = runnable
        self._gpus = gpus
        self._tuned = tuned
        self._request = request
        self._lock = threading.Lock()
        self._unchecked: set[str] = set()

    def added(self, names: Iterable[str]) -> None:
        """These workloads are configured now: look at them at the next :meth:`check`."""
        with self._lock:
            self._unchecked.update(names)

    def check(self) -> None:
        """Request the unchecked workloads on each GPU whose model lacks winners for them."""
        with self._lock:
            names = set(self._unchecked)
        work = [w for w in self._runnable() if w.name in names]
        if work:
            tuned: dict[str, frozenset[str]] = {}
            try:
                for gpu, model in self._gpus():
                    if model not in tuned:
                        tuned[model] = self._tuned(model)
                    missing = [w for w in work if w.name not in tuned[model]]
                    if missing:
                        self._request(gpu, missing, REASON)
            except StoreError as exc:  # looked at again at the next check
                log.debug("configured workloads: the store cannot say what is tuned: %s", exc)
                return
        with self._lock:
            self._unchecked -= names
