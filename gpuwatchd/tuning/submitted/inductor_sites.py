"""GEMMs as torch.compile's Inductor sees them, and the lookup table that hands them winners.

Inductor lowers every ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` of a compiled graph by
asking its choices handler for candidate kernels (ATen's cuBLAS call, Triton template
configs, ...) and, under ``max-autotune``, benchmarking them at compile time. Its
supported lookup table (``torch._inductor.config.lookup_table.table`` with
``torch._inductor.lookup_table.LookupTableChoices``) replaces that: a key made of the
inputs' dtypes, sizes and strides, the op's scalars and the op name maps to the
choices to consider; with one choice there is nothing to benchmark.

One GEMM of a graph can ask more than once, under different keys: ``addmm`` asks for
ATen choices with the 1-D bias and for Triton templates with the bias expanded to
``[M, N]`` (stride ``[0, 1]``). A :class:`GemmSite` records every ask ("call") of one
GEMM with the key Inductor used and the choices it generated; the table gpuwatchd
builds (:func:`lookup_table`) puts the winning choice under its call's key and a
:data:`EXCLUSIVE` marker under every key of the site, which gpuwatchd's choices handler
reads as "nothing else": the site compiles to exactly the winner. Inductor's own
``LookupTableChoices`` ignores the marker (an entry for a template not in use).

Key format (torch 2.11-2.13, ``LookupTableChoices._generate_kernel_inputs_key`` and
``make_lookup_key``), reproduced by :func:`lookup_key` and checked against Inductor's
own code in the tests::

    ((torch.float16, [64, 128], [128, 1]), (torch.float16, [128, 256], [256, 1]))+mm
    ((torch.bfloat16, [256], [1]), ...)+alpha=1&beta=1+addmm

Plain data only (no torch): the daemon, the worker and the job share it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwatchd.tuning.families.inductor_mm import EXCLUSIVE_ID, FAMILY
from gpuwatchd.tuning.types import Workload
from gpuwatchd.validate import fail, is_finite, need_text

#: Workload op of Inductor GEMM sites (its family: FAMILY).
OP = "inductor.gemm"
#: Inductor op names the worker can reproduce (one torch call each).
OP_NAMES = ("mm", "addmm", "bmm", "baddbmm")
#: Matrix operands per op, after any bias input.
_ARITY = {"mm": 2, "addmm": 3, "bmm": 2, "baddbmm": 3}
#: Marks a key as fully described by the table: templates not listed give no choice.
EXCLUSIVE: dict[str, Any] = {"template_id": EXCLUSIVE_ID}
DTYPES = ("bfloat16", "float16", "float32")
_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
_SHAPE_KEYS = frozenset({"op_name", "inputs", "scalars", "keys"})


def is_default_choice(entry: Mapping[str, Any], op_name: str) -> bool:
    """Whether ``entry`` is what torch.compile lowers ``op_name`` to without max-autotune:
    ATen's own op (``aten::addmm``), the one choice it has then. ``aten::bias_addmm`` and
    every template are max-autotune's extras: they replace it only where measured faster
    beyond the noise."""
    return entry.get("template_id") == f"aten::{op_name}"


@dataclass(frozen=True, slots=True)
class TensorDesc:
    """One input as Inductor keys it: dtype (torch attribute name), sizes, strides."""

    dtype: str
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "size": list(self.size), "stride": list(self.stride)}

    def key_part(self) -> str:
        """``(torch.float16, [64, 128], [128, 1])`` as ``str`` of Inductor's tuple prints it."""
        return f"(torch.{self.dtype}, {list(self.size)}, {list(self.stride)})"


@dataclass(frozen=True, slots=True)
class SiteCall:
    """One ask of a GEMM site: the key, the templates in use, the choices generated.

    ``choices`` are lookup-table entries: ``{"template_id": ..., **kwargs}`` plus
    ``template_hash`` where the template has one.
    """

    key: str
    templates: tuple[str, ...]
    choices: tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class GemmSite:
    """One GEMM of a compiled graph: its op, inputs (of its first ask) and every ask."""

    op_name: str
    inputs: tuple[TensorDesc, ...]
    scalars: dict[str, Any]
    calls: tuple[SiteCall, ...]
    count: int = 1  # how many GEMMs of the graph(s) had exactly these keys

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.key for c in self.calls))

    def choices(self) -> list[tuple[str, dict[str, Any]]]:
        """Every choice Inductor generated for the site, with the key it belongs to."""
        return [(c.key, dict(e)) for c in self.calls for e in c.choices]

    def workload(self) -> Workload:
        """The ``inductor.mm`` workload that tunes this site (choices found on the GPU)."""
        return Workload(
            name=site_name(self.op_name, self.inputs, self.keys),
            op=OP,
            shape={
                "op_name": self.op_name,
                "inputs": [d.to_json() for d in self.inputs],
                "scalars": dict(self.scalars),
                "keys": list(self.keys),
            },
            dtype=self.inputs[-1].dtype,
            families=(FAMILY,),
        )


def lookup_key(inputs: Sequence[TensorDesc], scalars: Mapping[str, Any], op_name: str) -> str:
    """Inductor's device-agnostic lookup key for these inputs, scalars and op."""
    parts = [d.key_part() for d in inputs]
    key = "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
    if scalars:
        key += "+" + "&".join(f"{k}={scalars[k]}" for k in sorted(scalars))
    return f"{key}+{op_name}"


def site_name(op_name: str, inputs: Sequence[TensorDesc], keys: Sequence[str]) -> str:
    """``inductor.addmm.bf16.8192x1024x4096.<hash>``: readable dims, exact identity."""
    a, b = inputs[-2], inputs[-1]
    m, k = a.size[-2], a.size[-1]
    n = b.size[-1]
    batch = f"b{a.size[0]}." if len(a.size) == 3 else ""
    digest = hashlib.sha256("\n".join(keys).encode("utf-8")).hexdigest()[:10]
    return f"inductor.{op_name}.{_SHORT.get(b.dtype, b.dtype)}.{batch}{m}x{n}x{k}.{digest}"


def merge_sites(sites: Iterable[GemmSite]) -> list[GemmSite]:
    """Sites with the same keys are one tuning problem: keep the first, sum the counts."""
    by_keys: dict[tuple[str, ...], GemmSite] = {}
    for s in sites:
        seen = by_keys.get(s.keys)
        by_keys[s.keys] = s if seen is None else _with_count(seen, seen.count + s.count)
    return list(by_keys.values())


def _with_count(site: GemmSite, count: int) -> GemmSite:
    return GemmSite(site.op_name, site.inputs, site.scalars, site.calls, count)


# -- workloads -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SiteSpec:
    """A validated ``inductor.gemm`` workload: what the worker compiles."""

    op_name: str
    inputs: tuple[TensorDesc, ...]
    scalars: dict[str, Any]
    keys: tuple[str, ...]


def parse_site_workload(workload: Workload) -> SiteSpec:
    """Validate an ``inductor.gemm`` workload; ValueError naming the bad field."""
    where = f"workload {workload.name!r}"
    if workload.op != OP:
        raise fail(f"{where}: op", f"expected {OP!r}", workload.op)
    shape = workload.shape
    unknown = sorted(set(shape) - _SHAPE_KEYS)
    if unknown:
        raise fail(f"{where}: shape.{unknown[0]}", "unknown key", shape[unknown[0]])
    op_name = shape.get("op_name")
    if op_name not in OP_NAMES:
        raise fail(f"{where}: shape.op_name", f"expected one of {', '.join(OP_NAMES)}", op_name)
    raw = shape.get("inputs")
    if not isinstance(raw, list) or len(raw) != _ARITY[op_name]:
        raise fail(
            f"{where}: shape.inputs", f"expected {_ARITY[op_name]} inputs for {op_name}", raw
        )
    inputs = tuple(_tensor_desc(d, f"{where}: shape.inputs[{i}]") for i, d in enumerate(raw))
    rank = 3 if op_name in ("bmm", "baddbmm") else 2
    for i, d in enumerate(inputs[-2:]):
        if len(d.size) != rank:
            raise fail(f"{where}: shape.inputs[{len(inputs) - 2 + i}].size",
                       f"expected {rank} dimensions for {op_name}", list(d.size))  # fmt: skip
    a, b = inputs[-2], inputs[-1]
    if a.size[-1] != b.size[-2] or a.size[:-2] != b.size[:-2]:
        raise fail(f"{where}: shape.inputs", "operand sizes do not multiply",
                   [list(a.size), list(b.size)])  # fmt: skip
    scalars = shape.get("scalars", {})
    if not isinstance(scalars, Mapping) or not all(is_finite(v) for v in scalars.values()):
        raise fail(f"{where}: shape.scalars", "expected an object of numbers", scalars)
    keys = shape.get("keys")
    if not isinstance(keys, list) or not keys:
        raise fail(f"{where}: shape.keys", "expected a non-empty list of lookup keys", keys)
    for i, k in enumerate(keys):
        need_text(k, f"{where}: shape.keys[{i}]")
        if not k.endswith("+" + op_name):
            raise fail(f"{where}: shape.keys[{i}]", f"expected a key ending in +{op_name}", k)
    first = lookup_key(inputs, scalars, op_name)
    if keys[0] != first:
        raise fail(f"{where}: shape.keys[0]", f"expected {first!r} (the inputs' own key)", keys[0])
    return SiteSpec(op_name, inputs, dict(scalars), tuple(keys))


def _tensor_desc(d: Any, where: str) -> TensorDesc:
    if not isinstance(d, Mapping):
        raise fail(where, "expected an object with dtype, size, stride", d)
    dtype = d.get("dtype")
    if dtype not in DTYPES:
        raise fail(f"{where}.dtype", f"expected one of {', '.join(DTYPES)}", dtype)
    size, stride = d.get("size"), d.get("stride")
    for name, v, low in (("size", size, 1), ("stride", stride, 0)):
        ok = (
            isinstance(v, list)
            and 1 <= len(v) <= 3
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= low for x in v)
        )
        if not ok:
            raise fail(f"{where}.{name}", f"expected 1 to 3 integers >= {low}", v)
    assert isinstance(size, list) and isinstance(stride, list)
    if len(size) != len(stride):
        raise fail(f"{where}.stride", f"expected {len(size)} strides", stride)
    return TensorDesc(str(dtype), tuple(size), tuple(stride))


# -- the lookup table ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SiteChoice:
    """The choice picked for one site: its keys, the key it belongs to, its table entry."""

    site_keys: tuple[str, ...]
    key: str
    entry: dict[str, Any]


def lookup_table(picks: Iterable[SiteChoice]) -> dict[str, list[dict[str, Any]]]:
    """Inductor's ``lookup_table.table`` compiling each site to exactly its pick.

    The pick's entry goes under its own key; every key of the site also gets the
    :data:`EXCLUSIVE` marker. A key claimed by two different picks keeps the first
    (both would make Inductor benchmark the two).
    """
    table: dict[str, list[dict[str, Any]]] = {}
    for pick in picks:
        if pick.key not in pick.site_keys:
            raise ValueError(f"lookup key {pick.key!r} is not one of its site's keys")
        if any(_is_choice(e) for k in pick.site_keys for e in table.get(k, [])):
            continue  # the site (or one sharing a key with it) is already decided
        for k in pick.site_keys:
            table.setdefault(k, [])
        table[pick.key].append(dict(pick.entry))
        for k in pick.site_keys:
            table[k].append(dict(EXCLUSIVE))
    return table


def _is_choice(entry: Mapping[str, Any]) -> bool:
    return entry.get("template_id") != EXCLUSIVE_ID


def check_table(table: Any) -> dict[str, list[dict[str, Any]]]:
    """A lookup table as Inductor requires it: string keys, lists of JSON objects that
    each name a ``template_id``. ValueError naming the bad entry."""
    if not isinstance(table, Mapping):
        raise fail("table", "expected an object", table)
    for key, entries in table.items():
        need_text(key, "table key")
        if not isinstance(entries, list):
            raise fail(f"table[{key!r}]", "expected a list of entries", entries)
        for i, e in enumerate(entries):
            if not isinstance(e, Mapping) or not isinstance(e.get("template_id"), str):
                raise fail(f"table[{key!r}][{i}]", "expected an object with a template_id", e)
            try:
                json.dumps(e)
            except (TypeError, ValueError):
                raise fail(f"table[{key!r}][{i}]", "expected JSON values", e) from None
    return {str(k): [dict(e) for e in v] for k, v in table.items()}


#: Entry fields the label shows itself, or that follow from the others.
_LABEL_QUIET = frozenset(
    {"template_id", "template_hash", "BLOCK_M", "BLOCK_N", "BLOCK_K", "num_stages",
     "num_warps", "GROUP_M", "EVEN_K", "ALLOW_TF32", "USE_FAST_ACCUM", "ACC_TYPE",
     "hint_override"}
)  # fmt: skip


def entry_label(entry: Mapping[str, Any]) -> str:
    """A short name for a choice: ``aten::mm``, ``triton::mm 128x128x64 s3 w8 g8``."""
    tid = str(entry.get("template_id", "?"))
    blocks = [entry.get(k) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")]
    if not all(isinstance(b, int) for b in blocks):
        extra = sorted(
            (k, v) for k, v in entry.items() if k not in ("template_id", "template_hash")
        )
        return " ".join([tid, ",".join(f"{k}={v}" for k, v in extra)]) if extra else tid
    label = f"{tid} {'x'.join(map(str, blocks))}"
    for key, short in (("num_stages", "s"), ("num_warps", "w"), ("GROUP_M", "g")):
        if isinstance(entry.get(key), int):
            label += f" {short}{entry[key]}"
    rest = sorted(k for k in entry if k not in _LABEL_QUIET and entry[k] not in (None, False))
    return label + "".join(f" {k}={entry[k]}" for k in rest)
