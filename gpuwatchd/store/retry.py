"""A store call tried again after a backoff while the server answers "busy".

A lock held past the lock timeout (another host's transaction stalled on the same
rows), a statement timeout or a lost serialization race is :class:`StoreBusy`: the
store is up and the same call usually works seconds later. Other errors are raised at
once; so is the last busy one once the tries are spent.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from gpuwatchd.store.errors import StoreBusy

log = logging.getLogger("gpuwatchd.store")

_T = TypeVar("_T")

#: The waits between tries (seconds, each jittered by up to half of itself): four tries.
BACKOFF_S: tuple[float, ...] = (1.0, 4.0, 15.0)


def retrying(
    call: Callable[[], _T],
    what: str,
    *,
    backoff_s: Sequence[float] = BACKOFF_S,
    sleep: Callable[[float], None] = time.sleep,
) -> _T:
    """``call()``, tried again after each wait of ``backoff_s`` while it raises
    :class:`StoreBusy`; the last StoreBusy is raised once they are spent."""
    for wait in backoff_s:
        try:
            return call()
        except StoreBusy as e:
            pause = wait * (1 + random.random() / 2)
            log.info("%s: %s; trying again in %.1f s", what, e, pause)
            sleep(pause)
    return call()
