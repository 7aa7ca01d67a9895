"""Run the example kernels the way a job would and say what gpuwatchd chose for each.

    PYTHONPATH=examples python -m user_kernels.driver [--out run.json] [--repeat 20]

The first run on an empty store misses: Triton autotunes (the start-up time is printed)
and a tuning request is filed with the daemon, or spooled when none runs. Once the
daemon has tuned them, the next run hits: zero seconds autotuning, the recorded winner.
Each kernel's output is checked against PyTorch.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from user_kernels import faulty, fused_matmul_bias_act, layer_norm, softmax

#: (name, shape) pairs the driver runs; the same two shapes per kernel as the benchmark.
SHAPES: dict[str, list[tuple[int, ...]]] = {
    "matmul_bias_gelu": [(4096, 4096, 4096), (8192, 2048, 8192)],
    "softmax": [(8192, 8192), (16384, 3072)],
    "layer_norm": [(8192, 8192), (32768, 2048)],
}


Case = tuple[str, tuple[int, ...], Any, Callable[[], Any]]


def cases(dtype: torch.dtype = torch.float16, with_faulty: bool = False) -> list[Case]:
    """(kernel, shape, its gpuwatchd wrapper, a call that returns (output, reference)).

    ``with_faulty`` adds :mod:`user_kernels.faulty`, whose reference is the right answer
    (so a wrong pick by Triton's autotuner shows as a large error).
    """
    dev = "cuda"
    out = []
    for m, n, k in SHAPES["matmul_bias_gelu"]:
        a = torch.randn(m, k, device=dev, dtype=dtype)
        b = torch.randn(k, n, device=dev, dtype=dtype) / k**0.5
        bias = torch.randn(n, device=dev, dtype=dtype)
        out.append((
            "matmul_bias_gelu", (m, n, k), fused_matmul_bias_act.matmul_bias_act_kernel,
            lambda a=a, b=b, bias=bias: (
                fused_matmul_bias_act.matmul_bias_act(a, b, bias),
                fused_matmul_bias_act.reference(a, b, bias),
            ),
        ))  # fmt: skip
    for rows, cols in SHAPES["softmax"]:
        x = torch.randn(rows, cols, device=dev, dtype=dtype)
        out.append((
            "softmax", (rows, cols), softmax.softmax_kernel,
            lambda x=x: (softmax.softmax(x), softmax.reference(x)),
        ))  # fmt: skip
    for rows, cols in SHAPES["layer_norm"]:
        x = torch.randn(rows, cols, device=dev, dtype=dtype)
        w = torch.randn(cols, device=dev, dtype=dtype)
        bias = torch.randn(cols, device=dev, dtype=dtype)
        out.append((
            "layer_norm", (rows, cols), layer_norm.layer_norm_kernel,
            lambda x=x, w=w, bias=bias: (
                layer_norm.layer_norm(x, w, bias), layer_norm.reference(x, w, bias)
            ),
        ))  # fmt: skip
    if with_faulty:
        x = torch.randn(4096, 4096, device=dev, dtype=dtype)
        out.append((
            "faulty_row_scale", (4096, 4096), faulty.row_max_scale_kernel,
            lambda x=x: (faulty.row_max_scale(x), x / x.abs().amax(dim=1, keepdim=True)),
        ))  # fmt: skip
    return out


def run(repeat: int, with_faulty: bool = False) -> list[dict[str, Any]]:
    """Each case once (first call: hit or autotune), checked, then ``repeat`` timed calls."""
    results = []
    for name, shape, kernel, call in cases(with_faulty=with_faulty):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got, ref = call()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        choice = kernel.gpuwatchd_last
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            call()
        end.record()
        end.synchronize()
        results.append({
            "kernel": name,
            "shape": list(shape),
            "config": choice.label if choice else None,
            "source": choice.source if choice else None,
            "workload": choice.workload if choice else None,
            "reason": choice.reason if choice else None,
            "autotune_s": choice.autotune_s if choice else None,
            "submission": choice.submission.how if choice and choice.submission else None,
            "first_call_s": first_s,
            "rel_error": err,
            "ms_per_call_incl_reference": start.elapsed_time(end) / max(1, repeat),
        })  # fmt: skip
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--repeat", type=int, default=0, help="timed calls after the first")
    p.add_argument("--faulty", action="store_true", help="also run user_kernels.faulty")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    results = run(args.repeat, args.faulty)
    for r in results:
        print(
            f"{r['kernel']:18} {r['shape']!s:22} {r['source']:9} {r['config']:45} "
            f"autotune {r['autotune_s']:.2f}s first call {r['first_call_s']:.2f}s "
            f"err {r['rel_error']:.1e}"
        )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
