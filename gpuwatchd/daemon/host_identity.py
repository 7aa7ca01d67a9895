"""One machine per host name in a shared store.

A fleet tells hosts apart by ``GPUWATCHD_HOST`` (or the hostname); two machines under one
name would overwrite each other's winners and fail each other's sessions as abandoned.
So the daemon holds its name in the store under a lease naming its machine id
(:func:`~gpuwatchd.store.rows.machine_id`), its boot id and a random nonce of its own,
renewed at every fleet sync and given back at a clean stop.

A second live machine under the same name is refused with one line naming both. One
with the same name *and* machine id but another boot is a cloned image, or this machine
rebooted before its last lease lapsed: writes wait (monitoring goes on) until the lease
lapses (a reboot: then it is taken) or its holder renews it (a clone: refused in one
line, and writes stay refused while the other machine holds the name).
"""

from __future__ import annotations

import logging
import threading
import uuid
from contextlib import suppress

from gpuwatchd.store import SqlStore, StoreError
from gpuwatchd.store.owner import Holder, HostLease
from gpuwatchd.store.rows import boot_id

log = logging.getLogger(__name__)

#: The lease on the name lasts this many fleet syncs: a few missed renewals are not a
#: departure, and a machine gone for good frees its name within minutes.
LEASE_SYNCS = 3
#: The shortest lease on a name, whatever the sync interval.
MIN_LEASE_S = 180.0
#: The longest a stop waits to give the name back: the lease lapses by itself, so a
#: store that hangs must not hold the stop for its whole call bound (the DaemonSet's
#: terminationGracePeriodSeconds and systemd's TimeoutStopSec cover a stop).
RELEASE_WAIT_S = 3.0


class HostNameTaken(StoreError):
    """Another live machine holds this host name; the message names both machines."""


def lease_s(sync_interval_s: float) -> float:
    """How long the name is held between renewals, for a fleet sync interval."""
    return max(MIN_LEASE_S, LEASE_SYNCS * sync_interval_s)


class HostIdentity:
    """This process's hold on ``host`` in ``store``; it refuses the store's writes
    (:meth:`SqlStore.refuse_writes`) while another boot of its machine id holds it."""

    def __init__(self, store: SqlStore, host: str, machine: str, lease_s: float) -> None:
        self._store = store
        self.host = host
        self.machine = machine
        self.me = Holder(machine, boot_id(), uuid.uuid4().hex)
        self.lease_s = lease_s
        self._contested: HostLease | None = None  # the other boot's lease, as first seen
        self.clone: str | None = None  # the line refusing this machine as a clone

    def claim(self) -> bool:
        """Take or renew the name; True when it was just taken back from another boot
        (writes allowed again). HostNameTaken when another live machine holds it,
        another StoreError when the store cannot say."""
        lease = self._store.claim_host(self.host, self.me, self.lease_s)
        if lease.held:
            lifted = self._contested is not None or self.clone is not None
            if lifted:
                log.warning("host name %r held again by this machine; store writes resume",
                            self.host)  # fmt: skip
                self._store.refuse_writes(None)
            self._contested, self.clone = None, None
            return lifted
        holder = lease.holder
        assert holder is not None
        if holder.machine != self.machine:
            raise HostNameTaken(
                f"host name {self.host!r} is in use by another live machine (machine id"
                f" {holder.machine}); this machine is {self.machine}: give each machine its"
                " own GPUWATCHD_HOST"
            )
        self._other_boot(lease)
        return False

    def _other_boot(self, lease: HostLease) -> None:
        """Another boot of this machine id holds the name: a clone once it renews."""
        seen = self._contested
        holder = lease.holder
        assert holder is not None
        if seen is None:
            self._contested = lease
            why = (
                f"host name {self.host!r} and machine id {self.machine} are held by boot"
                f" {holder.boot_id or '?'} until its lease lapses (this is boot"
                f" {self.me.boot_id}): waiting to tell a reboot from a cloned image"
            )
            log.warning("%s; store writes wait, monitoring goes on", why)
            self._store.refuse_writes(why)
        elif self.clone is None and lease.expires_at > seen.expires_at:
            self.clone = (
                f"host name {self.host!r} and machine id {self.machine} are in use by another"
                f" live machine (boot {holder.boot_id or '?'}; this is boot {self.me.boot_id}):"
                " a cloned image; give each machine its own /etc/machine-id"
                " (systemd-machine-id-setup) and GPUWATCHD_HOST"
            )
            log.error("%s; store writes refused, monitoring goes on", self.clone)
            self._store.refuse_writes(self.clone)

    def release(self, wait_s: float = RELEASE_WAIT_S) -> None:
        """Give the name back at a clean stop, waiting at most ``wait_s`` (a store that
        is down, fails or hangs: the lease lapses by itself)."""
        if self._contested is not None or not self._store.up:
            return  # never held (another boot's lease is not ours), or nobody to tell
        done = threading.Thread(target=self._release, name="gpuwatchd-release-host", daemon=True)
        done.start()
        done.join(wait_s)  # a call still waiting is cut by the store's own bound

    def _release(self) -> None:
        with suppress(StoreError):
            self._store.release_host(self.host, self.machine)
