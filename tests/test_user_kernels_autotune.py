"""``gpuwatchd.triton.autotune`` on the CPU, with a fake Triton: the hit and miss paths.

A miss must behave exactly like ``triton.autotune`` (Triton benchmarks, then launches
its pick) and file a request that reproduces the call; a hit must launch the recorded
winner with no benchmarking at all, and say so.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import user_kernels_fakes as fakes
from control_fakes import read_line
from spool_helpers import scan_all

from gpuwatchd.client import GpuwatchdUnavailable
from gpuwatchd.jobside.call import triton_key
from gpuwatchd.jobside.requests import Submitter
from gpuwatchd.jobside.stack import Stack
from gpuwatchd.tuning.submitted.kernels import KernelRequest, config_spec, identity_of
from gpuwatchd.tuning.types import Regime, Versions
from gpuwatchd.tuning.winners import JOB_DEFAULT, KEPT_DEFAULT, VS_DEFAULT

torch = pytest.importorskip("torch")

VERSIONS = Versions(driver="580.159.04", cuda="13.0", torch="2.11.0", triton="3.6.0")
GPU = "NVIDIA H100 80GB HBM3"


class FakeWinner:
    """The fields of :class:`gpuwatchd.client.Winner` the lookup reads."""

    def __init__(self, workload: str, candidate: str, **changes: Any) -> None:
        self.workload = workload
        self.candidate = candidate
        self.gpu_model = GPU
        self.versions = VERSIONS
        self.meta: dict[str, Any] = {}
        self.measured_at = 1.7e9
        self.session_id = 7
        self.tie = False
        self.margin = 0.031
        self.__dict__.update(changes)


class FakeClient:
    def __init__(self, winners: dict[tuple[str, str], Any] | None = None) -> None:
        self.winners = winners or {}
        self.asked: list[tuple[str, str, str | None]] = []
        self.state_doc: Any = None

    def winner(self, workload: str, regime: Any, gpu_model: str | None = None) -> Any:
        self.asked.append((workload, str(regime), gpu_model))
        return self.winners.get((workload, str(Regime(regime).value)))

    def state(self, gpu: str) -> Any:
        if self.state_doc is None:
            raise GpuwatchdUnavailable("no daemon")
        return self.state_doc


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    fakes.install(monkeypatch)
    return fakes.write_module(tmp_path / "mods", "ukfake_kernels", fakes.KERNELS, monkeypatch)


@pytest.fixture(autouse=True)
def _mods_dir(tmp_path: Path) -> None:
    (tmp_path / "mods").mkdir()


def _context(kernel: Any, client: FakeClient, tmp_path: Path, sock: Path | None = None) -> Any:
    from gpuwatchd.triton import TuneContext

    ctx = TuneContext(
        client=client,  # type: ignore[arg-type]
        submitter=Submitter(
            socket_path=sock or tmp_path / "no-daemon.sock", spool_dir=tmp_path / "spool"
        ),
        stack=lambda device: Stack(GPU, "GPU-1234", VERSIONS),
    )
    kernel.context = ctx
    return ctx


def _call(kernel: Any, n: int = 100) -> tuple[Any, Any]:
    x = torch.randn(4, n)
    y = torch.zeros(4, n)
    kernel[lambda meta: (4, max(1, n // meta["BLOCK"]))](x, y, n)
    return x, y


def _name(kernel: Any, n: int = 100) -> str:
    ident = identity_of(kernel.fn, kernel.configs, kernel.keys)
    return f"triton.user:ukfake_kernels.scale@{ident[:8]}/n={n};float32,float32"


def test_miss_autotunes_like_triton_and_spools_a_request(
    kernels: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    k = kernels.scale
    client = FakeClient()
    _context(k, client, tmp_path)
    with caplog.at_level(logging.INFO, logger="gpuwatchd.triton"):
        x, y = _call(k)
    assert torch.equal(y, x * 2)
    tuner = k._tuner
    assert len(tuner.benchmarked) == 4  # Triton benchmarked every config
    assert config_spec(tuner.best_config).label == "BLOCK=256,w8,s3"  # 512 is out of resources
    choice = k.gpuwatchd_last
    assert choice.source == "autotuned" and choice.label == "BLOCK=256,w8,s3"
    assert choice.autotune_s == 0.25 and choice.submission.how == "spool"
    assert client.asked == [(_name(k), "sustained", GPU)]
    assert "Triton autotuned" in caplog.text and "spooled to" in caplog.text

    scan = scan_all(tmp_path / "spool")
    assert scan.rejected == [] and len(scan.entries) == 1
    req: KernelRequest = scan.entries[0].request
    assert req.path == "ukfake_kernels:scale" and req.workload_name == _name(k)
    assert req.identity == identity_of(k.fn, k.configs, ["n"])
    assert [(c.label, c.grid) for c in req.configs] == [
        ("BLOCK=64,w4,s3", (4, 1)),
        ("BLOCK=128,w4,s3", (4, 1)),
        ("BLOCK=256,w8,s3", (4, 1)),
        ("BLOCK=512,w8,s3", (4, 1)),
    ]
    x_spec = req.args[0].to_json()
    assert x_spec == {"name": "x_ptr", "kind": "tensor", "shape": [4, 100], "strides": [100, 1],
                      "dtype": "float32", "device": "cpu"}  # fmt: skip
    assert req.args[2].to_json() == {"name": "n", "kind": "int", "value": 100}
    assert req.key_values == {"n": 100} and req.key_dtypes == ("torch.float32", "torch.float32")
    assert req.regime is Regime.SUSTAINED and req.versions == VERSIONS
    assert req.job_default == "BLOCK=256,w8,s3"  # what Triton picked: the job's default


def test_later_calls_of_a_key_neither_benchmark_nor_file_again(
    kernels: Any, tmp_path: Path
) -> None:
    k = kernels.scale
    client = FakeClient()
    _context(k, client, tmp_path)
    _call(k)
    _call(k)
    assert len(k._tuner.benchmarked) == 4 and len(client.asked) == 1
    _call(k, n=200)  # a new key: a new lookup, a new benchmark, a second request
    assert len(k._tuner.benchmarked) == 8 and len(client.asked) == 2
    assert len(scan_all(tmp_path / "spool").entries) == 2


def test_hit_runs_the_recorded_winner_without_benchmarking(
    kernels: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    k = kernels.scale
    ident = identity_of(k.fn, k.configs, k.keys)
    winner = FakeWinner(_name(k), "BLOCK=128,w4,s3", meta={"identity": ident})
    client = FakeClient({(_name(k), "sustained"): winner})
    _context(k, client, tmp_path)
    with caplog.at_level(logging.INFO, logger="gpuwatchd.triton"):
        x, y = _call(k)
    assert torch.equal(y, x * 2)
    assert k._tuner.benchmarked == []  # no autotuning at all
    launched = k.fn.launches[-1][1]
    assert launched["BLOCK"] == 128 and launched["num_warps"] == 4
    choice = k.gpuwatchd_choice[(100, "torch.float32", "torch.float32")]
    assert choice.source == "winner" and choice.winner is winner and choice.autotune_s == 0.0
    assert "3.1% ahead" in choice.reason and "session 7" in choice.reason
    assert "no autotuning" in caplog.text and "BLOCK=128,w4,s3" in caplog.text
    assert not (tmp_path / "spool").exists()  # nothing to ask for
    _call(k)
    assert k._tuner.benchmarked == [] and len(client.asked) == 1


@pytest.mark.parametrize(
    ("meta", "said"),
    [
        ({JOB_DEFAULT: True, KEPT_DEFAULT: True}, "Triton's own pick when the key was filed, no"),
        ({VS_DEFAULT: {"margin": 0.052, "noise": 0.01, "beats": True}}, "5.2% ahead of Triton's"),
        ({VS_DEFAULT: {"margin": "lots"}}, "3.1% ahead)"),  # stored meta is untrusted
    ],
)
def test_a_hit_says_how_the_winner_stands_against_the_jobs_own_pick(
    kernels: Any, tmp_path: Path, meta: dict[str, Any], said: str
) -> None:
    k = kernels.scale
    ident = identity_of(k.fn, k.configs, k.keys)
    winner = FakeWinner(_name(k), "BLOCK=128,w4,s3", meta={"identity": ident, **meta})
    _context(k, FakeClient({(_name(k), "sustained"): winner}), tmp_path)
    _call(k)
    assert k._tuner.benchmarked == [] and said in k.gpuwatchd_last.reason


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"versions": Versions(cuda="13.0", triton="3.5.0")}, "another stack (triton 3.5.0"),
        ({"meta": {"identity": "0" * 64}}, "another version of the kernel"),
        ({"candidate": "BLOCK=999,w4,s3"}, "not one of the configs"),
    ],
)
def test_unusable_winners_are_misses_with_the_reason(
    kernels: Any, tmp_path: Path, changes: dict[str, Any], why: str
) -> None:
    k = kernels.scale
    winner = FakeWinner(_name(k), changes.pop("candidate", "BLOCK=128,w4,s3"), **changes)
    _context(k, FakeClient({(_name(k), "sustained"): winner}), tmp_path)
    _call(k)
    assert len(k._tuner.benchmarked) == 4
    assert k.gpuwatchd_last.source == "autotuned" and why in k.gpuwatchd_last.reason


def test_no_winners_source_still_runs_as_triton(kernels: Any, tmp_path: Path) -> None:
    class Down(FakeClient):
        def winner(self, *a: Any, **k: Any) -> Any:
            raise GpuwatchdUnavailable("no winners source: daemon down; no store file")

    k = kernels.scale
    _context(k, Down(), tmp_path)
    x, y = _call(k)
    assert torch.equal(y, x * 2) and "no winners source" in k.gpuwatchd_last.reason
    assert k.gpuwatchd_last.submission.how == "spool"


def test_regime_auto_asks_the_daemon_once(kernels: Any, tmp_path: Path) -> None:
    from gpuwatchd.jobside.autotune import GpuwatchdAutotuner

    class St:
        state = "cool_stable"
        throttle_reasons = ()

    k: GpuwatchdAutotuner = kernels.scale
    k.regime = "auto"
    client = FakeClient()
    client.state_doc = St()
    _context(k, client, tmp_path)
    _call(k)
    assert client.asked[0][1] == "unthrottled"
    assert "auto: the daemon sees the GPU cool and stable" in k.gpuwatchd_last.reason
    St.throttle_reasons = ("sw_power_cap",)  # type: ignore[assignment]
    k._regime = None
    _call(k, n=300)
    assert client.asked[1][1] == "sustained"


def test_regime_auto_without_a_daemon_is_sustained(kernels: Any, tmp_path: Path) -> None:
    k = kernels.scale
    k.regime = "auto"
    client = FakeClient()
    _context(k, client, tmp_path)
    _call(k)
    assert client.asked[0][1] == "sustained" and "view unavailable" in k.gpuwatchd_last.reason


def test_triton_key_matches_triton_for_positional_and_keyword_arguments() -> None:
    x = torch.zeros(2, dtype=torch.float16)
    names = ["x_ptr", "y_ptr", "n", "m"]
    pos = triton_key(names, ["m", "n"], (x, x, 5), {"m": 7, "grid": (1,), "warmup": False})
    assert pos.values == (7, 5, "torch.float16", "torch.float16")
    assert pos.named == {"m": 7, "n": 5}
    missing = triton_key(names, ["m"], (x, x, 5), {})  # a key the call did not pass
    assert missing.values == ("torch.float16", "torch.float16") and missing.named == {}


def test_a_kernel_defined_in_main_runs_but_files_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    triton = fakes.install(monkeypatch)
    import gpuwatchd.triton as gt

    def kernel(x_ptr, y_ptr, n, BLOCK):
        y_ptr[:, :n] = x_ptr[:, :n] * 2

    kernel.__module__ = "__main__"
    cfgs = [triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})]
    k = gt.autotune(configs=cfgs, key=["n"])(triton.jit(kernel))
    client = FakeClient()
    _context(k, client, tmp_path)
    x, y = _call(k)
    assert torch.equal(y, x * 2)
    assert "not tunable by gpuwatchd" in k.gpuwatchd_last.reason
    assert "__main__" in k.gpuwatchd_last.reason
    assert client.asked == [] and not (tmp_path / "spool").exists()


def test_a_single_config_needs_no_lookup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    triton = fakes.install(monkeypatch)
    import gpuwatchd.triton as gt

    k = gt.autotune(configs=[triton.Config({"BLOCK": 64})], key=["n"])(
        triton.jit(lambda x_ptr, y_ptr, n, BLOCK: None)
    )
    client = FakeClient()
    _context(k, client, tmp_path)
    _call(k)
    assert client.asked == [] and k.gpuwatchd_choice == {}


def test_decorator_checks_its_own_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    fakes.install(monkeypatch)
    import gpuwatchd.triton as gt

    with pytest.raises(ValueError, match="regime: expected one of"):
        gt.autotune(configs=[], key=["n"], regime="hot")
    with pytest.raises(ValueError, match="args_factory"):
        gt.autotune(configs=[], key=["n"], args_factory="no-colon")
    with pytest.raises(ValueError, match="module-level function"):
        gt.autotune(configs=[], key=["n"], args_factory=lambda kv: {})


# -- the control socket ------------------------------------------------------------------------


def _serve(path: Path, answers: list[dict[str, Any]], seen: list[dict[str, Any]]) -> None:
    """A control socket that answers each request line with the next canned answer."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path.unlink(missing_ok=True)
    srv.bind(str(path))
    srv.listen(4)
    srv.settimeout(5)

    def serve() -> None:
        with srv:
            for answer in list(answers):
                conn, _ = srv.accept()
                with conn:
                    seen.append(json.loads(read_line(conn)))
                    conn.sendall(json.dumps(answer).encode() + b"\n")

    threading.Thread(target=serve, daemon=True).start()


@pytest.mark.parametrize(
    ("answer", "how", "spooled"),
    [
        ({"ok": True, "queued": 1}, "daemon", False),
        ({"ok": False, "error": "op: unknown operation 'tune_kernel' (known: retune)"}, "spool",
         True),
        ({"ok": False, "error": "request.kernel.module: module 'x' is not under [tuning] "
                               "allowed_modules"}, "rejected", False),
    ],
)  # fmt: skip
def test_requests_go_to_the_daemon_first(
    kernels: Any, tmp_path: Path, answer: dict[str, Any], how: str, spooled: bool
) -> None:
    sock = Path(f"/tmp/gpuwatchd-test-{os.getpid()}-{how}.sock")
    seen: list[dict[str, Any]] = []
    _serve(sock, [answer], seen)
    try:
        k = kernels.scale
        _context(k, FakeClient(), tmp_path, sock=sock)
        _call(k)
    finally:
        sock.unlink(missing_ok=True)
    sub = k.gpuwatchd_last.submission
    assert sub.how == how, sub.detail
    assert seen[0]["op"] == "tune_kernel"
    assert KernelRequest.from_json(seen[0]["request"]).qualname == "scale"
    assert (tmp_path / "spool").exists() is spooled
    if how == "rejected":
        assert "allowed_modules" in sub.detail and not sub.filed
