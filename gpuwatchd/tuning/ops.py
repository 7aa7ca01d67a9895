"""The shape each op takes, and the check of a workload against its families' specs.

Checked when a ``[[workload]]`` table is read, so ``op = "fft"``, ``m = -1``,
``dtype = "float1024"`` or operands bigger than the device could hold are a one-line
error from ``gpuwatchd check-config`` (or the control socket, or the spool) instead of a
session failing in the worker hours later. Pure Python: which ops a family runs is its
spec (:mod:`gpuwatchd.tuning.families`), and the worker's families parse shapes with the
rules here (:func:`conv_shape`). A family from a plugin (entry point
``gpuwatchd.families``) may run ops of its own: with one in the list, an unknown op and
unknown shape keys are left to the plugin.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from gpuwatchd.tuning.dtypes import (
    DTYPES,
    ELEMENT_BYTES,
    canonical,
    element_bytes,
    storage_elements,
)
from gpuwatchd.tuning.families import ENTRY_POINT_GROUP, KNOWN_OPS, SPECS, device_kind
from gpuwatchd.tuning.types import Workload
from gpuwatchd.validate import fail, key_path, need_int, require

#: The most the operands of one workload (inputs and output) may take, by where it runs:
#: more than a GPU's or a tuning host's memory only fails in the worker.
MAX_OPERAND_BYTES = {"gpu": 16 * 2**30, "cpu": 2 * 2**30}
#: The largest single dimension (a tensor dimension, m, n, k, batch) accepted.
MAX_DIM = 2**31 - 1

_CONV_KEYS = ("input", "weight", "stride", "padding", "dilation", "groups")


def plugin_families() -> frozenset[str]:
    """Family names installed as entry points (read from metadata; nothing is imported)."""
    return frozenset(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))


def check_workload(w: Workload, where: str, plugins: frozenset[str] | None = None) -> None:
    """Raise ValueError naming the field when ``w``'s families, op or shape cannot run."""
    plugins = plugin_families() if plugins is None else plugins
    for i, fam in enumerate(w.families):
        if fam not in SPECS and fam not in plugins:
            known = ", ".join(sorted({*SPECS, *plugins}))
            raise fail(f"{where}.families[{i}]", f"unknown family (known: {known})", fam)
    from_plugin = any(f not in SPECS for f in w.families)
    for fam in w.families:
        spec = SPECS.get(fam)
        if spec is not None and not spec.runs(w.op):
            raise fail(f"{where}.op", f"family {fam} runs {', '.join(spec.ops)}", w.op)
    if w.op not in KNOWN_OPS:
        if from_plugin:
            return
        raise fail(f"{where}.op", f"unknown op (known: {', '.join(KNOWN_OPS)})", w.op)
    try:
        elements = SHAPES[w.op].check(w, where, not from_plugin)
    except ValueError as exc:
        text = str(exc)
        raise ValueError(text if text.startswith(where) else f"{where}: {text}") from None
    if elements is not None and not from_plugin:
        _check_size(w, where, elements)


def _check_size(w: Workload, where: str, elements: int) -> None:
    """The dtype is one the families know, and the operands fit the device's cap."""
    dtype = canonical(w.dtype)
    if dtype is None:
        known = ", ".join(dict.fromkeys(DTYPES.values()))
        raise fail(f"{where}.dtype", f"expected one of {known} (or bf16, fp16, fp32, ...)", w.dtype)
    _check_bytes(w, where, elements * ELEMENT_BYTES[dtype])


def _check_bytes(w: Workload, where: str, size: int) -> None:
    """The operands' ``size`` in bytes fits the cap of the device ``w`` runs on."""
    device = "cpu" if device_kind(w.families) == "cpu" else "gpu"
    cap = MAX_OPERAND_BYTES[device]
    require(
        size <= cap,
        f"{where}.shape",
        f"operands of {_gib(size)} GiB, over the {_gib(cap)} GiB a {device} workload may take",
        dict(w.shape),
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.4g}"


def _keys(shape: Mapping[str, Any], where: str, known: tuple[str, ...], strict: bool) -> None:
    if not strict:
        return
    for key in shape:
        if key not in known:
            what = f"unknown key for this op ({', '.join(known)})"
            raise fail(key_path(f"{where}.shape", key), what, key)


def _dim(value: Any, where: str, minimum: int = 1) -> int:
    n = need_int(value, where, minimum=minimum)
    require(n <= MAX_DIM, where, f"expected an integer <= {MAX_DIM}", value)
    return n


def _positive(shape: Mapping[str, Any], key: str, where: str) -> int:
    if key not in shape:
        raise ValueError(f"{where}.shape.{key}: missing")
    return _dim(shape[key], f"{where}.shape.{key}")


def _gemm(keys: tuple[str, ...]) -> Callable[[Workload, str, bool], int]:
    """(batch,) m, n, k: A is m x k, B k x n, C m x n (each ``batch`` times)."""

    def check(w: Workload, where: str, strict: bool) -> int:
        _keys(w.shape, where, keys, strict)
        size = {key: _positive(w.shape, key, where) for key in keys}
        m, n, k = size["m"], size["n"], size["k"]
        return size.get("batch", 1) * (m * k + k * n + m * n)

    return check


def _dims(value: Any, where: str) -> tuple[int, int, int, int]:
    if not isinstance(value, list | tuple) or len(value) != 4:
        raise fail(where, "expected a list of 4 positive integers", value)
    a, b, c, d = (_dim(v, f"{where}[{i}]") for i, v in enumerate(value))
    return a, b, c, d


def _pair(value: Any, where: str, low: int) -> tuple[int, int]:
    items = value if isinstance(value, list | tuple) else [value, value]
    if len(items) != 2:
        raise fail(where, f"expected an integer >= {low} or a list of two", value)
    a, b = (_dim(v, where, minimum=low) for v in items)
    return a, b


@dataclass(frozen=True, slots=True)
class ConvShape:
    """A 2-D convolution: input (N,C,H,W), weight (K,C/groups,R,S), per-axis stride,
    padding and dilation, and groups; :attr:`output` is at least 1x1."""

    input: tuple[int, int, int, int]
    weight: tuple[int, int, int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int

    @property
    def output(self) -> tuple[int, int, int, int]:
        """(N, K, H_out, W_out), as torch.nn.functional.conv2d computes them."""
        n, _, h, w = self.input
        k, _, r, s = self.weight
        ho = (h + 2 * self.padding[0] - self.dilation[0] * (r - 1) - 1) // self.stride[0] + 1
        wo = (w + 2 * self.padding[1] - self.dilation[1] * (s - 1) - 1) // self.stride[1] + 1
        return (n, k, ho, wo)


def conv_shape(shape: Mapping[str, Any], where: str) -> ConvShape:
    """The conv shape rule: ``shape`` (keys input, weight, stride, padding, dilation,
    groups) as a :class:`ConvShape`; ValueError naming the field under ``where``
    (e.g. ``workload[0].shape``)."""
    n_c_h_w = _dims(shape.get("input"), f"{where}.input")
    k_c_r_s = _dims(shape.get("weight"), f"{where}.weight")
    stride = _pair(shape.get("stride", 1), f"{where}.stride", 1)
    padding = _pair(shape.get("padding", 0), f"{where}.padding", 0)
    dilation = _pair(shape.get("dilation", 1), f"{where}.dilation", 1)
    groups = _dim(shape.get("groups", 1), f"{where}.groups")
    if n_c_h_w[1] != k_c_r_s[1] * groups:
        what = f"has {k_c_r_s[1]} input channels per group, input has {n_c_h_w[1]} in {groups}"
        raise fail(f"{where}.weight", what, list(k_c_r_s))
    if k_c_r_s[0] % groups:
        what = f"output channels not divisible by {groups}"
        raise fail(f"{where}.weight", what, list(k_c_r_s))
    conv = ConvShape(n_c_h_w, k_c_r_s, stride, padding, dilation, groups)
    if min(conv.output[2:]) < 1:
        raise fail(f"{where}.weight", "is larger than the padded input", list(k_c_r_s))
    return conv


def _conv(w: Workload, where: str, strict: bool) -> int:
    """The conv rule; the operands' elements (input, weight, output)."""
    _keys(w.shape, where, _CONV_KEYS, strict)
    c = conv_shape(w.shape, f"{where}.shape")
    return math.prod(c.input) + math.prod(c.weight) + math.prod(c.output)


def _inductor(w: Workload, where: str, strict: bool) -> None:
    """Sizes and dtypes are the site's own, checked as Inductor describes them; the inputs'
    storage and the product (rows of the first operand x columns of the last) fit the cap."""
    from gpuwatchd.tuning.submitted.inductor_sites import parse_site_workload

    site = parse_site_workload(w)
    first, last = site.inputs[-2], site.inputs[-1]
    out = math.prod(first.size[:-1]) * last.size[-1]
    size = out * element_bytes(last.dtype) + sum(
        storage_elements(d.size, d.stride) * element_bytes(d.dtype) for d in site.inputs
    )
    _check_bytes(w, where, size)


def _triton_user(w: Workload, where: str, strict: bool) -> None:
    """The user's kernel arguments, checked as a kernel request; the tensors' storage, as the
    worker allocates it, fits the cap."""
    from gpuwatchd.tuning.submitted.kernels import request_from_workload

    request = request_from_workload(w)
    size = sum(
        storage_elements(a.shape or (), a.strides or ()) * element_bytes(a.dtype or "")
        for a in request.args
        if a.kind == "tensor"
    )
    _check_bytes(w, where, size)


@dataclass(frozen=True, slots=True)
class ShapeRule:
    """How an op's ``shape`` is checked: its keys (empty: the job's own description) and
    the check, which returns the operands' elements (None: it checked their bytes itself).
    Ops that share a rule are aliases (``gemm`` of ``matmul``)."""

    keys: tuple[str, ...]
    check: Callable[[Workload, str, bool], int | None]

    @property
    def from_jobs(self) -> bool:
        """Workloads of this op come from jobs (captured sites, kernel requests)."""
        return not self.keys


_MATMUL = ShapeRule(("m", "n", "k"), _gemm(("m", "n", "k")))
_CONV = ShapeRule(_CONV_KEYS, _conv)

#: Every op some built-in family runs -> its shape rule, in the order docs list them.
SHAPES: dict[str, ShapeRule] = {
    "matmul": _MATMUL,
    "gemm": _MATMUL,
    "bmm": ShapeRule(("batch", "m", "n", "k"), _gemm(("batch", "m", "n", "k"))),
    "conv2d": _CONV,
    "conv": _CONV,
    "inductor.gemm": ShapeRule((), _inductor),
    "triton.user": ShapeRule((), _triton_user),
}
