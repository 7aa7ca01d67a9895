"""Family specs (gpuwatchd/tuning/families) and worker implementations name each other.

Every spec names a worker module and a builder that exist, every builder of the worker
package has a spec, every op a spec names has a shape rule, and the daemon reads the
specs without importing torch or the worker package.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpuwatchd.tuning.worker.families as worker_families
from gpuwatchd.tuning import ops
from gpuwatchd.tuning.families import KNOWN_OPS, SPECS, WORKER_PACKAGE, FamilySpec, specs_for
from gpuwatchd.tuning.types import Workload

WORKER_DIR = Path(worker_families.__file__).parent


def _builders(module: str) -> set[str]:
    """Top-level functions of a worker module that build candidates (``build``, ``*_family``)."""
    tree = ast.parse((WORKER_DIR / f"{module}.py").read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and (node.name == "build" or node.name.endswith("_family"))
    }


@pytest.mark.parametrize("spec", SPECS.values(), ids=lambda s: s.name)
def test_every_spec_has_an_implementation(spec: FamilySpec) -> None:
    module, _, attr = spec.implementation.partition(":")
    assert module == f"{WORKER_PACKAGE}.{spec.module}"
    assert importlib.util.find_spec(module) is not None, module
    assert attr in _builders(spec.module), f"{module} defines no {attr}"


def test_every_implementation_has_a_spec() -> None:
    declared = {(s.module, s.builder) for s in SPECS.values()}
    found = {
        (info.name, fn)
        for info in pkgutil.iter_modules([str(WORKER_DIR)])
        for fn in _builders(info.name)
    }
    assert found == declared


def test_family_names_and_ops_are_those_of_the_specs() -> None:
    assert set(worker_families.family_names()) >= set(SPECS)
    assert set(KNOWN_OPS) == set(ops.SHAPES), "an op without a shape rule, or a rule unused"
    for spec in SPECS.values():
        assert spec.ops and all(op in KNOWN_OPS for op in spec.ops)


def test_a_worker_module_finds_its_specs_by_its_name() -> None:
    for spec in SPECS.values():
        assert spec in specs_for(f"{WORKER_PACKAGE}.{spec.module}")
    assert specs_for(f"{WORKER_PACKAGE}.common") == ()


def test_a_family_refuses_an_op_it_does_not_run_in_one_line() -> None:
    with pytest.raises(
        ValueError,
        match=r"^workload w: family sim cannot run op 'conv2d' \(it runs gemm, matmul\)$",
    ):
        SPECS["sim"].require_op("w", "conv2d")


def test_the_conv_shape_rule_is_one_rule_for_the_daemon_and_the_worker() -> None:
    bad = Workload(
        "c", "conv2d", {"input": [1, 3, 8, 8], "weight": [4, 2, 3, 3]}, "fp32", ("torch.conv2d",)
    )
    with pytest.raises(ValueError) as daemon:
        ops.check_workload(bad, "workload[0]", frozenset())
    from gpuwatchd.tuning.worker.families import torch_conv

    with pytest.raises(ValueError) as worker:
        torch_conv.parse_conv(bad)
    tail = "shape.weight: has 2 input channels per group, input has 3 in 1, got [4, 2, 3, 3]"
    assert str(daemon.value) == f"workload[0].{tail}"
    assert str(worker.value) == f"workload 'c': {tail}"


def test_reading_the_specs_imports_neither_torch_nor_the_worker() -> None:
    code = (
        "import sys, gpuwatchd.tuning.families, gpuwatchd.tuning.ops\n"
        "bad = [m for m in sys.modules\n"
        "       if m == 'torch' or m.startswith('gpuwatchd.tuning.worker')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("spec", SPECS.values(), ids=lambda s: s.name)
def test_a_family_that_imports_user_code_takes_the_allowed_modules(spec: FamilySpec) -> None:
    tree = ast.parse((WORKER_DIR / f"{spec.module}.py").read_text())
    (builder,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == spec.builder]
    assert (len(builder.args.args) == 3) == spec.user_code, spec.name
