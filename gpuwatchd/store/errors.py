"""The exceptions the store raises, so callers catch a single type (or its one subclass)."""

from __future__ import annotations


class StoreError(Exception):
    """A store operation failed; the message is one line naming the file or the bad field."""


class StoreUnavailable(StoreError):
    """The store could not be reached, or the operation was cut off (connection lost, server
    restarting, a timeout): nothing was written, and the same call may work seconds later.
    Callers retry soon; it is never a failed tuning."""


class WritesRefused(StoreUnavailable):
    """This daemon may not write the store now (its schema is too old for the database,
    or another machine holds its host name and machine id): nothing was written, and
    work waits as for an unreachable store while monitoring and reads go on."""
