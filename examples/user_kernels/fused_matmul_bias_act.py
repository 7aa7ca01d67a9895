"""C = act(A @ B + bias): a GEMM with its epilogue fused (bias add, then GELU or ReLU).

The tile configs are the usual Hopper candidates plus one (256x256x64, 4 stages) that
needs more shared memory than an H100 has: Triton's autotuner skips it as out of
resources, and so does gpuwatchd's worker, per config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

import gpuwatchd.triton

CONFIGS = [
    triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s
    )
    for bm, bn, bk, s, w in (
        (128, 256, 64, 3, 8),
        (128, 256, 64, 4, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 4),
        (128, 128, 64, 3, 8),
        (64, 256, 64, 4, 4),
        (128, 64, 64, 4, 4),
        (256, 256, 64, 4, 8),  # over 227 KiB of shared memory: out of resources on Hopper
    )
]


@triton.jit
def _gelu(x):
    # tanh approximation, written with exp so it compiles on any Triton version
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))


@gpuwatchd.triton.autotune(configs=CONFIGS, key=["M", "N", "K"])
@triton.jit
def matmul_bias_act_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % rows_here
    tile_n = (pid % per_group) // rows_here
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_m % M
    cols = offs_n % N
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kt * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    bias = tl.load(bias_ptr + cols).to(tl.float32)
    acc = acc + bias[None, :]
    if ACTIVATION == "gelu":
        acc = _gelu(acc)
    elif ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def grid(m: int, n: int) -> Callable[[dict[str, Any]], tuple[int]]:
    """The launch grid for an (m, n) output: one program per BLOCK_M x BLOCK_N tile."""
    return lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)


def matmul_bias_act(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor, activation: str = "gelu"
) -> torch.Tensor:
    """act(a @ b + bias) for 2-D a (M, K), b (K, N), bias (N,)."""
    m, k = a.shape
    _, n = b.shape
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    matmul_bias_act_kernel[grid(m, n)](
        a, b, bias, c, m, n, k, *a.stride(), *b.stride(), *c.stride(), ACTIVATION=activation
    )
    return c


def reference(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor, activation: str = "gelu"
) -> torch.Tensor:
    out = a.float() @ b.float() + bias.float()
    if activation == "gelu":
        out = torch.nn.functional.gelu(out, approximate="tanh")
    elif activation == "relu":
        out = torch.relu(out)
    return out.to(a.dtype)
