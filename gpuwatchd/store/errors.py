"""The exceptions the store raises, so callers catch a single type (or one of its subclasses)."""

from __future__ import annotations


class StoreError(Exception):
    """A store operation failed; the message is one line naming the file or the bad field."""


class StoreUnavailable(StoreError):
    """The store could not be reached, or the operation was cut off (connection lost, server
    restarting, no answer within the call bound): nothing was written, and the same call
    may work seconds later. Callers retry soon; it is never a failed tuning."""


class WritesRefused(StoreUnavailable):
    """This daemon may not write the store now (its schema is too old for the database,
    or another machine holds its host name and machine id): nothing was written, and
    work waits as for an unreachable store while monitoring and reads go on."""


class StoreBusy(StoreError):
    """The server answered, but the operation waited too long for a lock another writer
    holds, ran over the statement timeout, or lost a serialization race: nothing was
    written, the store is up, and the same call may work after a short backoff
    (:func:`gpuwatchd.store.retry.retrying`)."""
