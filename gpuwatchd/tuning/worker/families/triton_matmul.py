"""``triton.matmul`` family: our own tiled Triton GEMM over a grid of tile configs.

The kernel is the standard one: one BLOCK_M x BLOCK_N tile of C per program, tiles
ordered in groups of GROUP_M tile-rows so that programs running together share A rows
and B columns in L2, K walked in BLOCK_K steps through ``tl.dot`` into an fp32
accumulator, the tile stored in the input dtype (bf16/fp16). Triton pipelines the K loop
``num_stages`` deep and uses wgmma on Hopper.

Triton (and torch) are imported on first use only. The kernel's source refers to the
module global ``tl``, which :func:`_kernel` binds to ``triton.language`` before Triton
parses the function; the annotations stay strings (``from __future__ import
annotations``), which is how Triton reads them anyway.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuwatchd.tuning.families import specs_for
from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.worker.candidate import CandidateError, DeviceSession
from gpuwatchd.tuning.worker.cuda_session import first_line, require_cuda_device
from gpuwatchd.tuning.worker.families.base import CandidateBase
from gpuwatchd.tuning.worker.families.common import compiled_facts
from gpuwatchd.tuning.worker.families.torch_matmul import GemmData, GemmSpec, parse_gemm

(SPEC,) = specs_for(__name__)
FAMILY = SPEC.name
DTYPES = ("bfloat16", "float16")
#: Opt-in shared memory per block on H100/H200 (227 KiB): the budget of the default grid.
HOPPER_SMEM_BYTES = 232448
_NUM_WARPS = (1, 2, 4, 8, 16)
_INT32_MAX = 2**31 - 1

tl: Any = None  # triton.language, bound by _kernel(); the kernel source below refers to it


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_pow2(v: object) -> bool:
    return _is_int(v) and v > 0 and (v & (v - 1)) == 0  # type: ignore[operator]


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One point of the grid: tile shape, software-pipeline depth, warps, swizzle group."""

    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    group_m: int = 8

    def __post_init__(self) -> None:
        for field, value, lo, hi in (
            ("block_m", self.block_m, 16, 512),
            ("block_n", self.block_n, 16, 512),
            ("block_k", self.block_k, 16, 512),
        ):
            if not _is_pow2(value) or not lo <= value <= hi:
                raise ValueError(f"{field} must be a power of two in [{lo}, {hi}], got {value!r}")
        if not _is_int(self.num_stages) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be an integer in [1, 8], got {self.num_stages!r}")
        if self.num_warps not in _NUM_WARPS or not _is_int(self.num_warps):
            raise ValueError(f"num_warps must be one of {_NUM_WARPS}, got {self.num_warps!r}")
        if not _is_int(self.group_m) or not 1 <= self.group_m <= 64:
            raise ValueError(f"group_m must be an integer in [1, 64], got {self.group_m!r}")

    @property
    def label(self) -> str:
        """``128x256x64,s3,w8,g8``: the spelling accepted by :meth:`parse`."""
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k},"
            f"s{self.num_stages},w{self.num_warps},g{self.group_m}"
        )

    @property
    def name(self) -> str:
        return f"triton[{self.label}]"

    def smem_bytes(self, elem_bytes: int) -> int:
        """Shared memory of the pipelined A and B tiles: a lower bound of what Triton asks."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * elem_bytes

    def to_json(self) -> dict[str, int]:
        return {
            "block_m": self.block_m,
            "block_n": self.block_n,
            "block_k": self.block_k,
            "num_stages": self.num_stages,
            "num_warps": self.num_warps,
            "group_m": self.group_m,
        }

    @classmethod
    def parse(cls, text: str) -> TileConfig:
        """``128x256x64,s3,w8`` or ``...,g8`` (group defaults to 8)."""
        m = _LABEL_RE.match(text.strip())
        if m is None:
            raise ValueError(f"expected a config like '128x256x64,s3,w8,g8', got {text!r}")
        g = m["g"]
        return cls(
            int(m["bm"]), int(m["bn"]), int(m["bk"]), int(m["s"]), int(m["w"]), int(g) if g else 8
        )

    @classmethod
    def from_json(cls, d: Any) -> TileConfig:
        if isinstance(d, str):
            return cls.parse(d)
        if not isinstance(d, dict):
            raise ValueError(f"expected a string or a mapping, got {type(d).__name__}")
        known = {"block_m", "block_n", "block_k", "num_stages", "num_warps", "group_m"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        missing = sorted(known - {"group_m"} - set(d))
        if missing:
            raise ValueError(f"missing key {missing[0]!r}")
        return cls(**d)


_LABEL_RE = re.compile(
    r"^(?P<bm>\d+)x(?P<bn>\d+)x(?P<bk>\d+),s(?P<s>\d+),w(?P<w>\d+)(?:,g(?P<g>\d+))?$"
)

#: Sensible on Hopper for large bf16/fp16 GEMMs; every one fits in 227 KiB of shared memory.
DEFAULT_CONFIGS: tuple[TileConfig, ...] = (
    TileConfig(128, 256, 64, 3, 8),
    TileConfig(256, 128, 64, 3, 8),
    TileConfig(128, 256, 64, 4, 8),
    TileConfig(256, 128, 64, 4, 8),
    TileConfig(128, 128, 64, 4, 4),
    TileConfig(128, 128, 64, 3, 8),
    TileConfig(128, 128, 128, 3, 8),
    TileConfig(64, 256, 64, 4, 4),
    TileConfig(256, 64, 64, 4, 4),
    TileConfig(64, 128, 64, 4, 4),
)


def configs_for(workload: Workload) -> list[TileConfig]:
    """``params.configs`` (strings or mappings) if given, else :data:`DEFAULT_CONFIGS`."""
    raw = workload.params.get("configs")
    if raw is None:
        return list(DEFAULT_CONFIGS)
    where = f"workload {workload.name!r}: params.configs"
    if not isinstance(raw, list | tuple) or not raw:
        raise ValueError(f"{where} must be a non-empty list, got {raw!r}")
    out: list[TileConfig] = []
    for i, item in enumerate(raw):
        try:
            cfg = TileConfig.from_json(item)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}[{i}]: {e}") from None
        if cfg in out:
            raise ValueError(f"{where}[{i}]: duplicate config {cfg.label}")
        out.append(cfg)
    return out


def check_fits(cfg: TileConfig, elem_bytes: int, limit_bytes: int | None) -> None:
    """CandidateError when the config's pipelined tiles alone exceed the shared memory."""
    need = cfg.smem_bytes(elem_bytes)
    if limit_bytes is not None and need > limit_bytes:
        raise CandidateError(
            f"{cfg.name}: needs at least {need // 1024} KiB of shared memory, "
            f"the device allows {limit_bytes // 1024} KiB per block"
        )


def _matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_MN: tl.constexpr,
):
    """C = A @ B. EVEN_K: K % BLOCK_K == 0; EVEN_MN: M, N are multiples of the tile."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # Swizzle: walk GROUP_M tile-rows column by column so neighbours reuse L2 lines.
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % rows_here
    tile_n = (pid % per_group) // rows_here

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if EVEN_MN:
        rows = tl.max_contiguous(tl.multiple_of(offs_m, BLOCK_M), BLOCK_M)
        cols = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    else:
        # Wrap out-of-range rows/cols onto valid ones: loads stay in bounds without a
        # mask, and the store below drops them.
        rows = offs_m % M
        cols = offs_n % N
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@functools.cache
def _kernel() -> Any:
    """The jitted kernel (imports Triton; raises CandidateError when it cannot)."""
    global tl
    try:
        import triton
        import triton.language
    except ImportError as e:
        raise CandidateError(f"{FAMILY}: Triton is not importable: {e}") from None
    tl = triton.language
    return triton.jit(_matmul_kernel)


def smem_limit(device_index: int) -> int | None:
    """Shared memory per block the device allows, as Triton itself reads it (None: unknown)."""
    try:
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(device_index)
        return int(props["max_shared_mem"])
    except Exception:  # Triton's driver API moves between versions: no limit, compile decides
        return None


def _launch_args(data: GemmData, cfg: TileConfig) -> tuple[tuple[Any, ...], dict[str, Any]]:
    s = data.spec
    a, b, c = data.a, data.b, data.c
    args = (a, b, c, s.m, s.n, s.k, *a.stride(), *b.stride(), *c.stride())
    kwargs = {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "GROUP_M": cfg.group_m,
        "EVEN_K": s.k % cfg.block_k == 0,
        "EVEN_MN": s.m % cfg.block_m == 0 and s.n % cfg.block_n == 0,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }
    return args, kwargs


def _grid(spec: GemmSpec, cfg: TileConfig) -> tuple[int]:
    return (-(-spec.m // cfg.block_m) * -(-spec.n // cfg.block_n),)


class TritonMatmul(CandidateBase):
    """Our Triton GEMM with one tile config."""

    family = FAMILY

    def __init__(self, cfg: TileConfig, data: GemmData, device_index: int) -> None:
        super().__init__(cfg.name)
        self.cfg = cfg
        self._data = data
        self._device_index = device_index
        self._launch: Any = None
        self._args: tuple[Any, ...] = ()
        self._kwargs: dict[str, Any] = {}
        self._held = False

    def _setup(self) -> None:
        """Compile and warm up, check against float64, read the kernel's facts."""
        import torch

        spec = self._data.spec
        limit = smem_limit(self._device_index)
        check_fits(self.cfg, spec.elem_bytes, limit)
        kernel = _kernel()
        self._data.acquire()
        self._held = True
        self._args, self._kwargs = _launch_args(self._data, self.cfg)
        self._launch = kernel[_grid(spec, self.cfg)]
        self._data.clear_output()
        t0 = time.perf_counter()
        try:
            compiled = self._launch(*self._args, **self._kwargs)
            torch.cuda.synchronize(self._data.device)
        except Exception as e:  # Triton raises OutOfResources, CompilationError, ...
            raise CandidateError(f"{self.name}: {type(e).__name__}: {first_line(e)}") from e
        compile_s = time.perf_counter() - t0
        err = self._data.check(self.name)
        self._meta = {
            "config": self.cfg.to_json(),
            "kernels": [str(getattr(compiled, "name", "_matmul_kernel"))],
            "shape": spec.describe(),
            "flops": spec.flops,
            "bytes": spec.bytes,
            "working_set_bytes": spec.bytes,
            "rel_error": err,
            "compile_s": compile_s,
            "smem_bytes_estimate": self.cfg.smem_bytes(spec.elem_bytes),
            "smem_limit_bytes": limit,
            **compiled_facts(compiled),
        }

    def run(self, calls: int) -> None:
        launch, args, kwargs = self._launch, self._args, self._kwargs
        if launch is None:
            raise CandidateError(f"{self.name}: run before setup")
        for _ in range(calls):
            launch(*args, **kwargs)

    def teardown(self) -> None:
        self._launch = None
        self._args = ()
        if self._held:
            self._held = False
            self._data.release()


def build(workload: Workload, session: DeviceSession) -> list[TritonMatmul]:
    """One candidate per tile config of ``params.configs`` (default: the Hopper grid)."""
    spec = parse_gemm(workload, DTYPES, SPEC)
    _check_indexing(workload.name, spec)
    configs = configs_for(workload)
    device = require_cuda_device(session, FAMILY)
    data = GemmData(spec, device)
    index = device.index if device.index is not None else 0
    return [TritonMatmul(cfg, data, index) for cfg in configs]


def _check_indexing(name: str, spec: GemmSpec) -> None:
    """The kernel computes offsets in int32: refuse operands with more elements than that."""
    for label, elems in (
        ("m*k", spec.m * spec.k),
        ("k*n", spec.k * spec.n),
        ("m*n", spec.m * spec.n),
    ):
        if elems > _INT32_MAX:
            raise ValueError(
                f"workload {name!r}: shape {label} = {elems} elements is over the "
                f"{_INT32_MAX} that {FAMILY}'s 32-bit offsets address"
            )


def triton_autotune_pick(
    workload: Workload, configs: Sequence[TileConfig] | None = None
) -> dict[str, Any]:
    """What ``@triton.autotune(key=["M", "N", "K"])`` picks over the same configs.

    Runs the autotuner as a user would (its own do_bench, whatever the GPU's state) on
    the current CUDA device and returns the chosen config and, where this Triton exposes
    them, the per-config times it saw. For comparing with the per-regime winners.
    """
    import torch
    import triton

    spec = parse_gemm(workload, DTYPES, SPEC)
    _check_indexing(workload.name, spec)
    grid_cfgs = list(configs) if configs is not None else configs_for(workload)
    by_key = {_cfg_key(c): c for c in grid_cfgs}
    tuned = triton.autotune(
        configs=[_triton_config(triton, c) for c in grid_cfgs],
        key=["M", "N", "K"],
    )(
        triton.heuristics(
            {
                "EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0,
                "EVEN_MN": lambda a: a["M"] % a["BLOCK_M"] == 0 and a["N"] % a["BLOCK_N"] == 0,
            }
        )(_kernel())
    )
    data = GemmData(spec, torch.device("cuda", torch.cuda.current_device()))
    data.acquire()
    try:
        a, b, c = data.a, data.b, data.c

        def grid(meta: dict[str, Any]) -> tuple[int]:
            return (triton.cdiv(spec.m, meta["BLOCK_M"]) * triton.cdiv(spec.n, meta["BLOCK_N"]),)

        t0 = time.perf_counter()
        tuned[grid](a, b, c, spec.m, spec.n, spec.k, *a.stride(), *b.stride(), *c.stride())
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - t0
        best = tuned.best_config
        pick = by_key.get(_triton_cfg_key(best))
        timings: dict[str, float] = {}
        for tcfg, t in (getattr(tuned, "configs_timings", None) or {}).items():
            ours = by_key.get(_triton_cfg_key(tcfg))
            ms = t[0] if isinstance(t, list | tuple) else t
            if ours is not None and isinstance(ms, int | float):
                timings[ours.name] = float(ms)
    finally:
        data.release()
    return {
        "name": pick.name if pick else None,
        "config": pick.to_json() if pick else None,
        "triton_config": str(best),
        "timings_ms": timings,
        "wall_s": wall_s,
    }


def _triton_config(triton: Any, c: TileConfig) -> Any:
    meta = {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "GROUP_M": c.group_m}
    return triton.Config(meta, num_warps=c.num_warps, num_stages=c.num_stages)


def _cfg_key(c: TileConfig) -> tuple[int, ...]:
    return (c.block_m, c.block_n, c.block_k, c.group_m, c.num_warps, c.num_stages)


def _triton_cfg_key(tc: Any) -> tuple[int, ...]:
    kw = tc.kwargs
    return (
        int(kw["BLOCK_M"]),
        int(kw["BLOCK_N"]),
        int(kw["BLOCK_K"]),
        int(kw["GROUP_M"]),
        int(tc.num_warps),
        int(tc.num_stages),
    )
