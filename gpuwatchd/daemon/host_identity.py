"""One machine per host name in a shared store.

A fleet tells hosts apart by ``GPUWATCHD_HOST`` (or the hostname); two machines under one
name would overwrite each other's winners and fail each other's sessions as abandoned.
So the daemon holds its name in the store under a lease naming its machine id
(:func:`~gpuwatchd.store.rows.machine_id`), renewed at every fleet sync and given back at
a clean stop. A second live machine under the same name is refused with one line naming
both; the name is free again once the holder stops or its lease lapses.
"""

from __future__ import annotations

import logging
from contextlib import suppress

from gpuwatchd.store import SqlStore, StoreError

log = logging.getLogger(__name__)

#: The lease on the name lasts this many fleet syncs: a few missed renewals are not a
#: departure, and a machine gone for good frees its name within minutes.
LEASE_SYNCS = 3
#: The shortest lease on a name, whatever the sync interval.
MIN_LEASE_S = 180.0


class HostNameTaken(StoreError):
    """Another live machine holds this host name; the message names both machines."""


def lease_s(sync_interval_s: float) -> float:
    """How long the name is held between renewals, for a fleet sync interval."""
    return max(MIN_LEASE_S, LEASE_SYNCS * sync_interval_s)


class HostIdentity:
    """This machine's hold on ``host`` in ``store``."""

    def __init__(self, store: SqlStore, host: str, machine: str, lease_s: float) -> None:
        self._store = store
        self.host = host
        self.machine = machine
        self.lease_s = lease_s

    def claim(self) -> None:
        """Take or renew the name; HostNameTaken when another live machine holds it,
        another StoreError when the store cannot say."""
        other = self._store.claim_host(self.host, self.machine, self.lease_s)
        if other is not None:
            raise HostNameTaken(
                f"host name {self.host!r} is in use by another live machine (machine id"
                f" {other}); this machine is {self.machine}: give each machine its own"
                " GPUWATCHD_HOST"
            )

    def release(self) -> None:
        """Give the name back at a clean stop (a store error: it lapses by itself)."""
        with suppress(StoreError):
            self._store.release_host(self.host, self.machine)
