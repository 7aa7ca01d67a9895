"""Users' own ``@triton.autotune`` kernels: the tuning-request wire format and kernel identity.

A job that misses a recorded winner files a :class:`KernelRequest`: enough to reproduce
the call in the tuning worker (the kernel's import path, its configs with the launch
grid each one used, the key values, every argument's kind and description). The daemon
validates it (:meth:`KernelRequest.loads`, one-line :class:`KernelRequestError`), checks
its names against :mod:`gpuwatchd.tuning.submitted.trust` and tunes it as an
ordinary :class:`~gpuwatchd.tuning.types.Workload` (:meth:`KernelRequest.to_workload`),
so the store, the report and ``/api/v1/winners`` carry user kernels unchanged.

Identity: :func:`kernel_identity` hashes the kernel's source, its config list and its
key names. An edited kernel (or config list) is a new kernel; its old winners name
another identity and are never used. Plain data only: no torch, no Triton import; the
helpers that read Triton objects go by attribute (``.fn``, ``.kwargs``, ``.num_warps``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.tuning.families.triton_user import FAMILY
from gpuwatchd.tuning.submitted.launch_options import parse_launch_options
from gpuwatchd.tuning.types import Regime, Versions, Workload
from gpuwatchd.tuning.versions import same_version
from gpuwatchd.validate import (
    ErrorType,
    fail,
    field_error,
    is_number,
    load_json,
    need_int,
    need_object,
    need_text,
    require,
)

#: Identifies the request document shape; bump on an incompatible change.
REQUEST_FORMAT = "gpuwatchd-kernel-request/1"
#: The largest request accepted (socket, spool file): far more than hundreds of configs.
MAX_REQUEST_BYTES = 256 * 1024
#: Workload names longer than this carry a hash of the key instead of the key itself.
MAX_NAME_CHARS = 240
ARG_KINDS = ("tensor", "int", "float", "bool", "str", "none")
#: Config fields besides ``kwargs``, in the order Triton's ``Config`` takes them.
CONFIG_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")

Scalar = int | float | bool | str | None

_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_HEX64_RE = re.compile(r"[0-9a-f]{64}")


class KernelRequestError(ValueError):
    """A tuning request (or a kernel that cannot be described) named by one line."""


# -- field checks ----------------------------------------------------------------------------


def _fail(where: str, what: str, value: Any) -> KernelRequestError:
    return KernelRequestError(field_error(where, what, value))


def _obj(
    value: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    return need_object(value, where, required, optional, error=KernelRequestError)


def _text(value: Any, where: str) -> str:
    return need_text(value, where, error=KernelRequestError)


def _int(value: Any, where: str, minimum: int | None = 0) -> int:
    number = need_int(value, where, error=KernelRequestError)
    if minimum is not None:
        ok = number >= minimum
        require(ok, where, f"expected an integer >= {minimum}", value, KernelRequestError)
    return number


def _opt_int(value: Any, where: str, minimum: int = 1) -> int | None:
    return None if value is None else _int(value, where, minimum)


def _scalar(value: Any, where: str) -> Scalar:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise _fail(where, "expected a JSON scalar (finite number, string, true/false, null)", value)


def _names(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise _fail(where, "expected a list of names", value)
    return tuple(_text(v, f"{where}[{i}]") for i, v in enumerate(value))


def module_name(value: Any, where: str, error: ErrorType = KernelRequestError) -> str:
    """A dotted module name (``pkg.kernels``); ``error`` naming ``where`` otherwise."""
    if not isinstance(value, str) or not _MODULE_RE.fullmatch(value):
        raise fail(where, "expected a dotted module name like 'pkg.kernels'", value, error)
    return value


def _module(value: Any, where: str) -> str:
    return module_name(value, where)


def _qualname(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _MODULE_RE.fullmatch(value):
        raise _fail(where, "expected a module-level name like 'kernel' or 'Ops.kernel'", value)
    return value


def parse_import_path(value: Any, where: str) -> tuple[str, str]:
    """``"pkg.mod:qual.name"`` -> ("pkg.mod", "qual.name"); one-line error otherwise."""
    if not isinstance(value, str) or value.count(":") != 1:
        raise _fail(where, "expected 'module:qualname'", value)
    module, qualname = value.split(":")
    return _module(module, where), _qualname(qualname, where)


# -- configs ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConfigSpec:
    """One ``triton.Config``: its meta-parameters, options, and the grid it launched with.

    ``pre_hook`` records only that the config has one (code is not data); the worker
    uses the imported kernel's own config objects, hooks included. ``grid`` is the
    launch grid evaluated for this config's meta-parameters (None in identity hashes).
    """

    kwargs: dict[str, Scalar]
    num_warps: int | None = None
    num_stages: int | None = None
    num_ctas: int | None = None
    maxnreg: int | None = None
    pre_hook: bool = False
    grid: tuple[int, ...] | None = None

    @property
    def label(self) -> str:
        """A readable, unique name: ``BLOCK_M=128,BLOCK_N=64,w4,s3`` (+ ``c2``, ``r128``)."""
        parts = [f"{k}={_show_scalar(v)}" for k, v in self.kwargs.items()]
        for prefix, v in (
            ("w", self.num_warps),
            ("s", self.num_stages),
            ("c", None if self.num_ctas == 1 else self.num_ctas),
            ("r", self.maxnreg),
        ):
            if v is not None:
                parts.append(f"{prefix}{v}")
        if self.pre_hook:
            parts.append("hook")
        return ",".join(parts) or "default"

    def identity_json(self) -> dict[str, Any]:
        """What identifies the config (no grid: that depends on the call)."""
        return {
            "kwargs": dict(self.kwargs),
            **{name: getattr(self, name) for name in CONFIG_OPTIONS},
            "pre_hook": self.pre_hook,
        }

    def to_json(self) -> dict[str, Any]:
        d = self.identity_json()
        d["grid"] = list(self.grid) if self.grid is not None else None
        return d

    @classmethod
    def from_json(cls, d: Any, where: str) -> ConfigSpec:
        d = _obj(d, where, ("kwargs",), (*CONFIG_OPTIONS, "pre_hook", "grid"))
        kw = d["kwargs"]
        if not isinstance(kw, dict):
            raise _fail(f"{where}.kwargs", "expected an object", kw)
        kwargs = {
            _text(k, f"{where}.kwargs"): _scalar(v, f"{where}.kwargs.{k}") for k, v in kw.items()
        }
        pre_hook = d.get("pre_hook", False)
        if not isinstance(pre_hook, bool):
            raise _fail(f"{where}.pre_hook", "expected true or false", pre_hook)
        return cls(
            kwargs=kwargs,
            **{n: _opt_int(d.get(n), f"{where}.{n}") for n in CONFIG_OPTIONS},
            pre_hook=pre_hook,
            grid=_grid(d.get("grid"), f"{where}.grid"),
        )


def _grid(value: Any, where: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not 1 <= len(value) <= 3:
        raise _fail(where, "expected a list of 1 to 3 integers", value)
    return tuple(_int(v, f"{where}[{i}]") for i, v in enumerate(value))


def _show_scalar(v: Scalar) -> str:
    return json.dumps(v) if isinstance(v, str) or v is None else str(v)


def config_spec(cfg: Any, grid: Sequence[int] | None = None) -> ConfigSpec:
    """A ``triton.Config`` (read by attribute) as a :class:`ConfigSpec`.

    KernelRequestError when a meta-parameter is not a JSON scalar or the config uses an
    IR override file: such a config cannot be reproduced from a request.
    """
    raw = getattr(cfg, "kwargs", None)
    if not isinstance(raw, Mapping):
        raise KernelRequestError(f"config {cfg!r}: has no kwargs mapping; not a triton.Config")
    kwargs: dict[str, Scalar] = {}
    for k, v in raw.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise KernelRequestError(f"config {k}={v!r}: meta-parameters must be finite")
        if v is not None and not isinstance(v, bool | int | float | str):
            raise KernelRequestError(
                f"config {k}={v!r}: meta-parameters must be numbers, strings, booleans or None"
            )
        kwargs[str(k)] = v
    if getattr(cfg, "ir_override", None):
        raise KernelRequestError("configs with an ir_override file cannot be tuned by gpuwatchd")
    options: dict[str, int | None] = {}
    for name in CONFIG_OPTIONS:
        v = getattr(cfg, name, None)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise KernelRequestError(f"config {name}={v!r}: expected an integer or None")
        options[name] = v
    return ConfigSpec(
        kwargs=kwargs,
        **options,
        pre_hook=getattr(cfg, "pre_hook", None) is not None,
        grid=tuple(int(g) for g in grid) if grid is not None else None,
    )


# -- kernel identity ---------------------------------------------------------------------------


def base_function(kernel: Any) -> Callable[..., Any]:
    """The Python function under Triton's wrappers (Autotuner, Heuristics, JITFunction)."""
    obj, seen = kernel, 0
    while not inspect.isfunction(obj):
        inner = getattr(obj, "fn", None)
        seen += 1
        if inner is None or seen > 16:
            raise KernelRequestError(f"{kernel!r}: not a Triton kernel (no Python function inside)")
        obj = inner
    return obj


def kernel_source(kernel: Any) -> str:
    """The kernel's source from its ``def`` line on, dedented (decorators left out, as
    Triton's own ``JITFunction.src``): the part of the text that is the kernel."""
    fn = base_function(kernel)
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as e:
        raise KernelRequestError(f"{fn.__qualname__}: source not available ({e})") from None
    m = re.search(r"^def\s+\w+\s*\(", src, re.MULTILINE)
    return src[m.start() :] if m else src


def kernel_identity(source: str, configs: Iterable[ConfigSpec], key: Sequence[str]) -> str:
    """SHA-256 (hex) of the kernel source, its config list (in order) and its key names."""
    doc = {
        "source": source,
        "configs": [c.identity_json() for c in configs],
        "key": list(key),
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def identity_of(kernel: Any, configs: Iterable[Any], key: Sequence[str]) -> str:
    """:func:`kernel_identity` of a Triton kernel object and its ``triton.Config`` list."""
    return kernel_identity(kernel_source(kernel), [config_spec(c) for c in configs], key)


# -- arguments ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ArgSpec:
    """One kernel argument: a tensor's shape/strides/dtype/device, a scalar's value, or None."""

    name: str
    kind: str
    value: Scalar = None
    shape: tuple[int, ...] | None = None
    strides: tuple[int, ...] | None = None
    dtype: str | None = None
    device: str | None = None

    def to_json(self) -> dict[str, Any]:
        if self.kind == "tensor":
            return {
                "name": self.name,
                "kind": "tensor",
                "shape": list(self.shape or ()),
                "strides": list(self.strides or ()),
                "dtype": self.dtype,
                "device": self.device,
            }
        if self.kind == "none":
            return {"name": self.name, "kind": "none"}
        return {"name": self.name, "kind": self.kind, "value": self.value}

    @property
    def numel(self) -> int:
        return math.prod(self.shape or ())

    @classmethod
    def from_json(cls, d: Any, where: str) -> ArgSpec:
        if not isinstance(d, dict):
            raise _fail(where, "expected an object", d)
        kind = d.get("kind")
        if kind not in ARG_KINDS:
            raise _fail(f"{where}.kind", f"expected one of {', '.join(ARG_KINDS)}", kind)
        if kind == "tensor":
            d = _obj(d, where, ("name", "kind", "shape", "strides", "dtype"), ("device",))
            shape = _dims(d["shape"], f"{where}.shape")
            strides = _dims(d["strides"], f"{where}.strides")
            if len(strides) != len(shape):
                raise _fail(f"{where}.strides", f"expected {len(shape)} strides", d["strides"])
            device = d.get("device")
            return cls(
                name=_text(d["name"], f"{where}.name"),
                kind=kind,
                shape=shape,
                strides=strides,
                dtype=_dtype(d["dtype"], f"{where}.dtype"),
                device=None if device is None else _text(device, f"{where}.device"),
            )
        if kind == "none":
            d = _obj(d, where, ("name", "kind"))
            return cls(name=_text(d["name"], f"{where}.name"), kind=kind)
        d = _obj(d, where, ("name", "kind", "value"))
        return cls(
            name=_text(d["name"], f"{where}.name"),
            kind=kind,
            value=_typed_scalar(kind, d["value"], f"{where}.value"),
        )


def _dims(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > 8:
        raise _fail(where, "expected a list of at most 8 integers", value)
    return tuple(_int(v, f"{where}[{i}]") for i, v in enumerate(value))


def _dtype(value: Any, where: str) -> str:
    text = _text(value, where)
    if not re.fullmatch(r"[a-z][a-z0-9_]*", text):
        raise _fail(where, "expected a dtype name like 'float16'", value)
    return text


def _typed_scalar(kind: str, value: Any, where: str) -> Scalar:
    ok = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: is_number(v) and math.isfinite(v),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
    }[kind]
    if not ok(value):
        raise _fail(where, f"expected a {kind}", value)
    return float(value) if kind == "float" else value


def dtype_name(dtype: Any) -> str:
    """``torch.float16`` (or its text) -> ``float16``."""
    return str(dtype).rsplit(".", 1)[-1]


def describe_arg(name: str, value: Any) -> ArgSpec:
    """A live argument as an :class:`ArgSpec`; KernelRequestError for what cannot be rebuilt."""
    if value is None:
        return ArgSpec(name, "none")
    if isinstance(value, bool):
        return ArgSpec(name, "bool", value)
    if isinstance(value, int):
        return ArgSpec(name, "int", value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise KernelRequestError(f"argument {name}: non-finite float {value!r}")
        return ArgSpec(name, "float", value)
    if isinstance(value, str):
        return ArgSpec(name, "str", value)
    if all(hasattr(value, a) for a in ("data_ptr", "shape", "stride", "dtype")):
        return ArgSpec(
            name,
            "tensor",
            shape=tuple(int(s) for s in value.shape),
            strides=tuple(int(s) for s in value.stride()),
            dtype=dtype_name(value.dtype),
            device=str(getattr(value, "device", "")) or None,
        )
    raise KernelRequestError(
        f"argument {name}: a {type(value).__name__} cannot be described "
        "(tensors, numbers, strings, booleans and None can)"
    )


# -- the request -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KernelRequest:
    """Everything the worker needs to reproduce one autotuned call of a user kernel.

    ``key_values`` maps each key name the call passed to its value; ``key_dtypes`` are the
    dtypes Triton appends to its cache key (one per tensor argument, in argument order).
    ``launch_options`` are extra launch keywords that are not kernel arguments, only those
    :mod:`gpuwatchd.tuning.submitted.launch_options` allows.
    ``origin`` is informational (job pid, interpreter), never acted upon. ``job_default``
    is the label of the config plain Triton picked in the job that filed the request: what
    the job runs without gpuwatchd, which a winner must beat beyond the noise.
    """

    module: str
    qualname: str
    identity: str
    key_names: tuple[str, ...]
    key_values: dict[str, Scalar]
    key_dtypes: tuple[str, ...]
    configs: tuple[ConfigSpec, ...]
    args: tuple[ArgSpec, ...]
    regime: Regime
    gpu_model: str
    versions: Versions
    reset_to_zero: tuple[str, ...] = ()
    restore_value: tuple[str, ...] = ()
    launch_options: dict[str, Scalar] = field(default_factory=dict)
    args_factory: str | None = None
    origin: dict[str, Any] = field(default_factory=dict)
    job_default: str | None = None

    def __post_init__(self) -> None:
        self.check()

    # -- derived names ---------------------------------------------------------------

    @property
    def path(self) -> str:
        return f"{self.module}:{self.qualname}"

    @property
    def key_label(self) -> str:
        """``n_rows=4096,n_cols=4096;float16,float16``: the key as readable text."""
        named = ",".join(f"{k}={_show_scalar(v)}" for k, v in self.key_values.items())
        dtypes = ",".join(dtype_name(d) for d in self.key_dtypes)
        return f"{named};{dtypes}" if dtypes else named

    @property
    def workload_name(self) -> str:
        return workload_name(self.module, self.qualname, self.identity, self.key_label)

    @property
    def main_dtype(self) -> str:
        return next((a.dtype for a in self.args if a.kind == "tensor" and a.dtype), "none")

    def config_by_label(self) -> dict[str, ConfigSpec]:
        return {c.label: c for c in self.configs}

    # -- checks ----------------------------------------------------------------------

    def check(self) -> None:
        """Consistency beyond field types: names resolve, configs are distinct, grids given."""
        _module(self.module, "request.kernel.module")
        _qualname(self.qualname, "request.kernel.qualname")
        if not _HEX64_RE.fullmatch(self.identity):
            raise _fail(
                "request.kernel.identity", "expected 64 lowercase hex digits", self.identity
            )
        if not self.configs:
            raise _fail("request.configs", "expected at least one config", [])
        labels: set[str] = set()
        for i, c in enumerate(self.configs):
            if c.label in labels:
                raise _fail(f"request.configs[{i}]", "duplicate config", c.label)
            labels.add(c.label)
            if c.grid is None:
                raise _fail(f"request.configs[{i}].grid", "expected the launch grid", None)
        arg_names = [a.name for a in self.args]
        dupes = sorted({n for n in arg_names if arg_names.count(n) > 1})
        if dupes:
            raise _fail("request.args", "duplicate argument", dupes[0])
        for where, names in (
            ("request.reset_to_zero", self.reset_to_zero),
            ("request.restore_value", self.restore_value),
        ):
            for n in names:
                if n not in arg_names:
                    raise _fail(where, "expected names of arguments of the call", n)
        for k in self.key_values:
            if k not in self.key_names:
                raise _fail("request.key.values", "expected only key names", k)
        if self.args_factory is not None:
            parse_import_path(self.args_factory, "request.args_factory")
        parse_launch_options(self.launch_options, "request.launch_options", KernelRequestError)
        if not self.gpu_model.strip():
            raise _fail("request.gpu_model", "expected a non-empty string", self.gpu_model)
        if self.job_default is not None and self.job_default not in labels:
            raise _fail("request.job_default", "expected one of the configs", self.job_default)

    def written(self) -> tuple[str, ...]:
        """Arguments the kernel declares it writes (reset_to_zero and restore_value)."""
        return tuple(dict.fromkeys((*self.reset_to_zero, *self.restore_value)))

    # -- JSON ------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": REQUEST_FORMAT,
            "kernel": {"module": self.module, "qualname": self.qualname, "identity": self.identity},
            "key": {
                "names": list(self.key_names),
                "values": dict(self.key_values),
                "dtypes": list(self.key_dtypes),
            },
            "configs": [c.to_json() for c in self.configs],
            "args": [a.to_json() for a in self.args],
            "reset_to_zero": list(self.reset_to_zero),
            "restore_value": list(self.restore_value),
            "launch_options": dict(self.launch_options),
            "args_factory": self.args_factory,
            "regime": self.regime.value,
            "gpu_model": self.gpu_model,
            "versions": json.loads(self.versions.key()),
            "origin": dict(self.origin),
            # left out when unknown, so a daemon that predates the field reads the request
            **({} if self.job_default is None else {"job_default": self.job_default}),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, d: Any) -> KernelRequest:
        """Parse and check a request document; any problem is one KernelRequestError line."""
        d = _obj(
            d,
            "request",
            ("format", "kernel", "key", "configs", "args", "regime", "gpu_model", "versions"),
            (
                "reset_to_zero",
                "restore_value",
                "launch_options",
                "args_factory",
                "origin",
                "job_default",
            ),
        )
        if d["format"] != REQUEST_FORMAT:
            raise _fail("request.format", f"expected {REQUEST_FORMAT!r}", d["format"])
        k = _obj(d["kernel"], "request.kernel", ("module", "qualname", "identity"))
        key = _obj(d["key"], "request.key", ("names", "values"), ("dtypes",))
        values = key["values"]
        if not isinstance(values, dict):
            raise _fail("request.key.values", "expected an object", values)
        configs = d["configs"]
        if not isinstance(configs, list):
            raise _fail("request.configs", "expected a list", configs)
        args = d["args"]
        if not isinstance(args, list):
            raise _fail("request.args", "expected a list", args)
        try:
            regime = Regime(d["regime"])
        except ValueError:
            known = ", ".join(r.value for r in Regime)
            raise _fail("request.regime", f"expected one of {known}", d["regime"]) from None
        try:
            versions = Versions.from_json(d["versions"])
        except ValueError as e:
            raise KernelRequestError(f"request.{e}") from None
        opts = parse_launch_options(
            d.get("launch_options", {}), "request.launch_options", KernelRequestError
        )
        origin = d.get("origin", {})
        if not isinstance(origin, dict):
            raise _fail("request.origin", "expected an object", origin)
        factory = d.get("args_factory")
        default = d.get("job_default")
        return cls(
            module=_module(k["module"], "request.kernel.module"),
            qualname=_qualname(k["qualname"], "request.kernel.qualname"),
            identity=_text(k["identity"], "request.kernel.identity"),
            key_names=_names(key["names"], "request.key.names"),
            key_values={
                _text(n, "request.key.values"): _scalar(v, f"request.key.values.{n}")
                for n, v in values.items()
            },
            key_dtypes=tuple(
                _dtype_text(v, f"request.key.dtypes[{i}]")
                for i, v in enumerate(_list(key.get("dtypes", []), "request.key.dtypes"))
            ),
            configs=tuple(
                ConfigSpec.from_json(c, f"request.configs[{i}]") for i, c in enumerate(configs)
            ),
            args=tuple(ArgSpec.from_json(a, f"request.args[{i}]") for i, a in enumerate(args)),
            regime=regime,
            gpu_model=_text(d["gpu_model"], "request.gpu_model"),
            versions=versions,
            reset_to_zero=_names(d.get("reset_to_zero", []), "request.reset_to_zero"),
            restore_value=_names(d.get("restore_value", []), "request.restore_value"),
            launch_options=dict(opts),
            args_factory=None if factory is None else _text(factory, "request.args_factory"),
            origin=origin,
            job_default=None if default is None else _text(default, "request.job_default"),
        )

    @classmethod
    def loads(cls, text: str | bytes) -> KernelRequest:
        """Parse a request from JSON text (size-capped, strict JSON)."""
        doc = load_json(text, "request", max_bytes=MAX_REQUEST_BYTES, error=KernelRequestError)
        return cls.from_json(doc)

    # -- as a workload ---------------------------------------------------------------

    def to_workload(self) -> Workload:
        """The request as a workload of the ``triton.user`` family.

        Whether its code may be imported is :mod:`gpuwatchd.tuning.submitted.trust`'s to say: the
        daemon checks the names before queueing it, the worker the objects as it imports.
        """
        return Workload(
            name=self.workload_name,
            op=FAMILY,
            shape={
                "key": dict(self.key_values),
                "dtypes": [dtype_name(d) for d in self.key_dtypes],
            },
            dtype=self.main_dtype,
            families=(FAMILY,),
            params={"request": self.to_json()},
        )


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise _fail(where, "expected a list", value)
    return value


def _dtype_text(value: Any, where: str) -> str:
    text = _text(value, where)
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.]*", text):
        raise _fail(where, "expected a dtype like 'torch.float16'", value)
    return text


def workload_name(module: str, qualname: str, identity: str, key_label: str) -> str:
    """``triton.user:<module>.<qualname>@<hash8>/<key>``: one workload per kernel and key.

    A key too long for a readable name is replaced by a hash of it.
    """
    head = f"{FAMILY}:{module}.{qualname}@{identity[:8]}/"
    if len(head) + len(key_label) > MAX_NAME_CHARS:
        key_label = "key-" + hashlib.sha256(key_label.encode("utf-8")).hexdigest()[:16]
    return head + key_label


def kernel_prefix(module: str, qualname: str, identity: str) -> str:
    """The workload-name prefix shared by every key of one kernel identity."""
    return f"{FAMILY}:{module}.{qualname}@{identity[:8]}/"


def request_from_workload(workload: Workload) -> KernelRequest:
    """The request a ``triton.user`` workload carries in ``params.request``."""
    raw = workload.params.get("request")
    if raw is None:
        raise KernelRequestError(f"workload {workload.name!r}: params.request: missing")
    req = KernelRequest.from_json(raw)
    if req.workload_name != workload.name:
        raise KernelRequestError(
            f"workload {workload.name!r}: its request names workload {req.workload_name!r}"
        )
    return req


# -- winners ---------------------------------------------------------------------------------

#: The version fields a Triton kernel's timing depends on.
KERNEL_VERSION_FIELDS = ("triton", "cuda", "driver")


def versions_mismatch(recorded: Versions, ours: Versions) -> str | None:
    """Why a winner measured on ``recorded`` must not be used on ``ours`` (None: usable).

    Triton's version must be known on both sides and the same; CUDA and the driver the
    same wherever both sides know them, by the one rule (:mod:`gpuwatchd.tuning.versions`).
    """
    for name in KERNEL_VERSION_FIELDS:
        theirs, mine = getattr(recorded, name), getattr(ours, name)
        if name == "triton" and (theirs is None or mine is None):
            return f"triton version unknown ({theirs or '?'} recorded, {mine or '?'} here)"
        if theirs is not None and mine is not None and not same_version(name, theirs, mine):
            return f"{name} {theirs} recorded, {mine} here"
    return None
