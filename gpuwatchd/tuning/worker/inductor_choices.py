"""gpuwatchd's two Inductor choices handlers (subclasses of Inductor's ``LookupTableChoices``).

Imported only through :mod:`gpuwatchd.tuning.worker.inductor`, after it checked that this
torch has the lookup table. The classes live at module level so Inductor can name them
in its cache key (``config.inductor_choices_class`` is pickled by reference).

- :class:`RecordingChoices` lets Inductor generate every choice of every GEMM it lowers,
  records them as :class:`GemmSite` objects and hands back one choice per GEMM (ATen's
  when there is one), so a recording compile benchmarks nothing.
- :class:`TableChoices` is the stock lookup plus the :data:`EXCLUSIVE_ID` marker: a key
  marked exclusive gives only the choices listed for it, none otherwise. It counts what
  it handed out per ask (``handed``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from torch._inductor.lookup_table import LookupTableChoices

from gpuwatchd.tuning.submitted.inductor_sites import (
    EXCLUSIVE_ID,
    GemmSite,
    SiteCall,
    TensorDesc,
    lookup_key,
    merge_sites,
)

RECORDING_UUID = "gpuwatchd-recording/1"
TABLE_UUID = "gpuwatchd-lookup-table/1"


@dataclass(slots=True)
class _SiteBuilder:
    op_name: str
    inputs: tuple[TensorDesc, ...]
    scalars: dict[str, Any]
    calls: list[SiteCall] = field(default_factory=list)
    answered: bool = False  # one choice was handed back for this GEMM

    def site(self) -> GemmSite:
        return GemmSite(self.op_name, self.inputs, self.scalars, tuple(self.calls))


class RecordingChoices(LookupTableChoices):  # type: ignore[misc]
    """Generates every choice, records it, hands back one per GEMM."""

    def __init__(self) -> None:
        super().__init__()
        self.builders: dict[tuple[Any, ...], _SiteBuilder] = {}

    def uuid(self) -> str:
        return RECORDING_UUID

    def _get_lookup_table(self) -> dict[str, list[dict[str, Any]]]:
        return {}  # record what Inductor generates on its own

    def _finalize_template_configs(  # type: ignore[override]
        self, template_choices: Any, kernel_inputs: Any, templates: Any, op_name: str,
        *args: Any, **kwargs: Any,
    ) -> list[Any]:  # fmt: skip
        ktcs = list(
            super()._finalize_template_configs(
                template_choices, kernel_inputs, templates, op_name, *args, **kwargs
            )
        )
        inputs = describe_inputs(kernel_inputs)
        scalars = dict(getattr(kernel_inputs, "_scalars", None) or {})
        # One GEMM asks several times (ATen with the 1-D bias, templates with it expanded);
        # its matrix operands are the same IR nodes each time, another GEMM's are not.
        instance = (op_name, *(id(n) for n in kernel_inputs.nodes()[-2:]))
        builder = self.builders.get(instance)
        if builder is None:
            builder = self.builders[instance] = _SiteBuilder(op_name, inputs, scalars)
        key = inductor_key(self, kernel_inputs, op_name, inputs, scalars)
        entries = tuple(e for e in (choice_entry(k) for k in ktcs) if e is not None)
        builder.calls.append(SiteCall(key, tuple(t.uid for t in templates), entries))
        if builder.answered or not ktcs:
            return []
        builder.answered = True
        aten = [k for k in ktcs if str(k.template.uid).startswith("aten::")]
        return [(aten or ktcs)[0]]

    def sites(self) -> list[GemmSite]:
        return merge_sites(b.site() for b in self.builders.values())


class TableChoices(LookupTableChoices):  # type: ignore[misc]
    """The stock lookup, plus: a key marked exclusive gives only its listed choices."""

    def __init__(self) -> None:
        super().__init__()
        self.handed: list[tuple[str, str, int]] = []  # (op, key, choices handed out)

    def uuid(self) -> str:
        return TABLE_UUID

    def _finalize_template_configs(  # type: ignore[override]
        self, template_choices: Any, kernel_inputs: Any, templates: Any, op_name: str,
        *args: Any, **kwargs: Any,
    ) -> list[Any]:  # fmt: skip
        table = self._get_lookup_table()
        listed: list[dict[str, Any]] = []
        hit_key = ""
        for key in self.make_lookup_key_variants(kernel_inputs, op_name):
            if key is not None and key in table:
                listed, hit_key = table[key], key
                break
        uids = {t.uid for t in templates}
        exclusive = any(e.get("template_id") == EXCLUSIVE_ID for e in listed)
        if exclusive and not any(e.get("template_id") in uids for e in listed):
            self.handed.append((op_name, hit_key, 0))
            return []
        out = list(
            super()._finalize_template_configs(
                template_choices, kernel_inputs, templates, op_name, *args, **kwargs
            )
        )
        self.handed.append((op_name, hit_key, len(out)))
        return out


def describe_inputs(kernel_inputs: Any) -> tuple[TensorDesc, ...]:
    """The inputs as Inductor keys them (hinted sizes and strides)."""
    out = []
    for dtype, size, stride in zip(
        kernel_inputs.dtypes(),
        kernel_inputs.shapes_hinted(),
        kernel_inputs.strides_hinted(),
        strict=True,
    ):
        name = str(dtype).removeprefix("torch.")
        out.append(TensorDesc(name, tuple(int(x) for x in size), tuple(int(x) for x in stride)))
    return tuple(out)


def inductor_key(
    handler: Any,
    kernel_inputs: Any,
    op_name: str,
    inputs: tuple[TensorDesc, ...],
    scalars: dict[str, Any],
) -> str:
    """The device-agnostic key, from Inductor's own code where it gives one.

    ``make_lookup_key`` answers None off CUDA; then Inductor's input-key function is
    used directly, and :func:`lookup_key` only when neither exists.
    """
    key = handler.make_lookup_key(kernel_inputs, op_name, include_device=False)
    if isinstance(key, str):
        return key
    make = getattr(handler, "_generate_kernel_inputs_key", None)
    if make is not None:
        return f"{make(kernel_inputs)}+{op_name}"
    return lookup_key(inputs, scalars, op_name)


def choice_entry(ktc: Any) -> dict[str, Any] | None:
    """A generated choice as a lookup-table entry; None when its kwargs are not JSON."""
    params = ktc.params
    to_dict = getattr(params, "to_serializeable_dict", None) or params.to_kwargs
    entry: dict[str, Any] = {"template_id": str(ktc.template.uid), **to_dict()}
    src_hash = getattr(ktc.template, "src_hash", None)
    if isinstance(src_hash, str) and src_hash:
        entry["template_hash"] = src_hash
    for value in entry.values():
        if value is not None and not isinstance(value, str | int | float | bool):
            return None
    try:
        json.dumps(entry)
    except (TypeError, ValueError):
        return None
    return entry
