"""The winner-or-tie rule with the noise threshold doing the deciding, and the winner rules.

Every case here is one the 0.5% floor alone cannot settle: the verdict turns on the CI
half-widths, on how the two combine, or on the config reaching :func:`stats.decide`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import pytest
from test_protocol import CFG, WL, FakeCandidate, FakeSession

from gpuwatchd.tuning.types import CandidateStats, Regime, RegimeResult
from gpuwatchd.tuning.winners import clear_winner, pick_winner, winners_differ
from gpuwatchd.tuning.worker import protocol, stats

WIDE: Sequence[float] = [
    100.0 + i for i in range(20)
]  # median 109.5; 95% CI 105..114, 50% CI 107..112
H95 = (114.0 - 105.0) / (2 * 109.5)  # 0.0411: each wide set's relative CI half-width
H50 = (112.0 - 107.0) / (2 * 109.5)  # 0.0228
SLOWER: Sequence[float] = [x * 1.05 for x in WIDE]  # 5% behind: inside hypot(H95, H95) = 0.058
FLAT_BEST: Sequence[float] = [109.5] * 20  # no spread: a CI half-width of zero
FLAT_SLOWER: Sequence[float] = [109.5 * 1.05] * 20


def test_a_margin_inside_the_combined_noise_is_a_tie() -> None:
    d = stats.decide({"slow": SLOWER, "fast": WIDE})
    assert (d.winner, d.tie, d.ranking) == (None, True, ("fast", "slow"))
    assert d.margin == pytest.approx(0.05)
    assert d.noise == pytest.approx(math.hypot(H95, H95))  # both intervals, in quadrature


def test_the_defaults_are_noise_k_1_floor_half_a_percent_95_percent_confidence() -> None:
    samples = {"fast": WIDE, "slow": SLOWER}
    assert stats.decide(samples) == stats.decide(
        samples, noise_k=1.0, min_margin=0.005, confidence=0.95
    )
    flat = stats.decide({"a": [1.0] * 5, "b": [1.004] * 5})  # no spread: the floor decides
    assert (flat.tie, flat.noise) == (True, 0.005)


def test_a_lower_confidence_narrows_the_intervals_and_names_the_winner() -> None:
    d = stats.decide({"fast": WIDE, "slow": SLOWER}, confidence=0.5)
    assert (d.winner, d.tie) == ("fast", False)
    assert d.noise == pytest.approx(math.hypot(H50, H50))


def test_noise_k_scales_the_noise() -> None:
    d = stats.decide({"fast": WIDE, "slow": SLOWER}, noise_k=0.5)
    assert (d.winner, d.tie) == ("fast", False)
    assert d.noise == pytest.approx(0.5 * math.hypot(H95, H95))
    d = stats.decide({"fast": WIDE, "slow": SLOWER}, noise_k=0.8)  # 0.0465 < 0.05
    assert d.winner == "fast"
    d = stats.decide({"fast": WIDE, "slow": SLOWER}, noise_k=0.9)  # 0.0523 > 0.05
    assert d.tie


def test_min_margin_is_a_floor_over_the_noise() -> None:
    d = stats.decide({"fast": WIDE, "slow": [x * 1.2 for x in WIDE]}, min_margin=0.25)
    assert (d.winner, d.tie, d.noise) == (None, True, 0.25)
    d = stats.decide({"fast": WIDE, "slow": [x * 1.2 for x in WIDE]}, min_margin=0.04)
    assert (d.winner, d.noise) == ("fast", pytest.approx(math.hypot(H95, H95)))


@pytest.mark.parametrize(
    ("best", "runner"),
    [(WIDE, FLAT_SLOWER), (FLAT_BEST, SLOWER)],
    ids=["wide-best", "wide-runner-up"],
)
def test_either_candidates_interval_counts(best: list[float], runner: list[float]) -> None:
    d = stats.decide({"best": best, "runner": runner})
    assert d.noise == pytest.approx(H95)  # the flat one adds nothing, the wide one all
    assert (d.winner, d.tie) == ("best", False)  # 0.05 > 0.041
    d = stats.decide({"best": best, "runner": runner}, noise_k=1.3)  # 0.053 > 0.05
    assert (d.winner, d.tie) == (None, True)


def test_a_margin_equal_to_the_noise_is_a_tie() -> None:
    d = stats.decide({"a": [1.0] * 3, "b": [1.25] * 3}, min_margin=0.25)
    assert (d.margin, d.noise, d.winner, d.tie) == (0.25, 0.25, None, True)


def test_a_zero_median_best_is_a_tie_with_infinite_margin_and_noise() -> None:
    d = stats.decide({"zero": [0.0, 0.0], "one": [1.0, 1.0]})
    assert (d.winner, d.tie, d.margin, d.noise) == (None, True, math.inf, math.inf)


def test_ranking_is_by_median_then_name_and_skips_empty_sets() -> None:
    d = stats.decide({"c": [3.0], "b": [1.0], "a": [1.0], "dead": []})
    assert d.ranking == ("a", "b", "c")
    assert (d.winner, d.tie, d.margin) == (None, True, 0.0)


def test_no_usable_candidate_and_a_single_one() -> None:
    assert stats.decide({}) == stats.Decision(None, False, None, None, ())
    assert stats.decide({"x": []}) == stats.Decision(None, False, None, None, ())
    assert stats.decide({"x": [], "y": [2.0]}) == stats.Decision("y", False, None, None, ("y",))


# -- the protocol hands the config to the decision -----------------------------------------


def test_the_protocol_passes_noise_k_min_margin_and_confidence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[dict[str, Any]] = []
    real = stats.decide

    def spy(samples: dict[str, Sequence[float]], **kw: Any) -> stats.Decision:
        seen.append(kw)
        return real(samples, **kw)

    monkeypatch.setattr(protocol.stats, "decide", spy)
    cfg = CFG.__class__(**{**_fields(CFG), "noise_k": 2.5, "min_margin": 0.3, "confidence": 0.8})
    res = protocol.measure(
        WL, [FakeCandidate("a", 1e-3), FakeCandidate("b", 1.1e-3)], FakeSession(),
        Regime.UNTHROTTLED, cfg,
    )  # fmt: skip
    assert seen == [{"noise_k": 2.5, "min_margin": 0.3, "confidence": 0.8}]
    assert (res.winner, res.tie, res.noise) == (None, True, 0.3)  # 10% < the 30% floor
    assert [c.name for c in res.candidates] == ["a", "b"]


def _fields(cfg: object) -> dict[str, Any]:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}  # type: ignore[attr-defined]


@pytest.mark.parametrize("flagged", ["a", "b"])
def test_the_same_kernel_rule_needs_both_candidates_to_vouch(flagged: str) -> None:
    kernels = {"kernels": ["k"], "kernels_identify_code": True}
    cands = [
        FakeCandidate("a", 1.00e-3, **(kernels if flagged == "a" else {"kernels": ["k"]})),
        FakeCandidate("b", 1.10e-3, **(kernels if flagged == "b" else {"kernels": ["k"]})),
    ]
    res = protocol.measure(WL, cands, FakeSession(), Regime.UNTHROTTLED, CFG)
    assert (res.winner, res.tie) == ("a", False)
    assert "tie_reason" not in res.candidates[0].meta


def test_candidates_are_reported_fastest_first_and_the_failed_last() -> None:
    broken = FakeCandidate("broken", 0.5e-3)
    broken.fail_setup = True
    cands = [FakeCandidate("slow", 1.2e-3), broken, FakeCandidate("fast", 1.0e-3)]
    res = protocol.measure(WL, cands, FakeSession(), Regime.UNTHROTTLED, CFG)
    assert [c.name for c in res.candidates] == ["fast", "slow", "broken"]
    assert (res.workload, res.regime, res.winner) == (WL.name, Regime.UNTHROTTLED, "fast")
    assert res.margin == pytest.approx(0.2, abs=0.01) and res.noise is not None


def test_candidates_that_failed_while_timed_follow_the_others_by_median() -> None:
    cands = [FakeCandidate("slow_fails", 2.0e-3), FakeCandidate("fast_fails", 1.5e-3)]
    for c in cands:
        c.fail_run_after = 8  # after some of its batches were timed
    cands.append(FakeCandidate("ok", 1.0e-3))
    res = protocol.measure(WL, cands, FakeSession(), Regime.UNTHROTTLED, CFG)
    assert [c.name for c in res.candidates] == ["ok", "fast_fails", "slow_fails"]
    assert all(c.samples > 0 for c in res.candidates)
    assert [("error" in c.meta) for c in res.candidates] == [False, True, True]


# -- the winner rules ------------------------------------------------------------------------


def _cand(name: str, median_s: float | None) -> CandidateStats:
    return CandidateStats(
        name, "fake", Regime.UNTHROTTLED, median_s, None, 0, 0, None, None, None, None, 0
    )


def _result(winner: str | None, tie: bool, *cands: CandidateStats) -> RegimeResult:
    return RegimeResult("w", Regime.UNTHROTTLED, cands, winner, tie, None, None)


def test_pick_winner_records_the_declared_winner() -> None:
    cands = (_cand("a", 2.0), _cand("b", 1.0), _cand("c", 3.0))
    assert pick_winner(_result("c", False, *cands)) is cands[2]


def test_pick_winner_on_a_tie_records_the_fastest_measured() -> None:
    cands = (_cand("none", None), _cand("slow", 0.5), _cand("zero", 0.0), _cand("mid", 0.2))
    assert pick_winner(_result(None, True, *cands)) is cands[2]  # 0.0 s is a time too
    three = (_cand("slow", 0.5), _cand("none", None), _cand("fast", 0.1))
    assert pick_winner(_result(None, True, *three)) is three[2]


def test_pick_winner_on_a_tie_puts_a_zero_median_before_any_positive_one() -> None:
    cands = (_cand("five_us", 5e-6), _cand("zero", 0.0), _cand("one_ns", 1e-9))
    assert pick_winner(_result(None, True, *cands)) is cands[1]


def test_a_decision_is_frozen() -> None:
    d = stats.decide({"fast": WIDE, "slow": [x * 2 for x in WIDE]})
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.winner = "slow"  # type: ignore[misc]
    assert d.winner == "fast"


def test_pick_winner_without_a_result_is_none() -> None:
    assert pick_winner(_result(None, True, _cand("x", None))) is None  # nothing timed
    assert pick_winner(_result(None, False, _cand("x", 1.0))) is None  # nothing decided


def test_clear_winner_and_winners_differ() -> None:
    assert clear_winner("a", tie=False) == "a"
    assert clear_winner("a", tie=True) is None
    assert clear_winner(None, tie=False) is None
    assert winners_differ("a", "b") is True
    assert winners_differ("a", "a") is False
    assert winners_differ(None, "b") is False
    assert winners_differ("a", None) is False
    assert winners_differ(None, None) is False
