"""After ``capture()`` and ``apply_winners()`` return, the job's process is as it was: no
profiler ever started (CUPTI, once attached, stays and slows the process in bursts), none
enabled, no thread left running, no process-wide switch changed except the winner the plan
applied (issue 27). On CPU, with torch's CPU build."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from capture_fakes import client_with, result, stats

torch = pytest.importorskip("torch")

import gpuwatchd.torch as gt  # noqa: E402
from gpuwatchd.jobside import apply_winners as aw  # noqa: E402
from gpuwatchd.tuning.submitted.captured import CapturedCall, CapturedSet, workload_for  # noqa: E402


def switches() -> dict[str, Any]:
    """Every process-wide setting a library could leave changed."""
    return {
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "grad_enabled": torch.is_grad_enabled(),
        "rng_state": torch.get_rng_state().tolist(),
    }


@pytest.fixture
def profiler_starts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Names of the profiler entry points called (every torch.profiler session calls them)."""
    import torch.autograd.profiler as prof

    started: list[str] = []
    for name in ("_prepare_profiler", "_enable_profiler"):
        real = getattr(prof, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            started.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(prof, name, spy)
    yield started


def assert_nothing_left(before: dict[str, Any], threads: set[threading.Thread]) -> None:
    assert switches() == before
    assert not torch.autograd._profiler_enabled()
    assert set(threading.enumerate()) == threads


def test_capture_starts_no_profiler_and_leaves_nothing(profiler_starts: list[str]) -> None:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 4)
    )
    x = torch.randn(2, 3, 8, 8)
    model(x).sum().backward()
    before, threads = switches(), set(threading.enumerate())
    with gt.capture(model) as cap:
        for _ in range(2):
            model(x).sum().backward()
    assert profiler_starts == []
    assert_nothing_left(before, threads)
    assert {c.aten for c in cap.calls} >= {"convolution", "addmm"}
    assert all(c.time_s > 0 for c in cap.calls if c.phase == "forward")


CONV = CapturedCall(
    "conv2d", "convolution", "forward", "float32",
    {"input": [2, 8, 16, 16], "weight": [8, 8, 3, 3], "stride": [1, 1], "padding": [1, 1],
     "dilation": [1, 1], "groups": 1},
    "contiguous", False, False, 3, 0.003, 0.5,
)  # fmt: skip


def _cudnn(pick: str, median: float, beats: bool | None) -> Any:
    meta: dict[str, Any] = {"pick": pick, "input_layout": "contiguous",
                            "weight_layout": "contiguous"}  # fmt: skip
    if beats is not None:
        meta["vs_default"] = {"margin": 0.5, "noise": 0.01, "beats": beats}
    return stats(f"cudnn[{pick},contiguous]", "torch.conv2d", median, meta)


def test_apply_winners_starts_no_profiler_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, profiler_starts: list[str]
) -> None:
    """A benchmark pick that beats the default: its first call runs (on CPU here), and
    afterwards the benchmark flag, the threads and the profiler are as they were."""
    name = workload_for(CONV).name
    rows = [result(name, [_cudnn("benchmark", 0.5e-3, True), _cudnn("heuristic", 1e-3, None)])]
    client = client_with(tmp_path, rows, torch_version=torch.__version__)
    doc = CapturedSet((CONV,), "cpu", 0.006, None, torch.__version__).to_json()
    path = tmp_path / "capture.json"
    path.write_text(json.dumps(doc))
    cap = gt.load_capture(path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(aw, "DEVICE", "cpu")
    before, threads = switches(), set(threading.enumerate())
    applied = gt.apply_winners(cap, client=client, gpu_model=None)
    assert applied.warmed == (name,) and applied.blocked == ()
    assert profiler_starts == []
    assert_nothing_left(before, threads)


def test_a_benchmark_pick_measured_under_another_torch_is_not_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its kernels were seen to repeat under the recorded stack only: the default stays."""
    name = workload_for(CONV).name
    rows = [result(name, [_cudnn("benchmark", 0.5e-3, True), _cudnn("heuristic", 1e-3, None)])]
    client = client_with(tmp_path, rows, torch_version="1.0.0")
    doc = CapturedSet((CONV,), "cpu", 0.006, None, torch.__version__).to_json()
    path = tmp_path / "capture.json"
    path.write_text(json.dumps(doc))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(aw, "DEVICE", "cpu")
    applied = gt.apply_winners(gt.load_capture(path), client=client, gpu_model=None)
    assert applied.warmed == ()
    ((blocked, why),) = applied.blocked
    assert blocked == name and "torch 1.0.0" in why
