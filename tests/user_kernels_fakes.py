"""A fake ``triton`` for the user-kernel tests: enough of Triton 3.6's autotuner, no GPU.

``Config``, ``jit`` (a ``JITFunction`` that calls the Python function with torch CPU
tensors), ``autotune``/``Autotuner`` (the key and cache logic of Triton 3.6's
``Autotuner.run``, with a deterministic fake benchmark) and ``OutOfResources``. Install
it with :func:`install`; write kernels to import with :func:`write_module`.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


class OutOfResources(Exception):
    """What Triton raises when a config needs more shared memory than the GPU has."""


class Config:
    def __init__(
        self,
        kwargs: dict[str, Any],
        num_warps: int = 4,
        num_stages: int = 3,
        num_ctas: int = 1,
        maxnreg: int | None = None,
        pre_hook: Callable[..., Any] | None = None,
        ir_override: str | None = None,
    ) -> None:
        self.kwargs = kwargs
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.num_ctas = num_ctas
        self.maxnreg = maxnreg
        self.pre_hook = pre_hook
        self.ir_override = ir_override

    def all_kwargs(self) -> dict[str, Any]:
        opts = {k: getattr(self, k) for k in OPTIONS if getattr(self, k) is not None}
        return {**self.kwargs, **opts}

    def __hash__(self) -> int:
        return hash((*self.all_kwargs().items(), self.pre_hook))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and (
            (*self.all_kwargs().items(), self.pre_hook)
            == (*other.all_kwargs().items(), other.pre_hook)
        )


class JITFunction:
    """Runs the Python function itself; records every launch (grid, arguments, options)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.arg_names = list(inspect.signature(fn).parameters)
        self.launches: list[tuple[Any, dict[str, Any]]] = []

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

    def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        bound = {**dict(zip(self.arg_names, args, strict=False)), **kwargs}
        g = grid(bound) if callable(grid) else grid
        self.launches.append((g, dict(bound)))
        return self.fn(**{k: v for k, v in bound.items() if k in self.arg_names})


class Autotuner:
    """Triton 3.6's ``Autotuner.run`` key and cache logic; ``bench`` times a config."""

    def __init__(
        self,
        fn: Any,
        arg_names: list[str],
        configs: list[Config],
        key: list[str],
        reset_to_zero: list[str] | None = None,
        restore_value: list[str] | None = None,
        pre_hook: Callable[..., Any] | None = None,
        post_hook: Callable[..., Any] | None = None,
        prune_configs_by: dict[str, Any] | None = None,
        do_bench: Callable[..., Any] | None = None,
        **_: Any,
    ) -> None:
        self.fn = fn
        self.arg_names = arg_names
        self.configs = configs or [Config({})]
        self.keys = key
        self.cache: dict[tuple[Any, ...], Config] = {}
        self.reset_to_zero = list(reset_to_zero or ())
        self.restore_value = list(restore_value or ())
        self.pre_hook = pre_hook or (lambda kwargs, reset_only=False: 0)
        self.post_hook = post_hook or (lambda kwargs, exception: 0)
        self.prune = (prune_configs_by or {}).get("early_config_prune")
        self.benchmarked: list[Config] = []

    def _bench(self, *args: Any, config: Config, **kwargs: Any) -> float:
        self.benchmarked.append(config)
        try:
            self.fn.run(*args, **kwargs, **config.all_kwargs())
        except OutOfResources:
            return float("inf")
        return TIMES.get(config.kwargs.get("BLOCK"), 1.0 / (1 + config.kwargs.get("BLOCK", 0)))

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self.nargs = dict(zip(self.arg_names, args, strict=False))
        if len(self.configs) > 1:
            all_args = {**self.nargs, **kwargs}
            _args = {k: v for k, v in all_args.items() if k in self.arg_names}
            key = [_args[k] for k in self.keys if k in _args]
            for arg in _args.values():
                if hasattr(arg, "dtype"):
                    key.append(str(arg.dtype))
            tkey = tuple(key)
            if tkey not in self.cache:
                pruned = self.prune(self.configs, self.nargs) if self.prune else self.configs
                if len(pruned) == 1:
                    self.cache[tkey] = pruned[0]
                else:
                    timings = {c: self._bench(*args, config=c, **kwargs) for c in pruned}
                    self.bench_time = 0.25
                    self.cache[tkey] = min(timings, key=timings.__getitem__)
                    self.configs_timings = timings
            config = self.cache[tkey]
        else:
            config = self.configs[0]
        self.best_config = config
        return self.fn.run(*args, **kwargs, **config.all_kwargs())

    def warmup(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []


#: Fake benchmark time by BLOCK value (default: bigger blocks are faster).
TIMES: dict[Any, float] = {}


def autotune(configs: list[Config], key: list[str], **kwargs: Any) -> Callable[[Any], Autotuner]:
    return lambda fn: Autotuner(fn, fn.arg_names, configs, key, **kwargs)


def jit(fn: Callable[..., Any]) -> JITFunction:
    return JITFunction(fn)


def install(monkeypatch: Any) -> types.ModuleType:
    """Put the fake in ``sys.modules['triton']`` for one test."""
    mod = types.ModuleType("triton")
    mod.__version__ = "3.6.0"  # type: ignore[attr-defined]
    for name in ("Config", "JITFunction", "Autotuner", "OutOfResources", "autotune", "jit"):
        setattr(mod, name, globals()[name])
    monkeypatch.setitem(sys.modules, "triton", mod)
    TIMES.clear()
    return mod


def write_module(root: Path, name: str, body: str, monkeypatch: Any) -> types.ModuleType:
    """Write ``root/name.py``, put ``root`` on sys.path and import it fresh."""
    (root / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.invalidate_caches()
    return importlib.import_module(name)


#: A kernel module: ``scale`` doubles x into y for every config (BLOCK 512 is out of
#: resources), ``partial`` handles only the first BLOCK columns (wrong when BLOCK < n).
KERNELS = """
import triton
import gpuwatchd.triton as gt

SHAPES = ((64, 4), (128, 4), (256, 8), (512, 8))
CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in SHAPES]


@gt.autotune(configs=CONFIGS, key=["n"])
@triton.jit
def scale(x_ptr, y_ptr, n, BLOCK):
    if BLOCK >= 512:
        raise triton.OutOfResources("out of resource: shared memory")
    y_ptr[:, :n] = x_ptr[:, :n] * 2


PARTIAL_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=4) for b in (64, 256, 256 + 1, 1024)]


@gt.autotune(configs=PARTIAL_CONFIGS, key=["n"])
@triton.jit
def partial(x_ptr, y_ptr, n, BLOCK):
    y_ptr[:, : min(n, BLOCK)] = x_ptr[:, : min(n, BLOCK)] * 2


def make_args(key_values):
    import torch

    n = key_values["n"]
    x = torch.arange(4 * n, dtype=torch.float32).reshape(4, n)
    return {"x_ptr": x}
"""


def sample_request(**changes: Any) -> Any:
    """A valid :class:`~gpuwatchd.tuning.submitted.kernels.KernelRequest` (fields overridable)."""
    from gpuwatchd.tuning.submitted.kernels import ArgSpec, ConfigSpec, KernelRequest
    from gpuwatchd.tuning.types import Regime, Versions

    fields: dict[str, Any] = {
        "module": "user_kernels.softmax",
        "qualname": "softmax_kernel",
        "identity": "ab" * 32,
        "key_names": ("n_cols",),
        "key_values": {"n_cols": 4096},
        "key_dtypes": ("torch.float16", "torch.float16"),
        "configs": (
            ConfigSpec({"BLOCK_N": 1024}, num_warps=4, num_stages=2, num_ctas=1, grid=(8192,)),
            ConfigSpec({"BLOCK_N": 2048}, num_warps=8, num_stages=2, num_ctas=1, grid=(8192,)),
        ),
        "args": (
            ArgSpec(
                "x_ptr",
                "tensor",
                shape=(8192, 4096),
                strides=(4096, 1),
                dtype="float16",
                device="cuda:0",
            ),
            ArgSpec(
                "y_ptr",
                "tensor",
                shape=(8192, 4096),
                strides=(4096, 1),
                dtype="float16",
                device="cuda:0",
            ),
            ArgSpec("n_cols", "int", 4096),
            ArgSpec("eps", "float", 1e-5),
            ArgSpec("flag", "bool", True),
            ArgSpec("act", "str", "gelu"),
            ArgSpec("bias", "none"),
        ),
        "regime": Regime.SUSTAINED,
        "gpu_model": "NVIDIA H100 80GB HBM3",
        "versions": Versions(driver="580.159.04", cuda="13.0", torch="2.11.0", triton="3.6.0"),
        "reset_to_zero": ("y_ptr",),
        "launch_options": {"enable_fp_fusion": True},
        "args_factory": "user_kernels.softmax:make_args",
        "origin": {"pid": 42, "python": "/usr/bin/python3"},
    }
    fields.update(changes)
    return KernelRequest(**fields)
