"""What the tune stage of ``bench/gpu_resnet_ab.py`` still lacks, read from the store.

A submitted conv shape is covered when :func:`plan_winners` can plan it (a winner with the
job's default measured in the job's own layouts) and, for a variant whose every shape was
submitted, when it was also measured in each other uniform memory format: the plan weighs
converting the whole model only when every captured conv shape was.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from gpuwatchd.client import Winner
from gpuwatchd.jobside.winner_plan import measured_layouts, plan_winners
from gpuwatchd.tuning.submitted.captured import CONV_LAYOUTS, CapturedCall, workload_for


def coverage_gaps(
    calls: Iterable[CapturedCall],
    submitted: Collection[str],
    winners: Mapping[str, Winner],
    every_shape: bool,
) -> dict[str, str]:
    """``{workload: what is missing}`` for the submitted conv shapes of one capture."""
    calls = [c for c in calls if c.tunable and c.kind == "conv2d"]
    plan = plan_winners(calls, winners, "keep")
    gaps = {name: why for name, why in plan.skipped if name in submitted}
    if not every_shape:
        return gaps
    for call in calls:
        name = workload_for(call).name
        if name in gaps or name not in submitted:
            continue
        have = measured_layouts(winners[name])
        lacking = [f for f in CONV_LAYOUTS if (f, f) != call.layouts and (f, f) not in have]
        if lacking:
            gaps[name] = f"not measured in {', '.join(lacking)}"
    return gaps
