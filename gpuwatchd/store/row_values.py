"""Values read back from the store, checked as untrusted input.

Whoever can write the store (a fleet's shared PostgreSQL, a copied SQLite file) reaches
every reader: the report, ``/api/v1/winners``, the drift and fleet ticks and every job
that applies winners. So every value read back passes these loaders: JSON bounded in
size and depth, numbers finite and integers 64-bit, text bounded and, where it becomes
an identifier, printable. Inductor lookup entries must have exactly the shape the
worker records (:func:`~gpuwatchd.tuning.worker.inductor_choices.choice_entry`):
known keys, ints and flags, strings from an allow-list; nothing else reaches torch.

Every failure is a ``ValueError`` naming the column or field: the store skips the row
with one warning.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gpuwatchd.tuning.families.inductor_mm import EXCLUSIVE_ID
from gpuwatchd.validate import fail, load_json, show

if TYPE_CHECKING:  # the sites' module is the worker's and the job's, not the daemon's
    from gpuwatchd.tuning.submitted.inductor_sites import SiteChoice

#: A JSON column's largest text: a candidate's meta is a few hundred bytes.
MAX_JSON_CHARS = 1 << 20
#: How deep lists and objects of a stored JSON value may nest.
MAX_JSON_DEPTH = 16
#: A string inside a stored JSON value (kernel names, lookup keys are far shorter).
MAX_JSON_STRING = 1 << 16
#: A text column (names, messages).
MAX_TEXT = 1 << 16
#: A name that becomes an identifier: a label, a lookup key, a workload, a host.
MAX_NAME = 1024
#: Stored integers are 64-bit (SQLite's and PostgreSQL's BIGINT).
INT_LIMIT = 1 << 63


def json_value(text: Any, what: str) -> Any:
    """A JSON column's value: at most :data:`MAX_JSON_CHARS`, :data:`MAX_JSON_DEPTH`
    deep, floats finite, ints 64-bit, strings at most :data:`MAX_JSON_STRING`."""
    if not isinstance(text, str):
        raise fail(what, "expected JSON text", text)
    value = load_json(text, what, max_bytes=MAX_JSON_CHARS, max_depth=MAX_JSON_DEPTH)
    _check_tree(value, what)
    return value


def json_object(text: Any, what: str) -> dict[str, Any]:
    value = json_value(text, what)
    if not isinstance(value, dict):
        raise fail(what, "expected a JSON object", value)
    return value


def json_list(text: Any, what: str) -> list[Any]:
    value = json_value(text, what)
    if not isinstance(value, list):
        raise fail(what, "expected a JSON list", value)
    return value


def _check_tree(value: Any, what: str) -> None:
    """Every leaf of a decoded value (already bounded in depth) within bounds."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise fail(what, "expected finite numbers", v)
        elif isinstance(v, str):
            if len(v) > MAX_JSON_STRING:
                raise fail(what, f"expected strings of at most {MAX_JSON_STRING} characters", v)
        elif isinstance(v, int) and not -INT_LIMIT <= v < INT_LIMIT:  # bools are 0 and 1
            raise fail(what, "expected 64-bit integers", v)


def text(value: Any, what: str) -> str:
    """A text column: a string of at most :data:`MAX_TEXT` characters."""
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise fail(what, f"expected text of at most {MAX_TEXT} characters", value)
    return value


def name(value: Any, what: str) -> str:
    """A name that becomes an identifier: printable text of at most :data:`MAX_NAME`."""
    if not isinstance(value, str) or len(value) > MAX_NAME or not value.isprintable():
        raise fail(what, f"expected a printable name of at most {MAX_NAME} characters", value)
    return value


# -- Inductor lookup entries -------------------------------------------------------------------

#: The ops' templates a site's choices come from (torch 2.11-2.13): anything else is refused.
TEMPLATE_IDS = frozenset(
    {
        EXCLUSIVE_ID,
        *(f"aten::{n}" for n in ("mm", "addmm", "bias_addmm", "bmm", "baddbmm")),
        *(f"aten::{n}" for n in ("mm_dtype", "bmm_dtype")),
        *(f"triton::{n}" for n in ("mm", "bmm", "mm_persistent", "mm_persistent_tma")),
        *(f"triton::{n}" for n in ("mm_dtype", "bmm_dtype", "blackwell_ws_persistent_device_tma")),
        "contiguous_mm",
        "contiguous_addmm",
        "decompose_k",
    }
)
#: Template keywords that are sizes and counts (0 to 2**20).
INT_KEYS = frozenset(
    {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_stages", "num_warps", "num_ctas",
     "NUM_SMS", "TMA_SIZE", "TILE_SIZE_A", "TILE_SIZE_B", "MIN_BLOCK_TILE_AM",
     "MIN_BLOCK_TILE_AK", "MIN_BLOCK_TILE_BK", "MIN_BLOCK_TILE_BN", "matrix_instr_nonkdim",
     "waves_per_eu", "kpack", "k_split", "EPILOGUE_SUBTILE"}
)  # fmt: skip
#: Template keywords that are flags (the TMA templates' options among them).
FLAG_KEYS = frozenset(
    {"EVEN_K", "ALLOW_TF32", "USE_FAST_ACCUM", "TMA_EXPERIMENTAL_API", "WARP_SPECIALIZE",
     "FLATTEN", "EPILOGUE_SUBTILE", "A_ROW_MAJOR", "B_ROW_MAJOR", "tma_store",
     "tma_load_for_template_epilogue", "transpose_discontiguous_tensor_descriptors_override"}
)  # fmt: skip
#: Template keywords with a few known string values.
ENUM_KEYS: dict[str, frozenset[str]] = {
    "ACC_TYPE": frozenset({"tl.float32", "tl.float16", "tl.bfloat16", "tl.float64", "tl.int32"}),
}
MAX_INT_KWARG = 1 << 20
#: The hash of a template's source, as Inductor writes it (hex digits).
_HASH = re.compile(r"[0-9a-f]{1,128}")
#: Most lookup keys a site has (one per ask of a GEMM; 2 for ``addmm``).
MAX_SITE_KEYS = 16


def inductor_entry(entry: Any, what: str) -> dict[str, Any]:
    """A lookup-table entry of exactly the recorded shape; ValueError naming the key."""
    if not isinstance(entry, Mapping):
        raise fail(what, "expected an object", entry)
    tid = entry.get("template_id")
    if tid not in TEMPLATE_IDS:
        raise fail(f"{what}.template_id", "expected a known GEMM template", tid)
    for key, value in entry.items():
        if not _entry_value_ok(key, value):
            raise fail(what, f"unknown key or value for key {show(key)}", value)
    return dict(entry)


def _entry_value_ok(key: str, value: Any) -> bool:
    if key == "template_id":
        return True
    if key == "template_hash":
        return isinstance(value, str) and _HASH.fullmatch(value) is not None
    if key == "hint_override" and value is None:
        return True
    if key in FLAG_KEYS and isinstance(value, bool):
        return True
    if key in INT_KEYS or key == "hint_override":
        ok_int = isinstance(value, int) and not isinstance(value, bool)
        return ok_int and 0 <= value <= MAX_INT_KWARG
    return isinstance(value, str) and value in ENUM_KEYS.get(key, ())


#: The meta fields of an Inductor candidate that a job's lookup table is built from.
INDUCTOR_META_KEYS = ("site_keys", "lookup_key", "lookup_entry")


def inductor_choice(meta: Mapping[str, Any], what: str = "meta") -> SiteChoice:
    """The lookup choice an ``inductor.mm`` candidate's meta records, every part checked."""
    from gpuwatchd.tuning.submitted.inductor_sites import SiteChoice

    keys = meta.get("site_keys")
    if not isinstance(keys, list) or not 1 <= len(keys) <= MAX_SITE_KEYS:
        raise fail(f"{what}.site_keys", f"expected 1 to {MAX_SITE_KEYS} lookup keys", keys)
    for i, k in enumerate(keys):
        name(k, f"{what}.site_keys[{i}]")
    key = meta.get("lookup_key")
    if not isinstance(key, str) or key not in keys:
        raise fail(f"{what}.lookup_key", "expected one of its site_keys", key)
    entry = inductor_entry(meta.get("lookup_entry"), f"{what}.lookup_entry")
    tid = entry["template_id"]
    if tid == EXCLUSIVE_ID:
        raise fail(f"{what}.lookup_entry.template_id", "expected a choice, not the marker", tid)
    return SiteChoice(tuple(keys), key, entry)
