"""torch.compile's lookup table, both ways, on CPU: the keys gpuwatchd writes are the keys
Inductor's own code makes; a table built from winners parses through Inductor's own
lookup; the recording handler sees the GEMMs of a real compile; installing and removing
the table leaves Inductor as it was."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from capture_fakes import client_with, result, stats

torch = pytest.importorskip("torch")
lookup = pytest.importorskip("torch._inductor.lookup_table")

import gpuwatchd.torch as gt  # noqa: E402
from gpuwatchd.tuning.submitted.inductor_sites import (  # noqa: E402
    EXCLUSIVE_ID,
    FAMILY,
    GemmSite,
    SiteCall,
    SiteChoice,
    TensorDesc,
    check_table,
    entry_label,
    is_default_choice,
    lookup_key,
    lookup_table,
    parse_site_workload,
)
from gpuwatchd.tuning.types import Workload  # noqa: E402
from gpuwatchd.tuning.worker.inductor import (  # noqa: E402
    fresh_function,
    handler_installed,
    lookup_table_support,
    recording_handler,
)
from gpuwatchd.tuning.worker.inductor_choices import TableChoices  # noqa: E402

BF16 = "bfloat16"
BIAS = TensorDesc(BF16, (3072,), (1,))
BIAS_EXPANDED = TensorDesc(BF16, (8192, 3072), (0, 1))
X = TensorDesc(BF16, (8192, 1024), (1024, 1))
W_T = TensorDesc(BF16, (1024, 3072), (1, 1024))
SCALARS = {"alpha": 1, "beta": 1}
ATEN = {"template_id": "aten::addmm"}
KEY_ATEN = lookup_key((BIAS, X, W_T), SCALARS, "addmm")
KEY_TRITON = lookup_key((BIAS_EXPANDED, X, W_T), SCALARS, "addmm")
TRITON = {
    "template_id": "triton::mm",
    "EVEN_K": True,
    "USE_FAST_ACCUM": False,
    "ACC_TYPE": "tl.float32",
    "num_stages": 3,
    "num_warps": 4,
    "BLOCK_M": 128,
    "BLOCK_N": 128,
    "BLOCK_K": 64,
    "hint_override": None,
    "GROUP_M": 8,
    "template_hash": "abc123",
}


class FakeInputs:
    """What Inductor's key functions read from a ``KernelInputs``."""

    def __init__(self, descs: tuple[TensorDesc, ...], scalars: dict[str, Any]) -> None:
        self._descs = descs
        self._scalars = scalars

    def device(self) -> Any:
        return torch.device("cuda", 0)

    def dtypes(self) -> tuple[Any, ...]:
        return tuple(getattr(torch, d.dtype) for d in self._descs)

    def shapes_hinted(self) -> tuple[tuple[int, ...], ...]:
        return tuple(d.size for d in self._descs)

    def strides_hinted(self) -> tuple[tuple[int, ...], ...]:
        return tuple(d.stride for d in self._descs)


class Template:
    def __init__(self, uid: str) -> None:
        self.uid = uid


class OnAGpu:
    """Makes Inductor's lookup run as on a CUDA device (this CPU build has none): the device
    key is a name and the table is read from the config as it is."""

    @staticmethod
    def _get_device_key(device: Any) -> str:
        return "NVIDIA H100 80GB HBM3"

    def _get_lookup_table(self) -> dict[str, list[dict[str, Any]]]:
        from torch._inductor import config

        return config.lookup_table.table or {}


class InductorOnAGpu(OnAGpu, lookup.LookupTableChoices):
    pass


class OursOnAGpu(OnAGpu, TableChoices):
    pass


def site() -> GemmSite:
    return GemmSite(
        "addmm",
        (BIAS, X, W_T),
        SCALARS,
        (
            SiteCall(KEY_ATEN, ("aten::addmm", "aten::bias_addmm"), (ATEN,)),
            SiteCall(KEY_TRITON, ("triton::mm",), (TRITON,)),
        ),
        count=4,
    )  # fmt: skip


# -- keys ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("descs", "scalars", "op"),
    [
        ((X, W_T), {}, "mm"),
        ((BIAS, X, W_T), SCALARS, "addmm"),
        ((TensorDesc("float16", (32, 128, 64), (8192, 64, 1)),) * 2, {}, "bmm"),
        ((TensorDesc("float32", (7,), (1,)),), {"beta": 0.5, "alpha": 2}, "addmm"),
    ],
)
def test_keys_are_the_ones_inductors_own_code_makes(
    descs: tuple[TensorDesc, ...], scalars: dict[str, Any], op: str
) -> None:
    fake = FakeInputs(descs, scalars)
    theirs = lookup.LookupTableChoices._generate_kernel_inputs_key(fake) + "+" + op
    assert lookup_key(descs, scalars, op) == theirs
    agnostic = InductorOnAGpu().make_lookup_key(fake, op, include_device=False)
    assert agnostic == theirs


def test_this_torch_has_the_lookup_table() -> None:
    assert lookup_table_support() is None


# -- sites and workloads ---------------------------------------------------------------------


def test_a_site_becomes_a_workload_the_family_accepts() -> None:
    w = site().workload()
    assert w.op == "inductor.gemm" and w.families == (FAMILY,) and w.dtype == BF16
    assert w.name.startswith("inductor.addmm.bf16.8192x3072x1024.")
    spec = parse_site_workload(Workload.from_json(w.to_json()))
    assert spec.keys == (KEY_ATEN, KEY_TRITON) and spec.inputs == (BIAS, X, W_T)
    assert spec.scalars == SCALARS


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.update(op_name="conv"), "shape.op_name: expected one of mm, addmm"),
        (lambda s: s.update(inputs=s["inputs"][1:]), "expected 3 inputs for addmm"),
        (lambda s: s["inputs"][1].update(dtype="int8"), "shape.inputs[1].dtype"),
        (lambda s: s["inputs"][2].update(size=[1000, 3072]), "operand sizes do not multiply"),
        (lambda s: s["inputs"][1].update(stride=[1]), "shape.inputs[1].stride: expected 2 strides"),
        (lambda s: s.update(keys=[]), "shape.keys: expected a non-empty list"),
        (lambda s: s["keys"].__setitem__(0, "x+mm"), "expected a key ending in +addmm"),
        (lambda s: s["keys"].__setitem__(0, KEY_TRITON), "(the inputs' own key)"),
        (lambda s: s.update(extra=1), "shape.extra: unknown key"),
    ],
)
def test_bad_site_workloads_name_the_field(edit: Any, message: str) -> None:
    d = site().workload().to_json()
    edit(d["shape"])
    with pytest.raises(ValueError) as e:
        parse_site_workload(Workload.from_json(d))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_choice_labels_are_short_and_distinct() -> None:
    assert entry_label({"template_id": "aten::addmm"}) == "aten::addmm"
    assert entry_label(TRITON) == "triton::mm 128x128x64 s3 w4 g8"
    assert entry_label({**TRITON, "EPILOGUE_SUBTILE": True}).endswith(" EPILOGUE_SUBTILE=True")
    assert entry_label({"template_id": "decompose_k", "k_split": 4}) == "decompose_k k_split=4"


# -- the table -------------------------------------------------------------------------------


def test_the_table_decides_every_key_of_each_site() -> None:
    s = site()
    table = check_table(lookup_table([SiteChoice(s.keys, KEY_TRITON, TRITON)]))
    assert table[KEY_TRITON] == [TRITON, {"template_id": EXCLUSIVE_ID}]
    assert table[KEY_ATEN] == [{"template_id": EXCLUSIVE_ID}]


def test_a_site_decided_twice_keeps_the_first_pick() -> None:
    s = site()
    aten = {"template_id": "aten::addmm"}
    table = lookup_table(
        [SiteChoice(s.keys, KEY_ATEN, aten), SiteChoice(s.keys, KEY_TRITON, TRITON)]
    )
    assert table[KEY_ATEN][0] == aten and table[KEY_TRITON] == [{"template_id": EXCLUSIVE_ID}]


def test_a_pick_outside_its_site_is_refused() -> None:
    with pytest.raises(ValueError, match="not one of its site's keys"):
        lookup_table([SiteChoice((KEY_ATEN,), KEY_TRITON, TRITON)])


def test_check_table_names_a_bad_entry() -> None:
    with pytest.raises(
        ValueError, match=r"table\['k'\]\[0\]: expected an object with a template_id"
    ):
        check_table({"k": [{"BLOCK_M": 1}]})


def test_inductors_own_lookup_reads_our_table() -> None:
    from torch._inductor import config

    table = lookup_table([SiteChoice(site().keys, KEY_TRITON, TRITON)])
    handler = InductorOnAGpu()
    inputs = FakeInputs((BIAS_EXPANDED, X, W_T), SCALARS)
    with config.patch({"lookup_table.table": table}):
        found = handler.lookup_template_configs(
            inputs, "addmm", ["triton::mm", "triton::mm_persistent_tma"], {"triton::mm": "abc123"}
        )
        stale = handler.lookup_template_configs(
            inputs, "addmm", ["triton::mm"], {"triton::mm": "another-hash"}
        )
    expected = {k: v for k, v in TRITON.items() if k not in ("template_id", "template_hash")}
    assert found == {"triton::mm": [expected]}
    assert stale == {}  # Inductor drops an entry whose template source changed


def test_our_handler_gives_nothing_for_a_key_that_lists_other_templates() -> None:
    from torch._inductor import config

    table = lookup_table([SiteChoice(site().keys, KEY_TRITON, TRITON)])
    handler = OursOnAGpu()
    aten_ask = FakeInputs((BIAS, X, W_T), SCALARS)
    unknown = FakeInputs((TensorDesc(BF16, (5,), (1,)), X, W_T), SCALARS)
    with config.patch({"lookup_table.table": table}):
        none = handler._finalize_template_configs(
            {"aten::addmm": iter(["aten choice"])}, aten_ask, [Template("aten::addmm")], "addmm"
        )
        passed = handler._finalize_template_configs(
            {"aten::addmm": iter(["aten choice"])}, unknown, [Template("aten::addmm")], "addmm"
        )
    assert none == [] and passed == ["aten choice"]
    assert handler.handed == [("addmm", KEY_ATEN, 0), ("addmm", "", 1)]


# -- recording a real compile (CPU Inductor) -------------------------------------------------


def _gemms(bias: Any, a: Any, b: Any, c: Any) -> Any:
    return torch.addmm(bias, a, b), torch.mm(a, c)


def test_recording_sees_the_gemms_of_a_compile_and_benchmarks_nothing() -> None:
    from torch._inductor import config

    bias, a = torch.randn(32), torch.randn(16, 64)
    b, c = torch.randn(32, 64).t(), torch.randn(64, 8)
    handler = recording_handler()
    with handler_installed(handler, None, max_autotune_gemm=True):
        out = torch.compile(fresh_function(_gemms, "t"), dynamic=False, fullgraph=True)(
            bias, a, b, c
        )
    torch.testing.assert_close(out[0], torch.addmm(bias, a, b))
    sites = {s.op_name: s for s in handler.sites()}
    assert set(sites) == {"addmm", "mm"}
    mm = sites["mm"]
    assert mm.inputs == (
        TensorDesc("float32", (16, 64), (64, 1)),
        TensorDesc("float32", (64, 8), (8, 1)),
    )
    assert mm.keys == (lookup_key(mm.inputs, {}, "mm"),)
    addmm = sites["addmm"]
    assert addmm.scalars == {"alpha": 1, "beta": 1}
    assert addmm.keys[0] == lookup_key(addmm.inputs, addmm.scalars, "addmm")
    assert addmm.inputs[2] == TensorDesc("float32", (64, 32), (1, 64))  # the transposed view
    assert {e["template_id"] for _, e in addmm.choices()} >= {"aten::addmm"}
    for s in sites.values():
        assert parse_site_workload(s.workload()).keys == s.keys
    assert config.lookup_table.table is None and config.fx_graph_cache is not False


def test_capture_compiled_gives_workloads_and_restores_inductor() -> None:
    from torch._inductor import config

    before = config.inductor_choices_class
    with gt.capture_compiled() as cap:
        torch.compile(fresh_function(_gemms, "c"), dynamic=False)(
            torch.randn(32), torch.randn(16, 64), torch.randn(32, 64).t(), torch.randn(64, 8)
        )
    assert sorted(w.shape["op_name"] for w in cap.workloads()) == ["addmm", "mm"]
    assert "addmm" in cap.table() and config.inductor_choices_class is before


# -- winners -> table -> installed -----------------------------------------------------------


def _site_stats(name: str, entry: dict[str, Any], key: str, median: float) -> Any:
    meta = {"lookup_entry": entry, "lookup_key": key, "site_keys": list(site().keys)}
    return stats(name, FAMILY, median, meta)


def test_the_table_comes_from_the_recorded_winners(tmp_path: Path) -> None:
    name = site().workload().name
    results = [
        result(
            name,
            [
                _site_stats("inductor[triton::mm 128x128x64 s3 w4 g8]", TRITON, KEY_TRITON, 1e-4),
                _site_stats(
                    "inductor[aten::addmm]", {"template_id": "aten::addmm"}, KEY_ATEN, 2e-4
                ),
            ],
        ),
        result("model.gemm.bf16.1x1x1.nn", [stats("cublas", "torch.matmul", 1e-5)]),
    ]
    client_with(tmp_path, results, torch_version=torch.__version__)
    client = client_with(tmp_path, [result("stale.site", [_site_stats(
        "inductor[aten::addmm]", {"template_id": "aten::addmm"}, KEY_ATEN, 1e-6)])],
        torch_version="1.0.0")  # fmt: skip
    table = gt.inductor_lookup_table(client=client)
    assert table == lookup_table([SiteChoice(site().keys, KEY_TRITON, TRITON)])


BIAS_ADDMM = {"template_id": "aten::bias_addmm"}
_DEFAULT = {"job_default": True}


def _verdict(beats: bool) -> dict[str, Any]:
    return {"vs_default": {"margin": 0.004, "noise": 0.01, "beats": beats}}


def test_only_atens_own_op_is_the_sites_default() -> None:
    """torch.compile without max-autotune lowers addmm to aten::addmm alone; bias_addmm is
    one of max-autotune's extras. Marking both made the protocol's default whichever came
    first, so a tie kept bias_addmm (issue 27)."""
    entries = [e for _, e in site().choices()] + [BIAS_ADDMM]
    assert [e["template_id"] for e in entries if is_default_choice(e, "addmm")] == ["aten::addmm"]
    assert is_default_choice({"template_id": "aten::mm"}, "mm")
    assert not is_default_choice({"template_id": "aten::mm"}, "addmm")


@pytest.mark.parametrize(
    ("winner_meta", "expected"),
    [
        # a row recorded when bias_addmm counted as a default: the nominal winner of a tie
        (_DEFAULT, ATEN),
        # a template within the noise of the default
        (_verdict(False), ATEN),
        # beyond the noise: it replaces the default
        (_verdict(True), None),
    ],
)
def test_the_table_keeps_the_default_unless_the_winner_beat_it(
    tmp_path: Path, winner_meta: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    name = site().workload().name
    old_default = "job_default" in winner_meta  # the bias_addmm row of a tie
    entry, key = (BIAS_ADDMM, KEY_ATEN) if old_default else (TRITON, KEY_TRITON)
    won = _site_stats("inductor[winner]", entry, key, 1.00e-4)
    won.meta.update(winner_meta)
    default = _site_stats("inductor[aten::addmm]", ATEN, KEY_ATEN, 1.01e-4)
    default.meta.update(_DEFAULT)
    client = client_with(tmp_path, [result(name, [won, default])], torch_version=torch.__version__)
    want = (
        SiteChoice(site().keys, KEY_ATEN, ATEN) if expected else SiteChoice(site().keys, key, entry)
    )
    assert gt.inductor_lookup_table(client=client) == lookup_table([want])


def test_use_inductor_winners_installs_and_removes_the_table() -> None:
    from torch._inductor import config
    from torch._inductor.virtualized import V

    table = lookup_table([SiteChoice(site().keys, KEY_TRITON, TRITON)])
    before_handler = V.choices
    installed = gt.use_inductor_winners(table=table)
    try:
        assert config.lookup_table.table == table and V.choices is installed.handler
        assert config.inductor_choices_class is type(installed.handler)
        assert installed.sites == 1 and "triton::mm 128x128x64 s3 w4 g8" in installed.describe()
    finally:
        installed.remove()
    assert config.lookup_table.table is None and config.inductor_choices_class is None
    assert V.choices is before_handler


def test_use_inductor_winners_refuses_a_bad_table() -> None:
    with pytest.raises(ValueError, match="template_id"):
        gt.use_inductor_winners(table={"k": [{}]})
