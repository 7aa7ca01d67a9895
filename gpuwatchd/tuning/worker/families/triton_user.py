"""``triton.user`` family: a user's own ``@triton.autotune`` kernel, one candidate per config.

The workload carries the job's tuning request (:mod:`gpuwatchd.tuning.submitted.kernels`); the job
spec carries the admin's ``allowed_modules``. Importing named code is code execution, so
the kernel and the args factory are imported only under :mod:`gpuwatchd.tuning.submitted.trust`'s
rule (allowed modules, public names, objects defined there), and the imported kernel
must hash to the request's identity: an edited kernel is refused rather than measured
under its old name.

Arguments are rebuilt from their descriptions (tensors of the recorded shape, strides
and dtype: random floats, zero integers; scalars as recorded), or by the request's
``args_factory(key_values)`` for kernels whose inputs must hold valid data. The first
candidate's setup runs every config once from the same inputs (:class:`UserKernel`):
a config that does not compile or is out of resources is rejected on its own, and a
config whose written outputs differ from the majority's (dtype-aware relative error)
is rejected with the figures, so a wrong kernel can never win.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuwatchd.tuning.dtypes import storage_elements
from gpuwatchd.tuning.submitted.kernels import (
    FAMILY,
    ArgSpec,
    ConfigSpec,
    KernelRequest,
    KernelRequestError,
    base_function,
    config_spec,
    identity_of,
    request_from_workload,
)
from gpuwatchd.tuning.submitted.launch_options import (
    check_keywords,
    kernel_parameters,
    parse_launch_options,
)
from gpuwatchd.tuning.submitted.trust import (
    TrustError,
    check_request,
    check_workload,
    import_function,
    import_kernel,
)
from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.winners import JOB_DEFAULT
from gpuwatchd.tuning.worker.candidate import CandidateError, DeviceSession
from gpuwatchd.tuning.worker.cuda_session import first_line
from gpuwatchd.tuning.worker.families.base import CandidateBase
from gpuwatchd.tuning.worker.families.common import compiled_facts
from gpuwatchd.validate import describe

#: Largest relative (Frobenius) difference between two configs' outputs that still agrees.
#: fp32 allows TF32 dots (Triton's default); integer and boolean outputs must be equal.
TOLERANCE = {
    "float64": 1e-9,
    "float32": 2e-3,
    "float16": 5e-3,
    "bfloat16": 3e-2,
}
FLOAT8_TOLERANCE = 1.5e-1
#: Groups of mutually agreeing configs kept while checking; a config agreeing with none
#: of them once this many exist is rejected outright.
MAX_GROUPS = 4


# -- importing the kernel ------------------------------------------------------------------


@dataclass(slots=True)
class LoadedKernel:
    """The imported kernel: what to launch, its Triton autotuner, and its live configs."""

    target: Any  # what Triton's autotuner launches (a JITFunction, or Heuristics over one)
    autotuner: Any
    configs: dict[str, Any]  # config label -> the kernel's own triton.Config (hooks and all)
    parameters: frozenset[str]  # the kernel function's parameter names


def load_kernel(request: KernelRequest, allowed: Sequence[str]) -> LoadedKernel:
    """Import and check the request's kernel: under the trust rule, same identity, same configs."""
    check_request(request, allowed)
    obj = import_kernel(request.module, request.qualname, allowed, "request.kernel")
    tuner = getattr(obj, "_tuner", None) or (obj if hasattr(obj, "keys") else None)
    if tuner is None or not hasattr(tuner, "configs") or not hasattr(tuner, "fn"):
        raise ValueError(f"{request.module}.{request.qualname} is not an autotuned Triton kernel")
    configs = list(getattr(obj, "configs", tuner.configs))
    identity = identity_of(obj, configs, request.key_names)
    if identity != request.identity:
        raise ValueError(
            f"{request.module}.{request.qualname} changed since the request "
            f"(identity {identity[:8]}, request {request.identity[:8]}): not tuned"
        )
    live = {config_spec(c).label: c for c in configs}
    missing = [c.label for c in request.configs if c.label not in live]
    if missing:
        raise ValueError(f"config {missing[0]} of the request is not one of the kernel's")
    parameters = kernel_parameters(base_function(obj))
    check_keywords((a.name for a in request.args), parameters, "request.args")
    return LoadedKernel(target=tuner.fn, autotuner=tuner, configs=live, parameters=parameters)


# -- arguments -------------------------------------------------------------------------------


def _torch() -> Any:
    import torch

    return torch


def build_tensor(spec: ArgSpec, device: Any, generator: Any) -> Any:
    """A tensor of the recorded shape, strides and dtype: floats random, the rest zero."""
    torch = _torch()
    dtype = getattr(torch, spec.dtype or "", None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"argument {spec.name}: unknown dtype {spec.dtype!r}")
    shape, strides = spec.shape or (), spec.strides or ()
    base = torch.zeros(storage_elements(shape, strides), dtype=dtype, device=device)
    if dtype.is_floating_point and base.numel():
        noise = torch.randn(base.numel(), generator=generator, dtype=torch.float32)
        base.copy_(noise.to(device))
    return base.as_strided(shape, strides)


def build_arguments(
    request: KernelRequest, device: Any, allowed: Sequence[str], seed: int = 0
) -> dict[str, Any]:
    """Every recorded argument rebuilt on ``device``, the args factory's values on top."""
    torch = _torch()
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for spec in request.args:
        if spec.kind == "tensor":
            out[spec.name] = build_tensor(spec, device, generator)
        else:
            out[spec.name] = spec.value
    if request.args_factory is not None:
        factory = import_function(request.args_factory, allowed, "request.args_factory")
        try:
            made = factory(dict(request.key_values))
        except Exception as e:  # user code
            raise ValueError(f"args_factory {request.args_factory} failed: {describe(e)}") from None
        if not isinstance(made, Mapping):
            raise ValueError(f"args_factory {request.args_factory}: expected a dict of arguments")
        for name, value in made.items():
            if name not in out:
                raise ValueError(f"args_factory {request.args_factory}: unknown argument {name!r}")
            out[name] = value.to(device) if hasattr(value, "data_ptr") else value
    return out


# -- comparing outputs -------------------------------------------------------------------------


def tolerance(dtype: Any) -> float:
    """Allowed relative difference for outputs of ``dtype`` (0: must be equal)."""
    name = str(dtype).rsplit(".", 1)[-1]
    if name.startswith("float8"):
        return FLOAT8_TOLERANCE
    return TOLERANCE.get(name, 0.0)


def relative_difference(a: Any, b: Any) -> float:
    """||a - b|| / max(||a||, ||b||) in float64; NaN where both are NaN counts as equal.

    Exact comparison (0 or inf) for integer and boolean tensors.
    """
    torch = _torch()
    if not (a.dtype.is_floating_point or a.dtype.is_complex):
        return 0.0 if torch.equal(a, b) else math.inf
    x, y = a.double(), b.double()
    both = torch.isnan(x) & torch.isnan(y)
    x, y = x.masked_fill(both, 0.0), y.masked_fill(both, 0.0)
    if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
        return 0.0 if torch.equal(x, y) else math.inf
    num = float((x - y).norm())
    den = max(float(x.norm()), float(y.norm()))
    return num / den if den > 0 else num


def compare_outputs(
    a: Mapping[str, Any], b: Mapping[str, Any], pristine: Mapping[str, Any]
) -> tuple[str | None, float]:
    """(why they differ or None, largest relative difference) of two configs' outputs.

    An output one config wrote and the other did not is compared with its input value.
    """
    worst = 0.0
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name, pristine[name]), b.get(name, pristine[name])
        diff = relative_difference(x, y)
        tol = tolerance(x.dtype)
        worst = max(worst, diff)
        if diff > tol:
            dtype = str(x.dtype).rsplit(".", 1)[-1]
            return f"{name}: relative difference {diff:.2e} > {tol:.0e} ({dtype})", worst
    return None, worst


# -- the shared check run ----------------------------------------------------------------------


@dataclass(slots=True)
class Verdict:
    """One config after the check run: its error, or what it computed and cost."""

    error: str | None = None
    compile_s: float | None = None
    compiled: Any = None
    outputs: list[str] = field(default_factory=list)
    difference: float | None = None  # largest relative difference from its group's reference


class UserKernel:
    """The imported kernel, its rebuilt arguments and the verdict on every config.

    Shared by the family's candidates; the first setup runs :meth:`check` for all.
    """

    def __init__(self, request: KernelRequest, allowed: Sequence[str], device: Any) -> None:
        self.request = request
        self.allowed = tuple(allowed)
        self.device = device
        self.loaded: LoadedKernel | None = None
        self.args: dict[str, Any] = {}
        self.verdicts: dict[str, Verdict] | None = None
        self._users = 0

    # -- life cycle ------------------------------------------------------------------

    def acquire(self) -> None:
        if self.loaded is None:
            self.loaded = load_kernel(self.request, self.allowed)
            self.args = build_arguments(self.request, self.device, self.allowed)
        if self.verdicts is None:
            self.verdicts = self.check()
        self._users += 1

    def release(self) -> None:
        self._users = max(0, self._users - 1)
        if self._users == 0:
            self.args = {}
            self.loaded = None

    # -- launching -------------------------------------------------------------------

    def launch_kwargs(self, spec: ConfigSpec) -> dict[str, Any]:
        """The keywords of one launch; checked again here, so that nothing but the
        kernel's parameters and allowed launch options ever reaches Triton."""
        assert self.loaded is not None
        cfg = self.loaded.configs[spec.label]
        options = parse_launch_options(self.request.launch_options)
        kwargs = {**self.args, **options, **cfg.all_kwargs()}
        check_keywords(kwargs, self.loaded.parameters, f"launch of config {spec.label}")
        return kwargs

    def launcher(self, spec: ConfigSpec) -> Any:
        assert self.loaded is not None and spec.grid is not None
        return self.loaded.target[spec.grid]

    def config_hook(self, spec: ConfigSpec) -> Any:
        assert self.loaded is not None
        return getattr(self.loaded.configs[spec.label], "pre_hook", None)

    def sync(self) -> None:
        if getattr(self.device, "type", None) == "cuda":
            _torch().cuda.synchronize(self.device)

    # -- the check run ---------------------------------------------------------------

    def check(self) -> dict[str, Verdict]:
        """Run every config once from the same inputs; reject failures and outliers.

        Outputs are grouped as they come (a config joins the first group whose reference
        it agrees with), so at most :data:`MAX_GROUPS` outputs are held at a time.
        """
        tensors = {n: v for n, v in self.args.items() if hasattr(v, "data_ptr")}
        pristine = {n: t.clone() for n, t in tensors.items()}
        declared = set(self.request.written())
        verdicts: dict[str, Verdict] = {}
        groups: list[_Group] = []
        for spec in self.request.configs:
            verdict, outputs = self._run_once(spec, tensors, pristine, declared)
            verdicts[spec.label] = verdict
            if verdict.error is None:
                _join(groups, spec.label, outputs, verdict, pristine)
        _judge(groups, verdicts, pristine)
        for name, t in tensors.items():  # leave the inputs as they were for timing
            t.copy_(pristine[name])
        return verdicts

    def _run_once(
        self,
        spec: ConfigSpec,
        tensors: Mapping[str, Any],
        pristine: Mapping[str, Any],
        declared: set[str],
    ) -> tuple[Verdict, dict[str, Any]]:
        torch = _torch()
        assert self.loaded is not None
        for name, t in tensors.items():
            t.copy_(pristine[name])
        kwargs = self.launch_kwargs(spec)
        full = dict(kwargs)
        tuner = self.loaded.autotuner
        t0 = time.perf_counter()
        try:
            hook = self.config_hook(spec)
            if hook is not None:
                hook(full)
            _call_hook(getattr(tuner, "pre_hook", None), full)
            compiled = self.launcher(spec)(**kwargs)
            self.sync()
        except Exception as e:  # Triton: OutOfResources, CompilationError, PTXASError, ...
            self._check_context(spec, e)
            return Verdict(error=f"{type(e).__name__}: {first_line(e)}"), {}
        compile_s = time.perf_counter() - t0
        outputs = {
            n: t.clone()
            for n, t in tensors.items()
            if n in declared or not torch.equal(t, pristine[n])
        }
        post = getattr(tuner, "post_hook", None)
        if callable(post):
            post(full, exception=None)
        return Verdict(compile_s=compile_s, compiled=compiled, outputs=sorted(outputs)), outputs

    def _check_context(self, spec: ConfigSpec, e: Exception) -> None:
        """Re-raise as a session failure when the CUDA context did not survive the error."""
        try:
            self.sync()
        except Exception as lost:
            raise RuntimeError(
                f"CUDA context lost after config {spec.label} ({first_line(e)}): {first_line(lost)}"
            ) from None


@dataclass(slots=True)
class _Group:
    """Configs whose outputs agree with the reference outputs of the first of them."""

    reference: str
    outputs: Mapping[str, Any]
    members: list[str]


def _join(
    groups: list[_Group],
    label: str,
    outputs: Mapping[str, Any],
    verdict: Verdict,
    pristine: Mapping[str, Any],
) -> None:
    """Put a config into the first group it agrees with, else open a group for it."""
    for g in groups:
        why, diff = compare_outputs(outputs, g.outputs, pristine)
        if why is None:
            g.members.append(label)
            verdict.difference = diff
            return
    if len(groups) < MAX_GROUPS:
        groups.append(_Group(label, outputs, [label]))
        verdict.difference = 0.0
        return
    why, _ = compare_outputs(outputs, groups[0].outputs, pristine)
    verdict.error = f"outputs differ from every other config's ({why} vs {groups[0].reference})"


def _judge(groups: list[_Group], verdicts: dict[str, Verdict], pristine: Mapping[str, Any]) -> None:
    """Keep the group holding a strict majority of the configs; reject every other config."""
    if not groups:
        return
    total = sum(len(g.members) for g in groups)
    best = max(groups, key=lambda g: len(g.members))
    if len(best.members) * 2 <= total:
        for g in groups:
            for label in g.members:
                verdicts[label].error = (
                    "outputs disagree between configs with no majority "
                    f"({len(groups)} groups among {total} configs)"
                )
        return
    for g in groups:
        if g is best:
            continue
        why, _ = compare_outputs(g.outputs, best.outputs, pristine)
        for label in g.members:
            verdicts[label].error = (
                f"outputs differ from the majority of configs ({why}: "
                f"{g.reference} vs {best.reference})"
            )


def _call_hook(hook: Any, nargs: dict[str, Any]) -> None:
    if callable(hook):
        hook(nargs)


# -- candidates --------------------------------------------------------------------------------


class UserConfig(CandidateBase):
    """One config of the user's kernel, launched as the user's job launches it."""

    family = FAMILY

    def __init__(self, kernel: UserKernel, spec: ConfigSpec) -> None:
        super().__init__(spec.label)
        self.spec = spec
        self._kernel = kernel
        self._held = False
        self._launch: Any = None
        self._kwargs: dict[str, Any] = {}
        self._hook: Any = None

    def _setup(self) -> None:
        k = self._kernel
        k.acquire()  # a kernel that cannot be imported or built fails the whole session
        self._held = True
        assert k.verdicts is not None
        verdict = k.verdicts[self.spec.label]
        if verdict.error is not None:
            raise CandidateError(f"{self.name}: {verdict.error}")
        self._launch = k.launcher(self.spec)
        self._kwargs = k.launch_kwargs(self.spec)
        self._hook = k.config_hook(self.spec)
        tensors = [v for v in k.args.values() if hasattr(v, "data_ptr")]
        working_set = sum(t.untyped_storage().nbytes() for t in tensors)
        self._meta = {
            "config": self.spec.identity_json(),
            "identity": k.request.identity,
            "kernel": k.request.path,
            "kernels": [k.request.qualname.rsplit(".", 1)[-1]],
            "grid": list(self.spec.grid or ()),
            "compile_s": verdict.compile_s,
            "outputs_checked": verdict.outputs,
            "max_rel_difference": verdict.difference,
            "working_set_bytes": working_set,
            JOB_DEFAULT: self.spec.label == k.request.job_default,
            **compiled_facts(verdict.compiled),
        }

    def run(self, calls: int) -> None:
        launch, kwargs, hook = self._launch, self._kwargs, self._hook
        if launch is None:
            raise CandidateError(f"{self.name}: run before setup")
        for _ in range(calls):
            if hook is not None:
                hook(kwargs)
            launch(**kwargs)

    def teardown(self) -> None:
        self._launch, self._kwargs, self._hook = None, {}, None
        if self._held:
            self._held = False
            self._kernel.release()


def _device(session: DeviceSession) -> Any:
    """The session's CUDA device; the CPU only under Triton's interpreter (tests)."""
    device = getattr(session, "device", None)
    if getattr(device, "type", None) == "cuda":
        return device
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _torch().device("cpu")
    raise CandidateError(f"{FAMILY} needs a CUDA device session, got {type(session).__name__}")


def build(
    workload: Workload, session: DeviceSession, allowed_modules: Sequence[str] = ()
) -> list[UserConfig]:
    """One candidate per config of the workload's request (see the module docstring).

    ``allowed_modules`` is the job's list (the daemon's configuration); whatever the
    workload itself carries is refused, never used.
    """
    allowed = tuple(allowed_modules)
    try:
        check_workload(workload, allowed, "workload")
        request = request_from_workload(workload)
    except (KernelRequestError, TrustError) as e:
        raise ValueError(f"workload {workload.name!r}: {e}") from None
    kernel = UserKernel(request, allowed, _device(session))
    return [UserConfig(kernel, spec) for spec in request.configs]
