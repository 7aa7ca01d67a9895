"""The families that tune captured shapes, as far as a machine without a GPU can see them:
``torch.gemm`` (transposed and batched GEMMs) and ``inductor.mm`` (torch.compile's choices)
validate their workloads with one-line errors and refuse a non-CUDA session."""

from __future__ import annotations

from typing import Any

import pytest

from gpuwatchd.tuning.submitted.captured import CapturedCall, workload_for
from gpuwatchd.tuning.submitted.inductor_sites import GemmSite, SiteCall, TensorDesc, lookup_key
from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.worker.candidate import CandidateError
from gpuwatchd.tuning.worker.devices import CpuSession
from gpuwatchd.tuning.worker.families import family_names, get_family
from gpuwatchd.tuning.worker.families.torch_gemm import parse_strided_gemm


def captured_gemm(batch: int, layout: str, dtype: str = "bfloat16") -> Workload:
    call = CapturedCall(
        "gemm", "bmm" if batch > 1 else "mm", "backward", dtype,
        {"batch": batch, "m": 512, "n": 256, "k": 128}, layout, False, True, 3, 0.001, 0.2,
    )  # fmt: skip
    return workload_for(call)


def test_both_families_are_registered() -> None:
    assert {"torch.gemm", "inductor.mm"} <= set(family_names())


def test_captured_gemms_parse_with_their_layout_and_batch() -> None:
    spec = parse_strided_gemm(captured_gemm(8, "tn"))
    assert (spec.batch, spec.m, spec.n, spec.k, spec.layout) == (8, 512, 256, 128, "tn")
    assert spec.flops == 2 * 8 * 512 * 256 * 128
    plain = parse_strided_gemm(captured_gemm(1, "nt", "float32"))
    assert (plain.batch, plain.tf32, plain.dtype) == (1, True, "float32")
    assert plain.tolerance == 1e-2


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda w: {**w, "op": "conv2d"}, "cannot run op 'conv2d' \\(it runs matmul, bmm\\)"),
        (lambda w: {**w, "params": {"layout": "nx"}}, "params.layout must be one of nn, nt"),
        (lambda w: {**w, "shape": {**w["shape"], "batch": 0}}, "shape.batch must be a positive"),
        (lambda w: {**w, "dtype": "int8"}, "dtype must be one of"),
        (lambda w: {**w, "params": {"layout": "nn", "tf32": 1}}, "params.tf32 must be true"),
    ],
)
def test_bad_gemm_workloads_name_the_field(edit: Any, message: str) -> None:
    w = Workload.from_json(edit(captured_gemm(4, "nn").to_json()))
    with pytest.raises(ValueError, match=message):
        parse_strided_gemm(w)


def site_workload(**params: Any) -> Workload:
    a = TensorDesc("float16", (64, 32), (32, 1))
    b = TensorDesc("float16", (32, 16), (16, 1))
    key = lookup_key((a, b), {}, "mm")
    w = GemmSite("mm", (a, b), {}, (SiteCall(key, ("aten::mm",), ()),)).workload()
    return Workload(w.name, w.op, w.shape, w.dtype, w.families, params)


def test_an_inductor_site_too_large_for_the_gpu_is_refused() -> None:
    """Inputs sized by their strides, plus the product, against the GPU workload cap."""
    from gpuwatchd.tuning.ops import check_workload

    check_workload(site_workload(), "workload")
    a = TensorDesc("float16", (2**17, 2**16), (2**16, 1))  # 16 GiB on its own
    b = TensorDesc("float16", (2**16, 16), (16, 1))
    key = lookup_key((a, b), {}, "mm")
    big = GemmSite("mm", (a, b), {}, (SiteCall(key, ("aten::mm",), ()),)).workload()
    with pytest.raises(ValueError, match=r"^workload\.shape: operands of 16\.0\d* GiB, over"):
        check_workload(big, "workload")


@pytest.mark.parametrize("family", ["torch.gemm", "inductor.mm"])
def test_families_refuse_a_session_without_cuda(family: str) -> None:
    w = captured_gemm(2, "nt") if family == "torch.gemm" else site_workload()
    with pytest.raises(CandidateError, match="needs a CUDA device session"):
        get_family(family)(w, CpuSession(flush_bytes=0))


@pytest.mark.parametrize(
    ("params", "message"),
    [({"max_choices": 0}, "params.max_choices must be an integer >= 1"),
     ({"tf32": "yes"}, "params.tf32 must be true or false"),
     ({"seed": 1.5}, "params.seed must be an integer")],
)  # fmt: skip
def test_inductor_family_checks_its_params_first(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_family("inductor.mm")(site_workload(**params), CpuSession(flush_bytes=0))
