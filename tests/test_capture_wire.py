"""The plain-data side of captured workloads (no torch): the capture document, the
add/list/remove requests, workload files, TOML writing and the workload spool."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from spool_helpers import scan_all

from gpuwatchd.control.wire import ADD_WORKLOADS as ADD_OP
from gpuwatchd.control.wire import REMOVE_WORKLOADS as REMOVE_OP
from gpuwatchd.tuning.intake.spool import (
    REJECTED_DIR,
    SUBDIR,
    WORKLOADS,
    Spool,
    write_workload_request,
)
from gpuwatchd.tuning.intake.workload_requests import (
    MAX_WORKLOADS,
    add_request,
    check_workload_name,
    list_request,
    parse_add_request,
    parse_remove_request,
    read_workloads_file,
    remove_request,
    workloads_toml,
)
from gpuwatchd.tuning.submitted.captured import (
    CAPTURE_FORMAT,
    CapturedCall,
    CapturedSet,
    parse_capture,
    share_table,
    to_workloads,
    workload_for,
)
from gpuwatchd.tuning.types import Workload

GEMM = {"m": 64, "n": 32, "k": 16}


def gemm(
    m: int = 8192,
    n: int = 3072,
    k: int = 1024,
    *,
    batch: int = 1,
    layout: str = "nt",
    phase: str = "forward",
    share: float = 0.2,
    dtype: str = "bfloat16",
    tf32: bool = False,
    calls: int = 4,
) -> CapturedCall:
    return CapturedCall(
        "gemm", "mm", phase, dtype, {"batch": batch, "m": m, "n": n, "k": k}, layout,
        False, tf32, calls, share * 0.01, share,
    )  # fmt: skip


def conv(
    *,
    phase: str = "forward",
    layout: str = "contiguous",
    share: float = 0.1,
    tf32: bool = True,
    bias: bool = False,
) -> CapturedCall:
    shape = {
        "input": [64, 3, 224, 224],
        "weight": [64, 3, 3, 3],
        "stride": [1, 1],
        "padding": [1, 1],
        "dilation": [1, 1],
        "groups": 1,
    }
    aten = "convolution" if phase == "forward" else "convolution_backward"
    return CapturedCall(
        "conv2d", aten, phase, "float32", shape, layout, bias, tf32, 2, share * 0.01, share
    )


# -- calls -> workloads ----------------------------------------------------------------------


def test_gemm_workloads_pick_the_family_by_layout_and_batch() -> None:
    plain = workload_for(gemm(layout="nn"))
    assert (plain.name, plain.op, plain.families, plain.params) == (
        "model.gemm.bf16.8192x3072x1024.nn",
        "matmul",
        ("torch.matmul",),
        {},
    )
    transposed = workload_for(gemm(layout="tn"))
    assert transposed.families == ("torch.gemm",) and transposed.params == {"layout": "tn"}
    batched = workload_for(gemm(128, 128, 64, batch=32, layout="nn"))
    assert batched.op == "bmm" and batched.shape == {"batch": 32, "m": 128, "n": 128, "k": 64}
    assert batched.families == ("torch.gemm",) and batched.name.endswith(".b32.nn")


def test_float32_workloads_carry_the_jobs_tf32_setting() -> None:
    w = workload_for(gemm(dtype="float32", tf32=True, layout="nn"))
    assert w.params == {"tf32": True} and w.name.endswith(".tf32")
    c = workload_for(conv(tf32=False))
    assert c.params == {"tf32": False} and c.name.endswith(".ieee")
    assert c.families == ("torch.conv2d",) and c.shape["stride"] == [1, 1]


def test_calls_that_tune_alike_make_one_workload_ranked_by_summed_share() -> None:
    calls = [
        gemm(share=0.10, phase="forward"),
        gemm(share=0.15, phase="backward"),  # same GEMM, same layout: same workload
        gemm(4096, 4096, 4096, share=0.2),
        conv(share=0.05),
        conv(share=0.02, bias=True),  # with and without bias: one workload
        conv(share=0.01, layout="channels_last"),  # the job's layouts make their own workload
        conv(share=0.5, phase="backward"),  # not tuned: the family times forward only
        gemm(share=0.9, dtype="float64"),  # no family measures float64
    ]
    ws = to_workloads(calls)
    assert [w.name for w in ws] == [
        "model.gemm.bf16.8192x3072x1024.nt",
        "model.gemm.bf16.4096x4096x4096.nt",
        "model.conv.f32.64x3x224x224.64x3x3x3.s1.p1.tf32",
        "model.conv.f32.64x3x224x224.64x3x3x3.s1.p1.tf32.cl",
    ]
    assert ws[3].params == {
        "tf32": True,
        "input_layout": "channels_last",
        "weight_layout": "channels_last",
    }
    assert to_workloads(calls, top=1) == ws[:1]
    assert to_workloads(calls, min_share=0.1) == ws[:2]


def test_an_untunable_call_has_no_workload() -> None:
    with pytest.raises(ValueError, match="not tunable"):
        workload_for(conv(phase="backward"))


def test_share_table_lists_every_call_largest_first() -> None:
    cs = CapturedSet((gemm(share=0.3), conv(phase="backward", share=0.4)), "cuda", 1.0, "H100")
    lines = share_table(cs).splitlines()
    assert lines[0].split()[:3] == ["share", "GPU", "ms"]
    assert "convolution_backward" in lines[1] and "(not tuned)" in lines[1]
    assert "8192x3072x1024 nt" in lines[2]
    assert lines[-1] == "GEMMs and convolutions: 70.0% of 1000.000 ms of GPU time"


# -- the capture document --------------------------------------------------------------------


def doc() -> dict[str, Any]:
    return CapturedSet((gemm(), conv()), "cuda", 0.5, "NVIDIA H100", "2.11.0").to_json()


def test_capture_document_round_trips() -> None:
    d = json.loads(json.dumps(doc()))
    parsed = parse_capture(d)
    assert parsed.calls == (gemm(), conv()) and parsed.device == "NVIDIA H100"
    assert d["format"] == CAPTURE_FORMAT and [w["name"] for w in d["workloads"]] == [
        w.name for w in parsed.workloads()
    ]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format="x/1"), "capture.format: expected 'gpuwatchd-capture/1'"),
        (lambda d: d.update(timer="gpu"), "capture.timer: expected one of cuda, cpu"),
        (lambda d: d.update(extra=1), "capture.extra: unknown key"),
        (lambda d: d["calls"][0].update(kind="gemv"), "capture.calls[0].kind"),
        (lambda d: d["calls"][0].update(layout="nchw"), "capture.calls[0].layout"),
        (
            lambda d: d["calls"][0]["shape"].update(m=0),
            "capture.calls[0].shape.m: expected an integer >= 1",
        ),
        (lambda d: d["calls"][0].update(share=1.5), "capture.calls[0].share"),
        (lambda d: d["calls"][0].update(calls=True), "capture.calls[0].calls"),
        (lambda d: d["calls"][1]["shape"].update(groups=2), "capture.calls[1].shape.weight"),
        (lambda d: d["calls"][1]["shape"].update(stride=[1]), "capture.calls[1].shape.stride"),
    ],
)
def test_bad_capture_documents_name_the_field_in_one_line(edit: Any, message: str) -> None:
    d = doc()
    edit(d)
    with pytest.raises(ValueError) as e:
        parse_capture(d)
    assert message in str(e.value) and "\n" not in str(e.value)


# -- requests --------------------------------------------------------------------------------


def workloads() -> tuple[Workload, ...]:
    return to_workloads([gemm(), conv(), gemm(128, 128, 64, batch=8, layout="nn")])


def test_add_request_round_trips_with_its_source() -> None:
    req = add_request(workloads(), {"kind": "capture", "pid": 7, "torch": "2.11.0"})
    parsed = parse_add_request(json.loads(json.dumps(req)))
    assert req["op"] == ADD_OP and parsed.workloads == workloads()
    assert parsed.source == {"kind": "capture", "pid": 7, "torch": "2.11.0"}


def test_list_and_remove_requests() -> None:
    assert list_request() == {"op": "list_workloads"}
    req = remove_request(["a.b", "a.b", "c"])
    assert req["op"] == REMOVE_OP and parse_remove_request(req) == ("a.b", "c")


@pytest.mark.parametrize(
    ("request_doc", "message"),
    [
        ({"op": "add_workloads"}, "workloads: expected a non-empty list"),
        ({"op": "add_workloads", "workloads": [], "x": 1}, "x: unknown key for op 'add_workloads'"),
        ({"op": "retune", "workloads": [1]}, "op: expected 'add_workloads'"),
        ({"op": "add_workloads", "workloads": [{"name": "a"}]}, "workloads[0].op"),
        (
            {"op": "add_workloads", "workloads": [{"name": "bad name", "op": "matmul",
             "dtype": "bf16", "shape": GEMM, "families": ["torch.matmul"]}]},
            "workloads[0].name: expected at most 200 letters",
        ),
        (
            {"op": "add_workloads", "workloads": [{"name": "a", "op": "matmul", "dtype": "bf16",
             "shape": GEMM, "families": ["torch.matmul"]}], "source": {"x": [1]}},
            "source.x: expected a string, number, boolean or null",
        ),
    ],
)  # fmt: skip
def test_bad_add_requests_name_the_field(request_doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_add_request(request_doc)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_too_many_workloads_are_refused() -> None:
    item = {"name": "a", "op": "matmul", "dtype": "bf16", "shape": GEMM, "families": ["x"]}
    with pytest.raises(ValueError, match=f"at most {MAX_WORKLOADS}"):
        parse_add_request({"op": ADD_OP, "workloads": [item] * (MAX_WORKLOADS + 1)})


def test_remove_needs_names() -> None:
    with pytest.raises(ValueError, match="names: expected a non-empty list"):
        parse_remove_request({"op": REMOVE_OP, "names": []})
    with pytest.raises(ValueError, match=r"names\[0\]"):
        parse_remove_request({"op": REMOVE_OP, "names": ["two words"]})


def test_workload_names_allow_what_captures_and_user_kernels_use() -> None:
    for name in ("model.gemm.bf16.8192x3072x1024.nt", "triton.user:pkg.mod.kern@0123abcd/M=128"):
        assert check_workload_name(name, "name") == name
    for bad in ("", "a b", "-lead", "x" * 201, "tab\there"):
        with pytest.raises(ValueError):
            check_workload_name(bad, "name")


# -- files -----------------------------------------------------------------------------------


def test_toml_escapes_and_reloads(tmp_path: Path) -> None:
    w = Workload(
        "odd.name",
        "matmul",
        GEMM,
        "bf16",
        ("torch.matmul",),
        {"note": 'quote " and \\ and \n', "scale": 0.5, "flags": [True], "nested": {"a b": 1}},
    )
    text = workloads_toml([w], "first line\nsecond line")
    assert text.startswith("# first line\n# second line\n")
    (table,) = tomllib.loads(text)["workload"]
    assert Workload.from_json(table) == w
    path = tmp_path / "w.toml"
    path.write_text(text)
    assert read_workloads_file(path) == (w,)


def test_toml_refuses_values_it_cannot_write() -> None:
    w = Workload("a", "matmul", {"m": float("nan")}, "bf16", ("x",))
    with pytest.raises(ValueError, match="non-finite"):
        workloads_toml([w])


def test_json_files_of_every_accepted_shape(tmp_path: Path) -> None:
    ws = workloads()
    items = [w.to_json() for w in ws]
    for i, content in enumerate((doc(), {"workloads": items}, items)):
        path = tmp_path / f"f{i}.json"
        path.write_text(json.dumps(content))
        expected = parse_capture(doc()).workloads() if i == 0 else ws
        assert read_workloads_file(path) == expected


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("w.toml", "[[workload]\n", "invalid TOML"),
        ("w.toml", "[daemon]\n", "expected [[workload]] tables"),
        ("w.json", "{", "not valid JSON"),
        ("w.json", '{"format": "other"}', "expected a gpuwatchd-capture/1 document"),
        ("w.json", "[]", "holds no workloads"),
        ("w.json", '[{"name": "a"}]', "workload[0].op"),
        ("w.bin", b"\xff\xfe", "not UTF-8 text"),
    ],
)
def test_bad_files_give_one_line_with_the_path(
    tmp_path: Path, name: str, content: str | bytes, message: str
) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ValueError) as e:
        read_workloads_file(path)
    assert str(e.value).startswith(str(path)) and message in str(e.value)
    assert "\n" not in str(e.value)


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        read_workloads_file(tmp_path / "nope.toml")


# -- spool -----------------------------------------------------------------------------------


def test_spool_keeps_one_file_per_set_of_workloads(tmp_path: Path) -> None:
    req = add_request(workloads(), {"kind": "capture"})
    first = write_workload_request(tmp_path, req)
    again = write_workload_request(tmp_path, req)
    other = write_workload_request(tmp_path, add_request(workloads()[:1]))
    assert first == again and other != first
    assert first.parent == tmp_path / SUBDIR
    assert sorted(p.name for p in (tmp_path / SUBDIR).iterdir()) == sorted({first.name, other.name})
    entries = scan_all(tmp_path, WORKLOADS).entries
    found = sorted((r.request.workloads for r in entries), key=len)
    assert found == [workloads()[:1], workloads()]
    spool = Spool(tmp_path)
    assert spool.remove(entries[0])
    spool.close()
    assert len(scan_all(tmp_path, WORKLOADS).entries) == 1


def test_bad_spool_files_are_moved_aside_with_their_reason(tmp_path: Path) -> None:
    good = write_workload_request(tmp_path, add_request(workloads()))
    bad = tmp_path / SUBDIR / "bad.json"
    bad.write_text('{"op": "add_workloads", "workloads": []}')
    scan = scan_all(tmp_path, WORKLOADS)
    assert [tmp_path / SUBDIR / r.name for r in scan.entries] == [good]
    ((name, reason, _moved),) = [(r.name, r.reason, r.moved_to) for r in scan.rejected]
    assert name == "bad.json" and "workloads: expected a non-empty list" in reason
    aside = tmp_path / REJECTED_DIR
    assert (aside / "bad.json").exists() and reason in (aside / "bad.json.reason").read_text()
    assert not bad.exists()


def test_spool_refuses_an_invalid_request_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        write_workload_request(tmp_path, {"op": ADD_OP, "workloads": []})
    assert not (tmp_path / SUBDIR).exists()


def test_a_missing_spool_is_empty(tmp_path: Path) -> None:
    scan = scan_all(tmp_path / "none", WORKLOADS)
    assert scan.entries == [] and scan.rejected == []
