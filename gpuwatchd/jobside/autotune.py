"""The drop-in for ``triton.autotune``: use gpuwatchd's recorded winner, else behave as Triton.

Every call goes through a real Triton ``Autotuner`` built from the same arguments, so
semantics (keys, pruning, hooks, reset_to_zero/restore_value, the launch) are Triton's.
On the first call of each key the wrapper looks for a recorded winner (see
:mod:`gpuwatchd.jobside.lookup`):

- hit: the winner's config goes into the Triton autotuner's own cache under the key
  Triton computes, so Triton launches it at once and benchmarks nothing;
- miss: Triton autotunes as it always would, and a tuning request for the configs it
  compared is filed (:mod:`gpuwatchd.jobside.requests`) so the daemon tunes them behind
  its gate and the next run hits.

Each key's decision is kept in ``kernel.gpuwatchd_choice`` and logged once at INFO.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuwatchd.client import Client
from gpuwatchd.jobside.call import (
    CallFacts,
    TritonKey,
    build_request,
    factory_path,
    import_path,
    triton_key,
)
from gpuwatchd.jobside.lookup import auto_regime, find_winner
from gpuwatchd.jobside.requests import Submission, Submitter
from gpuwatchd.jobside.stack import Stack, current_stack
from gpuwatchd.tuning.submitted.kernels import (
    KernelRequestError,
    base_function,
    config_spec,
    identity_of,
    workload_name,
)
from gpuwatchd.tuning.types import Regime
from gpuwatchd.validate import one_line

if TYPE_CHECKING:
    from gpuwatchd.api.winners import Winner

log = logging.getLogger("gpuwatchd.triton")

REGIMES = ("sustained", "unthrottled", "auto")


@dataclass(frozen=True, slots=True)
class Choice:
    """Which config a key runs and why.

    ``source``: ``winner`` (gpuwatchd's recorded winner, no autotuning), ``autotuned``
    (Triton benchmarked, as without gpuwatchd) or ``single`` (one config left: nothing
    to choose). ``autotune_s`` is Triton's benchmarking time (0 on a hit).
    ``submission`` says what became of the tuning request a miss filed.
    """

    key: tuple[Any, ...]
    config: Any
    label: str
    source: str
    reason: str
    regime: Regime | None
    workload: str | None
    winner: Winner | None = None
    autotune_s: float = 0.0
    submission: Submission | None = None


@dataclass(slots=True)
class TuneContext:
    """Where winners come from and requests go; the defaults find the local daemon,
    its store and its spool. ``stack`` reads the GPU model and versions of a device."""

    client: Client | None = None
    submitter: Submitter = field(default_factory=Submitter)
    stack: Callable[[Any], Stack] = current_stack
    submit: bool = True

    def get_client(self) -> Client:
        if self.client is None:
            self.client = Client()
        return self.client


class GpuwatchdAutotuner:
    """``@gpuwatchd.triton.autotune``: a Triton ``Autotuner`` that first asks gpuwatchd.

    Launch it as any Triton kernel: ``kernel[grid](*args, **kwargs)``. Attributes Triton's
    autotuner has (``best_config``, ``cache``, ``configs_timings``, ...) are its own.
    """

    def __init__(
        self,
        fn: Any,
        configs: Sequence[Any],
        key: Sequence[str],
        triton_options: dict[str, Any],
        regime: str,
        args_factory: str | None,
        context: TuneContext,
    ) -> None:
        import triton

        self.fn = fn
        self.arg_names: list[str] = list(fn.arg_names)
        self.keys: tuple[str, ...] = tuple(key)
        self.regime = regime
        self.args_factory = args_factory
        self.context = context
        self._tuner = triton.autotune(configs=list(configs), key=list(key), **triton_options)(fn)
        self.configs: list[Any] = list(self._tuner.configs)
        self._reset_to_zero = tuple(triton_options.get("reset_to_zero") or ())
        self._restore_value = tuple(triton_options.get("restore_value") or ())
        self.gpuwatchd_choice: dict[tuple[Any, ...], Choice] = {}
        self.gpuwatchd_last: Choice | None = None
        self._facts: CallFacts | None = None
        self._not_tunable: str | None = None
        self._regime: tuple[Regime, str] | None = None
        self._miss_reason = ""  # why the key being decided missed
        self._pending: tuple[Stack, Regime] | None = None  # its stack and regime, when known
        functools.update_wrapper(self, base_function(fn), updated=())  # type: ignore[arg-type]

    # -- Triton's kernel interface -----------------------------------------------------

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return functools.partial(self.run, grid=grid, warmup=False)

    def warmup(self, *args: Any, **kwargs: Any) -> Any:
        return self._tuner.warmup(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._tuner, name)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Launch; on a key's first call decide hit or miss (module docstring)."""
        if len(self.configs) <= 1:
            return self._tuner.run(*args, **kwargs)
        key = triton_key(self.arg_names, self.keys, args, kwargs)
        choice = self.gpuwatchd_choice.get(key.values)
        if choice is None:
            choice = self._first_call(key, args, kwargs)
            if choice is None:  # a miss: Triton autotunes, then the request is filed
                return self._autotune(key, args, kwargs)
        if choice.source == "winner":
            self._tuner.cache[key.values] = choice.config
        self.gpuwatchd_last = choice
        return self._tuner.run(*args, **kwargs)

    # -- hit or miss -----------------------------------------------------------------

    def _first_call(
        self, key: TritonKey, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Choice | None:
        """A hit's :class:`Choice`; None (reason kept for the miss) on a miss."""
        self._miss_reason, self._pending = "", None
        facts = self._call_facts()
        if facts is None:
            self._miss_reason = f"not tunable by gpuwatchd: {self._not_tunable}"
            return None
        try:
            stack = self.context.stack(_device_of(args, kwargs))
        except Exception as e:  # no CUDA, a broken driver: run as plain Triton
            self._miss_reason = f"cannot read the GPU: {type(e).__name__}: {one_line(e)}"
            return None
        regime, regime_why = self._resolve_regime(stack)
        name = workload_name(facts.module, facts.qualname, facts.identity, _key_label(key))
        labels = {config_spec(c).label: c for c in self.configs}
        found = find_winner(self.context.get_client(), name, facts.identity, regime, stack, labels)
        self._pending = (stack, regime)
        if found.winner is None:
            self._miss_reason = found.reason + (f"; {regime_why}" if regime_why else "")
            return None
        cfg = labels[found.winner.candidate]
        choice = Choice(
            key=key.values,
            config=cfg,
            label=found.winner.candidate,
            source="winner",
            reason=found.reason,
            regime=regime,
            workload=name,
            winner=found.winner,
        )
        self.gpuwatchd_choice[key.values] = choice
        log.info(
            "gpuwatchd.triton: %s [%s]: %s, %s; no autotuning",
            self.__name__,
            _key_label(key),
            choice.label,
            choice.reason,
        )
        return choice

    def _autotune(self, key: TritonKey, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Let Triton autotune this key, then file a request for what it compared."""
        before = getattr(self._tuner, "configs_timings", None)
        t0 = time.perf_counter()
        ret = self._tuner.run(*args, **kwargs)
        wall = time.perf_counter() - t0
        timings = getattr(self._tuner, "configs_timings", None)
        benchmarked = timings is not None and timings is not before
        best = self._tuner.best_config
        compared = list(timings) if timings is not None and benchmarked else [best]
        reason = self._miss_reason
        submission = None
        stack_regime = self._pending
        facts = self._facts
        if len(compared) > 1 and facts is not None and stack_regime is not None:
            submission = self._file(facts, key, compared, best, args, kwargs, *stack_regime)
            reason = f"{reason}; request {submission.detail}"
        choice = Choice(
            key=key.values,
            config=best,
            label=_label(best),
            source="autotuned" if len(compared) > 1 else "single",
            reason=reason,
            regime=stack_regime[1] if stack_regime else None,
            workload=None,
            autotune_s=float(getattr(self._tuner, "bench_time", wall)) if benchmarked else 0.0,
            submission=submission,
        )
        self.gpuwatchd_choice[key.values] = choice
        self.gpuwatchd_last = choice
        log.info(
            "gpuwatchd.triton: %s [%s]: Triton autotuned in %.2f s and picked %s (%s)",
            self.__name__,
            _key_label(key),
            choice.autotune_s,
            choice.label,
            reason,
        )
        return ret

    def _file(
        self,
        facts: CallFacts,
        key: TritonKey,
        compared: list[Any],
        picked: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        stack: Stack,
        regime: Regime,
    ) -> Submission:
        if not self.context.submit:
            return Submission("failed", "not filed (submit=False)")
        try:
            request = build_request(
                facts, key, compared, args, kwargs, regime, stack.gpu_model, stack.versions, picked
            )
        except (KernelRequestError, ValueError) as e:
            return Submission("failed", f"not filed: {one_line(e)}")
        return self.context.submitter.submit(request)

    # -- per kernel ------------------------------------------------------------------

    def _call_facts(self) -> CallFacts | None:
        """Identity and import path, computed once; None when the kernel cannot be tuned."""
        if self._facts is None and self._not_tunable is None:
            try:
                module, qualname = import_path(self)
                self._facts = CallFacts(
                    module=module,
                    qualname=qualname,
                    identity=identity_of(self.fn, self.configs, self.keys),
                    arg_names=tuple(self.arg_names),
                    keys=self.keys,
                    reset_to_zero=self._reset_to_zero,
                    restore_value=self._restore_value,
                    args_factory=self.args_factory,
                )
            except KernelRequestError as e:
                self._not_tunable = one_line(e)
        return self._facts

    def _resolve_regime(self, stack: Stack) -> tuple[Regime, str]:
        if self.regime != "auto":
            return Regime(self.regime), ""
        if self._regime is None:
            self._regime = auto_regime(self.context.get_client(), stack.gpu_uuid)
        return self._regime


def _device_of(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    for v in (*args, *kwargs.values()):
        if hasattr(v, "data_ptr") and hasattr(v, "device"):
            return v.device
    return None


def _key_label(key: TritonKey) -> str:
    named = ",".join(f"{k}={v}" for k, v in key.named.items())
    dtypes = ",".join(d.rsplit(".", 1)[-1] for d in key.dtypes)
    return f"{named};{dtypes}" if dtypes else named


def _label(cfg: Any) -> str:
    try:
        return config_spec(cfg).label
    except KernelRequestError:
        return str(cfg)


def autotune(
    configs: Sequence[Any],
    key: Sequence[str],
    prune_configs_by: dict[str, Any] | None = None,
    reset_to_zero: Sequence[str] | None = None,
    restore_value: Sequence[str] | None = None,
    pre_hook: Callable[..., Any] | None = None,
    post_hook: Callable[..., Any] | None = None,
    warmup: int | None = None,
    rep: int | None = None,
    use_cuda_graph: bool = False,
    do_bench: Callable[..., Any] | None = None,
    cache_results: bool = False,
    *,
    regime: str = "sustained",
    args_factory: str | Callable[..., Any] | None = None,
    context: TuneContext | None = None,
    **triton_options: Any,
) -> Callable[[Any], GpuwatchdAutotuner]:
    """``triton.autotune`` with gpuwatchd's recorded winners (see :mod:`gpuwatchd.triton`)."""
    if regime not in REGIMES:
        raise ValueError(f"regime: expected one of {', '.join(REGIMES)}, got {regime!r}")
    factory = factory_path(args_factory)
    given = {
        "prune_configs_by": prune_configs_by,
        "reset_to_zero": list(reset_to_zero) if reset_to_zero is not None else None,
        "restore_value": list(restore_value) if restore_value is not None else None,
        "pre_hook": pre_hook,
        "post_hook": post_hook,
        "warmup": warmup,
        "rep": rep,
        "do_bench": do_bench,
    }
    options = {k: v for k, v in given.items() if v is not None}
    if use_cuda_graph:
        options["use_cuda_graph"] = True
    if cache_results:
        options["cache_results"] = True
    options.update(triton_options)
    ctx = context if context is not None else TuneContext()

    def decorator(fn: Any) -> GpuwatchdAutotuner:
        return GpuwatchdAutotuner(fn, configs, key, options, regime, factory, ctx)

    return decorator
