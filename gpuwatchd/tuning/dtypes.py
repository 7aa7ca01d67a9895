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
#: Bytes per element of the other torch dtypes a user's kernel argument may have; a name
#: in neither table is sized at :data:`WIDEST_ELEMENT_BYTES` (the worker refuses what
#: torch does not know).
OTHER_ELEMENT_BYTES: dict[str, int] = {
    "bool": 1, "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "int16": 2, "uint16": 2, "int32": 4,
    "uint32": 4, "int64": 8, "uint64": 8, "complex64": 8, "complex128": 16,
}  # fmt: skip
WIDEST_ELEMENT_BYTES = 16


def element_bytes(name: str) -> int:
    """Bytes per element of a torch dtype named as torch names it (``float16``, ``int32``)."""
    return ELEMENT_BYTES.get(name) or OTHER_ELEMENT_BYTES.get(name, WIDEST_ELEMENT_BYTES)


def storage_elements(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Elements of the storage a strided view of ``shape`` reaches (0 for an empty one)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, strides, strict=True))


def canonical(name: str) -> str | None:
    """``bf16`` -> ``bfloat16``; None for a name not in :data:`DTYPES`."""
    return DTYPES.get(str(name).lower())
