"""A kernel with a bug in some configs, to show gpuwatchd's output check.

``row_max_scale_kernel`` divides each row by its largest absolute value, but loads the
row in one block: a config whose BLOCK_N is shorter than the row silently handles only
its first BLOCK_N columns. Triton's autotuner happily picks such a config when it is
fastest (it never compares outputs); gpuwatchd's worker rejects it as an outlier.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import gpuwatchd.triton

CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w)
    for bn, w in ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16))
]


@gpuwatchd.triton.autotune(configs=CONFIGS, key=["n_cols"])
@triton.jit
def row_max_scale_kernel(x_ptr, y_ptr, n_cols, stride, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols  # the bug: nothing covers columns past BLOCK_N
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.max(tl.abs(x), 0)
    tl.store(y_ptr + row * stride + cols, (x / scale).to(y_ptr.dtype.element_ty), mask=mask)


def row_max_scale(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    row_max_scale_kernel[(x.shape[0],)](x, y, x.shape[1], x.stride(0))
    return y
