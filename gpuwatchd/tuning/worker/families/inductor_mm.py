"""``inductor.mm`` family: the kernels torch.compile itself would pick from, for one GEMM site.

A workload (:func:`~gpuwatchd.tuning.submitted.inductor_sites.parse_site_workload`) describes one
GEMM as Inductor saw it in a job's graph: op (``mm``, ``addmm``, ``bmm``, ``baddbmm``),
inputs with their strides, scalars, and the lookup keys of its asks. The family
rebuilds those inputs here, compiles the op once with gpuwatchd's recording handler to
learn what Inductor generates on this GPU and this torch (ATen's cuBLAS call, each
Triton template config, ...), and checks the keys match the job's. Each generated
choice is a candidate: compiled alone with a one-choice lookup table, so the kernel
timed is exactly the kernel a job compiling with gpuwatchd's table will run.

Each candidate replays its compiled call from a CUDA graph (as ``mode="max-autotune"``
runs a compiled model), so the timing holds no Python or guard overhead. Its
``meta`` carries the lookup entry (``lookup_entry``, ``lookup_key``, ``site_keys``):
:func:`gpuwatchd.torch.inductor_lookup_table` builds the job's table from the winners'.
``params.max_choices`` keeps the first N choices (ATen first) for a short session.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from gpuwatchd.tuning.submitted.inductor_sites import (
    EXCLUSIVE,
    FAMILY,
    SiteSpec,
    TensorDesc,
    entry_label,
    is_default_choice,
    parse_site_workload,
)
from gpuwatchd.tuning.types import Workload
from gpuwatchd.tuning.winners import JOB_DEFAULT
from gpuwatchd.tuning.worker.candidate import CandidateError, DeviceSession
from gpuwatchd.tuning.worker.cuda_session import (
    first_line,
    fp32_precision,
    launched_kernels,
    relative_error,
    require_cuda_device,
)
from gpuwatchd.tuning.worker.families.base import CandidateBase
from gpuwatchd.tuning.worker.inductor import (
    InductorUnsupported,
    fresh_function,
    handler_installed,
    lookup_table_support,
    recording_handler,
    table_handler,
)

if TYPE_CHECKING:
    import torch

#: Inductor options every compile here uses: GEMM templates on, nothing else autotuned.
COMPILE_CONFIG: dict[str, Any] = {
    "max_autotune": False,
    "max_autotune_gemm": True,
    "coordinate_descent_tuning": False,
}
_ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _mm(a: Any, b: Any) -> Any:
    import torch

    return torch.mm(a, b)


def _bmm(a: Any, b: Any) -> Any:
    import torch

    return torch.bmm(a, b)


def _op_function(spec: SiteSpec) -> Callable[..., Any]:
    """The one torch call whose lowering is the site (scalars bound as in the job)."""
    import torch

    if spec.op_name == "mm":
        return _mm
    if spec.op_name == "bmm":
        return _bmm
    beta, alpha = spec.scalars.get("beta", 1), spec.scalars.get("alpha", 1)
    op = torch.addmm if spec.op_name == "addmm" else torch.baddbmm

    def biased(bias: Any, a: Any, b: Any) -> Any:
        return op(bias, a, b, beta=beta, alpha=alpha)

    return biased


def _precision(spec: SiteSpec, tf32: bool) -> AbstractContextManager[Any]:
    """The fp32 matmul mode for a float32 site; other dtypes leave torch's flags alone."""
    if spec.inputs[-1].dtype != "float32":
        return nullcontext()
    return fp32_precision("matmul", tf32)


class SiteInputs:
    """The site's inputs (exact sizes and strides) and a float64 reference, shared."""

    def __init__(self, spec: SiteSpec, device: torch.device, seed: int) -> None:
        import torch

        g = torch.Generator(device=device).manual_seed(seed)
        self.spec = spec
        self.tensors = tuple(_strided_randn(d, device, g) for d in spec.inputs)
        self.fn = _op_function(spec)
        with torch.no_grad():
            self.reference = self.fn(*(t.double() for t in self.tensors))

    @property
    def flops(self) -> int:
        a, b = self.spec.inputs[-2], self.spec.inputs[-1]
        batch = a.size[0] if len(a.size) == 3 else 1
        return 2 * batch * a.size[-2] * a.size[-1] * b.size[-1]

    @property
    def bytes(self) -> int:
        a, b = self.spec.inputs[-2], self.spec.inputs[-1]
        batch = a.size[0] if len(a.size) == 3 else 1
        elems = sum(_numel(d) for d in self.spec.inputs) + batch * a.size[-2] * b.size[-1]
        return elems * _ELEM_BYTES[b.dtype]

    @property
    def tolerance(self) -> float:
        dtype = self.spec.inputs[-1].dtype
        return {"bfloat16": 2e-2, "float16": 1e-2}.get(dtype, 1e-2)


def _numel(d: TensorDesc) -> int:
    """Elements the strided storage really spans (a stride-0 bias is one row)."""
    return 1 + sum((s - 1) * st for s, st in zip(d.size, d.stride, strict=True))


def _strided_randn(d: TensorDesc, device: Any, g: Any) -> Any:
    import torch

    dt = getattr(torch, d.dtype)
    t = torch.empty_strided(d.size, d.stride, dtype=dt, device=device)
    base = torch.randn(_numel(d), dtype=dt, device=device, generator=g)
    t.as_strided((_numel(d),), (1,)).copy_(base)
    return t


class InductorChoice(CandidateBase):
    """One choice Inductor generated for the site, compiled alone and replayed."""

    family = FAMILY

    def __init__(
        self,
        inputs: SiteInputs,
        key: str,
        entry: dict[str, Any],
        site_keys: tuple[str, ...],
        tf32: bool,
        tag: str,
    ) -> None:
        super().__init__(f"inductor[{entry_label(entry)}]")
        self._inputs = inputs
        self._key = key
        self._entry = entry
        self._site_keys = site_keys
        self._tf32 = tf32
        self._tag = tag
        self._compiled: Callable[..., Any] | None = None
        self._graph: Any = None
        self._out: Any = None

    def table(self) -> dict[str, list[dict[str, Any]]]:
        """A one-choice table: this entry under its key, every site key exclusive."""
        table: dict[str, list[dict[str, Any]]] = {k: [dict(EXCLUSIVE)] for k in self._site_keys}
        table[self._key] = [dict(self._entry), dict(EXCLUSIVE)]
        return table

    def _setup(self) -> None:
        import torch

        handler = table_handler()
        fn = fresh_function(self._inputs.fn, self._tag)
        args = self._inputs.tensors
        try:
            with _precision(self._inputs.spec, self._tf32), torch.no_grad():
                compiled = torch.compile(fn, dynamic=False, fullgraph=True)
                t0 = time.perf_counter()
                with handler_installed(handler, self.table(), **COMPILE_CONFIG):
                    out = compiled(*args)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
                self._compiled = compiled
                handed = sum(n for _, _, n in handler.handed)
                if handed != 1:
                    raise CandidateError(
                        f"{self.name}: Inductor was handed {handed} choices for the site "
                        f"(expected exactly this one); keys seen: {handler.handed}"
                    )
                err = relative_error(out, self._inputs.reference)
                if not err <= self._inputs.tolerance:
                    raise CandidateError(
                        f"{self.name}: wrong result, relative error {err:.3g} over "
                        f"{self._inputs.tolerance:g} against a float64 reference"
                    )
                aten = str(self._entry["template_id"]).startswith("aten::")
                # Inductor names its Triton kernels by position, not config: not worth a profile
                kernels = launched_kernels(lambda: compiled(*args)) if aten else []
                self._graph, self._out = self._capture(compiled, args)
        except (RuntimeError, AssertionError) as e:
            raise CandidateError(f"{self.name}: {type(e).__name__}: {first_line(e)}") from e
        config = {k: v for k, v in self._entry.items() if k not in ("template_id", "template_hash")}
        self._meta = {
            "template_id": self._entry["template_id"],
            "config": config,
            "lookup_key": self._key,
            "lookup_entry": dict(self._entry),
            "site_keys": list(self._site_keys),
            "kernels": kernels,
            # ATen's cuBLAS kernel names identify the code; Inductor's Triton names do not
            "kernels_identify_code": aten,
            # one default: with bias_addmm marked too, the protocol's default was whichever
            # of the two came first
            JOB_DEFAULT: is_default_choice(self._entry, self._inputs.spec.op_name),
            "cuda_graph": self._graph is not None,
            "compile_s": compile_s,
            "flops": self._inputs.flops,
            "bytes": self._inputs.bytes,
            "working_set_bytes": self._inputs.bytes,
            "rel_error": err,
        }

    @staticmethod
    def _capture(compiled: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, Any]:
        """A CUDA graph of one compiled call (warmed on a side stream, as torch asks)."""
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                compiled(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            out = compiled(*args)
        return graph, out

    def run(self, calls: int) -> None:
        if self._graph is None:
            raise CandidateError(f"{self.name}: run before setup")
        for _ in range(calls):
            self._graph.replay()

    def teardown(self) -> None:
        self._graph = self._out = self._compiled = None


def enumerate_site(inputs: SiteInputs, tf32: bool) -> list[tuple[str, dict[str, Any]]]:
    """Compile the site once with the recording handler: every (key, entry) Inductor
    generates here, ATen first. CandidateError when the keys differ from the job's."""
    import torch

    handler = recording_handler()
    fn = fresh_function(inputs.fn, "record")
    with _precision(inputs.spec, tf32), torch.no_grad():
        compiled = torch.compile(fn, dynamic=False, fullgraph=True)
        with handler_installed(handler, None, **COMPILE_CONFIG):
            compiled(*inputs.tensors)
    sites = handler.sites()
    if len(sites) != 1:
        raise CandidateError(f"{FAMILY}: compiling the op gave {len(sites)} GEMM sites, not 1")
    site = sites[0]
    if site.keys != inputs.spec.keys:
        raise CandidateError(
            f"{FAMILY}: Inductor keys this GEMM here as {list(site.keys)}, the job saw "
            f"{list(inputs.spec.keys)} (another torch, or inputs it lays out differently)"
        )
    choices = site.choices()
    choices.sort(key=lambda kc: not str(kc[1]["template_id"]).startswith("aten::"))
    return choices


def build(workload: Workload, session: DeviceSession) -> list[InductorChoice]:
    """One candidate per choice Inductor generates for the site (``params.max_choices``)."""
    spec = parse_site_workload(workload)
    params = workload.params
    limit = params.get("max_choices")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(
            f"workload {workload.name!r}: params.max_choices must be an integer >= 1, got {limit!r}"
        )
    tf32 = params.get("tf32", False)
    if not isinstance(tf32, bool):
        raise ValueError(f"workload {workload.name!r}: params.tf32 must be true or false")
    seed = params.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"workload {workload.name!r}: params.seed must be an integer")
    device = require_cuda_device(session, FAMILY)
    why = lookup_table_support()
    if why is not None:
        raise CandidateError(f"{FAMILY}: {why}")
    try:
        inputs = SiteInputs(spec, device, seed)
        choices = enumerate_site(inputs, tf32)
    except InductorUnsupported as e:
        raise CandidateError(f"{FAMILY}: {e}") from e
    except (RuntimeError, AssertionError) as e:
        raise CandidateError(f"{FAMILY}: {type(e).__name__}: {first_line(e)}") from e
    out: list[InductorChoice] = []
    names: set[str] = set()
    for i, (key, entry) in enumerate(choices):
        cand = InductorChoice(inputs, key, entry, spec.keys, tf32, f"c{i}")
        if cand.name in names:
            continue  # two entries that differ only in derived flags: one kernel
        names.add(cand.name)
        out.append(cand)
    return out[:limit] if limit is not None else out
