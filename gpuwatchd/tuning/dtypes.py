"""The element types a workload may name, their spellings and sizes (torch-free).

The daemon checks a workload's ``dtype`` against this table when it is configured,
added or spooled, and sizes the operands from it; the worker maps the same names onto
torch dtypes, so a name accepted here is one the worker knows.
"""

from __future__ import annotations

#: Every accepted spelling -> its canonical name (torch's attribute name).
DTYPES: dict[str, str] = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float64": "float64",
    "fp64": "float64",
}
#: Bytes per element of each canonical dtype.
ELEMENT_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def canonical(name: str) -> str | None:
    """``bf16`` -> ``bfloat16``; None for a name not in :data:`DTYPES`."""
    return DTYPES.get(str(name).lower())
