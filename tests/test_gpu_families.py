"""The real-GPU candidate families and the CUDA session.

Everything that can be checked without a GPU runs everywhere: config grids, workload
validation, device matching, flag handling, import hygiene. The tests marked ``gpu``
need CUDA (and Triton for the Triton ones) and run on a lent H100/H200.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gpuwatchd.telemetry.types import DeviceInfo, normalize_uuid
from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.worker.candidate import CandidateError
from gpuwatchd.tuning.worker.cuda_session import (
    CudaIdentity,
    CudaSession,
    canonical_dtype,
    fp32_precision,
    match_cuda_device,
    parse_pci_bus_id,
    relative_error,
)
from gpuwatchd.tuning.worker.families import torch_conv, torch_matmul, triton_matmul
from gpuwatchd.tuning.worker.families.base import CandidateBase
from gpuwatchd.tuning.worker.families.triton_matmul import (
    DEFAULT_CONFIGS,
    HOPPER_SMEM_BYTES,
    TileConfig,
    check_fits,
    configs_for,
)

REPO = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


gpu_triton = pytest.mark.skipif(not (HAS_CUDA and _has_triton()), reason="needs CUDA + Triton")


def gemm(m: int = 256, n: int = 256, k: int = 256, dtype: str = "bf16", **params: Any) -> Workload:
    return Workload("g", "matmul", {"m": m, "n": n, "k": k}, dtype, ("triton.matmul",), params)


def conv(shape: dict[str, Any] | None = None, dtype: str = "float32", **params: Any) -> Workload:
    base = {"input": [64, 3, 224, 224], "weight": [64, 3, 3, 3], "padding": 1}
    return Workload("c", "conv2d", shape or base, dtype, ("torch.conv2d",), params)


class NoCudaSession:
    """A session with no CUDA device (a CPU or simulated one)."""

    info = DeviceInfo(index=0, uuid="cpu", name="cpu")


# -- import hygiene -----------------------------------------------------------------------


def test_importing_the_gpu_modules_imports_neither_torch_nor_triton() -> None:
    code = textwrap.dedent(
        """
        import sys
        import gpuwatchd.tuning.worker.cuda_session
        import gpuwatchd.tuning.worker.families.triton_matmul as t
        import gpuwatchd.tuning.worker.families.torch_matmul
        import gpuwatchd.tuning.worker.families.torch_conv
        assert len(t.DEFAULT_CONFIGS) >= 8
        print(sorted(m for m in ("torch", "triton") if m in sys.modules))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- triton config grid -------------------------------------------------------------------


def test_default_grid_is_big_unique_and_fits_hopper_shared_memory() -> None:
    assert len(DEFAULT_CONFIGS) >= 8
    names = [c.name for c in DEFAULT_CONFIGS]
    assert len(set(names)) == len(names)
    for c in DEFAULT_CONFIGS:
        check_fits(c, 2, HOPPER_SMEM_BYTES)  # bf16/fp16
        assert c.num_warps >= 4  # wgmma needs a warpgroup
        assert TileConfig.parse(c.label) == c


def test_config_name_format() -> None:
    assert TileConfig(128, 256, 64, 3, 8, 8).name == "triton[128x256x64,s3,w8,g8]"
    assert TileConfig.parse("64x128x32,s2,w4") == TileConfig(64, 128, 32, 2, 4, 8)


def test_shared_memory_estimate_rejects_what_cannot_fit() -> None:
    big = TileConfig(256, 256, 128, 4, 8)  # 4 * (256 + 256) * 128 * 2 B = 512 KiB
    assert big.smem_bytes(2) == 524288
    with pytest.raises(CandidateError, match=r"triton\[256x256x128,s4,w8,g8\].*512 KiB.*227 KiB"):
        check_fits(big, 2, HOPPER_SMEM_BYTES)
    check_fits(TileConfig(128, 128, 128, 3, 8), 2, HOPPER_SMEM_BYTES)  # 192 KiB fits
    with pytest.raises(CandidateError):
        check_fits(TileConfig(128, 128, 128, 3, 8), 4, HOPPER_SMEM_BYTES)  # fp32: 384 KiB
    check_fits(big, 2, None)  # unknown limit: the compiler decides


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_m": 100}, "block_m"),
        ({"block_n": 8}, "block_n"),
        ({"block_k": 1024}, "block_k"),
        ({"num_stages": 0}, "num_stages"),
        ({"num_warps": 3}, "num_warps"),
        ({"group_m": 0}, "group_m"),
        ({"num_warps": True}, "num_warps"),
    ],
)
def test_bad_tile_config_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    base = {"block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 3, "num_warps": 4}
    with pytest.raises(ValueError, match=rf"^{field} must"):
        TileConfig(**(base | kwargs))


def test_params_configs_override_the_grid() -> None:
    as_dict = {"block_m": 64, "block_n": 64, "block_k": 32, "num_stages": 2, "num_warps": 4}
    w = gemm(configs=["128x128x64,s3,w4", as_dict | {"group_m": 4}])
    got = configs_for(w)
    assert [c.name for c in got] == ["triton[128x128x64,s3,w4,g8]", "triton[64x64x32,s2,w4,g4]"]
    assert configs_for(gemm()) == list(DEFAULT_CONFIGS)


@pytest.mark.parametrize(
    ("configs", "message"),
    [
        ([], r"params\.configs must be a non-empty list"),
        ("128x128x64,s3,w4", r"params\.configs must be a non-empty list"),
        (["128x128x64,s3,w4", "oops"], r"params\.configs\[1\]: expected a config like"),
        ([{"block_m": 128}], r"params\.configs\[0\]: missing key 'block_k'"),
        ([{"block_m": 128, "bm": 1}], r"params\.configs\[0\]: unknown key 'bm'"),
        (["96x128x64,s3,w4"], r"params\.configs\[0\]: block_m must be a power of two"),
        (["128x128x64,s3,w4", "128x128x64,s3,w4,g8"], r"params\.configs\[1\]: duplicate"),
    ],
)
def test_bad_params_configs_name_the_entry(configs: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        configs_for(gemm(configs=configs))


# -- GEMM workload validation -------------------------------------------------------------


@pytest.mark.parametrize(
    ("workload", "message"),
    [
        (Workload("g", "conv2d", {"m": 1, "n": 1, "k": 1}, "bf16", ()), r"family .* op 'conv2d'"),
        (gemm(m=0), r"shape\.m must be a positive integer, got 0"),
        (Workload("g", "matmul", {"m": 8, "n": 8}, "bf16", ()), r"shape\.k must be a positive"),
        (gemm(n=True), r"shape\.n must be a positive integer"),  # type: ignore[arg-type]
        (gemm(dtype="float32"), r"dtype must be one of bfloat16, float16, got 'float32'"),
        (gemm(dtype="int8"), r"dtype must be one of"),
        (gemm(seed="x"), r"params\.seed must be an integer"),
        (gemm(m=65536, k=65536), r"shape m\*k = 4294967296 elements is over"),
    ],
)
def test_triton_build_rejects_bad_workloads(workload: Workload, message: str) -> None:
    with pytest.raises(ValueError, match=r"workload 'g': " + message):
        triton_matmul.build(workload, NoCudaSession())


def test_gemm_spec_counts_flops_bytes_and_tolerance() -> None:
    spec = torch_matmul.parse_gemm(gemm(8192, 4096, 16384, "bfloat16"), ("bfloat16",))
    assert spec.flops == 2 * 8192 * 4096 * 16384
    assert spec.bytes == (8192 * 16384 + 16384 * 4096 + 8192 * 4096) * 2
    assert spec.tolerance == 2e-2
    fp32 = torch_matmul.parse_gemm(gemm(dtype="fp32", tf32=False), ("float32",))
    assert (fp32.dtype, fp32.tf32, fp32.tolerance) == ("float32", False, 1e-4)
    with pytest.raises(ValueError, match=r"params\.tf32 must be true or false"):
        torch_matmul.parse_gemm(gemm(dtype="fp32", tf32="yes"), ("float32",))


def test_gpu_families_refuse_a_session_without_cuda() -> None:
    for build, w, fam in (
        (triton_matmul.build, gemm(), "triton.matmul"),
        (torch_matmul.build, gemm(), "torch.matmul"),
        (torch_conv.build, conv(), "torch.conv2d"),
    ):
        with pytest.raises(CandidateError, match=rf"{fam} needs a CUDA device session"):
            build(w, NoCudaSession())


def test_run_before_setup_is_a_candidate_error() -> None:
    spec = torch_matmul.parse_gemm(gemm(), ("bfloat16",))
    data = torch_matmul.GemmData(spec, torch.device("cpu"))
    for cand in (
        triton_matmul.TritonMatmul(DEFAULT_CONFIGS[0], data, 0),
        torch_matmul.TorchMatmul("cublas", data),
        torch_conv.CudnnConv(
            torch_conv.parse_conv(conv()), "heuristic", ("contiguous", "contiguous"), data.device
        ),
    ):
        with pytest.raises(CandidateError, match="run before setup"):
            cand.run(1)
        cand.teardown()  # idempotent, and safe before setup


def test_torch_matmul_blas_param_is_checked() -> None:
    with pytest.raises(ValueError, match=r"params\.blas entries must be one of cublas, cublaslt"):
        torch_matmul.build(gemm(blas=["mkl"]), NoCudaSession())
    with pytest.raises(ValueError, match=r"params\.blas must be a non-empty list"):
        torch_matmul.build(gemm(blas=[]), NoCudaSession())


# -- conv workload validation -------------------------------------------------------------


def test_l4_conv_spec() -> None:
    spec = torch_conv.parse_conv(conv())
    assert spec.output == (64, 64, 224, 224)
    assert spec.flops == 2 * 64 * 64 * 224 * 224 * 3 * 9
    assert spec.bytes == (64 * 3 * 224 * 224 + 64 * 27 + 64 * 64 * 224 * 224) * 4
    assert (spec.padding, spec.stride, spec.tf32) == ((1, 1), (1, 1), False)
    strided = torch_conv.parse_conv(
        conv({"input": [2, 8, 15, 15], "weight": [4, 4, 3, 3], "stride": [2, 1], "groups": 2})
    )
    assert strided.output == (2, 4, 7, 13)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ({"input": [1, 3, 8], "weight": [4, 3, 3, 3]}, r"shape\.input: expected a list of 4"),
        ({"input": [1, 3, 8, 8], "weight": [4, 2, 3, 3]}, r"2 input channels per group"),
        ({"input": [1, 4, 8, 8], "weight": [3, 2, 3, 3], "groups": 2}, r"not divisible by 2"),
        ({"input": [1, 3, 8, 8], "weight": [4, 3, 3, 3], "padding": -1}, r"padding: expected"),
        ({"input": [1, 3, 8, 8], "weight": [4, 3, 3, 3], "stride": [1, 2, 3]}, r"shape\.stride"),
        ({"input": [1, 3, 2, 2], "weight": [4, 3, 3, 3]}, r"larger than the padded input"),
        ({"input": [1, 3, 8, 8], "weight": [4, 3, 3, 3], "groups": 0}, r"shape\.groups: expected"),
    ],
)
def test_bad_conv_shapes_name_the_field(shape: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=r"workload 'c': .*" + message):
        torch_conv.build(conv(shape), NoCudaSession())


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"picks": ["fastest"]}, r"params\.picks entries must be one of heuristic, benchmark"),
        ({"memory_formats": []}, r"params\.memory_formats must be a non-empty list"),
        ({"tf32": 1}, r"params\.tf32 must be true or false"),
    ],
)
def test_bad_conv_params_name_the_field(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        torch_conv.build(conv(**params), NoCudaSession())
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        torch_conv.build(conv(dtype="float64"), NoCudaSession())


def test_conv_refuses_the_v7_api_whose_cache_is_process_wide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCH_CUDNN_V8_API_DISABLED", "1")
    cudaish = SimpleNamespace(device=SimpleNamespace(type="cuda", index=0))
    with pytest.raises(CandidateError, match="TORCH_CUDNN_V8_API_DISABLED"):
        torch_conv.build(conv(), cudaish)  # type: ignore[arg-type]


def test_gpu_families_share_the_base_setup_that_cleans_up() -> None:
    classes = (torch_matmul.TorchMatmul, triton_matmul.TritonMatmul, torch_conv.CudnnConv)
    for cls in classes:
        assert issubclass(cls, CandidateBase), cls
        assert cls.setup is CandidateBase.setup and cls.meta is CandidateBase.meta, cls


# -- device matching and helpers ----------------------------------------------------------

U0 = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
U1 = "GPU-9f8e7d6c-0000-1111-2222-333344445555"


def test_uuid_and_pci_normalization() -> None:
    assert normalize_uuid(U0) == normalize_uuid(U0[4:].upper())
    assert normalize_uuid("MIG-abc") == "abc"
    assert parse_pci_bus_id("00000000:1B:00.0") == (0, 0x1B, 0)
    assert parse_pci_bus_id("0001:c3:1f.7") == (1, 0xC3, 0x1F)
    with pytest.raises(ValueError, match="pci_bus_id: not a PCI address"):
        parse_pci_bus_id("slot 3")


def test_cuda_ordinal_is_found_by_uuid_not_by_index() -> None:
    # CUDA_VISIBLE_DEVICES=<U1>,<U0>: NVML's GPU 0 is CUDA's device 1.
    visible = [CudaIdentity(0, U1[4:], (0, 0x2A, 0)), CudaIdentity(1, U0[4:], (0, 0x1B, 0))]
    assert match_cuda_device(DeviceInfo(index=0, uuid=U0, name="H100"), visible) == 1
    assert match_cuda_device(DeviceInfo(index=7, uuid=U1, name="H100"), visible) == 0


def test_pci_address_is_the_fallback_only_without_uuids() -> None:
    visible = [CudaIdentity(0, None, (0, 0x2A, 0)), CudaIdentity(1, None, (0, 0x1B, 0))]
    info = DeviceInfo(index=0, uuid=U0, name="H100", pci_bus_id="00000000:1B:00.0")
    assert match_cuda_device(info, visible) == 1
    with_uuids = [CudaIdentity(0, U1, (0, 0x1B, 0))]  # same PCI, other GPU (MIG, ...)
    with pytest.raises(RuntimeError, match=r"GPU 0 \(uuid GPU-0a1b.*not visible to CUDA"):
        match_cuda_device(info, with_uuids)


def test_cpu_only_session_says_why() -> None:
    if HAS_CUDA:
        pytest.skip("CUDA is available here")
    with pytest.raises(RuntimeError, match="CUDA is not available in this process"):
        CudaSession(0, None)


def test_dtype_spellings() -> None:
    assert canonical_dtype("BF16", ("bfloat16",), "w") == "bfloat16"
    assert canonical_dtype("half", ("float16",), "w") == "float16"
    with pytest.raises(ValueError, match="w: dtype must be one of float32, got 'bf16'"):
        canonical_dtype("bf16", ("float32",), "w")


def test_relative_error() -> None:
    ref = torch.ones(4, 4)
    assert relative_error(ref.clone(), ref) == 0.0
    assert relative_error(ref * 1.01, ref) == pytest.approx(0.01)
    bad = ref.clone()
    bad[0, 0] = math.nan
    assert relative_error(bad, ref) == math.inf


def test_fp32_precision_is_set_and_restored() -> None:
    node = torch.backends.cuda.matmul
    if not hasattr(node, "fp32_precision"):
        pytest.skip("this torch has only the legacy allow_tf32 flags")
    before = node.fp32_precision
    with fp32_precision("matmul", tf32=True) as mode:
        assert mode == "tf32" and node.fp32_precision == "tf32"
    with fp32_precision("conv", tf32=False) as mode:
        assert mode == "ieee" and torch.backends.cudnn.conv.fp32_precision == "ieee"
    assert node.fp32_precision == before


# -- on a GPU -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def session() -> Any:
    s = CudaSession(torch.cuda.current_device() if HAS_CUDA else 0, None)
    yield s
    s.close()


def _full_check(data: torch_matmul.GemmData) -> float:
    ref = data.a.float() @ data.b.float()
    return relative_error(data.c, ref)


@gpu_triton
@pytest.mark.parametrize("shape", [(1024, 1024, 1024), (777, 1000, 520)])
def test_every_default_triton_config_is_correct(session: Any, shape: tuple[int, ...]) -> None:
    cands = triton_matmul.build(gemm(*shape), session)
    assert [c.name for c in cands] == [c.name for c in DEFAULT_CONFIGS]
    try:
        for c in cands:
            c.setup()
            c.run(2)
            torch.cuda.synchronize()
            meta = c.meta()
            assert meta["rel_error"] < 1e-2
            assert _full_check(c._data) < 1e-2, c.name
            assert meta["flops"] == 2 * shape[0] * shape[1] * shape[2]
            json.dumps(meta)
    finally:
        for c in cands:
            c.teardown()


@gpu_triton
def test_triton_config_over_shared_memory_is_a_candidate_error(session: Any) -> None:
    (c,) = triton_matmul.build(gemm(configs=["256x256x128,s4,w8"]), session)
    with pytest.raises(CandidateError, match="shared memory"):
        c.setup()


@gpu_triton
def test_triton_autotune_pick_is_one_of_the_configs() -> None:
    grid = ["128x128x64,s3,w4", "64x128x64,s4,w4", "128x256x64,s3,w8"]
    pick = triton_matmul.triton_autotune_pick(gemm(1024, 1024, 1024, configs=grid))
    assert pick["name"] in {TileConfig.parse(g).name for g in grid}


@gpu
def test_torch_matmul_candidates_run_cublas_and_cublaslt(session: Any) -> None:
    before = torch.backends.cuda.preferred_blas_library()
    cands = torch_matmul.build(gemm(2048, 2048, 2048), session)
    assert [c.name for c in cands] == ["cublas", "cublaslt"]
    try:
        for c in cands:
            c.setup()
            c.run(2)
            assert torch.backends.cuda.preferred_blas_library() == before  # restored
            meta = c.meta()
            assert meta["kernels"], c.name
            assert meta["rel_error"] < 1e-2
            assert _full_check(c._data) < 1e-2
    finally:
        for c in cands:
            c.teardown()


def _fresh_process_heuristic_kernels(shape: dict[str, Any], fmt: str) -> list[str]:
    """The heuristic pick's kernels in a process that never ran benchmark mode."""
    code = textwrap.dedent(
        f"""
        import json, torch
        from gpuwatchd.tuning.worker.cuda_session import CudaSession
        from gpuwatchd.tuning.worker.families import torch_conv
        from gpuwatchd.tuning.types import Workload
        w = Workload("c", "conv2d", {shape!r}, "float32", (), {{"picks": ["heuristic"],
                     "memory_formats": [{fmt!r}], "input_layout": {fmt!r},
                     "weight_layout": {fmt!r}}})
        (c,) = torch_conv.build(w, CudaSession(torch.cuda.current_device(), None))
        c.setup()
        print(json.dumps(c.meta()["kernels"]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@gpu
def test_conv_picks_record_real_kernels_and_keep_their_own_choice(session: Any) -> None:
    # On an H200 with cuDNN 9.19 the heuristic picks an FFT conv for this NHWC fp32 shape
    # and benchmark mode an implicit GEMM; run in one thread, whichever runs first wins.
    shape = {"input": [32, 64, 56, 56], "weight": [64, 64, 3, 3], "padding": 1}
    cands = torch_conv.build(conv(shape, picks=["benchmark", "heuristic"]), session)
    assert [c.name for c in cands] == [
        "cudnn[benchmark,contiguous]",
        "cudnn[benchmark,channels_last]",
        "cudnn[heuristic,contiguous]",
        "cudnn[heuristic,channels_last]",
    ]
    flag = torch.backends.cudnn.benchmark
    try:
        for c in cands:  # benchmark picks first: they must not leak into the heuristic ones
            c.setup()
            meta = c.meta()
            assert meta["kernels"] and meta["fp32_precision"] == "ieee", meta
            assert meta["rel_error"] < 1e-4
            t = session.time_batch(c, 3)
            assert 0 < t < 5
            json.dumps(meta)
        heuristic = cands[3].meta()["kernels"]
    finally:
        for c in cands:
            c.teardown()
    assert torch.backends.cudnn.benchmark == flag
    assert heuristic == _fresh_process_heuristic_kernels(shape, "channels_last")


class _Matmul:
    """A known-size op for checking the session's clock."""

    name = "probe"
    family = "test"

    def __init__(self, n: int) -> None:
        self.a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.flops = 2 * n**3

    def run(self, calls: int) -> None:
        for _ in range(calls):
            torch.matmul(self.a, self.b)


@gpu
def test_cuda_session_times_a_known_op_plausibly(session: Any) -> None:
    op = _Matmul(4096)
    session.time_batch(op, 5)  # warm-up
    t10 = session.time_batch(op, 10)
    t20 = session.time_batch(op, 20)
    tflops = op.flops * 10 / t10 / 1e12
    assert 50 < tflops < 2000, tflops  # an H100/H200 runs this at several hundred
    assert t20 / t10 == pytest.approx(2.0, rel=0.25)
    session.flush_l2()
    assert session.l2_bytes >= 2**20
    assert session.sample().gpu == session.gpu_index
    with pytest.raises(ValueError, match="calls must be >= 1"):
        session.time_batch(op, 0)
