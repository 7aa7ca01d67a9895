"""What the client raises: every error is a :class:`GpuwatchdError` with a one-line text.

:class:`GpuwatchdError` itself is :mod:`gpuwatchd.api`'s, so a bad document, a failed
GET and an unreachable daemon are caught with one ``except``.
"""

from __future__ import annotations

from gpuwatchd.api.errors import GpuwatchdError

__all__ = ["GpuwatchdError", "GpuwatchdUnavailable", "NotServed"]


class GpuwatchdUnavailable(GpuwatchdError):
    """Neither the daemon nor (for winners) the store file could be reached."""


class NotServed(GpuwatchdError):
    """The daemon answered 404: an older daemon without this endpoint."""
