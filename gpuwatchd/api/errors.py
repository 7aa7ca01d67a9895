"""The one exception every reader of a gpuwatchd document raises.

It lives with the documents, below the client and the CLI, so the HTTP helper, the
parsers and the job-side client all raise (and catch) the same type.
"""

from __future__ import annotations


class GpuwatchdError(Exception):
    """Something the daemon or the store said could not be used; ``str()`` is one line."""
