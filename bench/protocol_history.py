"""The protocol's settings as they were, for benchmarks that compare against them.

``CLASSIC`` is the protocol before issue 13; ``ROUND_1`` the defaults after its first
round of deciding faster (racing unthrottled, reused calibration, sustained skip);
today's defaults are plain ``ProtocolConfig()``. Every setting added since is pinned to
the value that reproduces the older behaviour, so a new default does not leak into them.
"""

from __future__ import annotations

from typing import Any

from gpuwatchd.tuning.settings import ProtocolConfig

#: The settings the second round added or changed, at their earlier values: racing in the
#: unthrottled regime only, 0.2 s warm-ups, 50 ms pauses, a 3 s settle window judged by its
#: half-means (1 s when queued), every sustained batch kept, stop on a stable spread only,
#: one workload per worker job.
BEFORE_ROUND_2: dict[str, Any] = {
    "warmup_min_s": 0.2,
    "pause_s": 0.05,
    "max_pause_s": 0.05,
    "unpaused_when_unlimited": False,
    "settle_window_s": 3.0,
    "settle_horizon_s": 0.0,
    "warm_settle_window_s": 1.0,
    "race_sustained": False,
    "transient_max_s": 0.0,
    "stop_when_decided": False,
    "queue_workloads": 1,
    "probe_ends_on_limit": False,
}
#: Before issue 13: every candidate timed for five rounds, every regime warmed up afresh,
#: the sustained regime always measured.
CLASSIC = ProtocolConfig(
    min_rounds=5, race=False, reuse_calibration=False, skip_sustained=False, **BEFORE_ROUND_2
)
#: After issue 13's first round.
ROUND_1 = ProtocolConfig(**BEFORE_ROUND_2)
