"""gpuwatchd.torch (gated first call, CUDA-event timing) and gpuwatchd.triton_configs.

Without CUDA the gate wait and the benchmark-flag logic run against a fake torch and a
fake client; the real-GPU tests are skipped.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

import gpuwatchd.torch as gtorch
from gpuwatchd.client import GpuState, GpuwatchdUnavailable, RankedCandidate, Winner
from gpuwatchd.triton_configs import (
    configs_from_names,
    to_triton,
    triton_configs,
    winner_configs,
)
from gpuwatchd.tuning.types import Regime, Versions

BIG = "triton[128x256x64,s3,w8,g8]"
SMALL = "triton[128x128x64,s4,w4,g8]"
TALL = "triton[256x64x64,s4,w4,g4]"


# -- fakes -----------------------------------------------------------------------------------


class FakeEvent:
    def __init__(self, torch: FakeTorch) -> None:
        self._torch = torch

    def record(self, stream: object = None) -> None:
        self._torch.log.append("event")

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return self._torch.event_ms.pop(0)


class FakeTorch:
    """The bits of torch the integration touches, logging what happens in order."""

    __version__ = "0.0-fake"

    def __init__(self, log: list[str], *, cuda: bool = True) -> None:
        self.log = log
        self.event_ms: list[float] = []
        self.version = types.SimpleNamespace(cuda="12.8" if cuda else None)
        self.backends = types.SimpleNamespace(cudnn=types.SimpleNamespace(benchmark=False))
        props = types.SimpleNamespace(uuid="4ae2c0de-0000-1111-2222-333344445555")
        self.cuda = types.SimpleNamespace(
            is_available=lambda: cuda,
            synchronize=lambda *a: log.append("sync"),
            current_device=lambda: 3,
            get_device_properties=lambda i: props,
            Event=lambda enable_timing=False: FakeEvent(self),
        )


def gpu_state(**kw: Any) -> GpuState:
    base = GpuState(
        gpu=0,
        uuid="GPU-aaaa",
        name="NVIDIA H200",
        state="cool_stable",
        open=True,
        reasons=("quiet",),
        in_state_s=12.0,
        t_s=50.0,
        temp_c=40.0,
        power_w=120.0,
        sm_clock_mhz=1980.0,
        util_gpu_ratio=0.0,
        throttle_reasons=(),
        compute_pids=(),
        max_sm_clock_mhz=1980.0,
        power_limit_w=700.0,
        slowdown_temp_c=87.0,
        stalled=False,
        lost=False,
        sample_age_s=0.1,
        tuning=False,
    )
    return replace(base, **kw)


class FakeClient:
    """Records each wait and what the cudnn flag was at that moment."""

    def __init__(self, torch: FakeTorch, error: Exception | None = None) -> None:
        self.torch = torch
        self.error = error
        self.waits: list[tuple[int | str, float, frozenset[int]]] = []

    def wait_until_stable(
        self,
        gpu: int | str,
        timeout: float,
        poll_s: float = 0.5,
        *,
        own_pids: Any = None,
        on_poll: Any = None,
    ) -> GpuState:
        self.torch.log.append(f"wait(benchmark={self.torch.backends.cudnn.benchmark})")
        self.waits.append((gpu, timeout, frozenset(own_pids)))
        self.on_poll = on_poll
        if self.error is not None:
            raise self.error
        return gpu_state()


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> FakeTorch:
    log: list[str] = []
    torch = FakeTorch(log)
    monkeypatch.setattr(gtorch, "_torch", lambda: torch)

    def kernels(fn: Callable[[], None]) -> list[str]:
        log.append("profile")
        fn()
        return ["cudnn_kernel_a", "cudnn_kernel_b"]

    monkeypatch.setattr(gtorch, "launched_kernels", kernels)
    return torch


def conv_like(torch: FakeTorch) -> Callable[[int], int]:
    def fn(x: int, *, scale: int = 1) -> int:
        torch.log.append(f"call(benchmark={torch.backends.cudnn.benchmark})")
        return x * scale

    return fn


# -- tune_first_call -------------------------------------------------------------------------


def test_first_call_runs_after_the_gate_with_benchmark_on(fake_torch: FakeTorch) -> None:
    client = FakeClient(fake_torch)
    out = gtorch.tune_first_call(
        conv_like(fake_torch),
        21,
        scale=2,
        gpu=0,
        client=client,  # type: ignore[arg-type]
        on_poll=print,
        profile=True,
    )
    assert out.result == 42
    assert out.kernels == ("cudnn_kernel_a", "cudnn_kernel_b")
    assert out.state is not None and out.state.open and out.waited_s >= 0
    assert fake_torch.log == [
        "sync",  # our queued work finishes before we judge the GPU
        "wait(benchmark=True)",
        "call(benchmark=True)",  # the call cuDNN tunes on, once the gate is open
        "sync",
        "profile",
        "call(benchmark=True)",  # one more, profiled: the picked kernels
    ]
    assert fake_torch.backends.cudnn.benchmark is True
    assert client.waits == [(0, 600.0, frozenset({os.getpid()}))]
    assert client.on_poll is print


def test_default_gpu_is_the_current_cuda_device_by_uuid(fake_torch: FakeTorch) -> None:
    client = FakeClient(fake_torch)
    gtorch.tune_first_call(conv_like(fake_torch), 1, client=client, timeout=5)  # type: ignore[arg-type]
    assert client.waits[0][:2] == ("4ae2c0de-0000-1111-2222-333344445555", 5)


def test_gate_timeout_skips_the_call_and_restores_the_flag(fake_torch: FakeTorch) -> None:
    client = FakeClient(fake_torch, TimeoutError("gpu 0: gate not open after 5s"))
    with pytest.raises(TimeoutError, match="gate not open"):
        gtorch.tune_first_call(conv_like(fake_torch), 1, gpu=0, client=client)  # type: ignore[arg-type]
    assert not any(e.startswith("call") for e in fake_torch.log)
    assert fake_torch.backends.cudnn.benchmark is False


def test_unreachable_daemon_raises_unless_the_gate_is_optional(fake_torch: FakeTorch) -> None:
    down = GpuwatchdUnavailable("gpuwatchd daemon not reachable at http://127.0.0.1:9844")
    client = FakeClient(fake_torch, down)
    with pytest.raises(GpuwatchdUnavailable):
        gtorch.tune_first_call(conv_like(fake_torch), 1, gpu=0, client=client)  # type: ignore[arg-type]
    assert fake_torch.backends.cudnn.benchmark is False
    with pytest.warns(RuntimeWarning, match="ungated: gpuwatchd daemon not reachable"):
        out = gtorch.tune_first_call(
            conv_like(fake_torch),
            3,
            gpu=0,
            client=client,  # type: ignore[arg-type]
            require_gate=False,
        )
    assert out.result == 3 and out.state is None


def test_keep_benchmark_false_restores_the_flag_and_by_default_nothing_is_profiled(
    fake_torch: FakeTorch,
) -> None:
    """No profiler unless asked: its CUPTI subscription would stay with the job (issue 27)."""
    out = gtorch.tune_first_call(
        conv_like(fake_torch),
        5,
        gpu=0,
        client=FakeClient(fake_torch),  # type: ignore[arg-type]
        keep_benchmark=False,
    )
    assert out.kernels == () and "profile" not in fake_torch.log
    assert [e for e in fake_torch.log if e.startswith("call")] == ["call(benchmark=True)"]
    assert fake_torch.backends.cudnn.benchmark is False


def test_no_cuda_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gtorch, "_torch", lambda: FakeTorch([], cuda=False))
    with pytest.raises(RuntimeError, match="tune_first_call needs a CUDA GPU"):
        gtorch.tune_first_call(lambda: None, gpu=0, client=object())  # type: ignore[arg-type]


def test_the_torch_seam_is_the_real_torch_not_this_module() -> None:
    pytest.importorskip("torch")
    torch = gtorch._torch()
    assert torch is sys.modules["torch"] and torch is not gtorch
    assert hasattr(torch, "nn") and hasattr(torch.backends, "cudnn")


# -- steady_state_time -----------------------------------------------------------------------


def test_steady_state_time_is_the_median_per_call(fake_torch: FakeTorch) -> None:
    fake_torch.event_ms = [10.0, 30.0, 20.0]  # three batches of 10 calls
    calls: list[int] = []
    t = gtorch.steady_state_time(lambda: calls.append(1), iters=10, warmup=4, repeats=3)
    assert t == pytest.approx(2e-3)  # median 20 ms / 10 calls
    assert len(calls) == 4 + 3 * 10


def test_steady_state_time_rejects_a_bad_event_time(fake_torch: FakeTorch) -> None:
    fake_torch.event_ms = [0.0]
    with pytest.raises(RuntimeError, match="bad time"):
        gtorch.steady_state_time(lambda: None, iters=1, warmup=0, repeats=1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"iters": 0}, "iters"), ({"warmup": -1}, "warmup"), ({"repeats": 1.5}, "repeats")],
)
def test_steady_state_time_names_a_bad_argument(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: expected an integer"):
        gtorch.steady_state_time(lambda: None, **kwargs)


# -- triton configs --------------------------------------------------------------------------


def ranked(name: str, median: float | None, family: str = "triton.matmul") -> RankedCandidate:
    return RankedCandidate(name, family, median, 0.01, 10, 1.98e9, {})


def make_winner(candidate: str, family: str, ranking: list[RankedCandidate]) -> Winner:
    return Winner(
        gpu_model="NVIDIA H200",
        workload="gemm",
        regime=Regime.UNTHROTTLED,
        candidate=candidate,
        family=family,
        median_s=1e-3,
        sm_clock_hz=1.98e9,
        margin=0.02,
        tie=False,
        versions=Versions(),
        session_id=1,
        gpu_uuid="GPU-aaaa",
        measured_at=1.0,
        meta={},
        ranked=tuple(ranking),
        source="test",
    )


def test_configs_from_names_parses_candidate_names() -> None:
    assert configs_from_names([BIG, "triton[64x128x32,s2,w4]"]) == [
        {
            "BLOCK_M": 128,
            "BLOCK_N": 256,
            "BLOCK_K": 64,
            "GROUP_M": 8,
            "num_warps": 8,
            "num_stages": 3,
        },
        {
            "BLOCK_M": 64,
            "BLOCK_N": 128,
            "BLOCK_K": 32,
            "GROUP_M": 8,
            "num_warps": 4,
            "num_stages": 2,
        },
    ]
    with pytest.raises(ValueError, match=r"names\[1\]: expected a Triton candidate name"):
        configs_from_names([BIG, "cublas"])
    with pytest.raises(ValueError, match=r"names\[0\]: block_m must be a power of two"):
        configs_from_names(["triton[100x256x64,s3,w8,g8]"])


def test_winner_configs_put_the_winner_first() -> None:
    # A tie: the recorded winner is not the fastest median in this ranking.
    w = make_winner(BIG, "triton.matmul", [ranked(SMALL, 0.99e-3), ranked(BIG, 1e-3)])
    first = winner_configs(w, put_first=True)
    as_ranked = winner_configs(w, put_first=False)
    assert [c["BLOCK_N"] for c in first] == [256, 128]
    assert [c["BLOCK_N"] for c in as_ranked] == [128, 256]


def test_winner_configs_keep_only_timed_triton_candidates() -> None:
    w = make_winner(
        "cublas",
        "torch.matmul",
        [ranked("cublas", 0.9e-3, "torch.matmul"), ranked(TALL, 1e-3), ranked(SMALL, None)],
    )
    assert winner_configs(w) == configs_from_names([TALL])


def test_winner_configs_prefer_the_recorded_config() -> None:
    recorded = {"block_m": 64, "block_n": 64, "block_k": 32, "num_stages": 2, "num_warps": 2}
    cand = replace(ranked(BIG, 1e-3), meta={"config": recorded})
    w = replace(make_winner("cublas", "torch.matmul", [cand]))
    assert winner_configs(w)[0]["BLOCK_M"] == 64


class FakeTritonConfig:
    def __init__(self, kwargs: dict[str, int], num_warps: int, num_stages: int) -> None:
        self.kwargs, self.num_warps, self.num_stages = kwargs, num_warps, num_stages


class WinnerClient:
    def __init__(self, w: Winner | None) -> None:
        self.w = w
        self.asked: list[tuple[str, Any, Any]] = []

    def winner(self, workload: str, regime: Any, gpu_model: Any = None) -> Winner | None:
        self.asked.append((workload, regime, gpu_model))
        return self.w


def test_triton_configs_builds_triton_config_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(Config=FakeTritonConfig))
    w = make_winner(BIG, "triton.matmul", [ranked(BIG, 1e-3), ranked(TALL, 1.1e-3)])
    client = WinnerClient(w)
    configs = triton_configs(
        "gemm",
        "unthrottled",
        client=client,  # type: ignore[arg-type]
        rename={"BLOCK_M": "BLOCK_SIZE_M", "GROUP_M": "GROUP_SIZE_M"},
    )
    assert client.asked == [("gemm", "unthrottled", None)]
    assert [c.kwargs for c in configs] == [
        {"BLOCK_SIZE_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_SIZE_M": 8},
        {"BLOCK_SIZE_M": 256, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_SIZE_M": 4},
    ]
    assert [(c.num_warps, c.num_stages) for c in configs] == [(8, 3), (4, 4)]
    assert triton_configs("gemm", "sustained", client=WinnerClient(None)) == []  # type: ignore[arg-type]


def test_triton_configs_checks_rename_before_asking() -> None:
    client = WinnerClient(None)
    with pytest.raises(ValueError, match=r"^rename: key 'BLOCK' is not one of"):
        triton_configs("gemm", "unthrottled", client=client, rename={"BLOCK": "X"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^rename\['BLOCK_M'\]: expected a Python identifier"):
        triton_configs("gemm", "unthrottled", client=client, rename={"BLOCK_M": "1x"})  # type: ignore[arg-type]
    assert client.asked == []


def test_to_triton_without_triton_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    with pytest.raises(ImportError, match="needs Triton"):
        to_triton(configs_from_names([BIG]))


# -- on a real GPU ---------------------------------------------------------------------------


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


cuda = pytest.mark.skipif(not _has_cuda(), reason="needs torch with a CUDA GPU")


class OpenGate:
    def wait_until_stable(self, gpu: Any, timeout: float, **kw: Any) -> GpuState:
        return gpu_state()


@cuda
def test_real_conv_first_call_reports_cudnn_kernels() -> None:
    import torch
    import torch.nn.functional as F

    x = torch.randn(8, 3, 64, 64, device="cuda")
    w = torch.randn(16, 3, 3, 3, device="cuda")
    with torch.no_grad():
        out = gtorch.tune_first_call(F.conv2d, x, w, padding=1, client=OpenGate())  # type: ignore[arg-type]
        t = gtorch.steady_state_time(F.conv2d, x, w, padding=1, iters=20, warmup=2, repeats=3)
    assert out.result.shape == (8, 16, 64, 64)
    assert out.kernels and all(isinstance(k, str) and k for k in out.kernels)
    assert torch.backends.cudnn.benchmark is True
    assert 0 < t < 1.0


def test_real_triton_config_objects() -> None:
    triton = pytest.importorskip("triton")
    (cfg,) = to_triton(configs_from_names([BIG]))
    assert isinstance(cfg, triton.Config)
    assert cfg.kwargs["BLOCK_N"] == 256 and cfg.num_warps == 8 and cfg.num_stages == 3
