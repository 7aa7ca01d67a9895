"""Launch options of a tuning request: an allow-list of typed keywords, nothing else.

Triton takes compile options as launch keywords (``ir_override`` compiles a file it
names, ``ptx_options`` becomes ptxas's argv), so a job's request may carry only the
keywords of :data:`~gpuwatchd.tuning.submitted.launch_options.LAUNCH_OPTIONS`; the daemon refuses
the rest where the request is parsed and the worker again before it launches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import user_kernels_fakes as fakes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatchd.tuning.submitted.kernels import KernelRequest, KernelRequestError
from gpuwatchd.tuning.submitted.launch_options import (
    LAUNCH_OPTIONS,
    check_keywords,
    parse_launch_options,
)
from gpuwatchd.tuning.submitted.trust import TrustError, check_workload

HOSTILE = {
    "ir_override": "/tmp/evil.ptx",
    "ptx_options": "--options-file /etc/shadow",
    "extern_libs": {"libdevice": "/tmp/evil.bc"},
    "debug": True,
    "arch": "sm_90",
}


def _doc(**launch_options: Any) -> dict[str, Any]:
    doc = fakes.sample_request().to_json()
    doc["launch_options"] = launch_options
    return doc


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_request_carrying_a_compile_option_is_refused_in_one_line(name: str) -> None:
    with pytest.raises(KernelRequestError) as err:
        KernelRequest.from_json(_doc(**{name: HOSTILE[name]}))
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("request.launch_options: not an allowed launch option")
    assert repr(name) in text


def test_the_same_request_from_the_spool_text_is_refused() -> None:
    with pytest.raises(KernelRequestError, match="not an allowed launch option"):
        KernelRequest.loads(json.dumps(_doc(ir_override="/tmp/evil.ptx")))


def test_a_configured_workload_carrying_a_compile_option_is_refused() -> None:
    good = fakes.sample_request()
    workload = good.to_workload()
    workload.params["request"]["launch_options"] = {"ptx_options": "--options-file /etc/shadow"}
    with pytest.raises(TrustError, match="not an allowed launch option"):
        check_workload(workload, ("user_kernels",))


@pytest.mark.parametrize(
    ("options", "what"),
    [
        ({"num_warps": "4"}, "request.launch_options.num_warps: expected an integer in [1, 64]"),
        ({"num_warps": True}, "request.launch_options.num_warps: expected an integer"),
        ({"num_warps": 4096}, "request.launch_options.num_warps: expected an integer"),
        ({"launch_pdl": 1}, "request.launch_options.launch_pdl: expected true or false"),
        ({"default_dot_input_precision": "/x"}, "expected one of tf32, tf32x3, ieee"),
    ],
)
def test_allowed_keywords_take_typed_values_only(options: dict[str, Any], what: str) -> None:
    with pytest.raises(KernelRequestError) as err:
        KernelRequest.from_json(_doc(**options))
    assert what in str(err.value)


def test_allowed_keywords_with_good_values_pass() -> None:
    opts = {"num_warps": 8, "num_stages": 3, "enable_fp_fusion": False, "maxnreg": 128}
    assert KernelRequest.from_json(_doc(**opts)).launch_options == opts


def test_a_request_built_in_a_job_with_a_compile_option_is_refused() -> None:
    with pytest.raises(KernelRequestError, match="not an allowed launch option"):
        fakes.sample_request(launch_options={"ir_override": "/tmp/evil.ptx"})


def test_the_worker_refuses_any_keyword_that_is_not_a_parameter_or_allowed() -> None:
    params = frozenset({"x_ptr", "n", "BLOCK"})
    check_keywords(["x_ptr", "n", "BLOCK", "num_warps"], params, "launch")
    with pytest.raises(ValueError) as err:
        check_keywords(["x_ptr", "ir_override"], params, "launch")
    assert str(err.value).startswith("launch: neither a parameter of the kernel")
    assert str(err.value).endswith("got 'ir_override'")


# -- in the worker, with the fake Triton ---------------------------------------------------


@pytest.fixture
def mods(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    fakes.install(monkeypatch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (tmp_path / "mods").mkdir()
    return fakes.write_module(tmp_path / "mods", "uklo_kernels", fakes.KERNELS, monkeypatch)


def _worker_request(mods: Any, tmp_path: Path) -> KernelRequest:
    from test_user_kernels_family import _request

    return _request(mods.scale, tmp_path, 100)


def test_the_worker_checks_launch_options_again_before_it_launches(
    mods: Any, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    from gpuwatchd.tuning.worker.families.triton_user import UserKernel

    req = _worker_request(mods, tmp_path)
    object.__setattr__(req, "launch_options", {"ir_override": "/tmp/evil.ptx"})
    kernel = UserKernel(req, ("uklo_kernels",), torch.device("cpu"))
    with pytest.raises(ValueError, match="not an allowed launch option"):
        kernel.acquire()
    assert not [g for g, kw in mods.scale.fn.launches if "ir_override" in kw]


def test_an_argument_named_like_a_compile_option_never_reaches_the_launch(
    mods: Any, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    from gpuwatchd.tuning.submitted.kernels import ArgSpec
    from gpuwatchd.tuning.worker.families.triton_user import UserKernel

    req = _worker_request(mods, tmp_path)
    args = (*req.args, ArgSpec("ptx_options", "str", "--options-file /etc/shadow"))
    object.__setattr__(req, "args", args)
    kernel = UserKernel(req, ("uklo_kernels",), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"request\.args: neither a parameter of the kernel"):
        kernel.acquire()
    assert not [g for g, kw in mods.scale.fn.launches if "ptx_options" in kw]


# -- fuzz ------------------------------------------------------------------------------------

_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
_NAMES = st.sampled_from([*LAUNCH_OPTIONS, *HOSTILE]) | st.text(max_size=16)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_NAMES, _JSON, max_size=5))
def test_fuzz_launch_options_are_allowed_and_typed_or_refused_in_one_line(
    options: dict[str, Any],
) -> None:
    try:
        got = parse_launch_options(options)
    except ValueError as e:
        assert "\n" not in str(e) and str(e).startswith("request.launch_options")
        return
    assert got == options
    for name, value in got.items():
        assert LAUNCH_OPTIONS[name].accepts(value)
        assert not isinstance(value, dict | list | float) and value is not None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["launch_options", "configs", "args", "kernel", "key", "origin"]), _JSON)
def test_fuzz_a_request_field_replaced_by_any_json_is_parsed_or_refused_in_one_line(
    field: str, value: Any
) -> None:
    doc = fakes.sample_request().to_json()
    doc[field] = value
    try:
        req = KernelRequest.from_json(doc)
    except KernelRequestError as e:
        assert "\n" not in str(e)
        return
    assert set(req.launch_options) <= set(LAUNCH_OPTIONS)


#: Every allowed keyword with what it takes, written out (not derived from the module).
INTS = {"num_warps": (1, 64), "num_stages": (0, 16), "num_ctas": (1, 16), "maxnreg": (1, 255)}
BOOLS = ("enable_fp_fusion", "launch_cooperative_grid", "launch_pdl")
PRECISIONS = ("tf32", "tf32x3", "ieee")


def test_the_allow_list_is_exactly_these_keywords_and_types() -> None:
    assert set(LAUNCH_OPTIONS) == {*INTS, *BOOLS, "default_dot_input_precision"}
    for name, (low, high) in INTS.items():
        assert parse_launch_options({name: low}) == {name: low}
        assert parse_launch_options({name: high}) == {name: high}
        for bad in (low - 1, high + 1, True, "4", 4.0, None):
            with pytest.raises(ValueError) as err:
                parse_launch_options({name: bad})
            assert str(err.value) == (
                f"request.launch_options.{name}: expected an integer in [{low}, {high}], "
                f"got {bad!r}"
            )
    for name in BOOLS:
        for good in (True, False):
            assert parse_launch_options({name: good}) == {name: good}
        for bad in (1, 0, "true", None):
            with pytest.raises(ValueError, match=rf"\.{name}: expected true or false, got"):
                parse_launch_options({name: bad})
    for good in PRECISIONS:
        assert parse_launch_options({"default_dot_input_precision": good}) == {
            "default_dot_input_precision": good
        }
    for bad in ("TF32", "", 1, None):
        with pytest.raises(ValueError, match="expected one of tf32, tf32x3, ieee, got"):
            parse_launch_options({"default_dot_input_precision": bad})


def test_a_refusal_names_the_keyword_and_lists_the_allowed_ones() -> None:
    with pytest.raises(ValueError) as err:
        parse_launch_options({"ir_override": "/tmp/x"}, "spool/a.json: request.launch_options")
    allowed = ", ".join([*INTS, *BOOLS, "default_dot_input_precision"])
    assert str(err.value) == (
        "spool/a.json: request.launch_options: not an allowed launch option "
        f"(allowed: {allowed}), got 'ir_override'"
    )
    with pytest.raises(ValueError) as err:
        parse_launch_options(["num_warps"])
    assert str(err.value) == "request.launch_options: expected an object, got ['num_warps']"
    with pytest.raises(ValueError, match="not an allowed launch option"):
        parse_launch_options({4: 4})
