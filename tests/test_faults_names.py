"""Names from outside end where they seem to: a trailing newline is refused everywhere a
name is checked (issue 26, finding 10: ``re.match`` with ``$`` let ``"name\\n"`` pass)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.config.listen import parse_listen
from gpuwatchd.serve.web.config import parse_web_config
from gpuwatchd.triton_configs import configs_from_names
from gpuwatchd.tuning.intake.workload_requests import check_workload_name
from gpuwatchd.tuning.submitted.kernels import KernelRequestError, module_name, parse_import_path
from gpuwatchd.tuning.workloads import parse_workloads

HASH = "$2y$10$" + "a" * 53


def _workload(name: str) -> list[dict[str, Any]]:
    shape = {"m": 64, "n": 64, "k": 64}
    return [
        {"name": name, "op": "matmul", "shape": shape, "dtype": "float16",
         "families": ["torch.matmul"]}
    ]  # fmt: skip


CHECKS: dict[str, tuple[Callable[[str], object], str]] = {
    # name: (the check, a value it takes; the same value plus "\n" must be refused)
    "added workload name": (lambda v: check_workload_name(v, "name"), "job.gemm"),
    "configured workload name": (lambda v: parse_workloads(_workload(v), "workload"), "gemm-a"),
    "listen host": (parse_listen, "localhost:9844"),
    "kernel module": (lambda v: module_name(v, "module"), "pkg.kernels"),
    "kernel import path": (lambda v: parse_import_path(v, "kernel"), "pkg.mod:kernel"),
    "Triton candidate name": (lambda v: configs_from_names([v]), "triton[128x256x64,s4,w8,g8]"),
    "bcrypt hash": (
        lambda v: parse_web_config({"basic_auth_users": {"u": v}}, Path("/")),
        HASH,
    ),
}


@pytest.mark.parametrize("name", sorted(CHECKS))
@pytest.mark.parametrize("tail", ["\n", "\r\n", " "])
def test_a_name_with_a_trailing_newline_is_refused(name: str, tail: str) -> None:
    check, good = CHECKS[name]
    check(good)
    bad = good.replace(":9844", tail + ":9844") if name == "listen host" else good + tail
    with pytest.raises((ValueError, KernelRequestError)):
        check(bad)
