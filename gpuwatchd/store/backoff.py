"""Jittered exponential backoff between tries at a store that cannot be reached.

A fleet whose database went away must not knock on it in step: at 1,000 hosts a retry
once a second is 1,000 connection attempts a second (or failed logins, with a wrong
password) just as it comes back. Each failed try doubles the wait up to ``cap_s``, and
each wait is drawn between half of it and all of it ("equal jitter"), so hosts that
failed together spread out; a success starts again from ``first_s``.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

#: The wait after the first failure.
FIRST_S = 1.0
#: The longest wait: a store back is seen within a minute.
CAP_S = 60.0


class Backoff:
    """The wait before the next try; thread-safe. ``rand`` (0..1) is injectable."""

    def __init__(
        self,
        first_s: float = FIRST_S,
        cap_s: float = CAP_S,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self._rand = rand
        self._failures = 0
        self._lock = threading.Lock()

    def failed(self) -> float:
        """One more failed try: the seconds to wait before the next one."""
        with self._lock:
            ceiling = min(self.cap_s, self.first_s * 2.0 ** min(self._failures, 32))
            self._failures += 1
        return ceiling * (0.5 + 0.5 * self._rand())

    def reset(self) -> None:
        """A try succeeded: the next failure waits ``first_s`` again."""
        with self._lock:
            self._failures = 0
