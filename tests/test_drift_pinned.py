"""The drift detector's edges pinned: a failing versions lookup, NVML rounding inside the
tolerances, invalid references, ``reconfigure``, the ageing and dwell boundaries, and the
view it publishes.

Written against the mutation test (``bench/mutation_test.py``); the builders come from
``test_drift``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import FrozenInstanceError, replace
from typing import Any

import pytest
from test_drift import BASE_UNIX, INFO, MHZ, STACK, Libraries, feed, reference, snapshot

from gpuwatchd.drift import DriftConfig, DriftDetector, RetuneReason
from gpuwatchd.drift.detector import (
    MAX_CLOCK_TOLERANCE_HZ,
    POWER_LIMIT_TOLERANCE_W,
    GpuDriftView,
    Reference,
)
from gpuwatchd.monitor.board import GpuSnapshot, PollHealth
from gpuwatchd.tuning.types import Versions

R = RetuneReason
FAST = DriftConfig(dwell_s=0.0, cooldown_s=0.0, settle_s=0.0, min_load_s=60.0)


def same_stack() -> Versions:
    return Versions(torch="2.11.0", triton="3.5.0", cudnn="9.19.0.56")


def test_the_tolerances_are_nvml_rounding() -> None:
    assert POWER_LIMIT_TOLERANCE_W == 0.5  # NVML reports milliwatts
    assert MAX_CLOCK_TOLERANCE_HZ == 0.5e6  # and whole MHz


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"power_limit_w": 700.5}, None),  # exactly the tolerance: rounding
        ({"power_limit_w": 699.5}, None),
        ({"power_limit_w": 700.6}, R.POWER_LIMIT_CHANGED),
        ({"power_limit_w": 699.4}, R.POWER_LIMIT_CHANGED),
        ({"max_sm_clock_mhz": 1980.5}, None),
        ({"max_sm_clock_mhz": 1979.5}, None),
        ({"max_sm_clock_mhz": 1980.6}, R.MAX_CLOCK_CHANGED),
        ({"max_sm_clock_mhz": 1979.4}, R.MAX_CLOCK_CHANGED),
        ({"power_limit_w": None, "max_sm_clock_mhz": None}, None),  # unknown now
    ],
)
def test_nvml_rounding_within_the_tolerances_is_no_change(
    changes: dict[str, Any], reason: R | None
) -> None:
    det = DriftDetector(DriftConfig(), same_stack)
    reference(det)
    det.observe(snapshot(0.0, info=replace(INFO, **changes)))
    assert det.evaluate(BASE_UNIX + 60) == ({0: [reason]} if reason else {})


def test_an_unknown_reference_value_is_not_checked() -> None:
    det = DriftDetector(DriftConfig(), same_stack)
    reference(det, power_limit_w=None, max_clock_hz=None)
    det.observe(snapshot(0.0, info=replace(INFO, power_limit_w=300.0, max_sm_clock_mhz=900.0)))
    assert det.evaluate(BASE_UNIX + 60) == {}


def test_change_details_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    det = DriftDetector(DriftConfig(), same_stack)
    reference(det)
    det.observe(snapshot(0.0, info=replace(INFO, power_limit_w=650.0, max_sm_clock_mhz=1785.0)))
    with caplog.at_level(logging.WARNING, "gpuwatchd.drift.detector"):
        assert det.evaluate(BASE_UNIX + 60) == {0: [R.POWER_LIMIT_CHANGED, R.MAX_CLOCK_CHANGED]}
    text = caplog.text
    assert "power limit 650 W, winners measured at 700 W" in text
    assert "max SM clock 1785 MHz, winners measured at 1980 MHz" in text


def test_a_failing_versions_lookup_skips_only_the_versions_check(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken() -> Versions:
        raise RuntimeError("metadata entry is damaged")

    det = DriftDetector(DriftConfig(), broken)
    reference(det, versions=replace(STACK, torch="1.0"))  # would be a change if read
    det.observe(snapshot(0.0, info=replace(INFO, power_limit_w=650.0)))
    with caplog.at_level(logging.WARNING, "gpuwatchd.drift.detector"):
        assert det.evaluate(BASE_UNIX + 60) == {0: [R.POWER_LIMIT_CHANGED]}
    assert "cannot read installed library versions: metadata entry is damaged" in caplog.text
    libs = Libraries(same_stack())
    det._versions_now = libs  # the lookup recovers: the skipped check runs again
    assert det.evaluate(BASE_UNIX + 90) == {0: [R.VERSIONS_CHANGED]}


def test_versions_changed_names_the_fields(caplog: pytest.LogCaptureFixture) -> None:
    det = DriftDetector(DriftConfig(), lambda: Versions(torch="2.12.0", triton="3.5.0"))
    reference(det)
    det.observe(snapshot(0.0))
    with caplog.at_level(logging.WARNING, "gpuwatchd.drift.detector"):
        assert det.evaluate(BASE_UNIX + 60) == {0: [R.VERSIONS_CHANGED]}
    assert "torch 2.11.0+cu128 -> 2.12.0" in caplog.text


def test_without_device_info_the_driver_is_not_compared() -> None:
    det = DriftDetector(DriftConfig(), same_stack)
    reference(det, versions=replace(STACK, driver="1.0"))
    assert det.evaluate(BASE_UNIX + 60) == {}  # no snapshot: the driver now is unknown
    det.observe(snapshot(0.0))
    assert det.evaluate(BASE_UNIX + 90) == {0: [R.VERSIONS_CHANGED]}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sustained_clock_hz": 0.0}, "reference.sustained_clock_hz: must be a finite number > 0"),
        ({"sustained_clock_hz": -1.0}, "reference.sustained_clock_hz: must be"),
        ({"power_limit_w": math.nan}, "reference.power_limit_w: must be"),
        ({"max_clock_hz": math.inf}, "reference.max_clock_hz: must be"),
        ({"max_clock_hz": True}, "reference.max_clock_hz: must be"),
        ({"power_limit_w": "700"}, "reference.power_limit_w: must be"),
        ({"measured_at": math.nan}, "reference.measured_at: must be a unix time"),
        ({"measured_at": None}, "reference.measured_at: must be a unix time"),
        ({"versions": None}, "reference.versions: must be Versions"),
    ],
)
def test_an_invalid_reference_is_refused_and_changes_nothing(
    changes: dict[str, Any], message: str
) -> None:
    det = DriftDetector(DriftConfig(), same_stack)
    reference(det, power_limit_w=650.0)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        reference(det, **changes)
    assert det.view()[0].reference_clock_hz == 1440.0 * MHZ
    det.observe(snapshot(0.0))
    assert det.evaluate(BASE_UNIX + 60) == {0: [R.POWER_LIMIT_CHANGED]}  # the old one holds


def test_a_reference_may_leave_values_unknown_and_use_small_positive_ones() -> None:
    ref = Reference("GPU-x", None, None, None, Versions(), 0)
    assert ref.power_limit_w is None and ref.measured_at == 0
    assert Reference("GPU-x", 1, 0.001, 2, Versions(), -5.0).sustained_clock_hz == 1


def test_reconfigure_applies_to_known_and_new_gpus_and_keeps_the_evidence() -> None:
    det = DriftDetector(DriftConfig(), same_stack)
    reference(det)
    feed(det, 0.0, 120.0, clock_mhz=1300.0)
    det.evaluate(BASE_UNIX + 120)
    assert det.drift_ratio(0) is None  # 60 s settle + 120 s of load: not enough yet
    det.reconfigure(FAST)
    assert det.cfg is FAST
    feed(det, 120.0, 130.0, clock_mhz=1300.0)
    assert det.evaluate(BASE_UNIX + 130) == {0: [R.CLOCK_DRIFT]}  # the old samples count
    assert det.drift_ratio(0) == pytest.approx(1300 / 1440 - 1)
    det.observe(snapshot(0.0, info=replace(INFO, index=1, uuid="GPU-one")))
    feed_gpu1 = [snapshot(t, info=replace(INFO, index=1, uuid="GPU-one")) for t in range(1, 70)]
    for snap in feed_gpu1:
        det.observe(snap)
    reference(det, gpu=1, uuid="GPU-one")
    det.evaluate(BASE_UNIX + 200)
    assert det.drift_ratio(1) == pytest.approx(0.0)  # FAST's 60 s min load on a new GPU


def test_reconfigure_changes_the_window_of_every_track() -> None:
    det = DriftDetector(DriftConfig(), same_stack)
    det.observe(snapshot(0.0))
    cfg = DriftConfig(window_s=900.0, settle_s=5.0, util_min=0.5)
    det.reconfigure(cfg)
    w = det._tracks[0].window
    assert (w.window_s, w.settle_s, w.util_min) == (900.0, 5.0, 0.5)


@pytest.mark.parametrize(("age", "stale"), [(7 * 86_400.0, False), (7 * 86_400.0 + 1, True)])
def test_winners_are_stale_only_past_the_maximum_age(age: float, stale: bool) -> None:
    det = DriftDetector(DriftConfig(max_winner_age_s=7 * 86_400.0), same_stack)
    reference(det, measured_at=BASE_UNIX - age)
    assert det.evaluate(BASE_UNIX) == ({0: [R.WINNERS_STALE]} if stale else {})


def test_drift_exactly_at_the_threshold_is_no_drift() -> None:
    cfg = replace(FAST, threshold=0.25)
    det = DriftDetector(cfg, same_stack)
    reference(det, sustained_clock_hz=1600.0 * MHZ)
    feed(det, 0.0, 120.0, clock_mhz=1200.0)  # exactly -25%
    assert det.evaluate(BASE_UNIX + 120) == {}
    assert det.drift_ratio(0) == -0.25
    assert (det._tracks[0].held_s, det._tracks[0].beyond_at) == (0.0, None)  # no episode
    feed(det, 120.0, 400.0, clock_mhz=1100.0)
    assert det.evaluate(BASE_UNIX + 400) == {0: [R.CLOCK_DRIFT]}


def test_dwell_and_cooldown_boundaries_are_inclusive(caplog: pytest.LogCaptureFixture) -> None:
    cfg = replace(FAST, dwell_s=100.0, cooldown_s=300.0)
    det = DriftDetector(cfg, same_stack)
    reference(det, measured_at=BASE_UNIX)
    feed(det, 0.0, 100.0, clock_mhz=1300.0)
    assert det.evaluate(BASE_UNIX + 200) == {}  # first sight of drift: held 0 s
    assert det.evaluate(BASE_UNIX + 250) == {}  # held 50 s, dwell 100 s
    assert det._tracks[0].held_s == 50.0
    assert det.evaluate(BASE_UNIX + 299) == {}  # held 99 s
    with caplog.at_level(logging.WARNING, "gpuwatchd.drift.detector"):
        assert det.evaluate(BASE_UNIX + 300) == {0: [R.CLOCK_DRIFT]}  # 100 s held, age 300 s
    assert "sustained SM clock 1300 MHz is -9.7% from the 1440 MHz" in caplog.text
    assert "for 100 s" in caplog.text


def test_a_clock_going_back_in_time_between_evaluates_adds_no_dwell() -> None:
    det = DriftDetector(replace(FAST, dwell_s=100.0), same_stack)
    reference(det, measured_at=BASE_UNIX)
    feed(det, 0.0, 100.0, clock_mhz=1300.0)
    det.evaluate(BASE_UNIX + 500)
    det.evaluate(BASE_UNIX + 400)  # the wall clock stepped back
    assert det._tracks[0].held_s == 0.0


def test_an_unknown_learned_clock_pauses_the_dwell_count() -> None:
    det = DriftDetector(replace(FAST, dwell_s=100.0), same_stack)
    reference(det, measured_at=BASE_UNIX)
    feed(det, 0.0, 100.0, clock_mhz=1300.0)
    det.evaluate(BASE_UNIX + 200)
    det.observe(GpuSnapshot(0, INFO, None, None, PollHealth(False, 0.0, lost=True)))
    det.evaluate(BASE_UNIX + 260)
    assert det._tracks[0].beyond_at is None and det.drift_ratio(0) is None
    feed(det, 300.0, 400.0, clock_mhz=1300.0)
    det.evaluate(BASE_UNIX + 500)
    assert det._tracks[0].held_s == 0.0  # the gap did not count


def test_a_new_reference_restarts_the_dwell_and_returns_whether_it_changed() -> None:
    det = DriftDetector(replace(FAST, dwell_s=100.0), same_stack)
    assert reference(det, measured_at=BASE_UNIX) is True
    feed(det, 0.0, 100.0, clock_mhz=1300.0)
    det.evaluate(BASE_UNIX + 200)
    det.evaluate(BASE_UNIX + 250)
    assert reference(det, measured_at=BASE_UNIX) is False
    assert det._tracks[0].held_s == 50.0
    assert reference(det, measured_at=BASE_UNIX + 1) is True
    assert (det._tracks[0].held_s, det._tracks[0].beyond_at) == (0.0, None)


def test_the_view_and_its_accessors() -> None:
    det = DriftDetector(DriftConfig(), same_stack)
    assert det.view() == {} and det.drift_ratio(3) is None and det.pending(3) == set()
    reference(det, gpu=2, uuid="GPU-ref", sustained_clock_hz=None)
    assert det.view() == {2: GpuDriftView("GPU-ref", None, None, None, frozenset())}
    det._tracks[5] = det._new_track()  # neither info nor reference yet
    det.evaluate(BASE_UNIX)
    assert det.view()[5].uuid == "" and det.view()[5].reference_clock_hz is None
    det.observe(snapshot(0.0, info=replace(INFO, index=2, uuid="GPU-now")))
    det.evaluate(BASE_UNIX + 1)
    assert det.view()[2].uuid == "GPU-now"
    pending = det.pending(2)
    pending.add(R.NO_WINNERS)  # a copy: the detector's own set is untouched
    assert det.pending(2) == set()


def test_a_reference_and_a_published_view_are_frozen() -> None:
    det = DriftDetector(DriftConfig(), same_stack)
    reference(det, gpu=0)
    view = det.view()[0]
    with pytest.raises(FrozenInstanceError):
        view.pending = frozenset({R.NO_WINNERS})  # type: ignore[misc]
    ref = det._tracks[0].reference
    assert ref is not None
    with pytest.raises(FrozenInstanceError):
        ref.power_limit_w = 1.0  # type: ignore[misc]
    assert ref.power_limit_w == 700.0 and det.view()[0].pending == frozenset()


def test_no_winners_needs_a_known_gpu_and_is_logged_once_for_all(
    caplog: pytest.LogCaptureFixture,
) -> None:
    det = DriftDetector(DriftConfig(), same_stack)
    det._tracks[4] = det._new_track()  # nothing known about it: nothing to ask
    for gpu in (1, 0):
        det.observe(snapshot(0.0, info=replace(INFO, index=gpu, uuid=f"GPU-{gpu}")))
    with caplog.at_level(logging.INFO, "gpuwatchd.drift.detector"):
        raised = det.evaluate(BASE_UNIX)
    assert raised == {0: [R.NO_WINNERS], 1: [R.NO_WINNERS]} and list(raised) == [0, 1]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["GPU 0, 1: never tuned; first tuning requested (no_winners)"]


def test_the_same_device_info_again_keeps_the_learned_clock() -> None:
    det = DriftDetector(FAST, same_stack)
    reference(det)
    feed(det, 0.0, 70.0)
    det.observe(snapshot(70.0, info=replace(INFO)))  # equal uuid, a new object
    det.evaluate(BASE_UNIX)
    assert det.drift_ratio(0) == pytest.approx(0.0)


def test_a_new_reference_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    det = DriftDetector(DriftConfig(), same_stack)
    with caplog.at_level(logging.INFO, "gpuwatchd.drift.detector"):
        reference(det)
        reference(det)  # the same again: nothing to say
        reference(det, gpu=1, sustained_clock_hz=None, power_limit_w=None)
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 0: drift reference set: sustained clock 1440 MHz, power limit 700 W, "
        f"measured at {BASE_UNIX:.0f}",
        "GPU 1: drift reference set: sustained clock unknown, power limit unknown, "
        f"measured at {BASE_UNIX:.0f}",
    ]


def test_a_snapshot_without_device_info_keeps_the_known_gpu() -> None:
    det = DriftDetector(FAST, same_stack)
    reference(det)
    feed(det, 0.0, 70.0)
    sample = snapshot(70.0).sample
    det.observe(GpuSnapshot(0, None, sample, None, PollHealth(True, 0.001)))
    det.evaluate(BASE_UNIX)
    assert det.view()[0].uuid == INFO.uuid and det.drift_ratio(0) == pytest.approx(0.0)


def test_a_one_second_maximum_age_still_ages() -> None:
    det = DriftDetector(DriftConfig(max_winner_age_s=1.0), same_stack)
    reference(det, measured_at=BASE_UNIX - 2.0)
    assert det.evaluate(BASE_UNIX) == {0: [R.WINNERS_STALE]}


def test_another_gpu_in_the_slot_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    det = DriftDetector(FAST, same_stack)
    det.observe(snapshot(0.0))
    with caplog.at_level(logging.WARNING, "gpuwatchd.drift.detector"):
        det.observe(snapshot(1.0, info=replace(INFO, uuid="GPU-other")))
    assert caplog.messages == [
        f"GPU 0: now GPU-other (was {INFO.uuid}); its learned clock starts over"
    ]
