"""The family registry, the real-torch CPU families and the simulated GPU family end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.telemetry.types import ThrottleReason
from gpuwatchd.tuning.ops import check_workload
from gpuwatchd.tuning.settings import ProtocolConfig
from gpuwatchd.tuning.types import Regime, Workload
from gpuwatchd.tuning.worker import families
from gpuwatchd.tuning.worker.candidate import CandidateError
from gpuwatchd.tuning.worker.devices import CpuSession, SimSession
from gpuwatchd.tuning.worker.families.base import CandidateBase
from gpuwatchd.tuning.worker.families.cpu import TorchCpuCandidate
from gpuwatchd.tuning.worker.families.sim import (
    CUBLAS_LIKE,
    SPECS,
    TRITON_LIKE,
    SimKernel,
    sim_family,
)
from gpuwatchd.tuning.worker.protocol import tune

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_torch_thread() -> Any:
    """Time CPU kernels on one thread. With two OpenMP threads on a loaded 2-core machine a
    48x160x40 matmul measured 16 ms instead of 9 µs (a worker spinning at the barrier while
    its partner is descheduled), which no protocol can see through."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


CPU_CFG = ProtocolConfig(
    batch_target_s=0.004,
    warmup_s=0.01,
    pause_s=0.0,
    cool_pause_s=0.0,
    min_rounds=3,
    max_rounds=6,
    spread_target=0.05,
    time_budget_s=0.8,
    settle_window_s=0.05,
    settle_timeout_s=0.2,
    flush_l2="never",
)
SIM_GEMM = Workload(
    name="sim-gemm", op="gemm", shape={"m": 8192, "n": 8192, "k": 8192}, dtype="bf16",
    families=("sim",),
)  # fmt: skip


def matmul_wl(**kw: Any) -> Workload:
    base: dict[str, Any] = {
        "name": "mm", "op": "matmul", "shape": {"m": 48, "n": 40, "k": 160}, "dtype": "fp32",
        "families": ("cpu.matmul",),
    }  # fmt: skip
    base.update(kw)
    return Workload(**base)


# -- registry -----------------------------------------------------------------------------


def test_registry_lists_builtins_and_names_unknown_family() -> None:
    names = families.family_names()
    assert {"cpu.matmul", "cpu.conv2d", "sim", "torch.matmul", "triton.matmul"} <= set(names)
    with pytest.raises(families.UnknownFamily) as exc:
        families.get_family("cuda.magic")
    msg = str(exc.value)
    assert msg.startswith("unknown candidate family 'cuda.magic' (known: ") and "\n" not in msg
    assert families.get_family("sim") is sim_family


def test_user_families_come_from_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    group = families.ENTRY_POINT_GROUP
    eps = [
        EntryPoint("acme.gemm", "gpuwatchd.tuning.worker.families.sim:sim_family", group),
        EntryPoint("acme.broken", "no_such_module_here:family", group),
        EntryPoint("sim", "no_such_module_here:family", group),  # cannot shadow a built-in
    ]
    monkeypatch.setattr(families, "entry_points", lambda group: eps)
    assert {"acme.gemm", "acme.broken"} <= set(families.family_names())
    assert families.get_family("acme.gemm") is sim_family
    assert families.get_family("sim") is sim_family
    with pytest.raises(families.UnknownFamily, match=r"'acme.broken' from no_such_module_here"):
        families.get_family("acme.broken")
    wl = Workload("w", "gemm", {"m": 64, "n": 64, "k": 64}, "bf16", ("sim", "acme.gemm"))
    with pytest.raises(ValueError, match="appears twice"):
        families.candidates_for(wl, CpuSession(flush_bytes=0))


def test_daemon_side_imports_stay_torch_free() -> None:
    code = (
        "import sys; import gpuwatchd.tuning.worker.families, gpuwatchd.tuning.worker.protocol, "
        "gpuwatchd.tuning.worker.devices, gpuwatchd.tuning.worker.families.sim, "
        "gpuwatchd.tuning.worker.families.cpu; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False).returncode == 0


class _Taker(CandidateBase):
    """Takes a resource, then fails (or not) part-way through setup."""

    family = "test"

    def __init__(self, error: BaseException | None) -> None:
        super().__init__("taker")
        self.error = error
        self.held = 0
        self.teardowns = 0

    def _setup(self) -> None:
        self.held += 1
        if self.error is not None:
            raise self.error
        self._meta = {"held": self.held}

    def run(self, calls: int) -> None:
        return None

    def teardown(self) -> None:
        self.teardowns += 1
        self.held = 0


@pytest.mark.parametrize("error", [CandidateError("wrong result"), KeyboardInterrupt()])
def test_candidate_base_releases_what_a_failed_setup_took(error: BaseException) -> None:
    cand = _Taker(error)
    with pytest.raises(type(error)):
        cand.setup()
    assert (cand.held, cand.teardowns) == (0, 1)


def test_candidate_base_keeps_a_good_setup_and_copies_its_meta() -> None:
    cand = _Taker(None)
    cand.setup()
    assert (cand.held, cand.teardowns) == (1, 0)
    meta = cand.meta()
    meta["held"] = 99
    assert cand.meta() == {"held": 1} and cand.name == "taker"


# -- cpu ----------------------------------------------------------------------------------


def test_cpu_matmul_end_to_end_both_regimes() -> None:
    wl = matmul_wl()
    session = CpuSession(flush_bytes=0)
    cands = families.candidates_for(wl, session)
    names = [c.name for c in cands]
    assert names == ["torch.matmul", "torch.mm[out]", "einsum", "matmul[b^T]", "blocked[k64]"]
    results = tune(wl, cands, session, (Regime.UNTHROTTLED, Regime.SUSTAINED), CPU_CFG)
    assert [r.regime for r in results] == [Regime.UNTHROTTLED, Regime.SUSTAINED]
    for r in results:
        assert r.workload == "mm" and len(r.candidates) == 5
        assert (r.winner is None) == r.tie
        assert r.winner is None or r.winner == r.candidates[0].name
        medians = [c.median_s for c in r.candidates]
        assert all(m is not None and m > 0 for m in medians)
        assert medians == sorted(medians)  # type: ignore[type-var]
        for c in r.candidates:
            assert c.family == "cpu.matmul" and c.samples >= CPU_CFG.min_rounds
            assert c.rejected == 0 and c.sm_clock_hz is None and c.energy_j_per_call is None
            assert c.meta["flops"] == 2 * 48 * 40 * 160 and c.meta["calls_per_batch"] >= 1
            assert "error" not in c.meta
    assert results[1].candidates[0].meta["settled"] is True  # no telemetry: a window run


def test_cpu_conv2d_end_to_end() -> None:
    wl = Workload(
        "conv", "conv2d", {"input": [2, 3, 12, 12], "weight": [4, 3, 3, 3], "padding": 1},
        "float32", ("cpu.conv2d",),
    )  # fmt: skip
    session = CpuSession(flush_bytes=0)
    cands = families.candidates_for(wl, session)
    assert [c.name for c in cands] == [
        "conv2d", "conv2d[channels_last]", "conv2d[native]", "im2col+gemm",
    ]  # fmt: skip
    (r,) = tune(wl, cands, session, ["unthrottled"], CPU_CFG)
    assert all(c.samples >= CPU_CFG.min_rounds and c.median_s for c in r.candidates)
    assert r.candidates[0].meta["working_set_bytes"] == 4 * (2 * 3 * 144 + 4 * 27 + 2 * 4 * 144)


def test_cpu_bmm_end_to_end_and_checked_against_its_spec() -> None:
    wl = Workload("b", "bmm", {"batch": 3, "m": 24, "n": 20, "k": 40}, "float32", ("cpu.bmm",))
    check_workload(wl, "workload[0]", frozenset())  # the daemon accepts it as the worker runs it
    session = CpuSession(flush_bytes=0)
    cands = families.candidates_for(wl, session)
    assert [c.name for c in cands] == ["torch.bmm", "torch.bmm[out]", "einsum", "mm per entry"]
    (r,) = tune(wl, cands, session, ["unthrottled"], CPU_CFG)
    assert all(c.family == "cpu.bmm" and c.samples >= CPU_CFG.min_rounds for c in r.candidates)
    assert r.candidates[0].meta["flops"] == 2 * 3 * 24 * 20 * 40
    with pytest.raises(ValueError, match=r"family cpu.bmm runs bmm, got 'matmul'"):
        check_workload(replace(wl, op="matmul"), "workload[0]", frozenset())


def test_cpu_candidates_checked_against_float64_reference() -> None:
    import torch

    (good_bf16,) = [
        c for c in families.candidates_for(matmul_wl(dtype="bf16"), CpuSession(0))
        if c.name == "einsum"
    ]  # fmt: skip
    good_bf16.setup()  # bf16 passes within its own tolerance
    good_bf16.run(2)
    good_bf16.teardown()

    def make() -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        a = torch.ones(4, 4, dtype=torch.float64)
        return (a.float(), a.float()), a @ a

    wrong = TorchCpuCandidate(
        "off-by-one", "cpu.matmul", make, lambda a, b: a @ b + 1, {}, 1, 1, 1e-4
    )
    with pytest.raises(CandidateError, match=r"off-by-one: relative error 0\.25 > 0\.0001"):
        wrong.setup()
    shape = TorchCpuCandidate("bad-shape", "cpu.matmul", make, lambda a, b: a[:2], {}, 1, 1, 1e-4)
    with pytest.raises(CandidateError, match=r"bad-shape: output shape \(2, 4\) != reference"):
        shape.setup()
    boom = TorchCpuCandidate("boom", "cpu.matmul", make, lambda a, b: a @ b[:3], {}, 1, 1, 1e-4)
    with pytest.raises(CandidateError, match="boom: "):
        boom.setup()


@pytest.mark.parametrize(
    ("wl", "message"),
    [
        (matmul_wl(op="conv2d"), "workload mm: family cpu.matmul cannot run op 'conv2d'"),
        (matmul_wl(shape={"m": 4, "n": 0, "k": 4}), "workload mm: shape.n must be a positive"),
        (matmul_wl(shape={"m": 4, "n": 4}), "workload mm: shape.k must be a positive"),
        (matmul_wl(dtype="int8"), "workload mm: dtype 'int8' not supported"),
        (
            Workload("c", "conv2d", {"input": [1, 3, 8, 8], "weight": [4, 2, 3, 3]}, "fp32",
                     ("cpu.conv2d",)),
            "workload c: shape.weight: has 2 input channels per group, input has 3 in 1",
        ),
        (
            Workload("c", "conv2d", {"input": [1, 3, 8], "weight": [4, 3, 3, 3]}, "fp32",
                     ("cpu.conv2d",)),
            "workload c: shape.input: expected a list of 4 positive integers",
        ),
        (matmul_wl(families=("sim",), dtype="int4"), "workload mm: dtype 'int4' not supported"),
        (matmul_wl(families=("sim",), op="conv"), "workload mm: family sim cannot run op 'conv'"),
    ],
)  # fmt: skip
def test_bad_workloads_name_the_field(wl: Workload, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        families.candidates_for(wl, CpuSession(0))
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


# -- sim ----------------------------------------------------------------------------------


def test_sim_kernel_physics_compute_scales_with_clock_memory_does_not() -> None:
    session = SimSession.create("idle")
    cands = sim_family(SIM_GEMM, session)
    assert [c.name for c in cands] == [s.name for s in SPECS] and len(cands) == 5
    tri, cub = cands[0], cands[1]
    assert isinstance(tri, SimKernel) and isinstance(cub, SimKernel)
    fmax = session.info.max_sm_clock_mhz
    assert fmax == 1980.0
    for k in (tri, cub):
        full, half = k.seconds_per_call(fmax, fmax), k.seconds_per_call(fmax / 2, fmax)
        assert half - full == pytest.approx(k.compute_s)  # only compute doubles
    assert tri.seconds_per_call(fmax, fmax) < cub.seconds_per_call(fmax, fmax)
    assert tri.seconds_per_call(1440, fmax) > cub.seconds_per_call(1440, fmax)
    assert tri.compute_s / tri.seconds_per_call(fmax, fmax) > 0.9  # compute bound
    with pytest.raises(CandidateError, match="runs only on a sim session"):
        tri.run(1)
    with pytest.raises(CandidateError, match="not a simulated kernel"):
        session.time_batch(_NotSim(), 1)  # type: ignore[arg-type]


class _NotSim:
    name = "cpu-thing"
    family = "cpu.matmul"


def test_sim_session_heats_caps_and_reports_reasons_seen_mid_batch() -> None:
    session = SimSession.create("idle", substep_s=0.01)
    tri = sim_family(SIM_GEMM, session)[0]
    assert isinstance(tri, SimKernel)
    idle = session.sample()
    assert idle.sm_clock_mhz == 1980.0 and idle.procs == ()
    seconds = session.time_batch(tri, 3000)  # ~5 s of back-to-back GEMMs
    hot = session.sample()
    assert hot.reasons is not None and ThrottleReason.SW_POWER_CAP in hot.reasons
    assert hot.sm_clock_mhz is not None and hot.sm_clock_mhz < 0.8 * 1980
    assert hot.temp_c is not None and hot.temp_c > idle.temp_c + 10  # type: ignore[operator]
    assert hot.procs == (os.getpid(),)
    per_call_full = tri.seconds_per_call(1980, 1980)
    assert seconds / 3000 > 1.25 * per_call_full  # it slowed down with the clock
    assert session.now() == pytest.approx(seconds, rel=0.01)
    session.pause(5.0)
    cool = session.sample()
    assert cool.procs == () and cool.sm_clock_mhz == 1980.0
    assert not (cool.reasons or 0) & ThrottleReason.SW_POWER_CAP


def test_sim_session_power_limiter_engages_after_a_trace_like_delay() -> None:
    """The H200 trace: an idle GPU runs a matmul at 1980 MHz for ~0.2 s before the cap."""
    session = SimSession.create("idle")
    tri = sim_family(SIM_GEMM, session)[0]
    first_capped = None
    while session.now() < 1.0:
        session.time_batch(tri, 2)
        s = session.sample()
        if s.reasons and ThrottleReason.SW_POWER_CAP in s.reasons:
            first_capped = first_capped or session.now()
            assert s.sm_clock_mhz is not None and s.sm_clock_mhz < 1600
        else:  # full clock, give or take the sensor's one-bin jitter
            assert s.sm_clock_mhz is not None and s.sm_clock_mhz >= 1965.0
    assert first_capped is not None and 0.2 <= first_capped <= 0.26
    # Short batches at a 25% duty cycle never trip it ...
    session.pause(2.0)
    for _ in range(60):
        session.time_batch(tri, 15)
        s = session.sample()
        assert s.sm_clock_mhz is not None and s.sm_clock_mhz >= 1965.0
        assert not (s.reasons or 0) & ThrottleReason.SW_POWER_CAP
        session.pause(0.075)
    # ... and without the limiter's latency the model caps at once.
    instant = SimSession.create("idle", limiter_tau_s=0.0)
    instant.time_batch(tri, 1)
    assert ThrottleReason.SW_POWER_CAP in (instant.sample().reasons or ThrottleReason(0))


def test_sim_gemm_regime_flip() -> None:
    """Compute-bound wins cool; memory-heavy, lower-power kernel wins under the power cap."""
    session = SimSession.create("idle", seed=3)
    cands = families.candidates_for(SIM_GEMM, session)
    cfg = ProtocolConfig(time_budget_s=120.0, min_rounds=8)
    cool, hot = tune(SIM_GEMM, cands, session, ["unthrottled", "sustained"], cfg)
    assert (cool.winner, cool.tie) == (TRITON_LIKE.name, False)
    assert (hot.winner, hot.tie) == (CUBLAS_LIKE.name, False)
    assert cool.margin is not None and 0.01 < cool.margin < 0.03
    assert hot.margin is not None and 0.03 < hot.margin < 0.07
    losers = {s.name for s in SPECS} - {TRITON_LIKE.name, CUBLAS_LIKE.name}
    for r in (cool, hot):
        assert {c.name for c in r.candidates[2:]} == losers
    for c in cool.candidates:
        assert c.sm_clock_hz == pytest.approx(1980e6, rel=0.01)
        assert not c.reasons & ThrottleReason.SW_POWER_CAP
    for c in hot.candidates[:2]:
        assert c.sm_clock_hz is not None and c.sm_clock_hz < 0.8 * 1980e6
        assert c.reasons & ThrottleReason.SW_POWER_CAP and c.rejected == 0
        assert c.power_w is not None and c.power_w > 650
        assert c.energy_j_per_call == pytest.approx(c.power_w * c.median_s)  # type: ignore[operator]
    assert hot.candidates[0].meta["settled"] is True
