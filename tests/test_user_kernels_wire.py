"""User-kernel tuning requests: the wire format, kernel identity and the module allow-list."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
from user_kernels_fakes import sample_request

from gpuwatchd.tuning.submitted.kernels import (
    FAMILY,
    REQUEST_FORMAT,
    ConfigSpec,
    KernelRequest,
    KernelRequestError,
    config_spec,
    describe_arg,
    kernel_identity,
    kernel_source,
    request_from_workload,
    versions_mismatch,
)
from gpuwatchd.tuning.submitted.trust import (
    TrustError,
    check_request,
    module_allowed,
    parse_allowed_modules,
)
from gpuwatchd.tuning.types import Versions

# -- the wire format -----------------------------------------------------------------------------


def test_request_round_trips_through_json() -> None:
    req = sample_request()
    doc = json.loads(req.dumps())
    assert doc["format"] == REQUEST_FORMAT
    assert doc["configs"][1] == {
        "kwargs": {"BLOCK_N": 2048},
        "num_warps": 8,
        "num_stages": 2,
        "num_ctas": 1,
        "maxnreg": None,
        "pre_hook": False,
        "grid": [8192],
    }
    assert KernelRequest.loads(req.dumps()) == req
    assert "job_default" not in doc  # unknown: left out, so older daemons read the request


def test_workload_name_carries_kernel_identity_and_key() -> None:
    req = sample_request()
    assert req.workload_name == (
        "triton.user:user_kernels.softmax.softmax_kernel@abababab/n_cols=4096;float16,float16"
    )
    assert [c.label for c in req.configs] == ["BLOCK_N=1024,w4,s2", "BLOCK_N=2048,w8,s2"]


def test_a_very_long_key_is_hashed_in_the_name() -> None:
    req = sample_request(key_names=("s",), key_values={"s": "x" * 400})
    assert len(req.workload_name) < 120 and "/key-" in req.workload_name


def _mutate(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    parts = path.split(".")
    node: Any = doc
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    last = parts[-1]
    if value is _DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return doc


_DELETE = object()
_CFG0 = {"kwargs": {"BLOCK_N": 64}, "num_warps": 4, "grid": [1]}


@pytest.mark.parametrize(
    ("path", "value", "names"),
    [
        ("format", "other/1", "request.format"),
        ("kernel.module", "../evil", "request.kernel.module"),
        ("kernel.module", _DELETE, "request.kernel.module: missing"),
        ("kernel.qualname", "a b", "request.kernel.qualname"),
        ("kernel.identity", "zz", "request.kernel.identity"),
        ("kernel.extra", 1, "request.kernel.extra: unknown key"),
        ("configs", [], "request.configs"),
        ("configs.0.grid", None, "request.configs[0].grid"),
        ("configs.0.grid", [1, 2, 3, 4], "request.configs[0].grid"),
        ("configs.0.num_warps", "8", "request.configs[0].num_warps"),
        ("configs.0.kwargs", {"BLOCK_N": [1]}, "request.configs[0].kwargs.BLOCK_N"),
        ("configs", [_CFG0, _CFG0], "request.configs[1]: duplicate config"),
        ("args.0.kind", "pointer", "request.args[0].kind"),
        ("args.0.strides", [1], "request.args[0].strides"),
        ("args.0.shape", [-1, 2], "request.args[0].shape[0]"),
        ("args.2.value", "4096", "request.args[2].value"),
        ("args.3.value", True, "request.args[3].value"),
        ("reset_to_zero", ["nope"], "request.reset_to_zero"),
        ("key.values", {"other": 1}, "request.key.values"),
        ("regime", "hot", "request.regime"),
        ("versions", {"triton": 3}, "request.versions.triton"),
        ("args_factory", "no_colon", "request.args_factory"),
        ("gpu_model", "", "request.gpu_model"),
        ("job_default", "BLOCK_N=1,w1,s1", "request.job_default: expected one of the configs"),
        ("job_default", 3, "request.job_default"),
    ],
)
def test_bad_fields_are_one_line_errors_naming_the_field(path: str, value: Any, names: str) -> None:
    doc = _mutate(json.loads(sample_request().dumps()), path, value)
    with pytest.raises(KernelRequestError) as exc:
        KernelRequest.loads(json.dumps(doc))
    msg = str(exc.value)
    assert names in msg and "\n" not in msg


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("{", "not valid JSON"),
        ('{"format": NaN}', "NaN is not allowed"),
        ("[]", "expected an object"),
        (" " * 300_000, "larger than"),
    ],
)
def test_bad_documents_are_one_line_errors(text: str, what: str) -> None:
    with pytest.raises(KernelRequestError, match=what) as exc:
        KernelRequest.loads(text)
    assert "\n" not in str(exc.value)


def test_describe_arg_kinds() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, 6, dtype=torch.float16)[:, ::2]
    spec = describe_arg("x", t)
    assert (spec.kind, spec.shape, spec.strides, spec.dtype) == (
        "tensor",
        (4, 3),
        (6, 2),
        "float16",
    )
    assert describe_arg("n", 3).to_json() == {"name": "n", "kind": "int", "value": 3}
    assert describe_arg("f", True).kind == "bool"
    assert describe_arg("p", None).kind == "none"
    with pytest.raises(KernelRequestError, match="argument o: a object cannot be described"):
        describe_arg("o", object())
    with pytest.raises(KernelRequestError, match="non-finite"):
        describe_arg("x", float("nan"))


def test_config_spec_reads_triton_configs_by_attribute() -> None:
    class Cfg:
        kwargs: ClassVar[dict[str, object]] = {"BLOCK_M": 128, "ACT": "gelu"}
        num_warps, num_stages, num_ctas, maxnreg = 8, 3, 2, 128
        pre_hook = staticmethod(lambda nargs: None)
        ir_override = None

    spec = config_spec(Cfg(), grid=(4, 1))
    assert spec.label == 'BLOCK_M=128,ACT="gelu",w8,s3,c2,r128,hook'
    assert spec.grid == (4, 1) and spec.pre_hook
    Cfg.kwargs = {"BLOCK_M": object()}  # type: ignore[dict-item]
    with pytest.raises(KernelRequestError, match="meta-parameters must be"):
        config_spec(Cfg())


# -- identity -----------------------------------------------------------------------------------

KERNEL_V1 = '''
def kernel(x_ptr, n, BLOCK):
    """v1"""
    return n * 2
'''


def _load(tmp_path: Path, name: str, src: str) -> Any:
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.kernel


CFGS = [ConfigSpec({"BLOCK": 64}, 4, 3, 1), ConfigSpec({"BLOCK": 128}, 8, 3, 1)]


def test_identity_is_stable_for_the_same_source_configs_and_key(tmp_path: Path) -> None:
    a = _load(tmp_path, "k_a", KERNEL_V1)
    b = _load(tmp_path, "k_b", "# another file, same kernel\n" + KERNEL_V1)
    assert kernel_source(a) == kernel_source(b)
    assert kernel_identity(kernel_source(a), CFGS, ["n"]) == kernel_identity(
        kernel_source(b), list(CFGS), ("n",)
    )


def test_an_edited_kernel_or_config_list_is_a_new_identity(tmp_path: Path) -> None:
    src = kernel_source(_load(tmp_path, "k_v1", KERNEL_V1))
    edited = kernel_source(_load(tmp_path, "k_v2", KERNEL_V1.replace("n * 2", "n * 3")))
    base = kernel_identity(src, CFGS, ["n"])
    assert kernel_identity(edited, CFGS, ["n"]) != base
    assert kernel_identity(src, [CFGS[0], ConfigSpec({"BLOCK": 128}, 4, 3, 1)], ["n"]) != base
    assert kernel_identity(src, list(reversed(CFGS)), ["n"]) != base
    assert kernel_identity(src, CFGS, ["n", "BLOCK"]) != base
    # the grid a call used is not part of the kernel's identity
    with_grid = [ConfigSpec({"BLOCK": 64}, 4, 3, 1, grid=(7,)), CFGS[1]]
    assert kernel_identity(src, with_grid, ["n"]) == base


def test_kernel_source_unwraps_decorators_and_wrappers(tmp_path: Path) -> None:
    fn = _load(tmp_path, "k_w", KERNEL_V1)

    class Jit:
        def __init__(self, f: Any) -> None:
            self.fn = f

    assert kernel_source(Jit(Jit(fn))).startswith("def kernel(")
    with pytest.raises(KernelRequestError, match="not a Triton kernel"):
        kernel_source(object())


# -- the allow-list ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "prefixes", "ok"),
    [
        ("user_kernels.softmax", ["user_kernels"], True),
        ("user_kernels", ["user_kernels"], True),
        ("user_kernels_evil", ["user_kernels"], False),
        ("user_kernels.softmax", ["user_kernels.softmax"], True),
        ("user_kernels.layer_norm", ["user_kernels.softmax"], False),
        ("anything", [], False),
    ],
)
def test_module_allowed_matches_whole_dotted_prefixes(
    module: str, prefixes: list[str], ok: bool
) -> None:
    assert module_allowed(module, prefixes) is ok


def test_empty_allow_list_accepts_no_request() -> None:
    req = sample_request()
    with pytest.raises(TrustError, match="nothing is imported until set") as exc:
        check_request(req, [])
    assert "request.kernel" in str(exc.value)


def test_args_factory_module_must_be_allowed_too() -> None:
    req = sample_request(args_factory="elsewhere.factories:make")
    with pytest.raises(TrustError, match=r"request\.args_factory"):
        check_request(req, ["user_kernels"])
    check_request(sample_request(), ["user_kernels"])


def test_parse_allowed_modules_rejects_non_modules() -> None:
    assert parse_allowed_modules(["a.b", "c"]) == ("a.b", "c")
    with pytest.raises(TrustError, match=r"tuning.allowed_modules\[1\]"):
        parse_allowed_modules(["a", "b/c"])
    with pytest.raises(TrustError, match="expected a list"):
        parse_allowed_modules("a")


def test_request_as_workload_and_back() -> None:
    req = sample_request()
    w = req.to_workload()
    assert (w.op, w.families, w.dtype) == (FAMILY, (FAMILY,), "float16")
    assert w.shape == {"key": {"n_cols": 4096}, "dtypes": ["float16", "float16"]}
    assert set(w.params) == {"request"}  # no allow-list travels with the work
    assert request_from_workload(w) == req
    renamed = type(w)(**{**w.to_json(), "name": "other", "families": w.families})
    with pytest.raises(KernelRequestError, match="its request names workload"):
        request_from_workload(renamed)


# -- versions ------------------------------------------------------------------------------------


def test_versions_mismatch_compares_triton_cuda_and_driver() -> None:
    ours = Versions(driver="580.1", cuda="13.0", torch="2.11", triton="3.6.0")
    assert versions_mismatch(ours, ours) is None
    assert versions_mismatch(Versions(driver=None, cuda="13.0", triton="3.6.0"), ours) is None
    assert "triton 3.5.0 recorded" in (versions_mismatch(Versions(triton="3.5.0"), ours) or "")
    assert "cuda 12.8" in (versions_mismatch(Versions(cuda="12.8", triton="3.6.0"), ours) or "")
    assert "unknown" in (versions_mismatch(Versions(cuda="13.0"), ours) or "")
    # torch does not matter to a Triton kernel
    assert versions_mismatch(Versions(torch="2.10", cuda="13.0", triton="3.6.0"), ours) is None
