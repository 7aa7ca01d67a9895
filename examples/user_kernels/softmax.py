"""Row softmax with an online (one-pass) max/sum over column blocks of BLOCK_N.

One program per row; a row longer than BLOCK_N is walked in blocks, so BLOCK_N trades
registers and memory-level parallelism against loop trips: a real tuning choice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import gpuwatchd.triton

CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bn, w, s in (
        (1024, 4, 2),
        (2048, 4, 2),
        (2048, 8, 2),
        (4096, 8, 2),
        (4096, 16, 2),
        (8192, 16, 2),
        (1024, 8, 3),
        (2048, 8, 3),
    )
]


@gpuwatchd.triton.autotune(configs=CONFIGS, key=["n_cols"])
@triton.jit
def softmax_kernel(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    offs = tl.arange(0, BLOCK_N)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + offs
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        s = tl.where(m_new == float("-inf"), 0.0, s)
        m = m_new
    row_max = tl.max(m, 0)
    denom = tl.sum(s * tl.exp(m - row_max), 0)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + offs
        x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        y = tl.exp(x - row_max) / denom
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension of a 2-D tensor."""
    n_rows, n_cols = x.shape
    y = torch.empty_like(x)
    softmax_kernel[(n_rows,)](x, y, n_cols, x.stride(0), y.stride(0))
    return y


def reference(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.float(), dim=-1).to(x.dtype)
