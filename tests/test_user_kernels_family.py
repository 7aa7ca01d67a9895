"""The worker's ``triton.user`` family on the CPU, with a fake Triton (no GPU).

Runs the family as the worker does (build from a workload, the protocol times the
candidates) on a :class:`CpuSession`, with ``TRITON_INTERPRET=1`` so the family accepts
a CPU device. Covers the module allow-list, the identity check, per-config rejections
(out of resources, outputs that differ from the majority) and the args factory.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import user_kernels_fakes as fakes
from spool_helpers import scan_all

from gpuwatchd.jobside.requests import Submitter
from gpuwatchd.jobside.stack import Stack
from gpuwatchd.tuning.settings import ProtocolConfig
from gpuwatchd.tuning.submitted.kernels import KernelRequest
from gpuwatchd.tuning.types import Regime, Versions, Workload
from gpuwatchd.tuning.winners import JOB_DEFAULT, job_default
from gpuwatchd.tuning.worker.devices import CpuSession
from gpuwatchd.tuning.worker.families import get_family
from gpuwatchd.tuning.worker.families.triton_user import (
    build,
    relative_difference,
    tolerance,
)
from gpuwatchd.tuning.worker.protocol import tune

torch = pytest.importorskip("torch")

QUICK = ProtocolConfig(
    time_budget_s=0.5, min_rounds=2, max_rounds=3, warmup_s=0.0, settle_timeout_s=0.0,
    settle_window_s=0.05, batch_target_s=0.001, pause_s=0.0, cool_pause_s=0.0,
)  # fmt: skip


class NoWinner:
    def winner(self, *args: Any, **kwargs: Any) -> None:
        return None


@pytest.fixture
def mods(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    fakes.install(monkeypatch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (tmp_path / "mods").mkdir()
    return fakes.write_module(tmp_path / "mods", "ukfam_kernels", fakes.KERNELS, monkeypatch)


def _request(kernel: Any, tmp_path: Path, n: int, factory: str | None = None) -> KernelRequest:
    """What a job's miss on ``kernel`` files (through the real job-side code)."""
    from gpuwatchd.triton import TuneContext

    kernel.args_factory = factory
    kernel.context = TuneContext(
        client=NoWinner(),  # type: ignore[arg-type]
        submitter=Submitter(socket_path=tmp_path / "none.sock", spool_dir=tmp_path / "spool"),
        stack=lambda dev: Stack("FAKE GPU", None, Versions(cuda="13.0", triton="3.6.0")),
    )
    x, y = torch.randn(4, n), torch.zeros(4, n)
    kernel[(4,)](x, y, n)
    (entry,) = [e for e in scan_all(tmp_path / "spool").entries if e.request.key_values == {
        "n": n}]  # fmt: skip
    return entry.request


ALLOWED = ("ukfam_kernels",)


def _tune(workload: Workload) -> dict[str, Any]:
    session = CpuSession(flush_bytes=0)
    cands = build(workload, session, ALLOWED)
    (result,) = tune(workload, cands, session, [Regime.SUSTAINED], QUICK)
    return {c.name: c for c in result.candidates} | {"_result": result}


def test_the_config_triton_picked_for_the_job_is_measured_as_its_default(
    mods: Any, tmp_path: Path
) -> None:
    req = _request(mods.scale, tmp_path, 100)
    assert req.job_default == "BLOCK=256,w8,s3"
    got = _tune(req.to_workload())
    marked = [name for name, c in got.items() if name != "_result" and c.meta.get(JOB_DEFAULT)]
    assert marked == ["BLOCK=256,w8,s3"]
    default, _kept = job_default(got["_result"])
    assert default == "BLOCK=256,w8,s3"


def test_family_is_registered() -> None:
    assert get_family("triton.user") is build


def test_configs_are_timed_and_out_of_resources_is_rejected_per_config(
    mods: Any, tmp_path: Path
) -> None:
    req = _request(mods.scale, tmp_path, 100)
    got = _tune(req.to_workload())
    oor = got["BLOCK=512,w8,s3"]
    assert oor.median_s is None and "OutOfResources: out of resource" in oor.meta["error"]
    for label in ("BLOCK=64,w4,s3", "BLOCK=128,w4,s3", "BLOCK=256,w8,s3"):
        c = got[label]
        assert c.median_s is not None and c.samples >= 2, label
        assert c.meta["identity"] == req.identity and c.meta["kernel"] == "ukfam_kernels:scale"
        assert c.meta["outputs_checked"] == ["y_ptr"] and c.meta["max_rel_difference"] == 0.0
        assert c.meta["config"]["kwargs"] == {"BLOCK": int(label.split("=")[1].split(",")[0])}
    assert got["_result"].winner in (None, "BLOCK=64,w4,s3", "BLOCK=128,w4,s3", "BLOCK=256,w8,s3")


def test_a_config_whose_output_differs_from_the_majority_is_rejected(
    mods: Any, tmp_path: Path
) -> None:
    req = _request(mods.partial, tmp_path, 200)  # BLOCK 64 handles only 64 of 200 columns
    got = _tune(req.to_workload())
    bad = got["BLOCK=64,w4,s3"].meta["error"]
    assert "outputs differ from the majority of configs" in bad
    assert "y_ptr: relative difference" in bad and "float32" in bad
    for label in ("BLOCK=256,w4,s3", "BLOCK=257,w4,s3", "BLOCK=1024,w4,s3"):
        assert "error" not in got[label].meta and got[label].median_s is not None


def test_configs_that_all_disagree_are_all_rejected(mods: Any, tmp_path: Path) -> None:
    req = _request(mods.partial, tmp_path, 1000)  # 64, 256, 257 wrong, each differently
    got = _tune(req.to_workload())
    for label in ("BLOCK=64,w4,s3", "BLOCK=256,w4,s3", "BLOCK=257,w4,s3", "BLOCK=1024,w4,s3"):
        assert "no majority" in got[label].meta["error"]
    assert got["_result"].winner is None


def test_an_empty_allow_list_imports_nothing(
    mods: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    req = _request(mods.scale, tmp_path, 100)
    workload = req.to_workload()
    import sys

    monkeypatch.delitem(sys.modules, "ukfam_kernels")
    for allowed in ([], ["other"], ["ukfam"]):
        with pytest.raises(ValueError, match="not under \\[tuning\\] allowed_modules"):
            build(workload, CpuSession(), allowed)
    assert "ukfam_kernels" not in sys.modules


def test_an_edited_kernel_is_not_tuned_under_its_old_identity(
    mods: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    req = _request(mods.scale, tmp_path, 100)
    workload = req.to_workload()
    fakes.write_module(
        tmp_path / "mods", "ukfam_kernels", fakes.KERNELS.replace("* 2", "* 3"), monkeypatch
    )
    session = CpuSession()
    cands = build(workload, session, ALLOWED)
    with pytest.raises(ValueError, match="changed since the request"):
        tune(workload, cands, session, [Regime.SUSTAINED], QUICK)


def test_args_factory_builds_the_inputs(mods: Any, tmp_path: Path) -> None:
    from gpuwatchd.tuning.worker.families.triton_user import UserKernel

    req = _request(mods.scale, tmp_path, 100, factory="ukfam_kernels:make_args")
    assert req.args_factory == "ukfam_kernels:make_args"
    kernel = UserKernel(req, ALLOWED, torch.device("cpu"))
    kernel.acquire()
    assert torch.equal(kernel.args["x_ptr"], torch.arange(400.0).reshape(4, 100))
    assert kernel.args["y_ptr"].shape == (4, 100) and kernel.args["n"] == 100
    kernel.release()
    assert kernel.args == {}


def test_rebuilt_tensors_keep_recorded_strides_and_dtypes(mods: Any, tmp_path: Path) -> None:
    from gpuwatchd.tuning.submitted.kernels import ArgSpec
    from gpuwatchd.tuning.worker.families.triton_user import build_tensor

    gen = torch.Generator().manual_seed(0)
    t = build_tensor(ArgSpec("x", "tensor", shape=(4, 3), strides=(1, 4), dtype="float16"),
                     "cpu", gen)  # fmt: skip
    assert t.stride() == (1, 4) and t.dtype == torch.float16 and t.abs().sum() > 0
    b = build_tensor(ArgSpec("b", "tensor", shape=(8, 5), strides=(0, 1), dtype="float32"),
                     "cpu", gen)  # fmt: skip
    assert b.stride() == (0, 1) and torch.equal(b[0], b[7])
    i = build_tensor(ArgSpec("i", "tensor", shape=(6,), strides=(1,), dtype="int64"), "cpu", gen)
    assert i.dtype == torch.int64 and int(i.abs().sum()) == 0  # indices: zero, never random


def test_relative_difference_is_dtype_aware() -> None:
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert relative_difference(a, a.clone()) == 0.0  # NaN in both places agrees
    assert relative_difference(a, torch.tensor([1.0, 2.0, 3.0])) == math.inf
    assert relative_difference(torch.tensor([1, 2]), torch.tensor([1, 2])) == 0.0
    assert relative_difference(torch.tensor([1, 2]), torch.tensor([1, 3])) == math.inf
    assert 0 < relative_difference(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.001])) < 1e-3
    assert tolerance(torch.float16) == 5e-3 and tolerance(torch.bfloat16) == 3e-2
    assert tolerance(torch.int32) == 0.0 and tolerance("torch.float8_e4m3fn") > 0.1
