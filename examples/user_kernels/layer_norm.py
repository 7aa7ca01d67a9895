"""Layer norm forward (y = (x - mean) / std * w + b), also writing mean and 1/std per row.

One program per row, two passes over column blocks of BLOCK_N (statistics, then
normalise), as in Triton's tutorial but with the block size tuned rather than fixed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import gpuwatchd.triton

CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w)
    for bn, w in (
        (512, 2),
        (1024, 4),
        (1024, 8),
        (2048, 4),
        (2048, 8),
        (4096, 8),
        (4096, 16),
        (8192, 16),
    )
]


@gpuwatchd.triton.autotune(configs=CONFIGS, key=["N"])
@triton.jit
def layer_norm_kernel(
    x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, stride, N, eps, BLOCK_N: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride
    y_row = y_ptr + row * stride
    offs = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + offs
        acc += tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
    mean = tl.sum(acc, 0) / N
    var_acc = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + offs
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        d = tl.where(cols < N, x - mean, 0.0)
        var_acc += d * d
    rstd = 1.0 / tl.sqrt(tl.sum(var_acc, 0) / N + eps)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, N, BLOCK_N):
        cols = start + offs
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (x - mean) * rstd * w + b
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """Layer norm over the last dimension of a contiguous 2-D tensor."""
    m, n = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    layer_norm_kernel[(m,)](x, y, weight, bias, mean, rstd, x.stride(0), n, eps)
    return y


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    out = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float())
    return out.to(x.dtype)
