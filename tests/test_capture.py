"""gpuwatchd.torch.capture() on CPU: the GEMMs and convolutions of a small model, forward and
backward, with their shapes, layouts, counts and time shares; its workloads, files and
submission to a daemon or its spool."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from control_fakes import ControlServer

torch = pytest.importorskip("torch")

from spool_helpers import scan_all  # noqa: E402

import gpuwatchd.torch as gt  # noqa: E402
from gpuwatchd.config import load_config  # noqa: E402
from gpuwatchd.control.wire import ADD_WORKLOADS as ADD_OP  # noqa: E402
from gpuwatchd.jobside.capture import MODEL_ATTR  # noqa: E402
from gpuwatchd.tuning.intake.spool import WORKLOADS  # noqa: E402
from gpuwatchd.tuning.intake.workload_requests import read_workloads_file  # noqa: E402
from gpuwatchd.tuning.submitted.captured import parse_capture  # noqa: E402

STEPS = 2


class Small(torch.nn.Module):
    """One GEMM of each kind, one conv, one GEMM far larger than the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 32)  # addmm, weight transposed: layout nt
        self.big = torch.nn.Linear(1024, 1024, bias=False)  # mm nt, the largest share
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: Any, y: Any, img: Any, q: Any, k: Any) -> Any:
        out = self.lin(x).square().mean() + self.big(y).square().mean()
        out = out + self.conv(img).square().mean()
        return out + torch.bmm(q, k.transpose(1, 2)).square().mean()


@pytest.fixture(scope="module")
def captured() -> Any:
    torch.manual_seed(0)
    model = Small()
    args = (
        torch.randn(128, 64),
        torch.randn(512, 1024, requires_grad=True),
        torch.randn(2, 3, 16, 16),
        torch.randn(4, 16, 8, requires_grad=True),
        torch.randn(4, 16, 8, requires_grad=True),
    )
    model(*args).backward()  # first calls set up thread pools and caches: not the model's cost
    with gt.capture(model, timer="cpu") as cap:
        for _ in range(STEPS):
            model(*args).backward()
    return model, cap


def _find(cap: Any, aten: str, phase: str, **shape: Any) -> Any:
    hits = [
        c
        for c in cap.calls
        if c.aten == aten and c.phase == phase and all(c.shape[k] == v for k, v in shape.items())
    ]
    assert len(hits) == 1, (aten, phase, shape, [c.to_json() for c in cap.calls])
    return hits[0]


def test_forward_gemms_have_their_shapes_layouts_and_counts(captured: Any) -> None:
    _, cap = captured
    lin = _find(cap, "addmm", "forward", m=128, n=32, k=64)
    assert (lin.layout, lin.bias, lin.calls, lin.dtype) == ("nt", True, STEPS, "float32")
    big = _find(cap, "mm", "forward", m=512, n=1024, k=1024)
    assert (big.layout, big.bias, big.calls) == ("nt", False, STEPS)
    bmm = _find(cap, "bmm", "forward", batch=4, m=16, n=16, k=8)
    assert bmm.layout == "nt" and bmm.calls == STEPS


def test_backward_gemms_and_convs_are_recorded_as_backward(captured: Any) -> None:
    _, cap = captured
    # d(big)/d(y) = grad [512, 1024] @ W [1024, 1024]: row-major both
    grad_in = _find(cap, "mm", "backward", m=512, n=1024, k=1024)
    assert grad_in.layout == "nn" and grad_in.calls == STEPS
    conv_bwd = _find(cap, "convolution_backward", "backward", input=[2, 3, 16, 16])
    assert conv_bwd.kind == "conv2d" and conv_bwd.bias and not conv_bwd.tunable
    conv = _find(cap, "convolution", "forward", input=[2, 3, 16, 16])
    assert conv.shape["weight"] == [8, 3, 3, 3]
    assert (conv.shape["stride"], conv.shape["padding"], conv.shape["groups"]) == (
        [1, 1],
        [1, 1],
        1,
    )
    assert conv.layout == "contiguous" and conv.tunable


def test_shares_are_fractions_led_by_the_big_gemm(captured: Any) -> None:
    _, cap = captured
    shares = [c.share for c in cap.calls]
    assert all(0 <= s <= 1 for s in shares) and 0 < sum(shares) <= 1
    assert shares == sorted(shares, reverse=True)
    big = _find(cap, "mm", "forward", m=512, n=1024, k=1024)
    lin = _find(cap, "addmm", "forward", m=128, n=32, k=64)
    assert big.time_s > lin.time_s > 0  # 5.4e8 vs 5.2e5 multiply-adds
    assert cap.captured.timer == "cpu" and cap.captured.total_s >= sum(c.time_s for c in cap.calls)


def test_workloads_use_the_existing_families(captured: Any) -> None:
    _, cap = captured
    by_name = {w.name: w for w in cap.workloads()}
    big = by_name["model.gemm.f32.512x1024x1024.nt.ieee"]
    assert (big.op, big.families, big.params) == (
        "matmul",
        ("torch.gemm",),
        {"tf32": False, "layout": "nt"},
    )
    plain = by_name["model.gemm.f32.512x1024x1024.nn.ieee"]
    assert plain.families == ("torch.matmul",) and plain.shape == {"m": 512, "n": 1024, "k": 1024}
    bmm = by_name["model.gemm.f32.16x16x8.b4.nt.ieee"]
    assert bmm.op == "bmm" and bmm.shape == {"batch": 4, "m": 16, "n": 16, "k": 8}
    convs = [w for w in by_name.values() if w.op == "conv2d"]
    assert len(convs) == 1 and convs[0].families == ("torch.conv2d",)
    assert convs[0].shape["input"] == [2, 3, 16, 16]
    assert cap.workloads(top=2) == cap.workloads()[:2]


def test_table_lists_shares_and_marks_what_is_not_tuned(captured: Any) -> None:
    _, cap = captured
    text = str(cap)
    assert text.splitlines()[0].split()[:3] == ["share", "CPU", "ms"]
    assert "convolution_backward" in text and "(not tuned)" in text
    assert "512x1024x1024 nt" in text and text.splitlines()[-1].startswith(
        "GEMMs and convolutions:"
    )


def test_the_model_keeps_its_capture(captured: Any) -> None:
    model, cap = captured
    assert getattr(model, MODEL_ATTR) is cap


def test_toml_written_loads_through_the_daemon_config(captured: Any, tmp_path: Path) -> None:
    _, cap = captured
    path = cap.write(tmp_path / "workloads.toml")
    cfg = load_config(path)
    for w in cap.workloads():
        assert cfg.workload(w.name) == w
    assert read_workloads_file(path) == cap.workloads()


def test_json_written_round_trips(captured: Any, tmp_path: Path) -> None:
    _, cap = captured
    path = cap.write(tmp_path / "capture.json")
    doc = json.loads(path.read_text())
    again = parse_capture(doc)
    assert again.calls == cap.calls and again.timer == "cpu"
    assert read_workloads_file(path) == cap.workloads()


def test_channels_last_convolutions_are_recorded_so() -> None:
    conv = torch.nn.Conv2d(4, 4, 3).to(memory_format=torch.channels_last)
    x = torch.randn(1, 4, 8, 8).contiguous(memory_format=torch.channels_last)
    with gt.capture(timer="cpu") as cap, torch.no_grad():
        conv(x)
    (call,) = cap.calls
    assert call.layout == "channels_last" and call.phase == "forward" and call.calls == 1


def test_reading_a_capture_inside_its_block_is_an_error() -> None:
    with gt.capture(timer="cpu") as cap, pytest.raises(RuntimeError, match="still running"):
        _ = cap.calls


def test_bad_timer_is_refused() -> None:
    with pytest.raises(ValueError, match="timer"), gt.capture(timer="gpu"):
        pass


# -- submission ------------------------------------------------------------------------------


@pytest.fixture
def sock_path(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "control.sock"


def test_submit_goes_to_a_daemon_that_takes_it(
    captured: Any, sock_path: Path, tmp_path: Path
) -> None:
    _, cap = captured
    names = [w.name for w in cap.workloads(top=3)]
    daemon = ControlServer(sock_path, {"ok": True, "added": names, "replaced": []})
    try:
        sub = cap.submit(top=3, socket_path=sock_path, spool_dir=tmp_path / "spool")
    finally:
        daemon.close()
    assert sub.how == "daemon" and "3 workload(s)" in sub.detail
    (req,) = daemon.requests
    assert req["op"] == ADD_OP and [w["name"] for w in req["workloads"]] == names
    assert req["source"]["kind"] == "capture"
    assert not (tmp_path / "spool").exists()


def test_submit_spools_when_no_daemon_answers(
    captured: Any, sock_path: Path, tmp_path: Path
) -> None:
    _, cap = captured
    sub = cap.submit(socket_path=sock_path, spool_dir=tmp_path / "spool")
    assert sub.how == "spool" and "cannot reach gpuwatchd" in sub.detail
    scan = scan_all(tmp_path / "spool", WORKLOADS)
    (entry,) = scan.entries
    assert entry.request.workloads == cap.workloads() and scan.rejected == []


def test_submit_spools_for_a_daemon_without_the_operation(
    captured: Any, sock_path: Path, tmp_path: Path
) -> None:
    _, cap = captured
    daemon = ControlServer(
        sock_path, {"ok": False, "error": "op: unknown operation 'add_workloads'"}
    )
    try:
        sub = cap.submit(socket_path=sock_path, spool_dir=tmp_path / "spool")
    finally:
        daemon.close()
    assert sub.how == "spool" and "does not take add_workloads" in sub.detail


def test_a_refusal_is_reported_not_spooled(captured: Any, sock_path: Path, tmp_path: Path) -> None:
    _, cap = captured
    daemon = ControlServer(sock_path, {"ok": False, "error": "families: unknown family 'x'"})
    try:
        sub = cap.submit(socket_path=sock_path, spool_dir=tmp_path / "spool")
    finally:
        daemon.close()
    assert sub.how == "rejected" and "unknown family" in sub.detail and not sub.filed
    assert not (tmp_path / "spool").exists()


# -- apply_winners: what it refuses before touching the GPU ----------------------------------


def test_apply_winners_needs_a_capture(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no capture for this model"):
        gt.apply_winners(torch.nn.Linear(2, 2))


def test_converting_layers_needs_the_model(captured: Any) -> None:
    _, cap = captured
    with pytest.raises(ValueError, match="needs the model"):
        gt.apply_winners(cap, memory_format="winner")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_apply_winners_needs_a_gpu(captured: Any) -> None:
    model, _ = captured
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        gt.apply_winners(model)
