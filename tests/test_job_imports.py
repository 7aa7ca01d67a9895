"""What a job's import loads: every job pays ``import gpuwatchd.client`` (and ``.triton`` or
``.torch``), so none of them loads the store, the exporter, the daemon or the CLI; those
load when a call needs them (the winners read from a store file, say). The sets are
pinned: a module added to a job's import is a decision, made here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: Module prefixes no job import may load.
NEVER = (
    "gpuwatchd.store",
    "gpuwatchd.exporter",
    "gpuwatchd.cli",
    "gpuwatchd.daemon",
    "gpuwatchd.api.winners",
    "gpuwatchd.serve",
)

_CLIENT = {
    "gpuwatchd",
    "gpuwatchd.api",
    "gpuwatchd.api.document",
    "gpuwatchd.api.errors",
    "gpuwatchd.api.fetch",
    "gpuwatchd.api.gpu_state",
    "gpuwatchd.api.state",
    "gpuwatchd.client",
    "gpuwatchd.client.client",
    "gpuwatchd.client.discovery",
    "gpuwatchd.client.errors",
    "gpuwatchd.gate",
    "gpuwatchd.monitor",
    "gpuwatchd.monitor.board",
    "gpuwatchd.telemetry",
    "gpuwatchd.telemetry.types",
    "gpuwatchd.tuning",
    "gpuwatchd.tuning.types",
    "gpuwatchd.validate",
}
_JOBSIDE = {
    "gpuwatchd.client.control",
    "gpuwatchd.control",
    "gpuwatchd.control.wire",
    "gpuwatchd.jobside",
    "gpuwatchd.jobside.requests",
    # kernels takes its family's name from the family's spec; the specs load together
    "gpuwatchd.tuning.families",
    "gpuwatchd.tuning.families.cpu",
    "gpuwatchd.tuning.families.inductor_mm",
    "gpuwatchd.tuning.families.sim",
    "gpuwatchd.tuning.families.torch_conv",
    "gpuwatchd.tuning.families.torch_gemm",
    "gpuwatchd.tuning.families.torch_matmul",
    "gpuwatchd.tuning.families.triton_matmul",
    "gpuwatchd.tuning.families.triton_user",
    "gpuwatchd.tuning.intake",
    "gpuwatchd.tuning.intake.spool",
    "gpuwatchd.tuning.submitted",
    "gpuwatchd.tuning.submitted.kernels",
    "gpuwatchd.tuning.submitted.launch_options",
    "gpuwatchd.tuning.submitted.regular_file",
    "gpuwatchd.tuning.versions",  # kernels compares versions by the one rule
    "gpuwatchd.tuning.winners",
}
_TRITON = (
    _CLIENT
    | _JOBSIDE
    | {
        "gpuwatchd.triton",
        "gpuwatchd.jobside.autotune",
        "gpuwatchd.jobside.call",
        "gpuwatchd.jobside.lookup",
        "gpuwatchd.jobside.stack",
    }
)
_TORCH = (
    _CLIENT
    | _JOBSIDE
    | {
        "gpuwatchd.torch",
        "gpuwatchd.jobside.apply_winners",
        "gpuwatchd.jobside.capture",
        "gpuwatchd.jobside.inductor",
        "gpuwatchd.jobside.winner_plan",
        "gpuwatchd.jobside.workload_submit",
        "gpuwatchd.tuning.submitted.captured",
        "gpuwatchd.tuning.dtypes",
        "gpuwatchd.tuning.submitted.inductor_sites",
        "gpuwatchd.tuning.ops",
        "gpuwatchd.tuning.worker",
        "gpuwatchd.tuning.worker.candidate",
        "gpuwatchd.tuning.worker.cuda_session",
        "gpuwatchd.tuning.worker.inductor",
        "gpuwatchd.tuning.intake.workload_requests",
        "gpuwatchd.tuning.workloads",
    }
)


def loaded_by(module: str) -> set[str]:
    """The gpuwatchd modules a fresh interpreter holds after ``import module``."""
    code = (
        f"import sys, json; import {module}; "
        "print(json.dumps(sorted(n for n in sys.modules if n.split('.')[0] == 'gpuwatchd')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return set(json.loads(out.stdout))


@pytest.mark.parametrize(
    ("module", "expected"),
    [("gpuwatchd.client", _CLIENT), ("gpuwatchd.triton", _TRITON), ("gpuwatchd.torch", _TORCH)],
)
def test_a_jobs_import_loads_exactly_its_pinned_modules(module: str, expected: set[str]) -> None:
    got = loaded_by(module)
    assert not [m for m in got if any(m == n or m.startswith(n + ".") for n in NEVER)]
    assert got == expected


def test_the_winner_types_load_when_first_used() -> None:
    code = (
        "import sys; import gpuwatchd.client as c; assert 'gpuwatchd.store' not in sys.modules; "
        "w = c.Winner; import gpuwatchd.api.winners as m; assert w is m.Winner; "
        "assert c.RankedCandidate is m.RankedCandidate and c.parse_winners is m.parse_winners"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        import gpuwatchd.client

        _ = gpuwatchd.client.nope  # type: ignore[attr-defined]
