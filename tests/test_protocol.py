"""The measurement protocol and its statistics, on a scripted fake device."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import pytest

from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason
from gpuwatchd.tuning.settings import ProtocolConfig
from gpuwatchd.tuning.types import BatchRecord, Regime, Workload
from gpuwatchd.tuning.worker import stats
from gpuwatchd.tuning.worker.candidate import Candidate, CandidateError
from gpuwatchd.tuning.worker.protocol import Preempted, measure, tune

WL = Workload(
    name="w", op="matmul", shape={"m": 8, "n": 8, "k": 8}, dtype="fp32", families=("fake",)
)
MAX_MHZ = 2000.0
# Small batches and short pauses keep the fake-time runs cheap; the budget is generous.
CFG = ProtocolConfig(
    batch_target_s=0.01,
    warmup_s=0.02,
    pause_s=0.01,
    cool_pause_s=0.5,
    min_rounds=6,
    max_rounds=60,
    spread_target=0.01,
    time_budget_s=600.0,
    settle_window_s=1.0,
    settle_timeout_s=20.0,
)


class FakeCandidate:
    def __init__(self, name: str, per_call_s: float, **meta: Any) -> None:
        self.name = name
        self.family = "fake"
        self.per_call_s = per_call_s
        self._meta = meta
        self.setups = 0
        self.teardowns = 0
        self.fail_setup = False
        self.fail_run_after: int | None = None
        self.runs = 0

    def setup(self) -> None:
        self.setups += 1
        if self.fail_setup:
            raise CandidateError("wrong answer: max error 3.2")

    def run(self, calls: int) -> None:
        self.runs += 1
        if self.fail_run_after is not None and self.runs > self.fail_run_after:
            raise CandidateError("illegal memory access")

    def meta(self) -> dict[str, Any]:
        return dict(self._meta)

    def teardown(self) -> None:
        self.teardowns += 1


Throttle = Callable[["FakeSession", FakeCandidate], bool]


class FakeSession:
    """Fake time; per-call time = base * (1 + gauss noise); scripted throttle episodes.

    ``throttle(session, cand)`` decides whether the next batch is throttled: it then runs
    25% slower and the sample after it reports SW_POWER_CAP at 1400 MHz. ``sustained``
    makes the clock decay from max towards 1450 MHz while loaded (tau 2 s) and recover
    on pauses, with power following the clock.
    """

    def __init__(
        self,
        noise: float = 0.002,
        seed: int = 1,
        throttle: Throttle | None = None,
        low_clock: Throttle | None = None,
    ) -> None:
        self.info = DeviceInfo(index=0, uuid="GPU-fake", name="Fake GPU", max_sm_clock_mhz=MAX_MHZ)
        self.t = 0.0
        self.noise = noise
        self.rng = random.Random(seed)
        self.throttle = throttle
        self.low_clock = low_clock
        self.clock = MAX_MHZ
        self.reasons = ThrottleReason(0)
        self.batches = 0
        self.pauses: list[float] = []
        self.flushes = 0
        self.loaded_clock_floor: float | None = None

    def sample(self) -> Sample:
        return Sample(
            gpu=0,
            t=self.t,
            temp_c=40.0 + (MAX_MHZ - self.clock) / 20,
            power_w=200.0 + self.clock / 4,
            sm_clock_mhz=self.clock,
            reasons=self.reasons,
        )

    def time_batch(self, cand: Candidate, calls: int) -> float:
        assert isinstance(cand, FakeCandidate)
        cand.run(calls)
        self.batches += 1
        slow = 1.0
        self.reasons = ThrottleReason(0)
        self.clock = MAX_MHZ if self.loaded_clock_floor is None else self.clock
        if self.throttle is not None and self.throttle(self, cand):
            slow, self.clock, self.reasons = 1.25, 1400.0, ThrottleReason.SW_POWER_CAP
        elif self.low_clock is not None and self.low_clock(self, cand):
            slow, self.clock = 1.15, 1700.0
        per = cand.per_call_s * slow * max(0.5, 1.0 + self.rng.gauss(0.0, self.noise))
        if self.loaded_clock_floor is not None:
            per *= MAX_MHZ / self.clock
        dt = per * calls
        self.t += dt
        if self.loaded_clock_floor is not None:
            floor = self.loaded_clock_floor
            self.clock = floor + (self.clock - floor) * math.exp(-dt / 2.0)
        return dt

    def flush_l2(self) -> None:
        self.flushes += 1

    def pause(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.t += seconds
        if self.loaded_clock_floor is not None:
            self.clock = MAX_MHZ - (MAX_MHZ - self.clock) * math.exp(-seconds / 0.5)
        self.reasons = ThrottleReason(0)

    def now(self) -> float:
        return self.t


def records() -> tuple[list[BatchRecord], Callable[[BatchRecord], None]]:
    out: list[BatchRecord] = []
    return out, out.append


# -- statistics ---------------------------------------------------------------------------


def test_median_quantile_spread() -> None:
    assert stats.median([3.0, 1.0, 2.0]) == 2.0
    assert stats.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert stats.quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.25) == 2.0
    assert stats.relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2.0 / 3.0)
    assert stats.relative_spread([1.0]) == math.inf
    with pytest.raises(ValueError):
        stats.median([])


def test_median_ci_order_statistics() -> None:
    xs = [float(i) for i in range(1, 21)]  # n=20: 95% CI of the median is x(6)..x(15)
    assert stats.median_ci(xs) == (6.0, 15.0)
    assert stats.median_ci([1.0, 2.0, 3.0]) == (1.0, 3.0)  # too few: the full range
    lo, hi = stats.median_ci(xs, confidence=0.5)
    assert 6.0 < lo <= hi < 15.0


def test_decide_winner_and_tie() -> None:
    rng = random.Random(0)
    a = [1.00 * (1 + rng.gauss(0, 0.002)) for _ in range(20)]
    b = [1.02 * (1 + rng.gauss(0, 0.002)) for _ in range(20)]
    d = stats.decide({"b": b, "a": a})
    assert (d.winner, d.tie, d.ranking) == ("a", False, ("a", "b"))
    assert d.margin is not None and d.noise is not None
    assert d.margin == pytest.approx(0.02, abs=0.003) and d.margin > d.noise
    same = stats.decide({"a": a, "a2": [x * 1.001 for x in a]})
    assert same.winner is None and same.tie and same.ranking[0] == "a"
    assert stats.decide({"a": a, "dead": []}) == stats.Decision("a", False, None, None, ("a",))
    assert stats.decide({}).winner is None


# -- config -------------------------------------------------------------------------------


def test_config_from_mapping_validates_and_names_the_key() -> None:
    cfg = ProtocolConfig.from_mapping({"pause_s": 1, "min_rounds": 3, "flush_l2": "never"})
    assert cfg.pause_s == 1.0 and isinstance(cfg.pause_s, float) and cfg.min_rounds == 3
    bad: list[tuple[dict[str, Any], str]] = [
        ({"pause": 1}, "protocol.pause: unknown setting"),
        ({"min_rounds": 2.5}, "protocol.min_rounds: expected an integer"),
        ({"batch_target_s": 0}, "protocol.batch_target_s: must be > 0"),
        ({"clock_ratio_min": 1.5}, "protocol.clock_ratio_min"),
        ({"min_rounds": 10, "max_rounds": 5}, "protocol.max_rounds: must be >= min_rounds"),
        ({"flush_l2": "sometimes"}, "protocol.flush_l2"),
        ({"spread_target": True}, "protocol.spread_target: expected a finite number"),
        ({"time_budget_s": float("nan")}, "protocol.time_budget_s: expected a finite number"),
    ]
    for mapping, message in bad:
        with pytest.raises(ValueError) as exc:
            ProtocolConfig.from_mapping(mapping)
        assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


# -- unthrottled --------------------------------------------------------------------------


def test_unthrottled_picks_right_winner_despite_throttle_episodes() -> None:
    """1-3% apart; the best candidate is throttled in three of every five batches. Those
    are rejected and retried, so it still wins: counting them (25% slower) would put its
    median last."""
    cands = [FakeCandidate("c", 1.03e-3), FakeCandidate("b", 1.01e-3), FakeCandidate("a", 1.0e-3)]

    def throttle(s: FakeSession, c: FakeCandidate) -> bool:
        return c.name == "a" and c.runs % 5 in (1, 2, 3)

    session = FakeSession(throttle=throttle)
    recs, on_batch = records()
    res = measure(WL, cands, session, Regime.UNTHROTTLED, CFG, on_batch=on_batch)
    assert (res.winner, res.tie) == ("a", False)
    assert res.margin is not None and res.noise is not None and res.margin > res.noise
    assert [c.name for c in res.candidates] == ["a", "b", "c"]
    a = res.candidates[0]
    assert a.rejected > 0 and a.samples >= CFG.min_rounds
    assert a.median_s == pytest.approx(1.0e-3, rel=0.005)
    rejected = [r for r in recs if r.rejected]
    assert len(rejected) == a.rejected and all(r.candidate == "a" for r in rejected)
    assert all(r.reject_reason == "throttled: sw_power_cap" for r in rejected)
    assert all(r.reasons & ThrottleReason.SW_POWER_CAP for r in rejected)
    assert not any(r.reasons & ThrottleReason.SW_POWER_CAP for r in recs if not r.rejected)
    assert a.reasons == 0 and a.sm_clock_hz == pytest.approx(MAX_MHZ * 1e6)
    # Power is a 1 s average over paused batches: no energy per call in this regime.
    assert a.energy_j_per_call is None and a.meta["power_note"]
    assert all(c.setups == 1 and c.teardowns == 1 for c in cands)


def test_throttle_during_a_batch_is_rejected_then_retried_after_cool_pause() -> None:
    cands = [FakeCandidate("a", 1e-3), FakeCandidate("b", 2e-3)]
    hit: list[int] = []

    def throttle(s: FakeSession, c: FakeCandidate) -> bool:
        if c.name == "b" and c.runs == 9 and not hit:  # one batch mid-run
            hit.append(s.batches)
            return True
        return False

    session = FakeSession(throttle=throttle)
    recs, on_batch = records()
    res = measure(WL, cands, session, Regime.UNTHROTTLED, CFG, on_batch=on_batch)
    i = next(i for i, r in enumerate(recs) if r.rejected)
    assert recs[i].candidate == "b" and recs[i].sm_clock_mhz == 1400.0
    assert recs[i + 1].candidate == "b" and not recs[i + 1].rejected  # retried at once
    assert CFG.cool_pause_s in session.pauses
    b = next(c for c in res.candidates if c.name == "b")
    assert b.rejected == 1 and b.samples >= CFG.min_rounds
    assert res.winner == "a"


def test_low_clock_without_a_reason_is_rejected() -> None:
    cands = [FakeCandidate("a", 1e-3), FakeCandidate("b", 1.2e-3)]

    def low(s: FakeSession, c: FakeCandidate) -> bool:
        return c.name == "a" and c.runs in (8, 12)

    recs, on_batch = records()
    measure(WL, cands, FakeSession(low_clock=low), Regime.UNTHROTTLED, CFG, on_batch=on_batch)
    rejected = [r for r in recs if r.rejected]
    assert len(rejected) == 2
    assert rejected[0].reject_reason == "sm clock 1700 MHz under 90% of max 2000 MHz"


def test_always_throttled_gives_up_bounded_and_names_no_winner() -> None:
    cands = [FakeCandidate("a", 1e-3), FakeCandidate("b", 1e-3)]
    cfg = ProtocolConfig.from_mapping({**_cfg_dict(), "time_budget_s": 30.0, "max_retries": 2})
    session = FakeSession(throttle=lambda s, c: True)
    res = measure(WL, cands, session, Regime.UNTHROTTLED, cfg)
    assert res.winner is None and not res.tie
    for c in res.candidates:
        assert c.median_s is None and c.samples == 0 and c.rejected > 0
        skipped = c.meta["skipped_batches"]  # 1 try + 2 retries per slot, the last cut short
        assert skipped > 0 and 3 * skipped <= c.rejected < 3 * (skipped + 1)
    assert session.t < 30.0 + 1.0  # stopped by the budget


def test_identical_candidates_with_noise_are_a_tie() -> None:
    cands = [FakeCandidate("x", 1e-3), FakeCandidate("y", 1e-3)]
    res = measure(WL, cands, FakeSession(noise=0.01, seed=7), Regime.UNTHROTTLED, CFG)
    assert res.tie and res.winner is None
    assert res.margin is not None and res.noise is not None and res.margin <= res.noise
    assert all(c.samples >= CFG.min_rounds for c in res.candidates)


def test_interleaving_order_varies_between_rounds() -> None:
    cands = [FakeCandidate(n, 1e-3 * (1 + i / 50)) for i, n in enumerate("abcd")]
    recs, on_batch = records()
    res = measure(WL, cands, FakeSession(), Regime.UNTHROTTLED, CFG, on_batch=on_batch)
    rounds = [tuple(r.candidate for r in recs[i : i + 4]) for i in range(0, len(recs), 4)]
    assert len(rounds) == res.candidates[0].meta["rounds"] >= CFG.min_rounds
    assert all(sorted(r) == list("abcd") for r in rounds)  # each candidate once per round
    assert len(set(rounds)) > 1
    assert len({r[0] for r in rounds}) > 1  # not always the same one first
    # Same seed, same order: runs are reproducible.
    recs2, on_batch2 = records()
    measure(WL, cands, FakeSession(), Regime.UNTHROTTLED, CFG, on_batch=on_batch2)
    assert [r.candidate for r in recs2] == [r.candidate for r in recs]


def test_stops_when_spread_is_under_target_and_when_budget_ends() -> None:
    cands = [FakeCandidate("a", 1e-3), FakeCandidate("b", 1.1e-3)]
    quiet = measure(WL, cands, FakeSession(noise=0.0005), Regime.UNTHROTTLED, CFG)
    assert quiet.candidates[0].meta["rounds"] == CFG.min_rounds
    assert all(c.spread is not None and c.spread < CFG.spread_target for c in quiet.candidates)
    # Under 5% noise the spread never gets under 1%: only the budget stops them (stopping
    # on a settled pick, which would end it sooner, is tested below).
    noisy_session = FakeSession(noise=0.05)
    noisy_cfg = ProtocolConfig.from_mapping(
        {**_cfg_dict(), "time_budget_s": 2.0, "stop_when_decided": False}
    )
    noisy = measure(WL, cands, noisy_session, Regime.UNTHROTTLED, noisy_cfg)
    assert noisy.candidates[0].meta["rounds"] < CFG.max_rounds
    assert 2.0 <= noisy_session.t < 2.2


def test_a_pick_no_more_rounds_can_change_stops_the_regime_before_a_stable_spread() -> None:
    """10% apart under 5% noise: the spread never gets under 1%, but after the minimum
    rounds the winner's margin beats the noise, so the regime stops there; with
    ``stop_when_decided`` off it runs on to the budget."""
    cands = [FakeCandidate("a", 1e-3), FakeCandidate("b", 1.1e-3)]
    cfg = ProtocolConfig.from_mapping({**_cfg_dict(), "time_budget_s": 2.0})
    fast_session = FakeSession(noise=0.05)
    fast = measure(WL, cands, fast_session, Regime.UNTHROTTLED, cfg)
    assert fast.winner == "a" and fast.candidates[0].spread > cfg.spread_target
    assert fast.candidates[0].meta["rounds"] < 2 * cfg.min_rounds and fast_session.t < 1.0
    off = ProtocolConfig.from_mapping({**_cfg_dict(), "time_budget_s": 2.0,
                                       "stop_when_decided": False})  # fmt: skip
    slow_session = FakeSession(noise=0.05)
    measure(WL, [FakeCandidate("a", 1e-3), FakeCandidate("b", 1.1e-3)], slow_session,
            Regime.UNTHROTTLED, off)  # fmt: skip
    assert slow_session.t >= 2.0


def test_calls_per_batch_calibrated_to_target() -> None:
    recs, on_batch = records()
    measure(WL, [FakeCandidate("a", 1e-4)], FakeSession(), Regime.UNTHROTTLED, CFG, on_batch)
    assert all(r.calls == pytest.approx(CFG.batch_target_s / 1e-4, rel=0.02) for r in recs)


def test_l2_flushed_between_calls_for_small_working_sets_only() -> None:
    small = FakeCandidate("small", 1e-3, working_set_bytes=1 << 20)
    big = FakeCandidate("big", 1e-3, working_set_bytes=1 << 30)
    session = FakeSession()
    res = measure(WL, [small, big], session, Regime.UNTHROTTLED, CFG)
    by = {c.name: c for c in res.candidates}
    assert by["small"].meta["flush_l2"] and not by["big"].meta["flush_l2"]
    assert session.flushes > 0
    assert session.flushes == small.runs  # one flush before every call of the small one
    never = ProtocolConfig.from_mapping({**_cfg_dict(), "flush_l2": "never"})
    session2 = FakeSession()
    measure(WL, [small], session2, Regime.UNTHROTTLED, never)
    assert session2.flushes == 0


def test_failing_candidates_are_reported_not_fatal() -> None:
    bad_setup = FakeCandidate("bad-setup", 1e-3)
    bad_setup.fail_setup = True
    bad_run = FakeCandidate("bad-run", 0.5e-3)
    bad_run.fail_run_after = 5
    good = FakeCandidate("good", 1e-3)
    res = measure(WL, [bad_setup, bad_run, good], FakeSession(), Regime.UNTHROTTLED, CFG)
    by = {c.name: c for c in res.candidates}
    assert by["bad-setup"].meta["error"] == "wrong answer: max error 3.2"
    assert by["bad-run"].meta["error"] == "run: illegal memory access"
    assert by["good"].samples >= CFG.min_rounds and res.winner == "good"
    assert bad_setup.teardowns == 0 and bad_run.teardowns == 1 and good.teardowns == 1


def test_an_unexpected_setup_error_still_tears_down_the_others() -> None:
    class Exploding(FakeCandidate):
        def setup(self) -> None:
            raise RuntimeError("CUDA out of memory")

    first, boom, never = FakeCandidate("a", 1e-3), Exploding("b", 1e-3), FakeCandidate("c", 1)
    with pytest.raises(RuntimeError, match="out of memory"):
        measure(WL, [first, boom, never], FakeSession(), Regime.UNTHROTTLED, CFG)
    assert (first.teardowns, boom.teardowns, never.setups, never.teardowns) == (1, 0, 0, 0)


def test_duplicate_names_and_unknown_regime_are_errors() -> None:
    with pytest.raises(ValueError, match="duplicate names"):
        measure(WL, [FakeCandidate("a", 1), FakeCandidate("a", 1)], FakeSession(), "unthrottled")
    with pytest.raises(ValueError, match="regime: unknown regime 'hot'"):
        measure(WL, [FakeCandidate("a", 1)], FakeSession(), "hot")


def test_should_stop_raises_preempted_and_tears_down() -> None:
    cands = [FakeCandidate("a", 1e-3), FakeCandidate("b", 1e-3)]
    session = FakeSession()
    with pytest.raises(Preempted):
        measure(WL, cands, session, Regime.SUSTAINED, CFG, should_stop=lambda: session.t > 0.5)
    assert session.t < 0.5 + 0.05  # stopped at the next batch boundary
    assert all(c.teardowns == 1 for c in cands)


# -- sustained ----------------------------------------------------------------------------


def test_sustained_settles_then_times_back_to_back_without_rejecting() -> None:
    cands = [FakeCandidate("a", 1e-3), FakeCandidate("b", 1.02e-3)]
    session = FakeSession()
    session.loaded_clock_floor = 1450.0
    # The clock approaches its floor exponentially: a 2 s window asking for < 0.3% change
    # of its half-means settles within ~10 MHz of it.
    cfg = ProtocolConfig.from_mapping(
        {**_cfg_dict(), "settle_window_s": 2.0, "settle_clock_rel": 0.003}
    )
    recs, on_batch = records()
    res = measure(WL, cands, session, Regime.SUSTAINED, cfg, on_batch=on_batch)
    assert res.candidates[0].meta["settled"] is True
    assert res.candidates[0].meta["settle_s"] > 2 * 2.0  # several clock time constants
    assert recs and not any(r.rejected for r in recs)
    assert all(r.sm_clock_mhz is not None and r.sm_clock_mhz < 1462.0 for r in recs)
    assert session.pauses == []  # the device never idles in the sustained regime
    a = next(c for c in res.candidates if c.name == "a")
    assert a.median_s == pytest.approx(1e-3 * MAX_MHZ / 1450.0, rel=0.02)
    assert a.sm_clock_hz is not None and a.sm_clock_hz < 0.75 * MAX_MHZ * 1e6
    assert res.winner == "a"


def test_sustained_times_anyway_when_it_never_settles() -> None:
    class Drifting(FakeSession):
        def sample(self) -> Sample:  # the clock keeps sliding, 5% a second
            return Sample(gpu=0, t=self.t, sm_clock_mhz=2000.0 - 100.0 * self.t, power_w=690.0)

    session = Drifting()
    cfg = ProtocolConfig.from_mapping({**_cfg_dict(), "settle_timeout_s": 3.0})
    res = measure(WL, [FakeCandidate("a", 1e-3)], session, Regime.SUSTAINED, cfg)
    meta = res.candidates[0].meta
    assert meta["settled"] is False and 3.0 <= meta["settle_s"] < 3.1
    assert res.candidates[0].samples >= cfg.min_rounds


def test_tune_runs_both_regimes_with_one_setup_and_cools_before_unthrottled() -> None:
    cands = [FakeCandidate("a", 1e-3), FakeCandidate("b", 1.03e-3)]
    session = FakeSession()
    results = tune(WL, cands, session, ["sustained", "unthrottled"], CFG)
    assert [r.regime for r in results] == [Regime.SUSTAINED, Regime.UNTHROTTLED]
    assert session.pauses.count(CFG.cool_pause_s) >= 1
    assert all(c.setups == 1 and c.teardowns == 1 for c in cands)
    assert all(r.winner == "a" for r in results)


def _cfg_dict() -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(CFG)


def test_library_picks_launching_the_same_kernels_are_a_tie_whatever_the_gap() -> None:
    # On the H200 the cuDNN heuristic and benchmark picks of an fp16 conv launched the very
    # same kernel yet timed 7% apart (thread and order effects on a 59 µs kernel).
    kernels = ["sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc"]
    same = {"kernels": kernels, "kernels_identify_code": True}
    cands = [
        FakeCandidate("heuristic", 1.00e-3, **same),
        FakeCandidate("benchmark", 1.07e-3, **same),
    ]
    res = measure(WL, cands, FakeSession(), Regime.UNTHROTTLED, CFG)
    assert res.tie and res.winner is None
    assert res.margin is not None and res.margin > 0.05  # the gap is reported, not hidden
    assert res.candidates[0].meta["tie_reason"] == "winner and runner-up launch the same kernels"
    # Triton configs share a kernel name but not their code: no such rule for them.
    triton = [FakeCandidate("a", 1.00e-3, kernels=["_matmul_kernel"]),
              FakeCandidate("b", 1.07e-3, kernels=["_matmul_kernel"])]  # fmt: skip
    res = measure(WL, triton, FakeSession(), Regime.UNTHROTTLED, CFG)
    assert (res.winner, res.tie) == ("a", False)
