"""The trust boundary for user code: only ``[tuning] allowed_modules``, on every path.

Planted modules write a marker file when imported (``evil_mod``) or called
(``evil_helpers.pwn``, ``ukt_trust.kernels._hidden``); ``ukt_trust`` is the allowed
package, and its ``kernels`` module imports ``os``, ``subprocess`` and ``evil_helpers``
the way a real kernel module imports torch. Every way a job could name that code (the
control socket, the spool, the config, added workloads replayed at start, the worker
itself, the worker's working directory) must end in a one-line refusal and no marker;
an allowed kernel defined there is still tuned end to end (a fake Triton, no GPU).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import user_kernels_fakes as fakes
from test_daemon_user_work import call, make_config, make_daemon

from gpuwatchd.client.control import ask
from gpuwatchd.config import ConfigError, parse_config
from gpuwatchd.daemon.added_workloads import ASIDE_NAME, FILE_NAME, FORMAT
from gpuwatchd.serve.control import RequestError
from gpuwatchd.sessions.runner import TuneRunner
from gpuwatchd.store import SqlStore, sqlite_store
from gpuwatchd.telemetry.sim import SimBackend
from gpuwatchd.telemetry.types import DeviceInfo
from gpuwatchd.tuning.intake.spool import REJECTED_DIR, write_request, write_workload_request
from gpuwatchd.tuning.intake.workload_requests import add_request, parse_add_request
from gpuwatchd.tuning.session_spec import SessionSpec, SimSpec
from gpuwatchd.tuning.settings import ProtocolConfig
from gpuwatchd.tuning.submitted.kernels import ArgSpec, KernelRequest, config_spec, identity_of
from gpuwatchd.tuning.submitted.trust import (
    TrustError,
    check_workload,
    import_function,
    import_kernel,
    parse_allowed_modules,
)
from gpuwatchd.tuning.types import Regime, SessionStatus, Versions, Workload
from gpuwatchd.tuning.worker.devices import CpuSession
from gpuwatchd.tuning.worker.families.triton_user import build
from gpuwatchd.tuning.worker_isolation import PRIVATE_DIRS

TESTS = Path(__file__).resolve().parent
ALLOWED = ("ukt_trust",)
PLANTED = (
    "ukt_trust",
    "ukt_trust.kernels",
    "ukt_trust.side",
    "ukt_trust.sub",
    "ukt_trust.sub.mod",
    "evil_mod",
    "evil_helpers",
)
QUICK = ProtocolConfig(
    time_budget_s=0.5, min_rounds=2, max_rounds=3, warmup_s=0.0, settle_timeout_s=0.0,
    settle_window_s=0.05, batch_target_s=0.001, pause_s=0.0, cool_pause_s=0.0,
)  # fmt: skip
CPU = DeviceInfo(index=0, uuid="cpu-0", name="test cpu")
SIM_MODEL = "NVIDIA H200 (simulated)"

#: Appended to the fake kernels module: what a real kernel module has in reach.
KERNELS_EXTRA = """
import os
import subprocess
from os import system
from subprocess import getoutput

import evil_helpers
from evil_helpers import pwn


def _hidden(key_values):
    evil_helpers.mark("private called")
    return {}


class Ops:
    helpers = evil_helpers


import functools

# Code from evil_helpers under names this module defines; functools.wraps gives it this
# module's __module__ (and the kernel's source, to inspect.getsource).
wrapped_pwn = functools.wraps(make_args)(evil_helpers.pwn)
stolen = gt.autotune(configs=CONFIGS, key=["n"])(
    triton.jit(functools.wraps(scale.fn.fn)(evil_helpers.kern))
)
"""


def _mark_code(marks: Path) -> str:
    return f"def mark(what):\n    open({str(marks)!r} + '/' + what, 'w').close()\n\n\n"


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    """``tmp/pkgs`` holding the planted modules and a fake ``triton``; markers in ``tmp/marks``."""
    marks, pkgs = tmp_path / "marks", tmp_path / "pkgs"
    marks.mkdir()
    (pkgs / "ukt_trust").mkdir(parents=True)
    (pkgs / "triton").mkdir()
    (pkgs / "evil_mod.py").write_text(_mark_code(marks) + "mark('evil_mod imported')\n")
    (pkgs / "evil_helpers.py").write_text(
        _mark_code(marks)
        + "def pwn(key_values):\n    mark('pwn called')\n    return {}\n\n\n"
        + "def kern(x_ptr, y_ptr, n, BLOCK):\n    mark('kern called')\n"
    )
    (pkgs / "ukt_trust" / "side.py").write_text(_mark_code(marks) + "mark('side imported')\n")
    (pkgs / "ukt_trust" / "sub").mkdir()
    (pkgs / "ukt_trust" / "sub" / "__init__.py").write_text(
        _mark_code(marks) + "mark('sub imported')\n"
    )
    (pkgs / "ukt_trust" / "sub" / "mod.py").write_text("import evil_mod\n")
    (pkgs / "ukt_trust" / "__init__.py").write_text("")
    (pkgs / "ukt_trust" / "kernels.py").write_text(textwrap.dedent(fakes.KERNELS) + KERNELS_EXTRA)
    (pkgs / "triton" / "__init__.py").write_text(
        "from user_kernels_fakes import (Autotuner, Config, JITFunction, OutOfResources,\n"
        "                                autotune, jit)\n__version__ = '3.6.0'\n"
    )
    return tmp_path


def markers(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "marks").iterdir())


@pytest.fixture
def in_process(planted: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The planted modules importable here, none imported yet, Triton faked."""
    fakes.install(monkeypatch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.syspath_prepend(str(planted / "pkgs"))
    for name in PLANTED:
        monkeypatch.delitem(sys.modules, name, raising=False)
    return planted


def request_for(
    module: str = "ukt_trust.kernels",
    qualname: str = "scale",
    factory: str | None = None,
    n: int = 100,
    gpu_model: str = "FAKE GPU",
    dtypes: tuple[str, ...] = ("torch.float32", "torch.float32"),
) -> KernelRequest:
    """What a job's miss on the planted ``scale`` kernel files, naming what it likes."""
    source = _load_planted_kernel()
    configs = source.configs
    return KernelRequest(
        module=module,
        qualname=qualname,
        identity=identity_of(source, configs, ["n"]),
        key_names=("n",),
        key_values={"n": n},
        key_dtypes=dtypes,
        configs=tuple(config_spec(c, grid=(4,)) for c in configs),
        args=(
            ArgSpec("x_ptr", "tensor", shape=(4, n), strides=(n, 1), dtype="float32"),
            ArgSpec("y_ptr", "tensor", shape=(4, n), strides=(n, 1), dtype="float32"),
            ArgSpec("n", "int", n),
        ),
        regime=Regime.SUSTAINED,
        gpu_model=gpu_model,
        versions=Versions(cuda="13.0", triton="3.6.0"),
        args_factory=factory,
    )


def _load_planted_kernel() -> Any:
    """The ``scale`` kernel of the planted text, loaded apart from sys.modules."""
    import types

    mod = types.ModuleType("ukt_trust.kernels")
    code = textwrap.dedent(fakes.KERNELS)
    path = Path(tempfile.mkdtemp(prefix="ukt-src-")) / "kernels.py"
    path.write_text(code)  # inspect.getsource needs a file
    mod.__file__ = str(path)
    sys.modules["_ukt_identity_source"] = mod
    try:
        exec(compile(code, str(path), "exec"), mod.__dict__)
    finally:
        del sys.modules["_ukt_identity_source"]
    return mod.scale


def as_workload(req: KernelRequest) -> Workload:
    """The ``triton.user`` workload a job may send for ``req`` (what ``to_workload`` makes)."""
    shape = {"key": dict(req.key_values), "dtypes": [d.rsplit(".", 1)[-1] for d in req.key_dtypes]}
    return Workload(req.workload_name, "triton.user", shape, req.main_dtype, ("triton.user",),
                    {"request": req.to_json()})  # fmt: skip


def attack(workload: Workload, **params: Any) -> Workload:
    """``workload`` with extra ``params`` (what a job may put in an added workload)."""
    return replace(workload, params={**workload.params, **params})


def build_and_set_up(workload: Workload, allowed: tuple[str, ...] = ALLOWED) -> list[Any]:
    cands = build(workload, CpuSession(flush_bytes=0), allowed)
    cands[0].setup()
    return cands


# -- the worker: what it imports, and from whose list --------------------------------------


def test_worker_refuses_an_allow_list_carried_by_the_workload(in_process: Path) -> None:
    widened = attack(as_workload(request_for("evil_mod")), allowed_modules=["evil_mod"])
    for allowed in (ALLOWED, ()):
        with pytest.raises(ValueError) as err:
            build_and_set_up(widened, allowed)
        assert "params.allowed_modules: not accepted" in str(err.value)
        assert "\n" not in str(err.value)
    plain = as_workload(request_for("evil_mod"))
    with pytest.raises(ValueError, match=r"module 'evil_mod' is not under \[tuning\]"):
        build_and_set_up(plain)
    assert markers(in_process) == [] and "evil_mod" not in sys.modules


@pytest.mark.parametrize(
    ("factory", "needle"),
    [
        ("ukt_trust.kernels:pwn", "kernels:pwn is not defined in ukt_trust.kernels itself"),
        ("ukt_trust.kernels:getoutput", "getoutput is not defined in ukt_trust.kernels itself"),
        ("ukt_trust.kernels:system", "kernels:system is not defined in ukt_trust.kernels"),
        ("ukt_trust.kernels:evil_helpers.pwn", "kernels:evil_helpers is not defined in"),
        ("ukt_trust.kernels:subprocess.getoutput", "kernels:subprocess is not defined in"),
        ("ukt_trust.kernels:os.system", "ukt_trust.kernels:os is not defined in"),
        ("ukt_trust.kernels:Ops.helpers.pwn", "kernels:Ops.helpers.pwn is not defined in"),
        ("ukt_trust.kernels.subprocess:getoutput", "ukt_trust.kernels is not a package"),
        ("evil_helpers:pwn", "module 'evil_helpers' is not under [tuning] allowed_modules"),
    ],
)
def test_worker_refuses_factories_reached_through_an_allowed_module(
    in_process: Path, factory: str, needle: str
) -> None:
    workload = as_workload(request_for(factory=factory))
    with pytest.raises(ValueError) as err:
        build_and_set_up(workload)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert "request.args_factory: " in str(err.value)
    assert markers(in_process) == []


def test_code_given_an_allowed_modules_name_by_functools_wraps_is_refused(
    in_process: Path,
) -> None:
    workload = as_workload(request_for(factory="ukt_trust.kernels:wrapped_pwn"))
    with pytest.raises(ValueError) as err:
        build_and_set_up(workload)
    assert "kernels:wrapped_pwn is defined in evil_helpers, which is not under" in str(err.value)
    assert markers(in_process) == []


def test_a_kernel_wrapping_code_from_elsewhere_is_refused_though_its_source_matches(
    in_process: Path,
) -> None:
    workload = as_workload(request_for(qualname="stolen"))
    with pytest.raises(ValueError) as err:
        build_and_set_up(workload)
    assert "kernels:stolen wraps a function that is defined in evil_helpers" in str(err.value)
    assert "\n" not in str(err.value) and markers(in_process) == []


@pytest.mark.parametrize(
    ("factory", "needle"),
    [
        ("ukt_trust.side:make_args", "ukt_trust.side:make_args is not defined in ukt_trust.side"),
        ("ukt_trust.sub.mod:evil_mod", "sub.mod:evil_mod is not defined in ukt_trust.sub.mod"),
        ("ukt_trust.nosuch:make_args", "no Python source file for module ukt_trust.nosuch"),
    ],
)
def test_a_submodule_is_not_imported_before_the_name_is_checked_in_its_source(
    in_process: Path, factory: str, needle: str
) -> None:
    workload = as_workload(request_for(factory=factory))
    with pytest.raises(ValueError) as err:
        build_and_set_up(workload)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert markers(in_process) == []
    assert not {"ukt_trust.side", "ukt_trust.sub", "evil_mod"} & set(sys.modules)


@pytest.mark.parametrize(
    ("module", "qualname", "factory", "needle"),
    [
        ("ukt_trust.kernels", "scale", "ukt_trust.kernels:__builtins__.eval", "'__builtins__'"),
        ("ukt_trust.kernels", "scale", "ukt_trust.kernels:_hidden", "'_hidden' in"),
        ("ukt_trust.kernels", "_hidden", None, "'_hidden' in ukt_trust.kernels:_hidden"),
        ("ukt_trust._impl", "scale", None, "'_impl' in ukt_trust._impl:scale"),
        ("ukt_trust.kernels", "scale.__globals__", None, "'__globals__' in"),
    ],
)
def test_private_and_dunder_names_are_refused_before_anything_is_imported(
    in_process: Path, module: str, qualname: str, factory: str | None, needle: str
) -> None:
    workload = as_workload(request_for(module, qualname, factory))
    with pytest.raises(ValueError) as err:
        build(workload, CpuSession(), ALLOWED)  # refused before any candidate is set up
    assert needle in str(err.value) and "private or special name" in str(err.value)
    assert "ukt_trust.kernels" not in sys.modules and markers(in_process) == []


@pytest.mark.parametrize(
    ("qualname", "needle"),
    [("make_args", "is a function, not a Triton kernel"), ("Ops", "is a type, not a Triton")],
)
def test_a_kernel_name_must_reach_a_triton_kernel(
    in_process: Path, qualname: str, needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        build_and_set_up(as_workload(request_for(qualname=qualname)))


def test_an_allowed_kernel_defined_there_is_imported_with_its_factory(in_process: Path) -> None:
    workload = as_workload(request_for(factory="ukt_trust.kernels:make_args"))
    cands = build_and_set_up(workload)
    kernel = cands[0]._kernel
    assert kernel.args["x_ptr"].shape == (4, 100) and float(kernel.args["x_ptr"][0, 1]) == 1.0
    assert kernel.verdicts["BLOCK=64,w4,s3"].error is None
    assert markers(in_process) == []


# -- the real worker process: isolation and the job's list -----------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    with sqlite_store(tmp_path / "trust.db") as s:
        yield s


def _worker_env(planted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted modules and the fake Triton on the daemon's PYTHONPATH."""
    path = os.pathsep.join(filter(None, [str(planted / "pkgs"), str(TESTS),
                                         os.environ.get("PYTHONPATH")]))  # fmt: skip
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def cpu_job(workload: Workload, allowed: tuple[str, ...]) -> SessionSpec:
    return SessionSpec(0, "cpu-0", "cpu", (workload,), (Regime.SUSTAINED,), QUICK, 10.0,
                   allowed_modules=allowed)  # fmt: skip


def test_real_worker_tunes_an_allowed_kernel_and_refuses_a_widened_list(
    in_process: Path, store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    planted = in_process
    _worker_env(planted, monkeypatch)
    good = as_workload(request_for(factory="ukt_trust.kernels:make_args"))
    out = TuneRunner(store).run_session(cpu_job(good, ALLOWED), CPU, "sim", lambda: None,
                                        None, 120)  # fmt: skip
    assert (out.status, out.why) == (SessionStatus.COMPLETED, None)
    (result,) = out.results
    assert result.winner in {"BLOCK=64,w4,s3", "BLOCK=128,w4,s3", "BLOCK=256,w8,s3", None}
    assert sum(c.median_s is not None for c in result.candidates) == 3

    widened = attack(as_workload(request_for("evil_mod")), allowed_modules=["evil_mod"])
    out = TuneRunner(store).run_session(cpu_job(widened, ALLOWED), CPU, "sim", lambda: None,
                                        None, 120)  # fmt: skip
    assert out.status is SessionStatus.FAILED and out.why is not None
    assert "params.allowed_modules: not accepted" in out.why and "\n" not in out.why
    chained = as_workload(request_for(factory="ukt_trust.kernels:evil_helpers.pwn"))
    out = TuneRunner(store).run_session(cpu_job(chained, ()), CPU, "sim", lambda: None,
                                        None, 120)  # fmt: skip
    assert out.status is SessionStatus.FAILED and "allowed_modules" in (out.why or "")
    assert markers(planted) == []


def test_worker_ignores_a_json_py_in_the_daemons_working_directory(
    planted: Path, store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = planted / "cwd"
    cwd.mkdir()
    (cwd / "json.py").write_text(_mark_code(planted / "marks") + "mark('json.py imported')\n")
    monkeypatch.chdir(cwd)
    info = SimBackend(gpus=1, scenario="idle", seed=3).device_info(0)
    wl = Workload("sim-gemm", "gemm", {"m": 8192, "n": 8192, "k": 8192}, "bf16", ("sim",))
    spec = SessionSpec(0, info.uuid, "sim", (wl,), (Regime.UNTHROTTLED,),
                  ProtocolConfig(time_budget_s=5.0), 10.0, SimSpec("idle", 3, 1))  # fmt: skip
    out = TuneRunner(store).run_session(spec, info, "sim", lambda: None, None, 60)
    assert (out.status, out.why) == (SessionStatus.COMPLETED, None)
    assert markers(planted) == []


@pytest.fixture
def spy_dir() -> Iterator[Path]:
    """A folder any user can reach, for a worker that drops to another user."""
    d = Path(tempfile.mkdtemp(prefix="gw-spy-", dir="/tmp"))
    d.chmod(0o755)
    (d / "out").mkdir()
    (d / "out").chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def spy_python(d: Path) -> str:
    """An "interpreter" that writes where, as whom and with what it was started."""
    script = d / "python3"
    out = d / "out"
    script.write_text(
        "#!/bin/sh\n"
        f"pwd > {out}/cwd; id -u > {out}/uid; id -g > {out}/gid; id -G > {out}/groups\n"
        f'env > {out}/env; echo "$@" > {out}/args\nexit 3\n'
    )
    script.chmod(0o755)
    return str(script)


def spy_run(store: SqlStore, d: Path, **runner: Any) -> dict[str, str]:
    info = SimBackend(gpus=1, scenario="idle", seed=3).device_info(0)
    wl = Workload("sim-gemm", "gemm", {"m": 64, "n": 64, "k": 64}, "bf16", ("sim",))
    spec = SessionSpec(0, info.uuid, "sim", (wl,), (Regime.UNTHROTTLED,), sim=SimSpec("idle", 3, 1))
    out = TuneRunner(store, python=spy_python(d), **runner).run_session(
        spec, info, "sim", lambda: None, None, 30
    )
    assert out.status is SessionStatus.FAILED and "exit 3" in (out.why or "")
    return {p.name: p.read_text().strip() for p in (d / "out").iterdir()}


def test_worker_starts_with_python_p_in_root_with_a_minimal_environment(
    store: SqlStore, spy_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(spy_dir)
    daemon_env = {
        "PGPASSWORD": "secret",
        "NOTIFY_SOCKET": "/run/x",
        "FOO": "bar",
        "PYTHONSTARTUP": "/tmp/evil.py",
        "TRITON_CACHE_DIR": "/var/cache/t",
        "CUDA_CACHE_PATH": "/var/cache/c",
        "LC_ALL": "C.UTF-8",
    }
    for name, value in daemon_env.items():
        monkeypatch.setenv(name, value)
    path = ["", "relative/dir", "/abs/dir", os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    got = spy_run(store, spy_dir)
    assert got["cwd"] == "/"
    assert got["args"].split()[:4] == ["-P", "-s", "-m", "gpuwatchd.tuning.worker"]
    env = dict(line.split("=", 1) for line in got["env"].splitlines() if "=" in line)
    for gone in ("PGPASSWORD", "NOTIFY_SOCKET", "FOO", "PYTHONSTARTUP"):
        assert gone not in env
    for private in ("TRITON_CACHE_DIR", "CUDA_CACHE_PATH"):  # its own, not the daemon's
        assert env[private].endswith(f"/worker-{os.geteuid()}/{PRIVATE_DIRS[private]}")
    assert env["LC_ALL"] == "C.UTF-8" and env["PATH"] == os.environ["PATH"]
    entries = env["PYTHONPATH"].split(os.pathsep)
    assert "/abs/dir" in entries and all(os.path.isabs(p) for p in entries)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_a_root_daemon_starts_the_worker_as_worker_user(store: SqlStore, spy_dir: Path) -> None:
    import pwd

    nobody = pwd.getpwnam("nobody")
    got = spy_run(store, spy_dir, worker_user="nobody")
    assert (got["uid"], got["gid"]) == (str(nobody.pw_uid), str(nobody.pw_gid))
    assert "0" not in got["groups"].split()
    env = dict(line.split("=", 1) for line in got["env"].splitlines() if "=" in line)
    assert env["HOME"] == nobody.pw_dir and env["USER"] == "nobody"


def test_worker_user_must_exist_on_this_host() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"tuning": {"worker_user": "no-such-user-here"}})
    assert str(err.value) == "tuning.worker_user: no user 'no-such-user-here' on this host"
    assert parse_config({"tuning": {"worker_user": "nobody"}}).tuning.worker_user == "nobody"


# -- the daemon: refused where work arrives ------------------------------------------------


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gwt-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(short_dir: Path, in_process: Path) -> Iterator[Any]:
    d = make_daemon(make_config(short_dir, allowed_modules=list(ALLOWED)))
    yield d
    d.store.close()


def user_workload(**request: Any) -> Workload:
    """A ``triton.user`` workload as a job could add it (a name fit for added workloads)."""
    return as_workload(request_for(gpu_model=SIM_MODEL, dtypes=(), **request))


def _nothing_kept_or_queued(d: Any) -> None:
    assert d.tuner.pending() == {}
    assert d.user_work.added_names() == frozenset()
    added = d.user_work._added.path
    assert not added.exists() or json.loads(added.read_text())["workloads"] == []


def test_add_workloads_on_the_socket_cannot_widen_the_list(
    daemon: Any, in_process: Path, caplog: pytest.LogCaptureFixture
) -> None:
    widened = attack(user_workload(module="evil_mod"), allowed_modules=["evil_mod"])
    daemon.control.start()
    try:
        with caplog.at_level(logging.WARNING, "gpuwatchd.daemon.user_ops"):
            answer = ask(daemon.control.path, json.dumps(add_request([widened])), 5.0)
    finally:
        daemon.control.stop()
    assert answer["ok"] is False
    assert answer["error"].startswith("workloads[0].params.allowed_modules: not accepted")
    assert "\n" not in answer["error"]
    logged = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(logged) == 1 and f"uid {os.geteuid()}" in logged[0]
    _nothing_kept_or_queued(daemon)
    assert markers(in_process) == []


@pytest.mark.parametrize(
    ("workload", "needle"),
    [
        (lambda: user_workload(module="evil_mod"),
         "workloads[0].params.request.kernel: module 'evil_mod' is not under"),
        (lambda: user_workload(factory="ukt_trust.kernels:__builtins__.eval"),
         "workloads[0].params.request.args_factory: '__builtins__' in"),
        (lambda: attack(Workload("model.gemm", "matmul", {"m": 8, "n": 8, "k": 8}, "float16",
                                 ("torch.matmul",)), allowed_modules=["os"]),
         "workloads[0].params.allowed_modules: not accepted"),
    ],
)  # fmt: skip
def test_add_workloads_naming_code_outside_the_rule_is_refused(
    daemon: Any, workload: Any, needle: str
) -> None:
    with pytest.raises(RequestError) as err:
        call(daemon, add_request([workload()]))
    assert str(err.value).startswith(needle) and "\n" not in str(err.value)
    _nothing_kept_or_queued(daemon)


@pytest.mark.parametrize(
    ("request_", "needle"),
    [
        ({"factory": "ukt_trust.kernels:__builtins__.eval"}, "request.args_factory: '__builti"),
        ({"factory": "ukt_trust.kernels:_hidden"}, "request.args_factory: '_hidden' in"),
        ({"qualname": "scale.__globals__"}, "request.kernel: '__globals__' in"),
        ({"module": "evil_mod"}, "request.kernel: module 'evil_mod' is not under"),
    ],
)
def test_tune_kernel_naming_code_outside_the_rule_is_refused(
    daemon: Any, request_: dict[str, Any], needle: str
) -> None:
    req = request_for(gpu_model=SIM_MODEL, **request_)
    with pytest.raises(RequestError) as err:
        call(daemon, {"op": "tune_kernel", "request": req.to_json()})
    assert str(err.value).startswith(needle) and "\n" not in str(err.value)
    assert daemon.tuner.pending() == {}
    assert not list(daemon.user_work.spool_dir.glob("*.json"))


def test_spooled_workloads_outside_the_rule_are_set_aside_once(
    daemon: Any, in_process: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = daemon.user_work.spool_dir
    widened = attack(user_workload(module="evil_mod"), allowed_modules=["evil_mod"])
    path = write_workload_request(spool, add_request([widened]))
    with caplog.at_level(logging.WARNING, "gpuwatchd.daemon.user_work"):
        daemon.user_work.load()
        daemon.user_work.rescan()
    said = [r.getMessage() for r in caplog.records if path.name in r.getMessage()]
    assert len(said) == 1 and "params.allowed_modules: not accepted" in said[0]
    aside = spool / REJECTED_DIR
    assert not path.exists() and (aside / path.name).exists()
    assert "not accepted" in (aside / (path.name + ".reason")).read_text()
    _nothing_kept_or_queued(daemon)
    assert markers(in_process) == []


def test_spooled_kernel_requests_outside_the_rule_are_not_queued_and_said_once(
    daemon: Any, in_process: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = daemon.user_work.spool_dir
    req = request_for(gpu_model=SIM_MODEL, factory="ukt_trust.kernels:_hidden")
    path = write_request(spool, req)
    with caplog.at_level(logging.WARNING, "gpuwatchd.daemon.user_work"):
        daemon.user_work.load()
        daemon.user_work.rescan()
    said = [r.getMessage() for r in caplog.records if path.name in r.getMessage()]
    assert len(said) == 1 and "request.args_factory: '_hidden' in" in said[0]
    assert path.exists()  # kept for the admin: a later config may allow it
    assert daemon.tuner.pending() == {}
    assert markers(in_process) == []


def test_configured_workloads_follow_the_same_rule(in_process: Path) -> None:
    def config(workload: Workload, allowed: list[str]) -> Any:
        table = {**workload.to_json(), "families": list(workload.families)}
        return parse_config({"tuning": {"allowed_modules": allowed}, "workload": [table]})

    good = user_workload()
    assert good in config(good, list(ALLOWED)).workloads
    bad = [
        (good, [], "workload[0].params.request.kernel: module 'ukt_trust.kernels' is not under"),
        (attack(good, allowed_modules=["ukt_trust"]), [],
         "workload[0].params.allowed_modules: not accepted"),
        (user_workload(factory="ukt_trust.kernels:_hidden"), list(ALLOWED),
         "workload[0].params.request.args_factory: '_hidden' in"),
    ]  # fmt: skip
    for workload, allowed, needle in bad:
        with pytest.raises(ConfigError) as err:
            config(workload, allowed)
        assert str(err.value).startswith(needle) and "\n" not in str(err.value)
    assert markers(in_process) == []


def test_added_workloads_replayed_at_start_that_fail_the_rule_are_set_aside(
    short_dir: Path, in_process: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = user_workload()
    widened = attack(user_workload(module="evil_mod"), allowed_modules=["evil_mod"])
    state = make_config(short_dir, allowed_modules=list(ALLOWED)).daemon.state_dir
    kept = {
        "format": FORMAT,
        "workloads": [
            {**good.to_json(), "source": {"pid": 1}},
            {**widened.to_json(), "source": {"pid": 2}},
        ],
    }
    Path(state, FILE_NAME).write_text(json.dumps(kept))  # as an older daemon accepted them
    d = make_daemon(make_config(short_dir, allowed_modules=list(ALLOWED)))
    try:
        with caplog.at_level(logging.WARNING, "gpuwatchd.daemon.user_work"):
            d.user_work.load()
        assert d.user_work.added_names() == frozenset({good.name})
        assert set(d.tuner.pending()[0]) == {good.name}
        said = [r.getMessage() for r in caplog.records if widened.name in r.getMessage()]
        assert len(said) == 1 and "not accepted" in said[0] and "set aside in" in said[0]
        on_disk = json.loads(Path(state, FILE_NAME).read_text())["workloads"]
        assert [w["name"] for w in on_disk] == [good.name]
        (aside,) = Path(state, ASIDE_NAME).read_text().splitlines()
        assert json.loads(aside)["name"] == widened.name
        reason = json.loads(aside)["reason"]
        assert reason.startswith(f"added workload {widened.name!r}: workload.params.allowed")
    finally:
        d.store.close()
    assert markers(in_process) == []


def test_the_job_carries_the_configs_list_not_the_workloads(
    short_dir: Path, in_process: Path
) -> None:
    from gpuwatchd.sessions.plan import build_specs

    cfg = make_config(short_dir, allowed_modules=list(ALLOWED))
    (spec,) = build_specs(cfg.tuning_setup(), CPU, [user_workload()], [Regime.SUSTAINED])
    assert spec.allowed_modules == ALLOWED and SessionSpec.loads(spec.dumps()) == spec
    req = request_for(gpu_model=SIM_MODEL, dtypes=())
    assert req.to_workload() == as_workload(req)
    assert "allowed_modules" not in spec.workloads[0].params


def test_a_user_kernel_whose_tensors_would_not_fit_is_refused_before_it_is_kept(
    in_process: Path,
) -> None:
    """Its arguments' storage is sized as the worker would allocate it (strides included)."""
    from gpuwatchd.tuning.ops import check_workload

    check_workload(user_workload(n=2**20), "workload")  # 2 x 16 MiB: fine
    huge = user_workload(n=2**31)  # 2 x 32 GiB of float32
    with pytest.raises(ValueError, match=r"^workload\.shape: operands of 64 GiB, over the 16 GiB"):
        check_workload(huge, "workload")
    with pytest.raises(ValueError, match="over the 16 GiB a gpu workload may take"):
        parse_add_request({"op": "add_workloads", "workloads": [huge.to_json()]})


# -- the worker's rule on its own (what the daemon-side checks would otherwise catch first) --


@pytest.mark.parametrize(
    ("module", "qualname", "needle"),
    [
        ("evil_mod", "anything", "module 'evil_mod' is not under [tuning] allowed_modules"),
        ("ukt_trust.kernels", "_hidden", "'_hidden' in ukt_trust.kernels:_hidden is a private"),
    ],
)
def test_the_worker_import_checks_the_name_itself(
    in_process: Path, module: str, qualname: str, needle: str
) -> None:
    with pytest.raises(TrustError) as err:
        import_kernel(module, qualname, ALLOWED, "request.kernel")
    assert str(err.value).startswith(f"request.kernel: {needle}")
    with pytest.raises(TrustError) as err:
        import_function(f"{module}:{qualname}", ALLOWED, "request.args_factory")
    assert str(err.value).startswith(f"request.args_factory: {needle}")
    assert markers(in_process) == [] and "evil_mod" not in sys.modules


def test_a_module_planted_in_sys_modules_under_an_allowed_name_is_refused(
    in_process: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    fake = types.ModuleType("ukt_trust.kernels")  # the right name, another file
    fake.__file__ = str(in_process / "pkgs" / "evil_helpers.py")
    fake.make_args = lambda key_values: {}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ukt_trust.kernels", fake)
    with pytest.raises(TrustError) as err:
        import_function("ukt_trust.kernels:make_args", ALLOWED, "request.args_factory")
    assert "ukt_trust.kernels is not the module of that name at" in str(err.value)
    assert str(err.value).endswith("ukt_trust/kernels.py")


def test_a_module_source_is_read_up_to_8_mib_and_refused_beyond(in_process: Path) -> None:
    cap = 8 * 2**20
    head = "def make_args(key_values):\n    return {}\n"
    filler = "#" * (cap - len(head) - 1) + "\n"
    for name, text in (("at_cap", head + filler), ("over_cap", head + "#" + filler)):
        (in_process / "pkgs" / "ukt_trust" / f"{name}.py").write_text(text)
    assert (in_process / "pkgs" / "ukt_trust" / "at_cap.py").stat().st_size == cap
    fn = import_function("ukt_trust.at_cap:make_args", ALLOWED, "request.args_factory")
    assert fn({}) == {}
    with pytest.raises(TrustError, match=rf"over_cap\.py is over {cap} bytes"):
        import_function("ukt_trust.over_cap:make_args", ALLOWED, "request.args_factory")
    assert "ukt_trust.over_cap" not in sys.modules


def test_a_workload_of_the_user_family_is_checked_whatever_its_op(in_process: Path) -> None:
    workload = replace(as_workload(request_for("evil_mod")), op="matmul")
    with pytest.raises(TrustError, match=r"module 'evil_mod' is not under \[tuning\]"):
        check_workload(workload, ALLOWED)


def _plant(in_process: Path, name: str, text: str) -> None:
    (in_process / "pkgs" / "ukt_trust" / f"{name}.py").write_text(textwrap.dedent(text))


def test_a_name_may_pass_only_through_a_class_that_is_a_class_of_an_allowed_module(
    in_process: Path,
) -> None:
    _plant(
        in_process,
        "passages",
        """
        import evil_helpers


        def as_module(cls):
            return evil_helpers


        @as_module
        class Holder:
            def pwn(key_values):
                return {}


        class Foreign:
            __module__ = "evil_helpers"

            def make_args(key_values):
                return {}
        """,
    )
    cases = {
        "ukt_trust.passages:Holder.pwn": "ukt_trust.passages:Holder is a module, not a class",
        "ukt_trust.passages:Foreign.make_args": (
            "ukt_trust.passages:Foreign is a class defined in evil_helpers, which is not under"
        ),
    }
    for path, needle in cases.items():
        with pytest.raises(TrustError) as err:
            import_function(path, ALLOWED, "request.args_factory")
        assert str(err.value).startswith(f"request.args_factory: {needle}"), str(err.value)
    assert markers(in_process) == []


def test_a_function_of_the_modules_globals_but_code_from_another_file_is_refused(
    in_process: Path,
) -> None:
    _plant(
        in_process,
        "compiled",
        """
        planted = eval(compile("lambda key_values: {}", "/elsewhere/planted.py", "eval"))
        """,
    )
    with pytest.raises(TrustError) as err:
        import_function("ukt_trust.compiled:planted", ALLOWED, "request.args_factory")
    text = str(err.value)
    assert text.startswith("request.args_factory: ukt_trust.compiled:planted is code from")
    assert "(/elsewhere/planted.py), not from ukt_trust.compiled" in text


def test_a_factory_must_be_a_python_function(in_process: Path) -> None:
    with pytest.raises(TrustError) as err:
        import_function("ukt_trust.kernels:Ops", ALLOWED, "request.args_factory")
    assert str(err.value) == (
        "request.args_factory: ukt_trust.kernels:Ops is a type, not a Python function"
    )


def test_a_module_that_fails_to_import_is_one_line(in_process: Path) -> None:
    _plant(
        in_process,
        "broken",
        "def make_args(key_values):\n    return {}\n\n\nraise RuntimeError('boom')\n",
    )
    with pytest.raises(TrustError) as err:
        import_function("ukt_trust.broken:make_args", ALLOWED, "request.args_factory")
    assert (
        str(err.value) == "request.args_factory: cannot import ukt_trust.broken: RuntimeError: boom"
    )


def test_an_allowed_prefix_whose_parent_fails_to_import_is_one_line(in_process: Path) -> None:
    pkg = in_process / "pkgs" / "ukt_boom"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('parent boom')\n")
    (pkg / "kernels" / "__init__.py").write_text("")
    with pytest.raises(TrustError) as err:
        import_function("ukt_boom.kernels:make_args", ("ukt_boom.kernels",), "request.args_factory")
    assert str(err.value).startswith("request.args_factory: cannot find ukt_boom.kernels:")
    assert "parent boom" in str(err.value)
    sys.modules.pop("ukt_boom", None)


def test_allowed_modules_must_be_a_list() -> None:
    with pytest.raises(TrustError) as err:
        parse_allowed_modules("ukt_trust")
    assert str(err.value) == (
        "tuning.allowed_modules: expected a list of module prefixes, got 'ukt_trust'"
    )


def test_a_name_passes_through_a_class_of_the_allowed_module(in_process: Path) -> None:
    _plant(
        in_process,
        "through",
        """
        class Ops:
            def make_args(key_values):
                return {"n": 1}
        """,
    )
    fn = import_function("ukt_trust.through:Ops.make_args", ALLOWED, "request.args_factory")
    assert fn({}) == {"n": 1}


def test_a_malformed_path_is_a_trust_error(in_process: Path) -> None:
    with pytest.raises(TrustError, match=r"request\.args_factory: expected 'module:qualname'"):
        import_function("ukt_trust.kernels.make_args", ALLOWED, "request.args_factory")


def test_a_kernel_object_with_no_function_inside_is_a_trust_error(in_process: Path) -> None:
    _plant(
        in_process,
        "hollow",
        """
        class JITFunction:
            fn = None


        kernel = JITFunction()
        """,
    )
    with pytest.raises(TrustError) as err:
        import_kernel("ukt_trust.hollow", "kernel", ALLOWED, "request.kernel")
    assert str(err.value).startswith("request.kernel: ")
    assert "not a Triton kernel (no Python function inside)" in str(err.value)


def test_a_module_with_a_syntax_error_is_refused_before_it_is_imported(in_process: Path) -> None:
    _plant(in_process, "bad", "def make_args(key_values:\n    return {}\n")
    with pytest.raises(TrustError) as err:
        import_function("ukt_trust.bad:make_args", ALLOWED, "request.args_factory")
    assert str(err.value).startswith("request.args_factory: cannot read ukt_trust.bad: ")
    assert "ukt_trust.bad" not in sys.modules


def test_a_workload_of_another_family_has_no_request_to_check() -> None:
    plain = Workload("gemm-1", "gemm", {"m": 8, "n": 8, "k": 8}, "bf16", ("torch.matmul",))
    assert check_workload(plain, ALLOWED) is None


def test_what_the_source_defines_but_the_module_lacks_or_cannot_give_is_one_line(
    in_process: Path,
) -> None:
    _plant(
        in_process,
        "oddities",
        """
        gone = 1
        del gone


        class Boom:
            def __get__(self, obj, owner):
                raise RuntimeError("descriptor boom")


        class Ops:
            make_args = Boom()


        def _impl(key_values):
            return {}


        annotated: object = _impl
        """,
    )
    cases = {
        "gone": "request.args_factory: ukt_trust.oddities has no gone",
        "Ops.make_args": "request.args_factory: ukt_trust.oddities:Ops.make_args: descriptor boom",
    }
    for qualname, text in cases.items():
        with pytest.raises(TrustError) as err:
            import_function(f"ukt_trust.oddities:{qualname}", ALLOWED, "request.args_factory")
        assert str(err.value).replace("RuntimeError: ", "") == text
    fn = import_function("ukt_trust.oddities:annotated", ALLOWED, "request.args_factory")
    assert fn({}) == {}
