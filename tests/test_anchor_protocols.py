"""The anchors' protocols, the simulated GPU with known truth, and deciding faster.

The anchors (bench/anchor_protocols.py) and the benchmark's world (bench/sim_world.py)
are checked on scripted sessions; racing, the sustained-regime skip, reused calibration
and tune_queue are checked on gpuwatchd's protocol itself.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from anchor_protocols import NvbenchRule, cudnn_find, nvbench_cold, triton_autotune
from sim_world import NoisySession, make_set, settled_clock_mhz

from gpuwatchd.telemetry.types import DeviceInfo, Sample, ThrottleReason
from gpuwatchd.tuning.settings import ProtocolConfig
from gpuwatchd.tuning.types import BatchRecord, Regime, Workload
from gpuwatchd.tuning.worker.candidate import Candidate
from gpuwatchd.tuning.worker.devices import SimSession
from gpuwatchd.tuning.worker.families.sim import sim_family
from gpuwatchd.tuning.worker.protocol import tune, tune_queue
from gpuwatchd.tuning.worker.racing import out_of_race

MAX_MHZ = 2000.0


class Kernel:
    """A candidate with a fixed time per call; runs only on a ScriptedSession."""

    family = "fake"

    def __init__(self, name: str, per_call_s: float) -> None:
        self.name = name
        self.per_call_s = per_call_s
        self.teardowns = 0

    def setup(self) -> None:
        return None

    def run(self, calls: int) -> None:
        return None

    def meta(self) -> dict[str, Any]:
        return {"working_set_bytes": 1 << 30}

    def teardown(self) -> None:
        self.teardowns += 1


class ScriptedSession:
    """Fake time. ``slow(session, kernel)`` multiplies a batch's time (heat, noise);
    ``clock(session)`` is the SM clock samples report; ``power_w`` what they read."""

    def __init__(
        self,
        slow: Callable[[ScriptedSession, Kernel], float] | None = None,
        clock: Callable[[ScriptedSession], float] | None = None,
        power_w: float = 300.0,
        power_limit_w: float | None = 700.0,
        reasons: int = 0,
    ) -> None:
        self.info = DeviceInfo(
            index=0,
            uuid="GPU-scripted",
            name="Scripted GPU",
            max_sm_clock_mhz=MAX_MHZ,
            power_limit_w=power_limit_w,
        )
        self.t = 0.0
        self.slow = slow
        self.clock = clock
        self.power_w = power_w
        self.reasons = ThrottleReason(reasons)
        self.batches: list[tuple[str, int]] = []
        self.pauses: list[float] = []
        self.flushes = 0

    def sample(self) -> Sample:
        mhz = self.clock(self) if self.clock is not None else MAX_MHZ
        return Sample(
            gpu=0, t=self.t, sm_clock_mhz=mhz, power_w=self.power_w, temp_c=45.0,
            reasons=self.reasons,
        )  # fmt: skip

    def time_batch(self, cand: Candidate, calls: int) -> float:
        assert isinstance(cand, Kernel)
        factor = self.slow(self, cand) if self.slow is not None else 1.0
        dt = cand.per_call_s * calls * factor
        self.t += dt
        self.batches.append((cand.name, calls))
        return dt

    def flush_l2(self) -> None:
        self.flushes += 1
        self.t += 20e-6

    def pause(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.t += seconds

    def now(self) -> float:
        return self.t


def kernels(*times: float) -> list[Kernel]:
    return [Kernel(f"k{i}", t) for i, t in enumerate(times)]


# -- cuDNN ----------------------------------------------------------------------------------


def test_cudnn_sample_once_times_each_candidate_once_after_a_warmup_in_list_order() -> None:
    session = ScriptedSession()
    res = cudnn_find(session, kernels(1.02e-3, 1.0e-3, 1.01e-3), "sample_once")
    assert session.batches == [("k0", 1)] * 2 + [("k1", 1)] * 2 + [("k2", 1)] * 2
    assert res.pick == "k1" and res.samples == {"k0": 1, "k1": 1, "k2": 1}
    assert session.flushes == 0 and session.pauses == []  # cuDNN neither flushes nor rests


def test_cudnn_median_of_three_is_the_median_of_the_timed_runs() -> None:
    script = iter([1.0, 1.0, 1.3, 0.9, 1.0] * 2)  # warm-up, then 1.0, 1.3, 0.9 -> 1.0
    session = ScriptedSession(slow=lambda s, k: next(script))
    res = cudnn_find(session, kernels(1e-3, 1.05e-3), "median_of_three")
    assert res.times_s["k0"] == pytest.approx(1e-3)
    assert res.times_s["k1"] == pytest.approx(1.05e-3)
    assert res.pick == "k0" and res.samples["k0"] == 3


def test_cudnn_till_stable_repeats_while_a_run_beats_the_best_by_five_percent() -> None:
    # Warm-up, then 1.0, 0.9 (10% faster: go on), 0.88 (2% faster: stop), best 0.88.
    script = iter([2.0, 1.0, 0.9, 0.88, 7.0])
    session = ScriptedSession(slow=lambda s, k: next(script))
    res = cudnn_find(session, kernels(1e-3), "till_stable")
    assert res.samples["k0"] == 3 and res.times_s["k0"] == pytest.approx(0.88e-3)
    with pytest.raises(ValueError, match="technique"):
        cudnn_find(session, kernels(1e-3), "exhaustive")


# -- Triton ---------------------------------------------------------------------------------


def test_triton_do_bench_sizes_its_runs_from_an_estimate_and_flushes_before_each() -> None:
    session = ScriptedSession()
    res = triton_autotune(session, kernels(1e-3))
    estimate = 1e-3 + 20e-6  # five (flush, call) pairs, end to end
    n_warmup, n_repeat = int(0.025 / estimate), int(0.100 / estimate)
    assert session.batches == [("k0", 1)] * 6 + [("k0", n_warmup)] + [("k0", 1)] * n_repeat
    assert session.flushes == 5 + n_repeat and res.samples["k0"] == n_repeat


def test_triton_autotune_in_list_order_favours_the_first_config_on_a_heating_gpu() -> None:
    # The GPU slows by 30% once it has run 0.2 s back-to-back: the power cap engages.
    session = ScriptedSession(slow=lambda s, k: 1.3 if s.t > 0.2 else 1.0)
    slow_first = kernels(1.05e-3, 1.0e-3)
    assert triton_autotune(session, slow_first).pick == "k0"  # 5% slower, picked anyway
    # A tie goes to the first in list order, as min() over the configs does.
    assert triton_autotune(ScriptedSession(), kernels(1e-3, 1e-3)).pick == "k0"


# -- nvbench --------------------------------------------------------------------------------


def test_nvbench_discards_slow_clock_samples_and_sleeps_then_stops_when_quiet() -> None:
    slow_clock = {3, 4, 5, 6}  # samples 3-6 read 1400 MHz: 70% of rated, discarded

    def clock(s: ScriptedSession) -> float:
        return 1400.0 if len(s.batches) - 1 in slow_clock else MAX_MHZ

    session = ScriptedSession(clock=clock)
    res = nvbench_cold(session, kernels(1e-3))
    rule = NvbenchRule()
    assert res.samples["k0"] == len(session.batches) - 1 - len(slow_clock)
    # Three discards at the base delay, the fourth after a grown one.
    assert session.pauses == [0.05, 0.05, 0.05, 0.05 + min(0.05 * 1.5, 0.5)]
    # Quiet samples: it stops as soon as more than 0.5 s of GPU time is in.
    assert rule.min_time_s / 1e-3 <= res.samples["k0"] <= rule.min_time_s / 1e-3 + 2


def test_nvbench_noisy_samples_stop_on_convergence_or_timeout() -> None:
    flip = {"n": 0}

    def noisy(s: ScriptedSession, k: Kernel) -> float:
        flip["n"] += 1
        return 1.0 + (0.05 if flip["n"] % 2 else -0.05)  # 5% noise never gets under 0.5%

    session = ScriptedSession(slow=noisy)
    res = nvbench_cold(session, kernels(1e-3), NvbenchRule(timeout_s=2.0))
    assert res.samples["k0"] > 64  # stopped by the noise having converged, not by 0.5%
    assert session.now() < 2.0 + 0.01


# -- the simulated world --------------------------------------------------------------------


def test_candidate_sets_have_known_truth_within_the_asked_gaps() -> None:
    a, b = make_set(7, seed=3), make_set(7, seed=3)
    assert a == b  # reproducible
    for i in range(12):
        cset = make_set(i)
        fastest = min(k.unthrottled_s for k in cset.kernels)
        gaps = sorted(k.unthrottled_s / fastest - 1 for k in cset.kernels)[1:]
        assert 3 <= len(cset.kernels) <= 10
        assert all(0.005 <= g <= 0.05 for g in gaps)
        assert cset.regret("unthrottled", cset.best("unthrottled").name) == 0.0
        for k in cset.kernels:
            assert k.sustained_s >= k.unthrottled_s * (1 - 1e-9)
            if cset.kind == "light":
                assert k.settled_clock_mhz == pytest.approx(1980.0)
                assert k.sustained_s == pytest.approx(k.unthrottled_s)
    heavy = settled_clock_mhz(1325.0)
    assert 1400.0 < heavy < 1480.0  # the H200's ~1440 MHz under a bf16 GEMM loop
    assert settled_clock_mhz(300.0) == pytest.approx(1980.0)


def test_winners_flip_between_regimes_in_some_heavy_sets() -> None:
    flips = 0
    for i in range(60):
        cset = make_set(i)
        if cset.kind == "heavy" and cset.best("unthrottled") != cset.best("sustained"):
            flips += 1
    assert flips >= 3


def test_noisy_session_hot_start_is_capped_and_episodes_reach_the_samples() -> None:
    hot = next(make_set(i) for i in range(50) if make_set(i).start == "hot")
    session = NoisySession(hot, "t")
    (k, *_) = session.kernels()
    session.time_batch(k, 10)
    first = session.sample().reasons
    assert first is not None and first & ThrottleReason.SW_POWER_CAP  # the earlier job's cap
    ep = next(e for e in session.disturbances.episodes if e.reasons and e.start > session.now())
    session.pause(ep.start + 0.01 - session.now())
    s = session.sample()
    assert s.reasons is not None and s.reasons & ThrottleReason.HW_SLOWDOWN
    assert s.sm_clock_mhz is not None and s.sm_clock_mhz < 0.95 * 1980.0
    assert k.seconds_per_call(1980.0, 1980.0) > k.truth.unthrottled_s * 1.02  # slowed too


# -- racing ---------------------------------------------------------------------------------

WL = Workload("w", "matmul", {"m": 1}, "fp32", ("fake",))
CFG = ProtocolConfig(
    warmup_s=0.02, pause_s=0.01, cool_pause_s=0.05, time_budget_s=60.0, settle_window_s=0.5
)


def _accepted(records: list[BatchRecord], name: str) -> int:
    return sum(1 for r in records if r.candidate == name and not r.rejected)


def test_out_of_race_needs_disjoint_intervals_and_more_than_the_min_margin() -> None:
    leader = [1.00, 1.001, 0.999]
    assert out_of_race({"a": leader, "b": [1.02, 1.021, 1.019]}, confidence=0.95,
                       min_margin=0.005) == {"b"}  # fmt: skip
    overlap = {"a": leader, "b": [1.0005, 1.02, 1.03]}
    assert out_of_race(overlap, confidence=0.95, min_margin=0.005) == set()
    close = {"a": leader, "b": [1.002, 1.003, 1.0025]}  # disjoint but within 0.5%
    assert out_of_race(close, confidence=0.95, min_margin=0.005) == set()
    assert out_of_race({"a": leader, "dead": []}, confidence=0.95, min_margin=0.005) == set()


def test_racing_stops_timing_clearly_slower_candidates_after_min_rounds() -> None:
    cands = kernels(1.0e-3, 1.003e-3, 1.05e-3, 1.10e-3)
    recs: list[BatchRecord] = []
    res = tune(WL, cands, ScriptedSession(), ["unthrottled"], CFG, recs.append)[0]
    by = {c.name: c for c in res.candidates}
    assert _accepted(recs, "k2") == _accepted(recs, "k3") == CFG.min_rounds
    assert by["k2"].meta["out_of_race_after_rounds"] == CFG.min_rounds
    assert _accepted(recs, "k0") == _accepted(recs, "k1") == CFG.contender_rounds
    assert "out_of_race_after_rounds" not in by["k1"].meta  # within 0.5%: still a contender
    assert [c.name for c in res.candidates] == ["k0", "k1", "k2", "k3"]
    off = ProtocolConfig(**{**_asdict(CFG), "race": False})
    recs2: list[BatchRecord] = []
    tune(WL, kernels(1.0e-3, 1.003e-3, 1.05e-3, 1.10e-3), ScriptedSession(), ["unthrottled"],
         off, recs2.append)  # fmt: skip
    assert {_accepted(recs2, f"k{i}") for i in range(4)} == {off.min_rounds}


def test_sustained_regime_races_once_settled_and_not_when_turned_off() -> None:
    cfg = ProtocolConfig(**{**_asdict(CFG), "skip_sustained": False})
    recs: list[BatchRecord] = []
    tune(WL, kernels(1.0e-3, 1.003e-3, 1.10e-3), ScriptedSession(power_w=690.0), ["sustained"],
         cfg, recs.append)  # fmt: skip
    assert _accepted(recs, "k2") == cfg.min_rounds  # clearly out after the minimum
    assert _accepted(recs, "k0") == _accepted(recs, "k1") == cfg.contender_rounds
    for off in ({"race_sustained": False}, {"transient_max_s": 0.0}):
        recs = []
        tune(WL, kernels(1.0e-3, 1.003e-3, 1.10e-3), ScriptedSession(power_w=690.0),
             ["sustained"], ProtocolConfig(**{**_asdict(cfg), **off}), recs.append)  # fmt: skip
        assert {_accepted(recs, f"k{i}") for i in range(3)} == {cfg.contender_rounds}, off


def test_racing_waits_while_the_leader_is_unsteady() -> None:
    def wobble(s: ScriptedSession, k: Kernel) -> float:
        if k.name != "k0":
            return 1.0
        n = sum(1 for name, _ in s.batches if name == "k0")
        return 1.08 if n % 2 else 1.0  # the leader's batches alternate: spread ~4%

    recs: list[BatchRecord] = []
    # Stopping on a settled pick would end the regime after the contender rounds: off, to
    # see racing alone.
    cfg = ProtocolConfig(**{**_asdict(CFG), "max_rounds": 8, "stop_when_decided": False})
    tune(WL, kernels(1.0e-3, 1.2e-3), ScriptedSession(slow=wobble), ["unthrottled"], cfg,
         recs.append)  # fmt: skip
    assert _accepted(recs, "k1") == 8  # never dropped: the leader never steadied


def _asdict(cfg: ProtocolConfig) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(cfg)


# -- skipping the sustained regime ----------------------------------------------------------


def test_light_kernels_skip_the_sustained_regime_with_the_reason_recorded() -> None:
    session = ScriptedSession(power_w=350.0)
    recs: list[BatchRecord] = []
    un, su = tune(WL, kernels(1e-3, 1.02e-3), session, ["unthrottled", "sustained"], CFG,
                  recs.append)  # fmt: skip
    assert su.regime is Regime.SUSTAINED and not any(r.regime is Regime.SUSTAINED for r in recs)
    assert su.winner == un.winner == "k0"
    assert [c.median_s for c in su.candidates] == [c.median_s for c in un.candidates]
    assert all(c.regime is Regime.SUSTAINED for c in su.candidates)
    assert "350 W" in su.candidates[0].meta["sustained_skipped"]
    # The warm-ups ran back-to-back long enough for a 1 s average, and that evidence (the
    # kernels cannot reach the power limit) also dropped every unthrottled pause.
    assert session.pauses == []
    assert un.candidates[0].meta["unpaused"] == "cannot reach the power limit"
    paused = ScriptedSession(power_w=350.0)
    tune(WL, kernels(1e-3, 1.02e-3), paused, ["unthrottled", "sustained"],
         ProtocolConfig(**{**_asdict(CFG), "unpaused_when_unlimited": False}))  # fmt: skip
    assert paused.pauses[0] == CFG.cool_pause_s and CFG.pause_s in paused.pauses


@pytest.mark.parametrize(
    ("why", "session"),
    [
        ("power near the limit", ScriptedSession(power_w=650.0)),
        ("no power limit known", ScriptedSession(power_w=350.0, power_limit_w=None)),
        ("a power cap seen", ScriptedSession(power_w=350.0, reasons=ThrottleReason.SW_POWER_CAP)),
        ("clock off max", ScriptedSession(power_w=350.0, clock=lambda s: 1850.0)),
    ],
)
def test_sustained_regime_is_measured_without_clear_evidence(
    why: str, session: ScriptedSession
) -> None:
    recs: list[BatchRecord] = []
    _, su = tune(WL, kernels(1e-3, 1.02e-3), session, ["unthrottled", "sustained"], CFG,
                 recs.append)  # fmt: skip
    assert any(r.regime is Regime.SUSTAINED for r in recs), why
    assert "sustained_skipped" not in su.candidates[0].meta


def test_skip_can_be_turned_off_and_needs_the_unthrottled_regime_first() -> None:
    off = ProtocolConfig(**{**_asdict(CFG), "skip_sustained": False})
    for cfg, regimes in ((off, ["unthrottled", "sustained"]), (CFG, ["sustained", "unthrottled"])):
        recs: list[BatchRecord] = []
        tune(WL, kernels(1e-3), ScriptedSession(power_w=350.0), regimes, cfg, recs.append)
        assert any(r.regime is Regime.SUSTAINED for r in recs)


def test_simulated_gemm_is_never_skipped_and_light_kernels_are() -> None:
    gemm = Workload("g", "gemm", {"m": 8192, "n": 8192, "k": 8192}, "bf16", ("sim",))
    session = SimSession.create("idle", seed=1)
    _, su = tune(gemm, sim_family(gemm, session), session, ["unthrottled", "sustained"])
    assert "sustained_skipped" not in su.candidates[0].meta
    assert su.candidates[0].reasons & ThrottleReason.SW_POWER_CAP
    light = next(make_set(i) for i in range(40) if make_set(i).kind == "light")
    noisy = NoisySession(light, "t")
    _, su = tune(WL, noisy.kernels(), noisy, ["unthrottled", "sustained"])
    assert "sustained_skipped" in su.candidates[0].meta


# -- reused calibration and tune_queue ------------------------------------------------------


def test_sustained_after_unthrottled_reuses_the_batch_sizes() -> None:
    noskip = ProtocolConfig(**{**_asdict(CFG), "skip_sustained": False})
    session = ScriptedSession(power_w=650.0)
    recs: list[BatchRecord] = []
    tune(WL, kernels(1e-3, 1.02e-3), session, ["unthrottled", "sustained"], noskip, recs.append)
    sizes = {r.calls for r in recs}
    assert sizes == {round(CFG.batch_target_s / 1e-3), round(CFG.batch_target_s / 1.02e-3)}
    # Unthrottled warm-ups grow batches from one call; the sustained regime starts at size.
    assert [b for b in session.batches if b[1] == 1] == [("k0", 1), ("k1", 1)]


def test_tune_queue_settles_later_sustained_regimes_on_carried_heat() -> None:
    cfg = ProtocolConfig(**{**_asdict(CFG), "settle_window_s": 2.0, "skip_sustained": False})
    session = ScriptedSession(power_w=690.0)
    queue = [
        (Workload(f"w{i}", "matmul", {"m": i}, "fp32", ("fake",)), kernels(1e-3, 1.05e-3))
        for i in range(3)
    ]
    recs: list[BatchRecord] = []
    out = tune_queue(queue, session, ["unthrottled", "sustained"], cfg, recs.append)
    assert [[r.workload for r in rs] for rs in out] == [["w0", "w0"], ["w1", "w1"], ["w2", "w2"]]
    regimes = [r.regime for r in recs]
    last_u = len(regimes) - 1 - regimes[::-1].index(Regime.UNTHROTTLED)
    assert last_u < regimes.index(Regime.SUSTAINED)  # every workload's unthrottled one first
    settles = [rs[1].candidates[0].meta for rs in out]
    assert "settled_on_carried_heat" not in settles[0] and settles[0]["settle_s"] >= 2.0
    for meta in settles[1:]:
        assert meta["settled_on_carried_heat"] is True
        assert cfg.warm_settle_window_s <= meta["settle_s"] < 2.0
    assert all(k.teardowns == 1 for _, ks in queue for k in ks)  # type: ignore[attr-defined]
    one = tune(queue[0][0], kernels(1e-3, 1.05e-3), ScriptedSession(power_w=690.0),
               ["unthrottled", "sustained"], cfg)  # fmt: skip
    assert [r.winner for r in one] == [r.winner for r in out[0]]


def test_new_protocol_settings_are_validated() -> None:
    cfg = ProtocolConfig.from_mapping({"race": False, "skip_power_ratio": 1})
    assert cfg.race is False and cfg.skip_power_ratio == 1.0
    for mapping, message in (
        ({"race": "yes"}, "protocol.race: expected true or false"),
        ({"contender_rounds": 0}, "protocol.contender_rounds: must be >= 1"),
        ({"skip_power_ratio": 1.5}, "protocol.skip_power_ratio: must be in (0, 1]"),
        ({"power_probe_s": -1.0}, "protocol.power_probe_s: must be >= 0"),
        ({"warm_settle_window_s": 0.0}, "protocol.warm_settle_window_s: must be > 0"),
    ):
        with pytest.raises(ValueError) as exc:
            ProtocolConfig.from_mapping(mapping)
        assert str(exc.value).startswith(message)
    assert math.isfinite(ProtocolConfig().power_probe_s)


def test_the_bench_splits_gpuwatchds_gpu_time_into_its_parts() -> None:
    """Timed batches, pauses and settling of a heavy set are each measured and fit in the
    time the protocol held the GPU; an anchor's time is all its own measurement."""
    from protocol_vs_anchors import run_group

    rows = {r.protocol: r for r in run_group(([4], 0, ["gpuwatchd", "triton.do_bench"]))}
    ours = rows["gpuwatchd"]
    assert ours.kind == "heavy"
    assert ours.timed_s > 0 and ours.paused_s > 0 and ours.settle_s > 0
    assert ours.timed_s + ours.paused_s + ours.settle_s < ours.wall_s
    anchor = rows["triton.do_bench"]
    assert (anchor.timed_s, anchor.settle_s) == (0.0, 0.0)
