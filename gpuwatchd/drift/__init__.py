"""Drift detection: learn each GPU's sustained clock and schedule re-tunes when winners go stale.

Never imports torch: library versions come from installed-package metadata.
"""

from gpuwatchd.drift.config import DriftConfig
from gpuwatchd.drift.detector import DriftDetector, GpuDriftView, Reference, RetuneReason
from gpuwatchd.drift.job import DriftJob
from gpuwatchd.drift.seed import ReferenceSync, reference_from_store, seed_reference
from gpuwatchd.drift.versions import changed_versions, current_versions
from gpuwatchd.drift.window import LoadWindow

__all__ = [
    "DriftConfig",
    "DriftDetector",
    "DriftJob",
    "GpuDriftView",
    "LoadWindow",
    "Reference",
    "ReferenceSync",
    "RetuneReason",
    "changed_versions",
    "current_versions",
    "reference_from_store",
    "seed_reference",
]
