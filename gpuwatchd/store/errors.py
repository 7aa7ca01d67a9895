"""The one exception the store raises, so callers catch a single type."""

from __future__ import annotations


class StoreError(Exception):
    """A store operation failed; the message is one line naming the file or the bad field."""
