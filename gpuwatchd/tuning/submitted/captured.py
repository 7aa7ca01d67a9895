"""A model's own GEMM and convolution calls, as a job captured them, and the workloads they make.

:func:`gpuwatchd.torch.capture` watches a few training or inference steps and records
every GEMM (``mm``, ``addmm``, ``bmm``, ``baddbmm``) and 2-D convolution the model runs,
forward and backward, with its shapes, layout, dtype, call count and share of the time.
This module is the plain-data side of that (no torch): the :class:`CapturedCall` records,
their JSON document (``gpuwatchd-capture/1``, validated with one-line errors) and
:func:`to_workloads`, which turns them into :class:`Workload` objects for the existing
families, one per distinct tuning problem, biggest share first:

- a GEMM with both operands row-major (layout ``nn``) and no batch: op ``matmul``,
  family ``torch.matmul`` (cuBLAS vs cuBLASLt, what a job can choose);
- any other GEMM (a transposed operand, a batch): op ``matmul`` or ``bmm`` with
  ``params.layout``, family ``torch.gemm``, the same two libraries on that exact layout;
- a forward convolution: op ``conv2d``, family ``torch.conv2d`` with the job's input and
  weight layouts (``params.input_layout``/``weight_layout`` where not contiguous): the
  family times the heuristic and benchmark picks as the job runs them, and each uniform
  memory format the whole model could be converted to. Backward convolutions are
  recorded (they take time) but not tuned: the family times the forward pass only.

Layouts: ``n`` is a row-major operand (unit stride along its last dimension), ``t`` a
column-major one (a transposed view, as ``nn.Linear``'s weight is in ``x @ w.t()``). A
conv's ``layout`` is its input's memory format and ``weight_layout`` its weight's.
Workload names are derived from the shape, so capturing the same model twice gives the
same names and the daemon replaces rather than duplicates.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.tuning.families.torch_conv import MEMORY_FORMATS as CONV_LAYOUTS
from gpuwatchd.tuning.types import Workload
from gpuwatchd.validate import fail, need_bool, need_int, need_number, need_text

#: Identifies the capture document shape; bump on an incompatible change.
CAPTURE_FORMAT = "gpuwatchd-capture/1"
KINDS = ("gemm", "conv2d")
PHASES = ("forward", "backward")
GEMM_LAYOUTS = ("nn", "nt", "tn", "tt")
TIMERS = ("cuda", "cpu")
#: dtypes the GPU families measure; calls in other dtypes are recorded but not tuned.
TUNABLE_DTYPES = ("bfloat16", "float16", "float32")
#: Family of GEMMs a job reaches through plain row-major torch.matmul.
PLAIN_GEMM_FAMILY = "torch.matmul"
#: Family of transposed and batched GEMMs (same cuBLAS/cuBLASLt candidates).
STRIDED_GEMM_FAMILY = "torch.gemm"
CONV_FAMILY = "torch.conv2d"
#: Prefix of every workload made from a capture.
NAME_PREFIX = "model"
_SHORT_DTYPE = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
_SHORT_LAYOUT = {"contiguous": "nchw", "channels_last": "cl"}
_CALL_KEYS = frozenset(
    {
        "kind",
        "aten",
        "phase",
        "dtype",
        "shape",
        "layout",
        "bias",
        "tf32",
        "calls",
        "time_s",
        "share",
        "weight_layout",
    }
)
_DOC_KEYS = frozenset({"format", "timer", "total_s", "device", "torch", "calls", "workloads"})


@dataclass(frozen=True, slots=True)
class CapturedCall:
    """Every call of one signature seen during the capture.

    ``shape`` for a GEMM: ``batch`` (1 when unbatched), ``m``, ``n``, ``k``; for a conv:
    ``input`` (N,C,H,W), ``weight`` (K,C/groups,R,S), ``stride``, ``padding``,
    ``dilation`` (pairs) and ``groups``; ``layout`` is the input's memory format and
    ``weight_layout`` the weight's (None: the same). ``time_s`` is the time of all
    ``calls`` together (GPU time on a GPU, CPU time on CPU); ``share`` is that time over
    all the time the capture measured, so the shapes worth tuning stand out. ``tf32``:
    for float32, whether the job let this op use TF32 tensor cores (always false for
    other dtypes).
    """

    kind: str
    aten: str
    phase: str
    dtype: str
    shape: dict[str, Any]
    layout: str
    bias: bool
    tf32: bool
    calls: int
    time_s: float
    share: float
    weight_layout: str | None = None

    @property
    def layouts(self) -> tuple[str, str]:
        """A conv's (input, weight) memory formats."""
        return (self.layout, self.weight_layout or self.layout)

    def to_json(self) -> dict[str, Any]:
        extra = {"weight_layout": self.weight_layout} if self.weight_layout is not None else {}
        return {
            "kind": self.kind,
            "aten": self.aten,
            "phase": self.phase,
            "dtype": self.dtype,
            "shape": self.shape,
            "layout": self.layout,
            "bias": self.bias,
            "tf32": self.tf32,
            "calls": self.calls,
            "time_s": self.time_s,
            "share": self.share,
            **extra,
        }

    @property
    def tunable(self) -> bool:
        """Whether :func:`to_workloads` makes a workload of it."""
        if self.dtype not in TUNABLE_DTYPES:
            return False
        return self.kind == "gemm" or self.phase == "forward"

    def describe(self) -> str:
        """The shape in one short string: ``8192x3072x1024 nt`` or ``64x3x224x224 * 64x3x3x3``."""
        s = self.shape
        if self.kind == "gemm":
            batch = f"{s['batch']}x " if s["batch"] > 1 else ""
            return f"{batch}{s['m']}x{s['n']}x{s['k']} {self.layout}"
        dims = "x".join(map(str, s["input"])) + " * " + "x".join(map(str, s["weight"]))
        extra = f" s{_pair_text(s['stride'])} p{_pair_text(s['padding'])}"
        if s["dilation"] != [1, 1]:
            extra += f" d{_pair_text(s['dilation'])}"
        if s["groups"] != 1:
            extra += f" g{s['groups']}"
        x_layout, w_layout = self.layouts
        if x_layout == w_layout:
            return dims + extra + (" cl" if x_layout == "channels_last" else "")
        return dims + extra + f" x:{_SHORT_LAYOUT[x_layout]} w:{_SHORT_LAYOUT[w_layout]}"


@dataclass(frozen=True, slots=True)
class CapturedSet:
    """What one capture saw: its calls (largest share first) and how it timed them."""

    calls: tuple[CapturedCall, ...]
    timer: str  # "cuda": torch.profiler GPU time; "cpu": CPU time (no GPU)
    total_s: float  # all the time the timer saw in the capture, the denominator of shares
    device: str | None = None  # GPU model the capture ran on
    torch: str | None = None  # torch version of the job
    extra: dict[str, Any] = field(default_factory=dict)

    def workloads(self, top: int | None = None, min_share: float = 0.0) -> tuple[Workload, ...]:
        return to_workloads(self.calls, top=top, min_share=min_share)

    def to_json(self) -> dict[str, Any]:
        """The ``gpuwatchd-capture/1`` document, with the workloads it makes."""
        return {
            "format": CAPTURE_FORMAT,
            "timer": self.timer,
            "total_s": self.total_s,
            "device": self.device,
            "torch": self.torch,
            "calls": [c.to_json() for c in self.calls],
            "workloads": [w.to_json() for w in self.workloads()],
        }


# -- calls -> workloads ----------------------------------------------------------------------


def to_workloads(
    calls: Iterable[CapturedCall], top: int | None = None, min_share: float = 0.0
) -> tuple[Workload, ...]:
    """One workload per distinct tuning problem, largest summed share first.

    Calls that tune the same way (a GEMM seen in forward and backward with one layout, a
    conv with and without bias in one pair of layouts) become one workload.
    ``top`` keeps the first N, ``min_share`` drops those under that share of the time.
    """
    if top is not None:
        need_int(top, "top", minimum=1)
    need_number(min_share, "min_share", minimum=0.0)
    shares: dict[str, float] = {}
    made: dict[str, Workload] = {}
    for call in calls:
        if not call.tunable:
            continue
        w = workload_for(call)
        made.setdefault(w.name, w)
        shares[w.name] = shares.get(w.name, 0.0) + call.share
    ranked = sorted(made, key=lambda name: (-shares[name], name))
    kept = [made[n] for n in ranked if shares[n] >= min_share]
    return tuple(kept[:top] if top is not None else kept)


def workload_for(call: CapturedCall) -> Workload:
    """The workload that tunes ``call``; ValueError for a call that is not tunable."""
    if not call.tunable:
        raise ValueError(
            f"call {call.aten} {call.describe()} ({call.dtype}, {call.phase}) is not tunable"
        )
    return _gemm_workload(call) if call.kind == "gemm" else _conv_workload(call)


def _gemm_workload(call: CapturedCall) -> Workload:
    s = call.shape
    dt = _SHORT_DTYPE[call.dtype]
    name = f"{NAME_PREFIX}.gemm.{dt}.{s['m']}x{s['n']}x{s['k']}"
    if s["batch"] > 1:
        name += f".b{s['batch']}"
    name += f".{call.layout}"
    params: dict[str, Any] = {}
    if call.dtype == "float32":
        params["tf32"] = call.tf32
        name += ".tf32" if call.tf32 else ".ieee"
    shape = {"m": s["m"], "n": s["n"], "k": s["k"]}
    if s["batch"] == 1 and call.layout == "nn":
        return Workload(name, "matmul", shape, call.dtype, (PLAIN_GEMM_FAMILY,), params)
    params["layout"] = call.layout
    if s["batch"] > 1:
        return Workload(
            name, "bmm", {"batch": s["batch"], **shape}, call.dtype, (STRIDED_GEMM_FAMILY,), params
        )
    return Workload(name, "matmul", shape, call.dtype, (STRIDED_GEMM_FAMILY,), params)


def _conv_workload(call: CapturedCall) -> Workload:
    s = call.shape
    dt = _SHORT_DTYPE[call.dtype]
    name = (
        f"{NAME_PREFIX}.conv.{dt}.{'x'.join(map(str, s['input']))}."
        f"{'x'.join(map(str, s['weight']))}.s{_pair_text(s['stride'])}"
        f".p{_pair_text(s['padding'])}"
    )
    if s["dilation"] != [1, 1]:
        name += f".d{_pair_text(s['dilation'])}"
    if s["groups"] != 1:
        name += f".g{s['groups']}"
    params: dict[str, Any] = {}
    if call.dtype == "float32":
        params["tf32"] = call.tf32
        name += ".tf32" if call.tf32 else ".ieee"
    x_layout, w_layout = call.layouts
    if (x_layout, w_layout) != ("contiguous", "contiguous"):
        name += (
            ".cl"
            if x_layout == w_layout
            else f".x{_SHORT_LAYOUT[x_layout]}.w{_SHORT_LAYOUT[w_layout]}"
        )
        params["input_layout"] = x_layout
        params["weight_layout"] = w_layout
    shape = {
        "input": list(s["input"]),
        "weight": list(s["weight"]),
        "stride": list(s["stride"]),
        "padding": list(s["padding"]),
        "dilation": list(s["dilation"]),
        "groups": s["groups"],
    }
    return Workload(name, "conv2d", shape, call.dtype, (CONV_FAMILY,), params)


def _pair_text(pair: Sequence[int]) -> str:
    return str(pair[0]) if pair[0] == pair[1] else f"{pair[0]}x{pair[1]}"


# -- the JSON document -----------------------------------------------------------------------


def parse_capture(doc: Any, source: str = "capture") -> CapturedSet:
    """Validate a ``gpuwatchd-capture/1`` document; ValueError naming the bad field."""
    if not isinstance(doc, Mapping):
        raise fail(source, "expected a JSON object", doc)
    if doc.get("format") != CAPTURE_FORMAT:
        raise fail(f"{source}.format", f"expected {CAPTURE_FORMAT!r}", doc.get("format"))
    _no_unknown(doc, _DOC_KEYS, source)
    timer = doc.get("timer")
    if timer not in TIMERS:
        raise fail(f"{source}.timer", f"expected one of {', '.join(TIMERS)}", timer)
    total = need_number(doc.get("total_s"), f"{source}.total_s", minimum=0.0)
    device = _optional_text(doc.get("device"), f"{source}.device")
    version = _optional_text(doc.get("torch"), f"{source}.torch")
    raw = doc.get("calls")
    if not isinstance(raw, list):
        raise fail(f"{source}.calls", "expected a list", raw)
    calls = tuple(parse_call(c, f"{source}.calls[{i}]") for i, c in enumerate(raw))
    return CapturedSet(calls, str(timer), total, device, version)


def parse_call(d: Any, where: str) -> CapturedCall:
    """One captured call; ValueError naming the bad field."""
    if not isinstance(d, Mapping):
        raise fail(where, "expected an object", d)
    _no_unknown(d, _CALL_KEYS, where)
    kind = d.get("kind")
    if kind not in KINDS:
        raise fail(f"{where}.kind", f"expected one of {', '.join(KINDS)}", kind)
    phase = d.get("phase")
    if phase not in PHASES:
        raise fail(f"{where}.phase", f"expected one of {', '.join(PHASES)}", phase)
    layouts = GEMM_LAYOUTS if kind == "gemm" else CONV_LAYOUTS
    layout = d.get("layout")
    if layout not in layouts:
        raise fail(f"{where}.layout", f"expected one of {', '.join(layouts)}", layout)
    shape_raw = d.get("shape")
    if not isinstance(shape_raw, Mapping):
        raise fail(f"{where}.shape", "expected an object", shape_raw)
    shape = _gemm_shape(shape_raw, where) if kind == "gemm" else _conv_shape(shape_raw, where)
    share = need_number(d.get("share"), f"{where}.share", minimum=0.0)
    if share > 1.0 + 1e-9:
        raise fail(f"{where}.share", "expected a fraction between 0 and 1", share)
    weight_layout = d.get("weight_layout")
    if weight_layout is not None and (kind != "conv2d" or weight_layout not in CONV_LAYOUTS):
        expected = f"one of {', '.join(CONV_LAYOUTS)} (conv2d only)"
        raise fail(f"{where}.weight_layout", f"expected {expected}", weight_layout)
    return CapturedCall(
        kind=str(kind),
        aten=need_text(d.get("aten"), f"{where}.aten"),
        phase=str(phase),
        dtype=need_text(d.get("dtype"), f"{where}.dtype"),
        shape=shape,
        layout=str(layout),
        bias=need_bool(d.get("bias"), f"{where}.bias"),
        tf32=need_bool(d.get("tf32"), f"{where}.tf32"),
        calls=need_int(d.get("calls"), f"{where}.calls", minimum=1),
        time_s=need_number(d.get("time_s"), f"{where}.time_s", minimum=0.0),
        share=share,
        weight_layout=weight_layout,
    )


def _gemm_shape(s: Mapping[str, Any], where: str) -> dict[str, Any]:
    _no_unknown(s, frozenset({"batch", "m", "n", "k"}), f"{where}.shape")
    return {
        key: need_int(s.get(key), f"{where}.shape.{key}", minimum=1)
        for key in ("batch", "m", "n", "k")
    }


def _conv_shape(s: Mapping[str, Any], where: str) -> dict[str, Any]:
    keys = ("input", "weight", "stride", "padding", "dilation", "groups")
    _no_unknown(s, frozenset(keys), f"{where}.shape")
    here = f"{where}.shape"
    out: dict[str, Any] = {
        "input": _int_list(s.get("input"), f"{here}.input", 4, 1),
        "weight": _int_list(s.get("weight"), f"{here}.weight", 4, 1),
        "stride": _int_list(s.get("stride"), f"{here}.stride", 2, 1),
        "padding": _int_list(s.get("padding"), f"{here}.padding", 2, 0),
        "dilation": _int_list(s.get("dilation"), f"{here}.dilation", 2, 1),
        "groups": need_int(s.get("groups"), f"{here}.groups", minimum=1),
    }
    if out["input"][1] != out["weight"][1] * out["groups"]:
        raise fail(
            f"{here}.weight",
            f"expected {out['input'][1]} input channels over {out['groups']} group(s)",
            out["weight"],
        )
    return out


def _int_list(v: Any, where: str, length: int, minimum: int) -> list[int]:
    ok = (
        isinstance(v, list)
        and len(v) == length
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= minimum for x in v)
    )
    if not ok:
        raise fail(where, f"expected a list of {length} integers >= {minimum}", v)
    return list(v)


def _optional_text(v: Any, where: str) -> str | None:
    return None if v is None else need_text(v, where)


def _no_unknown(d: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise fail(
            f"{where}.{unknown[0]}",
            f"unknown key (known: {', '.join(sorted(known))})",
            d[unknown[0]],
        )


def share_table(captured: CapturedSet, limit: int | None = None) -> str:
    """The calls as a text table, largest share first: what to tune, at a glance."""
    timer = "GPU" if captured.timer == "cuda" else "CPU"
    head = (
        f"{'share':>6} {timer + ' ms':>9} {'calls':>6}  {'op':<21} {'dtype':<8} {'phase':<8} shape"
    )
    lines = [head]
    rows = sorted(captured.calls, key=lambda c: -c.share)
    for c in rows[:limit] if limit is not None else rows:
        note = "" if c.tunable else "  (not tuned)"
        lines.append(
            f"{c.share * 100:5.1f}% {c.time_s * 1e3:9.3f} {c.calls:6d}  {c.aten:<21} "
            f"{c.dtype:<8} {c.phase:<8} {c.describe()}{note}"
        )
    covered = sum(c.share for c in captured.calls)
    lines.append(
        f"GEMMs and convolutions: {covered * 100:.1f}% of {captured.total_s * 1e3:.3f} ms "
        f"of {timer} time"
    )
    return "\n".join(lines)


def check_share(value: float) -> float:
    """A share as a finite fraction in [0, 1] (rounding can overshoot 1 by an ulp)."""
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"share: expected a fraction between 0 and 1, got {value!r}")
    return min(value, 1.0)
