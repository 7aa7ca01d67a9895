"""``gpuwatchd_control_turned_away_total``: connections the control socket turned away.

A connection that finds every slot taken is answered ``busy`` and closed (the client asks
again); the log says so once per burst with a count, and this counter keeps the total,
so a crowd of jobs or one user's connect flood shows on a dashboard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric


class ControlCollector:
    """The control server's count of busy turn-aways, read at each scrape (no I/O)."""

    name = "control"
    runs_inline = True  # one integer the server keeps
    timeless = True

    def __init__(self, turned_away: Callable[[], int]) -> None:
        self._turned_away = turned_away

    def version(self) -> object:
        return self._turned_away()

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "gpuwatchd_control_turned_away",
            "Connections to the control socket turned away busy (every slot taken) since"
            " the daemon started; their clients ask again.",
            value=float(self._turned_away()),
        )
