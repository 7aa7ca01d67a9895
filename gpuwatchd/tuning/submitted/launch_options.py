"""The launch keywords a tuning request may carry besides the kernel's own arguments.

Triton takes its compile options as launch keywords too: ``ir_override`` compiles and
runs a file it names, ``ptx_options`` becomes ptxas's command line, ``extern_libs``
links the libraries it names. A request is a job's data, so it carries only the
keywords of :data:`LAUNCH_OPTIONS`, each with a typed, bounded value (no paths, no tool
flags). The daemon refuses anything else where a request is parsed (control socket,
spool, config); the worker checks again, just before it launches, that every keyword is
a parameter of the imported kernel or one of these (:func:`check_keywords`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatchd.validate import ErrorType, fail

#: A launch option's value.
OptionValue = int | bool | str


@dataclass(frozen=True, slots=True)
class LaunchOption:
    """One allowed keyword: an int within [low, high], a bool, or one of ``choices``."""

    kind: type
    low: int = 0
    high: int = 0
    choices: tuple[str, ...] = ()

    def what(self) -> str:
        if self.kind is bool:
            return "expected true or false"
        if self.kind is int:
            return f"expected an integer in [{self.low}, {self.high}]"
        return f"expected one of {', '.join(self.choices)}"

    def accepts(self, value: Any) -> bool:
        if self.kind is bool:
            return isinstance(value, bool)
        if self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
            return ok and self.low <= value <= self.high
        return isinstance(value, str) and value in self.choices


#: The keywords Triton's launch takes that shape how a kernel runs and read nothing
#: from disk: warps, pipeline stages, CTAs per cluster, a register cap, fused
#: multiply-add, cooperative and programmatic-dependent launch, dot precision.
LAUNCH_OPTIONS: Mapping[str, LaunchOption] = {
    "num_warps": LaunchOption(int, 1, 64),
    "num_stages": LaunchOption(int, 0, 16),
    "num_ctas": LaunchOption(int, 1, 16),
    "maxnreg": LaunchOption(int, 1, 255),
    "enable_fp_fusion": LaunchOption(bool),
    "launch_cooperative_grid": LaunchOption(bool),
    "launch_pdl": LaunchOption(bool),
    "default_dot_input_precision": LaunchOption(str, choices=("tf32", "tf32x3", "ieee")),
}


def _known() -> str:
    return ", ".join(LAUNCH_OPTIONS)


def parse_launch_options(
    value: Any, where: str = "request.launch_options", error: ErrorType = ValueError
) -> dict[str, OptionValue]:
    """``value`` as launch options: an object of allowed keywords and typed values.

    ``error`` (one line naming the keyword) for anything else.
    """
    if not isinstance(value, Mapping):
        raise fail(where, "expected an object", value, error)
    out: dict[str, OptionValue] = {}
    for name, v in value.items():
        option = LAUNCH_OPTIONS.get(name) if isinstance(name, str) else None
        if option is None:
            what = f"not an allowed launch option (allowed: {_known()})"
            raise fail(where, what, name, error)
        if not option.accepts(v):
            raise fail(f"{where}.{name}", option.what(), v, error)
        out[name] = v
    return out


def kernel_parameters(fn: Any) -> frozenset[str]:
    """The parameter names of the Python function ``fn`` (the kernel under Triton's wrappers)."""
    return frozenset(inspect.signature(fn).parameters)


def check_keywords(
    names: Iterable[str], parameters: frozenset[str], where: str, error: ErrorType = ValueError
) -> None:
    """``error`` unless every keyword is one of the kernel's ``parameters`` or an allowed
    launch option: nothing else ever reaches Triton's launch."""
    for name in names:
        if name not in parameters and name not in LAUNCH_OPTIONS:
            what = f"neither a parameter of the kernel nor an allowed launch option ({_known()})"
            raise fail(where, what, name, error)
