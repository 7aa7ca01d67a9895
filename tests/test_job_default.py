"""What a job runs without gpuwatchd is always measured, and stays unless beaten beyond the
noise: the protocol's verdict against the default, the winners row it leads to, the conv
family's candidates as the job runs them, and the capture-then-apply order (no GPU)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from test_protocol import CFG, WL, FakeCandidate, FakeSession

from gpuwatchd.jobside.apply_winners import plan_cache_conflict
from gpuwatchd.jobside.capture import Capture, load_capture
from gpuwatchd.jobside.winner_plan import ConvChoice
from gpuwatchd.report.text import format_report, report_from
from gpuwatchd.store import StoredResult
from gpuwatchd.tuning.types import Regime, Versions, Workload
from gpuwatchd.tuning.winners import (
    JOB_DEFAULT,
    KEPT_DEFAULT,
    VS_DEFAULT,
    job_default,
    pick_winner,
)
from gpuwatchd.tuning.worker.families import torch_conv
from gpuwatchd.tuning.worker.protocol import measure

torch = pytest.importorskip("torch")
import gpuwatchd.torch as gt  # noqa: E402


def default(name: str, per_call_s: float) -> FakeCandidate:
    return FakeCandidate(name, per_call_s, **{JOB_DEFAULT: True})


# -- the protocol -----------------------------------------------------------------------------


def test_a_winner_within_the_noise_of_the_default_leaves_the_default_in_place() -> None:
    """Fastest by 0.3% (under min_margin): a tie, and the row records the default."""
    cands = [FakeCandidate("challenger", 0.997e-3), default("job", 1.0e-3)]
    res = measure(WL, cands, FakeSession(noise=0.001), Regime.UNTHROTTLED, CFG)
    assert res.tie and res.winner is None
    picked = pick_winner(res)
    assert picked is not None and picked.name == "job"
    assert picked.meta[KEPT_DEFAULT] is True
    verdict = next(c for c in res.candidates if c.name == "challenger").meta[VS_DEFAULT]
    assert verdict["beats"] is False and verdict["margin"] <= verdict["noise"]


def test_a_winner_far_ahead_of_the_default_replaces_it() -> None:
    cands = [default("job", 1.0e-3), FakeCandidate("fast", 0.8e-3)]
    res = measure(WL, cands, FakeSession(), Regime.UNTHROTTLED, CFG)
    assert (res.winner, res.tie) == ("fast", False)
    fast = next(c for c in res.candidates if c.name == "fast")
    assert fast.meta[VS_DEFAULT]["beats"] is True
    assert KEPT_DEFAULT not in fast.meta


class NoisyDefaultSession(FakeSession):
    """The job's default times with a wide spread of its own; the others barely vary."""

    def time_batch(self, cand: Any, calls: int) -> float:
        dt = super().time_batch(cand, calls)
        if cand.meta().get(JOB_DEFAULT):
            dt *= max(0.3, 1.0 + self.rng.gauss(0.0, 0.3))
        return dt


def test_a_declared_winner_the_noisy_default_is_not_beaten_by_keeps_the_default() -> None:
    """The winner beats the runner-up beyond the noise, but not the default further down."""
    cands = [
        FakeCandidate("fast", 1.00e-3),
        FakeCandidate("next", 1.10e-3),
        default("job", 1.12e-3),
    ]
    res = measure(WL, cands, NoisyDefaultSession(noise=0.001, seed=8), Regime.SUSTAINED, CFG)
    assert [c.name for c in res.candidates] == ["fast", "next", "job"]
    assert res.margin is not None and res.noise is not None
    assert res.margin > res.noise  # the plain decision: fast beats the runner-up
    verdict = next(c for c in res.candidates if c.name == "fast").meta[VS_DEFAULT]
    assert verdict["beats"] is False and verdict["margin"] > 0.05  # faster, within its noise
    assert (res.winner, res.tie) == (None, True)
    picked = pick_winner(res)
    assert picked is not None and picked.name == "job"
    assert picked.meta["tie_reason"] == "no candidate beats the job's default beyond the noise"


def test_a_tie_between_two_candidates_that_both_beat_the_default_is_not_the_default() -> None:
    cands = [
        default("job", 1.0e-3),
        FakeCandidate("a", 0.8e-3),
        FakeCandidate("b", 0.8e-3),
    ]
    res = measure(WL, cands, FakeSession(noise=0.01, seed=3), Regime.UNTHROTTLED, CFG)
    assert res.tie
    picked = pick_winner(res)
    assert picked is not None and picked.name in ("a", "b")


def test_the_report_names_the_default_and_whether_it_was_kept() -> None:
    kept = measure(
        WL,
        [FakeCandidate("challenger", 0.997e-3), default("job", 1.0e-3)],
        FakeSession(noise=0.001),
        Regime.UNTHROTTLED,
        CFG,
    )
    beaten = measure(
        WL,
        [default("job", 1.0e-3), FakeCandidate("fast", 0.8e-3)],
        FakeSession(),
        Regime.SUSTAINED,
        CFG,
    )
    stored = [StoredResult(1, "GPU", "GPU-0", Versions(), 0.0, res) for res in (kept, beaten)]
    doc = report_from(stored)
    assert [(r["job_default"], r["kept_default"]) for r in doc["results"]] == [
        ("job", True),
        ("job", False),
    ]
    text = format_report(doc)
    assert "default: job" in text and "fast" in text


def test_a_default_that_wins_outright_is_the_default_kept() -> None:
    res = measure(
        WL,
        [default("job", 0.8e-3), FakeCandidate("slow", 1.0e-3)],
        FakeSession(),
        Regime.SUSTAINED,
        CFG,
    )
    assert (res.winner, res.tie) == ("job", False)
    assert job_default(res) == ("job", True)


def test_without_a_default_candidate_the_rule_is_the_plain_decision() -> None:
    cands = [FakeCandidate("a", 0.997e-3), FakeCandidate("b", 1.0e-3)]
    res = measure(WL, cands, FakeSession(noise=0.001), Regime.UNTHROTTLED, CFG)
    assert all(VS_DEFAULT not in c.meta for c in res.candidates)


# -- the conv family: measured as the job runs it ---------------------------------------------


def conv_workload(**params: Any) -> Workload:
    shape = {"input": [8, 16, 32, 32], "weight": [16, 16, 3, 3], "stride": 1, "padding": 1}
    return Workload("c", "conv2d", shape, "float16", ("torch.conv2d",), params)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, [("contiguous", "contiguous"), ("channels_last", "channels_last")]),
        (
            {"input_layout": "channels_last", "weight_layout": "channels_last"},
            [("channels_last", "channels_last"), ("contiguous", "contiguous")],
        ),
        (  # NCHW activations into a channels_last weight: timed as it is, conversion included
            {"weight_layout": "channels_last"},
            [
                ("contiguous", "channels_last"),
                ("contiguous", "contiguous"),
                ("channels_last", "channels_last"),
            ],
        ),
        (
            {"memory_formats": ["channels_last"]},
            [("contiguous", "contiguous"), ("channels_last",) * 2],
        ),
    ],
)
def test_conv_candidates_start_with_the_jobs_own_layouts(params: dict, expected: list) -> None:
    spec = torch_conv.parse_conv(conv_workload(**params))
    formats = tuple(params.get("memory_formats", torch_conv.MEMORY_FORMATS))
    assert torch_conv.candidate_layouts(spec, formats) == expected


def test_conv_layout_params_are_checked() -> None:
    with pytest.raises(ValueError, match=r"params\.input_layout must be one of"):
        torch_conv.parse_conv(conv_workload(input_layout="nhwc"))


def test_the_mixed_candidate_is_named_for_both_operands() -> None:
    assert torch_conv.layout_label("contiguous", "channels_last") == "x:contiguous+w:channels_last"
    assert torch_conv.layout_label("channels_last", "channels_last") == "channels_last"


# -- capture once, apply in a later process ---------------------------------------------------


def run_capture() -> Capture:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU())
    model[0].to(memory_format=torch.channels_last)  # a weight-only conversion: a mixed pair
    with gt.capture(model, timer="cpu") as cap:
        model(torch.randn(2, 3, 16, 16))
    return cap


def test_a_written_capture_loads_in_a_later_process_with_its_layouts(tmp_path: Path) -> None:
    cap = run_capture()
    path = cap.write(tmp_path / "capture.json")
    loaded = load_capture(path)
    assert loaded.calls == cap.calls
    assert [w.name for w in loaded.workloads()] == [w.name for w in cap.workloads()]
    (fwd,) = [c for c in loaded.calls if c.phase == "forward"]
    assert fwd.layouts == ("contiguous", "channels_last")
    assert Capture.load(path).calls == cap.calls


def test_a_1x1_weight_valid_in_both_formats_follows_the_input_layout() -> None:
    model = torch.nn.Conv2d(8, 4, 1).to(memory_format=torch.channels_last)
    with gt.capture(timer="cpu") as cap:
        model(torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last))
    (fwd,) = [c for c in cap.calls if c.phase == "forward"]
    assert fwd.layouts == ("channels_last", "channels_last")


def test_loading_a_toml_or_broken_capture_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="TOML capture holds workloads only"):
        load_capture(tmp_path / "w.toml")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "gpuwatchd-capture/1", "timer": "cpu"}')
    with pytest.raises(ValueError, match=r"bad\.json\.total_s"):
        load_capture(bad)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    with pytest.raises(ValueError, match="not a JSON capture"):
        load_capture(deep)


def _choice(cap: Capture, pick: str) -> ConvChoice:
    (fwd,) = [c for c in cap.calls if c.phase == "forward"]
    return ConvChoice("w", fwd, f"cudnn[{pick},...]", pick, fwd.layouts, 1e-3, False)


def test_a_capture_fills_the_plan_cache_so_another_pick_is_refused_on_its_thread() -> None:
    cap = run_capture()
    assert torch.backends.cudnn.benchmark is False  # the pick the capture cached: heuristic
    why = plan_cache_conflict(_choice(cap, "benchmark"))
    assert why is not None and "new process" in why
    assert plan_cache_conflict(_choice(cap, "heuristic")) is None


def test_a_loaded_capture_on_a_thread_that_ran_nothing_has_no_conflict(tmp_path: Path) -> None:
    """The documented order: load, apply, then the first forward pass."""
    path = run_capture().write(tmp_path / "capture.json")
    seen: list[str | None] = []

    def later_process() -> None:
        seen.append(plan_cache_conflict(_choice(load_capture(path), "benchmark")))

    t = threading.Thread(target=later_process)
    t.start()
    t.join()
    assert seen == [None]


def test_apply_winners_takes_a_loaded_capture_for_the_model(tmp_path: Path) -> None:
    path = run_capture().write(tmp_path / "capture.json")
    model = torch.nn.Conv2d(3, 8, 3)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        gt.apply_winners(model, capture=gt.load_capture(path))
    with pytest.raises(ValueError, match="pass capture=load_capture"):
        gt.apply_winners(model)


def test_the_converted_model_gets_its_input_in_the_format_by_position_or_keyword() -> None:
    """``model(x)`` and ``model(pixel_values=x)`` both reach the convs in the measured format."""
    from gpuwatchd.jobside.apply_winners import convert_model

    seen: list[bool] = []

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 4, 3)

        def forward(self, pixel_values: Any) -> Any:
            seen.append(pixel_values.is_contiguous(memory_format=torch.channels_last))
            return self.conv(pixel_values)

    model = Net()
    convert_model(model, "channels_last")
    x = torch.randn(2, 4, 8, 8)
    model(x)
    model(pixel_values=x)
    assert seen == [True, True]
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
