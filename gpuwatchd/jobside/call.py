"""One call of an autotuned kernel, as Triton keys it and as a tuning request describes it.

:func:`triton_key` computes the autotuner's cache key exactly as Triton's ``Autotuner.run``
does (the key arguments' values in ``key`` order, then the dtype of every argument that
has one), so a recorded winner can be put in Triton's own cache under the key it will
look up. :func:`build_request` describes the call for the worker: arguments, the grid
each compared config launched with, and the import paths of the kernel and args factory.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpuwatchd.tuning.submitted.kernels import (
    ConfigSpec,
    KernelRequest,
    KernelRequestError,
    Scalar,
    base_function,
    config_spec,
    describe_arg,
    parse_import_path,
)
from gpuwatchd.tuning.types import Regime, Versions

#: Launch keywords Triton's ``kernel[grid](...)`` adds; never kernel arguments.
LAUNCH_KEYS = ("grid", "warmup")


@dataclass(frozen=True, slots=True)
class TritonKey:
    """Triton's autotuning cache key for one call, and its parts."""

    values: tuple[Any, ...]  # exactly what Triton's Autotuner uses as its cache key
    named: dict[str, Any]  # key argument name -> value, for the key names the call passed
    dtypes: tuple[str, ...]  # str(arg.dtype) of every argument with a dtype, in order


def bound_arguments(
    arg_names: Sequence[str], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """The call's kernel arguments by name: positional ones, then keyword ones."""
    all_args = {**dict(zip(arg_names, args, strict=False)), **kwargs}
    return {k: v for k, v in all_args.items() if k in arg_names}


def triton_key(
    arg_names: Sequence[str], keys: Sequence[str], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> TritonKey:
    """The key ``triton.runtime.autotuner.Autotuner.run`` computes for this call."""
    bound = bound_arguments(arg_names, args, kwargs)
    named_values = [bound[k] for k in keys if k in bound]
    dtypes = tuple(str(v.dtype) for v in bound.values() if hasattr(v, "dtype"))
    named = {k: bound[k] for k in keys if k in bound}
    return TritonKey(tuple(named_values) + dtypes, named, dtypes)


def import_path(kernel: Any) -> tuple[str, str]:
    """(module, qualname) under which the tuning worker finds ``kernel``.

    KernelRequestError when the worker could not import it: a kernel defined in a script
    (``__main__``) or inside a function, or a module attribute bound to something else.
    """
    fn = base_function(kernel)
    module, qualname = fn.__module__, fn.__qualname__
    if module == "__main__":
        raise KernelRequestError(
            f"{qualname} is defined in the script being run (__main__): the tuning worker "
            "cannot import it; move the kernel into an importable module"
        )
    if "<locals>" in qualname:
        raise KernelRequestError(
            f"{module}.{qualname} is defined inside a function: the tuning worker cannot "
            "import it; define it at module level"
        )
    found = resolve(module, qualname)
    if found is not kernel:
        raise KernelRequestError(
            f"{module}.{qualname} names {type(found).__name__}, not this autotuned kernel: "
            "bind the decorated kernel to the function's own name"
        )
    return module, qualname


def resolve(module: str, qualname: str) -> Any:
    """``module.qualname`` from the already imported module (None when it is not there)."""
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def factory_path(factory: str | Callable[..., Any] | None) -> str | None:
    """An args factory as ``module:qualname`` (a string is checked, a function converted)."""
    if factory is None:
        return None
    if isinstance(factory, str):
        parse_import_path(factory, "args_factory")
        return factory
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        raise ValueError(f"args_factory: expected a module-level function, got {factory!r}")
    if module == "__main__":
        raise ValueError("args_factory: defined in __main__; the tuning worker cannot import it")
    return f"{module}:{qualname}"


def evaluate_grid(grid: Any, meta: Mapping[str, Any]) -> tuple[int, ...]:
    """The launch grid for one config: ``grid(meta)`` when callable, as Triton does."""
    value = grid(dict(meta)) if callable(grid) else grid
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, tuple | list) or not 1 <= len(value) <= 3:
        raise KernelRequestError(f"grid: expected 1 to 3 integers, got {value!r}")
    out = []
    for g in value:
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise KernelRequestError(f"grid: expected integers >= 0, got {value!r}")
        out.append(int(g))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class CallFacts:
    """What the wrapper knows about the kernel, independent of one call."""

    module: str
    qualname: str
    identity: str
    arg_names: tuple[str, ...]
    keys: tuple[str, ...]
    reset_to_zero: tuple[str, ...]
    restore_value: tuple[str, ...]
    args_factory: str | None


def build_request(
    facts: CallFacts,
    key: TritonKey,
    compared: Sequence[Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    regime: Regime,
    gpu_model: str,
    versions: Versions,
    job_default: Any = None,
) -> KernelRequest:
    """The tuning request for one call over the configs Triton compared.

    ``job_default`` is the config Triton picked for the job (one of ``compared``): the
    request names it so the daemon measures it as the job's default.

    KernelRequestError (one line) when the call cannot be reproduced: an argument or key
    value that is not data, a grid that does not evaluate, a launch option that is code.
    """
    bound = bound_arguments(facts.arg_names, args, kwargs)
    options = {k: v for k, v in kwargs.items() if k not in facts.arg_names and k not in LAUNCH_KEYS}
    launch_options: dict[str, Scalar] = {}
    for k, v in options.items():
        if v is not None and not isinstance(v, bool | int | float | str):
            raise KernelRequestError(f"launch option {k}={v!r}: not a number, string or bool")
        launch_options[k] = v
    grid = kwargs.get("grid")
    if grid is None:
        raise KernelRequestError("the call has no grid: launch the kernel as kernel[grid](...)")
    configs: list[ConfigSpec] = []
    seen: set[str] = set()
    for cfg in compared:
        spec = config_spec(cfg)
        if spec.label in seen:
            continue
        seen.add(spec.label)
        meta = {**bound, **launch_options, **_all_kwargs(cfg)}
        try:
            g = evaluate_grid(grid, meta)
        except KernelRequestError:
            raise
        except Exception as e:  # the user's grid function: any error means no request
            why = f"{type(e).__name__}: {e}"
            raise KernelRequestError(f"grid for config {spec.label}: {why}") from None
        configs.append(replace(spec, grid=g))
    key_values: dict[str, Scalar] = {}
    for name, value in key.named.items():
        if value is not None and not isinstance(value, bool | int | float | str):
            raise KernelRequestError(f"key {name}={value!r}: not a number, string or bool")
        key_values[name] = value
    return KernelRequest(
        module=facts.module,
        qualname=facts.qualname,
        identity=facts.identity,
        key_names=facts.keys,
        key_values=key_values,
        key_dtypes=key.dtypes,
        configs=tuple(configs),
        args=tuple(describe_arg(n, v) for n, v in bound.items()),
        regime=regime,
        gpu_model=gpu_model,
        versions=versions,
        reset_to_zero=facts.reset_to_zero,
        restore_value=facts.restore_value,
        launch_options=launch_options,
        args_factory=facts.args_factory,
        origin={"pid": os.getpid(), "python": sys.executable},
        job_default=None if job_default is None else config_spec(job_default).label,
    )


def _all_kwargs(cfg: Any) -> dict[str, Any]:
    all_kwargs = getattr(cfg, "all_kwargs", None)
    if callable(all_kwargs):
        return dict(all_kwargs())
    return dict(getattr(cfg, "kwargs", {}))
