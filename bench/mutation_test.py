"""Mutation test of the core logic: gate, statistics, drift detector, winner decision, and
the trust rule for user code (with the launch-option allow-list).

Run: ``nice -n 10 python3 bench/mutation_test.py [--module gate] [--before REV] [-v]``.

Why this runner and not mutmut: mutants run in forked children of one warm process (a
mutant costs about a second of the guarding tests), every mutant is checked to have
reached the code the tests run before its outcome counts, and ``--before`` scores the
tests of an earlier revision against the same mutants in the same run. Its known
survivors, each with the reason it is equivalent, are kept below (``EQUIVALENT``).

How: each mutant is one AST edit of the module (operator swap, comparison flip, and/or,
``not`` dropped, number + 1, bool negated, ``return x`` -> ``return None``, a variable
passed to a call -> ``None``, statement deleted). A forked child compiles the mutated
module, transplants its function code and defaults into the live module (so every
importer sees the mutant, as a file edit would), checks that the edit is now in the live
code, and runs the module's own tests with ``-x``.

Outcomes: *killed* (a test failed or could not be collected, the mutated module does not
import or no longer defines a name another module imports, the child crashed),
*timeout* (killed, listed apart: a loaded machine can cause one), *survived*, *not
applied* (the edit never reached the code under test, e.g. a method's code that needs
other closure cells, or a value held in a closure: excluded from the score and listed)
and *error* (pytest itself failed: excluded and listed).
Killed% = killed / (mutants - not applied - equivalent - errors).

Not mutated: annotations (never evaluated under ``from __future__ import annotations``),
docstrings, string constants and f-strings (message text), ``assert`` statements (type
narrowing), log calls' arguments, and decorators and class-body assignments (a class is
built once, so an edit to ``@dataclass(frozen=True)`` or an enum member cannot be
transplanted; dataclass field defaults can, through ``__init__``'s defaults).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import copy
import importlib
import io
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Target:
    """One module under test: the file, the functions in scope, the tests that guard it."""

    name: str
    files: tuple[tuple[str, str, frozenset[str] | None], ...]  # (path, module, scopes)
    tests: tuple[str, ...]  # pytest arguments: pinned tests first, so kills are fast


_KEEP_SLOW = "not a_day_of_a_stable"  # two 2 s day-long replays; the rest covers them
TARGETS = {
    "gate": Target(
        "gate",
        (("gpuwatchd/gate.py", "gpuwatchd.gate", None),),
        (
            "tests/test_gate_pinned.py",
            "tests/test_gate.py",
            "tests/test_gate_window.py",  # SampleWindow, and every gate test over one
            "tests/test_faults_gate.py",
        ),
    ),
    "stats": Target(
        "stats",
        (("gpuwatchd/tuning/worker/stats.py", "gpuwatchd.tuning.worker.stats", None),),
        (
            "tests/test_stats_pinned.py",
            "tests/test_decision_pinned.py",
            "tests/test_protocol.py",
            "tests/test_deciding_faster.py",  # racing's use of the medians and CIs
        ),
    ),
    "drift": Target(
        "drift",
        (("gpuwatchd/drift/detector.py", "gpuwatchd.drift.detector", None),),
        ("tests/test_drift_pinned.py", "tests/test_drift.py", "-k", _KEEP_SLOW),
    ),
    "decision": Target(
        "decision",
        (
            ("gpuwatchd/tuning/winners.py", "gpuwatchd.tuning.winners", None),
            (
                "gpuwatchd/tuning/worker/stats.py",
                "gpuwatchd.tuning.worker.stats",
                frozenset({"decide"}),
            ),
            (
                "gpuwatchd/tuning/worker/regime_run.py",
                "gpuwatchd.tuning.worker.regime_run",
                frozenset({"RegimeRun._result"}),
            ),
        ),
        (
            "tests/test_decision_pinned.py",
            "tests/test_protocol.py",
            "tests/test_job_default.py",  # the job's default kept on a tie
            "tests/test_store.py",
        ),
    ),
    "store_rows": Target(
        "store_rows",
        (("gpuwatchd/store/row_values.py", "gpuwatchd.store.row_values", None),),
        (
            "tests/test_store_row_values.py",
            "tests/test_fuzz_store_rows.py",
            "-k",
            "not postgres",  # the same loaders on both back ends; a server per mutant is slow
        ),
    ),
    "spool": Target(
        "spool",
        (("gpuwatchd/tuning/intake/spool.py", "gpuwatchd.tuning.intake.spool", None),),
        (
            "tests/test_spool_fds.py",
            "tests/test_spool_details.py",
            "tests/test_user_kernels_spool.py",
            "tests/test_faults_input.py",
            "tests/test_capture_wire.py",
            "-m",
            "not slow",  # the 10 s race and the 30-file memory test: covered by the rest
            "-k",
            "not daemon_starts",  # a daemon subprocess never sees a mutant
        ),
    ),
    "trust": Target(
        "trust",
        (
            ("gpuwatchd/tuning/submitted/trust.py", "gpuwatchd.tuning.submitted.trust", None),
            (
                "gpuwatchd/tuning/submitted/launch_options.py",
                "gpuwatchd.tuning.submitted.launch_options",
                None,
            ),
        ),
        (
            "tests/test_trust_boundary.py",
            "tests/test_launch_options.py",
            "tests/test_user_kernels_wire.py",
            "-k",
            "not real_worker and not json_py",  # two worker processes; the rest covers them
        ),
    ),
}

# Survivors no test can kill, by (file, enclosing function, the node's first source line
# (indented once unless given), the node's source, the edit); each with the reason no test can tell
# it from the original.
EQUIVALENT: dict[tuple[str, str, str, str, str], str] = {}


def _equivalent(file: str, scope: str, line: str, src: str, edit: str, why: str) -> None:
    indented = line if line.startswith(" ") else "    " + line  # default: indented once
    EQUIVALENT[(file, scope, indented, src, edit)] = why


_G = "gpuwatchd/gate.py"
_S = "gpuwatchd/tuning/worker/stats.py"
_D = "gpuwatchd/drift/detector.py"
_HALF = (
    "the loop may run one step further, to j = n // 2, where P(Binom(n, 1/2) <= j) >= 1/2 "
    "exceeds every tail (1 - confidence) / 2 < 1/2: it breaks with the same j"
)
_equivalent(_S, "median_ci", "while j < n // 2:", "j < n // 2", "Compare < -> <=", _HALF)
_equivalent(_S, "median_ci", "while j < n // 2:", "n // 2", "BinOp // -> /", _HALF)
_equivalent(
    _G,
    "_recent",
    "if window[0].t >= cutoff:",
    "window[0].t >= cutoff",
    "Compare >= -> >",
    "a first sample exactly at the cutoff then takes the bisect path, which keeps it too",
)
for _line in ("idle = mask > 0 and bool(mask & _IDLE_BIT)",
              "if mask > 0 and mask & _LIMITING_BITS:"):  # fmt: skip
    _equivalent(
        _G,
        "evaluate",
        _line,
        "mask > 0",
        "Compare > -> >=",
        "a mask of 0 has no bit set, so the & after it is 0 (false) either way",
    )
_equivalent(
    _G,
    "evaluate",
    "if span is not None and span[1] and (span[1] - span[0]) / span[1] > lim:",
    "span is not None and span[1] and (span[1] - span[0]) / span[1] > lim",
    "BoolOp and -> or",
    "a fast-path filter: the latest clock is never None (else unavailable), and the same "
    "test is repeated on the non-idle samples inside, so entering more often changes nothing",
)
_CLOCK_FILTER = "if span is not None and span[1] and (span[1] - span[0]) / span[1] > lim:"
for _src, _edit in [("span[1] - span[0]", "BinOp - -> +"),
                    ("(span[1] - span[0]) / span[1]", "BinOp / -> *")]:  # fmt: skip
    _equivalent(
        _G,
        "evaluate",
        _CLOCK_FILTER,
        _src,
        _edit,
        "the first clock-spread test only filters: a wider filter lets more windows reach "
        "the exact test on the non-idle samples, which decides alone",
    )
_equivalent(
    _G,
    "evaluate",
    _CLOCK_FILTER,
    "(span[1] - span[0]) / span[1] > lim",
    "Compare > -> >=",
    "the same filter: a spread exactly at the limit then meets the exact test, which passes it",
)
_equivalent(
    _G,
    "evaluate",
    "mask = -1 if latest.reasons is None else latest.reasons._value_",
    "1@8",
    "Constant + 1",
    "any negative mask means no reading: both tests on it need mask > 0",
)
_equivalent(
    _G,
    "evaluate",
    "if mask > 0 and mask & _LIMITING_BITS:",
    "0@10",
    "Constant + 1",
    "mask 1 is GPU_IDLE alone, which holds no limiting bit: false either way",
)
_equivalent(
    _G,
    "from_mapping",
    " " * 20 + 'raise ValueError(f"gate.{key}: expected a whole number, got {value!r}")',
    'raise ValueError(f"gate.{key}: expected a whole number, got {value!r}")',
    "Statement delete",
    "the constructor then refuses the float with the very same message",
)
_NO_HI = "whether the upper bound is exclusive, for a key with no upper bound (None)"
for _line in (
    '"window_s": (0, True, None, False),',
    '"stale_after_s": (0, True, None, False),',
    '"settle_s": (0, False, None, False),',
):
    _equivalent(_G, "<module>", _line, f"False@{_line.rindex('False')}", "Constant negate", _NO_HI)
for _arg in ("field", "window"):
    _equivalent(
        _G,
        "_span",
        " " * 8 + "ordered: list[float] = sorted(map(field, window))  # type: ignore[arg-type]",
        "map(field, window)",
        f"Argument {_arg} -> None",
        "map() over None raises TypeError, the very exception that sends a window with a None "
        "to the slow path, which computes the same span",
    )
_equivalent(
    _G,
    "advance",
    " " * 8 + "if self[0].t < horizon:  # more than one leaves: a gap in the readings",
    "self[0].t < horizon",
    "Compare < -> <=",
    "a sample exactly at the horizon then takes the general path (enter, leave, trim with "
    "the unmutated test), which keeps it and yields the same orders",
)
_equivalent(
    _G,
    "evaluate",
    "if kept is not None and window[0].t >= cutoff:",
    "window[0].t >= cutoff",
    "Compare >= -> >",
    "a first sample exactly at the cutoff then takes the sorting path, whose _recent keeps "
    "it: the same spans",
)
_equivalent(
    _G,
    "advance",
    " " * 8 + "if w0 != w1 or (w0 and c0 != c1):",
    "w0 and c0 != c1",
    "BoolOp and -> or",
    "the extra moves it makes are no-ops: both sides None (neither sample counts), or the "
    "same clock removed and inserted again",
)
_equivalent(
    _G,
    "evaluate",
    "kept = window if isinstance(window, SampleWindow) and not window._nans else None",
    "isinstance(window, SampleWindow)",
    "Argument window -> None",
    "every window then takes the sorting path, which gives the same decision by design "
    "(the kept orders are only a faster way to the same spans)",
)
_equivalent(
    "gpuwatchd/tuning/worker/regime_run.py",
    "_result",
    " " * 16 + "s.name: list(zip(s.rounds, (r.seconds_per_call for r in s.accepted), strict=True))",
    "True@76",
    "Constant negate",
    "a slot's rounds and accepted batches are appended and cleared together, so the two "
    "are always the same length: strict only guards that",
)
_equivalent(
    "gpuwatchd/tuning/worker/regime_run.py",
    "_result",
    " " * 8 + "pick = winner or (decision.ranking[0] if tie and decision.ranking else None)",
    "tie and decision.ranking",
    "BoolOp and -> or",
    "decide and decide_race leave both winner and tie unset only with an empty ranking "
    "(nothing usable), where `tie or ranking` is false too",
)
_T = "gpuwatchd/tuning/submitted/trust.py"
_L = "gpuwatchd/tuning/submitted/launch_options.py"
_equivalent(
    _T,
    "allowed_prefix",
    "return max(found, key=len) if found else None",
    "max(found, key=len)",
    "Argument key=len -> None",
    "every prefix found is a prefix of the module, so of each other: the longest is also "
    "the greatest string",
)
_equivalent(
    _T,
    "check_defined",
    " " * 12 + "source = f.read(MAX_SOURCE_BYTES + 1)",
    "1@35",
    "Constant + 1",
    "reading one byte more changes nothing: any source longer than the cap is refused",
)
_ALIAS = "OptionValue = int | bool | str"
EQUIVALENT[(_L, "<module>", _ALIAS, _ALIAS, "Statement delete")] = (
    "a type alias read only in annotations, never evaluated"
)
_equivalent(
    _L,
    "<module>",
    '    "default_dot_input_precision": LaunchOption(str, choices=("tf32", "tf32x3", "ieee")),',
    'LaunchOption(str, choices=("tf32", "tf32x3", "ieee"))',
    "Argument str -> None",
    "a choices option is any kind other than bool and int: None takes the same branch",
)
for _field in ("low", "high"):
    _equivalent(
        _L,
        "LaunchOption",
        f"{_field}: int = 0",
        f"0@{len(_field) + 8}",
        "Constant + 1",
        "only bool and str options take the default, and they never read the bounds",
    )
_HELD = "held_s: float = 0.0  # evidence-backed seconds beyond the threshold, this episode"
_equivalent(
    _D,
    "_Track",
    _HELD,
    f"0.0@{_HELD.index('0.0')}",
    "Constant + 1",
    "held_s's default is never read: a track's dwell count starts when set_reference zeroes it",
)


_P = "gpuwatchd/tuning/intake/spool.py"
_JUST_MADE = "    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)"
for _src in ("os.O_RDONLY | os.O_DIRECTORY", "os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC"):
    _equivalent(
        _P,
        "write_atomically",
        _JUST_MADE,
        _src,
        "BinOp | -> &",
        "the folder was just made by mkdir(exist_ok=True), which raises for a file there, so "
        "O_DIRECTORY checks nothing more; O_CLOEXEC matters only to a thread that execs while "
        "the descriptor is open",
    )
_equivalent(
    _P,
    "_subfolder",
    "        for attempt in range(2):",
    "2@21",
    "Constant + 1",
    "a third try ends as the second (moved aside again, or SpoolError) unless a writer swaps "
    "the folder back exactly twice between two system calls",
)
_equivalent(
    _P,
    "_subfolder",
    '        raise AssertionError("unreachable")  # pragma: no cover',
    'raise AssertionError("unreachable")',
    "Statement delete",
    "unreachable: the loop's second pass returns or raises",
)
_equivalent(
    _P,
    "_pick",
    "                    if now - st.st_mtime > STALE_TMP_S and not stat.S_ISDIR(st.st_mode):",
    "now - st.st_mtime > STALE_TMP_S",
    "Compare > -> >=",
    "differs only for a temporary exactly STALE_TMP_S old to the nanosecond",
)
_equivalent(
    _P,
    "_mkdir_at",
    "        return False",
    "return False",
    "Return -> None",
    "the answer is only tested for truth: None is false too",
)


# -- mutant generation -------------------------------------------------------------------

_BINOPS: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}
_CMPOPS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_SYM = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Is: "is",
    ast.IsNot: "is_not",
    ast.In: "in",
    ast.NotIn: "not_in",
}
_LOG_METHODS = {"debug", "info", "warning", "error", "exception"}


@dataclass(frozen=True)
class Mutant:
    file: str
    module: str
    index: int  # position of the node in ast.walk order
    edit: str  # which edit, e.g. "Compare < -> <=" (with the operand position)
    scope: str  # enclosing function's qualified name, "<module>" at top level
    line: int
    src: str  # the node's source text

    line_text: str = ""  # the node's first source line, indentation kept

    def key(self) -> tuple[str, str, str, str, str]:
        scope = self.scope.rsplit(".", 1)[-1]
        return (self.file, scope, self.line_text, self.src, self.edit.split("@")[0])


def _skipped_nodes(tree: ast.Module) -> set[int]:
    """ids of nodes never mutated: annotations, docstrings, asserts, log-call arguments."""
    skip: set[int] = set()

    def drop(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            for deco in node.decorator_list:
                drop(deco)  # a class is built once: a decorator edit cannot be transplanted
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.Assign):
                    drop(stmt)  # enum members: the class is built once, as above
        if isinstance(node, ast.arg | ast.AnnAssign):
            drop(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            drop(node.returns)
        elif isinstance(node, ast.Assert):
            drop(node)
        elif isinstance(node, ast.JoinedStr):
            drop(node)  # message text
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _LOG_METHODS
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "log"
        ):
            for a in node.args:
                drop(a)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                drop(body[0])
    return skip


def _scopes(tree: ast.Module) -> dict[int, str]:
    """id(node) -> qualified name of the function (or class body) that holds it."""
    out: dict[int, str] = {}

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = child.name if scope == "<module>" else f"{scope}.{child.name}"
            out[id(child)] = inner
            visit(child, inner)

    visit(tree, "<module>")
    return out


def _edits(node: ast.AST, skip: set[int]) -> Iterator[str]:
    if isinstance(node, ast.BinOp | ast.AugAssign) and type(node.op) in _BINOPS:
        yield f"BinOp {_SYM[type(node.op)]} -> {_SYM[_BINOPS[type(node.op)]]}"
    elif isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            yield f"Compare {_SYM[type(op)]} -> {_SYM[_CMPOPS[type(op)]]}@{i}"
    elif isinstance(node, ast.BoolOp):
        yield "BoolOp " + ("and -> or" if isinstance(node.op, ast.And) else "or -> and")
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub):
        yield "UnaryOp drop " + ("not" if isinstance(node.op, ast.Not) else "-")
    elif isinstance(node, ast.Constant):
        if isinstance(node.value, bool):
            yield "Constant negate"
        elif isinstance(node.value, int | float):
            yield "Constant + 1"
    elif isinstance(node, ast.Call):
        for i, arg in enumerate(node.args):
            if isinstance(arg, ast.Name) and id(arg) not in skip:
                yield f"Argument {arg.id} -> None@{i}"
        for kw in node.keywords:
            if kw.arg is not None and isinstance(kw.value, ast.Name) and id(kw.value) not in skip:
                yield f"Argument {kw.arg}={kw.value.id} -> None@{kw.arg}"
    elif isinstance(node, ast.Return) and not (
        node.value is None or (isinstance(node.value, ast.Constant) and node.value.value is None)
    ):
        yield "Return -> None"
    if isinstance(node, ast.Assign | ast.AugAssign | ast.Raise | ast.Expr):
        yield "Statement delete"


def _apply(node: ast.AST, edit: str) -> ast.AST:
    """The mutated replacement for ``node`` (mutating in place where that is simpler)."""
    kind = edit.split("@")[0]
    if kind == "Statement delete":
        return ast.copy_location(ast.Pass(), node)
    if kind.startswith("BinOp"):
        assert isinstance(node, ast.BinOp | ast.AugAssign)
        node.op = _BINOPS[type(node.op)]()
    elif kind.startswith("Compare"):
        assert isinstance(node, ast.Compare)
        i = int(edit.split("@")[1])
        node.ops[i] = _CMPOPS[type(node.ops[i])]()
    elif kind.startswith("BoolOp"):
        assert isinstance(node, ast.BoolOp)
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif kind.startswith("UnaryOp"):
        assert isinstance(node, ast.UnaryOp)
        return node.operand
    elif kind == "Constant negate":
        assert isinstance(node, ast.Constant)
        node.value = not node.value
    elif kind == "Constant + 1":
        assert isinstance(node, ast.Constant)
        node.value = node.value + 1  # type: ignore[operator]
    elif kind.startswith("Argument"):
        assert isinstance(node, ast.Call)
        where = edit.split("@")[1]
        none = ast.copy_location(ast.Constant(None), node)
        if where.isdigit():
            node.args[int(where)] = none
        else:
            next(kw for kw in node.keywords if kw.arg == where).value = none
    elif kind == "Return -> None":
        assert isinstance(node, ast.Return)
        node.value = ast.Constant(None)
    return node


class _Replace(ast.NodeTransformer):
    def __init__(self, target: ast.AST, edit: str) -> None:
        self.target, self.edit = target, edit

    def generic_visit(self, node: ast.AST) -> ast.AST:
        if node is self.target:
            return _apply(node, self.edit)
        return super().generic_visit(node)


def mutants(target: Target) -> list[Mutant]:
    out = []
    for path, module, scopes in target.files:
        source = (ROOT / path).read_text()
        tree = ast.parse(source)
        lines = source.splitlines()
        skip, scope_of = _skipped_nodes(tree), _scopes(tree)
        for index, node in enumerate(ast.walk(tree)):
            if id(node) in skip or not hasattr(node, "lineno"):
                continue
            scope = scope_of.get(id(node), "<module>")
            if scopes is not None and not any(
                scope == s or scope.startswith(s + ".") for s in scopes
            ):
                continue
            text = ast.get_source_segment(source, node) or ""
            text = " ".join(text.split())[:80]
            line = lines[node.lineno - 1]
            stripped = line.rstrip()  # indented: the inner of two same lines differs
            if isinstance(node, ast.Constant):  # a line may hold the same constant twice
                text = f"{text}@{node.col_offset - (len(line) - len(line.lstrip()))}"
            for edit in _edits(node, skip):
                out.append(Mutant(path, module, index, edit, scope, node.lineno, text, stripped))
    return out


def mutated_code(m: Mutant) -> types.CodeType:
    tree = ast.parse((ROOT / m.file).read_text())
    node = next(n for i, n in enumerate(ast.walk(tree)) if i == m.index)
    tree = _Replace(node, m.edit).visit(copy.copy(tree))
    ast.fix_missing_locations(tree)
    return compile(tree, str(ROOT / m.file), "exec")


# -- applying a mutant in a child ---------------------------------------------------------


def _function(obj: object) -> types.FunctionType | None:
    for attr in ("__func__", "fget", "__wrapped__"):
        obj = getattr(obj, attr, obj)
    return obj if isinstance(obj, types.FunctionType) else None


def _copy_function(old: object, new: object) -> None:
    f_old, f_new = _function(old), _function(new)
    if f_old is None or f_new is None or f_old is f_new:
        return
    f_old.__code__ = f_new.__code__
    f_old.__defaults__ = f_new.__defaults__
    f_old.__kwdefaults__ = f_new.__kwdefaults__


class NotApplied(Exception):
    """The mutated code could not be put where the tests run it."""


def _top_statement(m: Mutant) -> ast.stmt:
    """The module-level statement that holds the mutated node."""
    tree = ast.parse((ROOT / m.file).read_text())
    node = next(n for i, n in enumerate(ast.walk(tree)) if i == m.index)
    for stmt in tree.body:
        if any(n is node for n in ast.walk(stmt)):
            return stmt
    raise NotApplied("the node is in no module-level statement")


def _bound_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [stmt.name]
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
    return [n.id for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)]


def _codes(obj: object) -> list[tuple[str, object]]:
    """(where, code and defaults) of a function, or of every function of a class."""
    f = _function(obj)
    if f is not None:
        return [("", (f.__code__, f.__defaults__, f.__kwdefaults__))]
    if isinstance(obj, type):
        return [
            (attr, (g.__code__, g.__defaults__, g.__kwdefaults__))
            for attr, value in sorted(obj.__dict__.items())
            if (g := _function(value)) is not None
        ]
    return []


def _check_applied(m: Mutant, live: types.ModuleType, ns: dict[str, object]) -> None:
    """Raise NotApplied unless the live module now runs the mutated statement.

    The statement's functions (a class's methods, a dataclass field default through
    ``__init__``) must differ from the unmutated file's, by value, and the live ones must
    be the mutated ones; a module-level value must be the mutated value (or be gone).
    """
    stmt = _top_statement(m)
    names = _bound_names(stmt)
    if not names:
        raise NotApplied(f"a module-level {type(stmt).__name__} binds no name")
    if isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
        for name in names:
            if name in ns and live.__dict__.get(name) is not ns[name]:
                raise NotApplied(f"{name} was not replaced")
            if name not in ns and name in live.__dict__:
                raise NotApplied(f"{name} was not removed")
        return
    original: dict[str, object] = {"__name__": m.module, "__builtins__": builtins}
    exec(compile((ROOT / m.file).read_text(), str(ROOT / m.file), "exec"), original)
    for name in names:
        mutated, before = dict(_codes(ns[name])), dict(_codes(original[name]))
        if mutated == before:  # code objects compare by value
            raise NotApplied(f"{name}: the edit reaches no function's code")
        now = dict(_codes(live.__dict__[name]))
        for where, (code, defaults, kwdefaults) in mutated.items():
            got = now.get(where)
            if got is None or got[0] is not code or got[1:] != (defaults, kwdefaults):
                raise NotApplied(f"{name}.{where} was not replaced")


def transplant(m: Mutant) -> None:
    """Make the live module behave as the mutated file would, for every importer.

    Raises NotApplied when it cannot (a code object that will not fit its function, an
    edit no function or module value carries); an exception from running the mutated
    module itself propagates: the file would not import.
    """
    live = importlib.import_module(m.module)
    ns: dict[str, object] = {"__name__": m.module, "__builtins__": builtins}
    exec(mutated_code(m), ns)  # the point of a mutation test
    try:
        assigned = {
            t.id
            for stmt in ast.parse((ROOT / m.file).read_text()).body
            if isinstance(stmt, ast.Assign | ast.AnnAssign)
            for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
            if isinstance(t, ast.Name)
        }
        for name in assigned - ns.keys():  # a deleted top-level assignment: gone, as on import
            gone = live.__dict__.pop(name, None)
            if gone is not None and (users := _importers(m.module, name, gone)):
                # ``from module import name`` in these fails on the edited file
                raise ImportError(f"{name} is imported by {', '.join(users)}")
        for name, new in ns.items():
            old = live.__dict__.get(name)
            if old is None:
                continue
            if isinstance(old, type) and isinstance(new, type):
                for attr, value in new.__dict__.items():
                    if attr in old.__dict__:
                        _copy_function(old.__dict__[attr], value)
            elif _function(old) is not None:
                _copy_function(old, new)
            elif name in assigned and new is not old:
                live.__dict__[name] = new
                _rebind_importers(m.module, name, old, new)
    except ValueError as e:  # e.g. a code object with other free variables
        raise NotApplied(str(e)) from e
    _check_applied(m, live, ns)


def _importers(module: str, name: str, value: object) -> list[str]:
    """The package's other modules that hold ``value`` as ``name``: they imported it."""
    return [
        other.__name__
        for other in list(sys.modules.values())
        if isinstance(other, types.ModuleType)
        and other.__name__.startswith("gpuwatchd")
        and other.__name__ != module
        and getattr(other, name, None) is value
    ]


def _rebind_importers(module: str, name: str, old: object, new: object) -> None:
    """``from module import name`` elsewhere in the package: rebind it as an import would."""
    for other in _importers(module, name, old):
        setattr(sys.modules[other], name, new)


#: Child exit statuses that are not pytest's.
_NOT_APPLIED, _NO_LOAD = 70, 71
#: pytest's: tests failed, or collection broke (a test module importing the mutant).
_FAILED = (1, 2)


def run_child(m: Mutant | None, args: list[str], timeout: float) -> tuple[str, float]:
    """Run the tests against mutant ``m`` (None: the unmutated code) in a forked child.

    Outcomes: ``killed`` (a test failed, collection broke, the mutated module does not
    import, or the child crashed), ``timeout`` (counted as killed, listed apart),
    ``survived``, ``not applied`` (the mutant never reached the code under test) and
    ``error`` (pytest itself failed: no tests, usage or internal error; not a kill).
    """
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        code = 99
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            signal.alarm(max(1, int(timeout)))
            if m is not None:
                try:
                    transplant(m)
                except NotApplied:
                    os._exit(_NOT_APPLIED)
                except Exception:
                    os._exit(_NO_LOAD)  # the mutated module does not even import
            import pytest

            code = int(pytest.main([*args, "-x", "-q", "-p", "no:cacheprovider"]))
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    took = time.monotonic() - start
    if os.WIFSIGNALED(status):
        return ("timeout" if os.WTERMSIG(status) == signal.SIGALRM else "killed"), took
    code = os.WEXITSTATUS(status)
    if code == 0:
        return "survived", took
    if code in _FAILED or code == _NO_LOAD:
        return "killed", took
    return ("not applied" if code == _NOT_APPLIED else "error"), took


def _preload(tests: tuple[str, ...]) -> None:
    """Import what the test files import, once, so each forked child starts warm."""
    for t in tests:
        path = ROOT / t
        if not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            for name in names:
                if not name.startswith("test_"):
                    with contextlib.suppress(ImportError):
                        importlib.import_module(name)


def _tests_at(rev: str, into: Path) -> Path:
    """The ``tests/`` folder as it was at git revision ``rev``, extracted under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "tests"], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def _args(tests: tuple[str, ...], root: Path) -> list[str]:
    """pytest arguments: test paths under ``root``, the project's pytest settings."""
    out = ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(root)]
    for t in tests:
        if t.startswith("tests/"):
            if (root / t).is_file():
                out.append(str(root / t))
        else:
            out.append(t)
    return out


@dataclass
class Tally:
    """Outcomes of one target's mutants, with the tests of ``--before`` and with today's."""

    total: int = 0
    not_applied: int = 0
    equivalent: int = 0
    errors: int = 0
    killed_before: int = 0
    killed: int = 0
    timeouts: int = 0
    survived: int = 0

    def rate(self, killed: int) -> float:
        return killed / max(1, self.total - self.not_applied - self.equivalent - self.errors)


def run_target(
    target: Target, before: Path | None, verbose: bool, lines: list[int] | None = None
) -> Tally:
    """Run every mutant of ``target``; with ``before`` (a tests/ copy) first against those.

    Today's tests hold the earlier ones, so a mutant the earlier tests kill is killed by
    today's too, and only the earlier survivors run again.
    """
    now_args = _args(target.tests, ROOT)
    before_args = _args(target.tests, before) if before is not None else None
    _preload(target.tests)
    timeouts = []
    for args in filter(None, (before_args, now_args)):
        outcome, base = run_child(None, args, 600)
        if outcome != "survived":
            sys.exit(f"{target.name}: the tests fail without any mutant ({outcome}): {args}")
        timeouts.append(max(10.0, 5 * base))
    tally = Tally()
    ms = [m for m in mutants(target) if not lines or m.line in lines]
    tally.total = len(ms)
    for m in ms:
        where = f"{m.file}:{m.line} {m.scope}: {m.edit}: {m.src}"
        outcome = "survived"
        if before_args is not None:
            outcome, _ = run_child(m, before_args, timeouts[0])
            if outcome in ("killed", "timeout"):
                tally.killed_before += 1
        if outcome in ("survived", "error"):
            outcome, _ = run_child(m, now_args, timeouts[-1])
        if outcome == "not applied":
            tally.not_applied += 1
            print(f"  NOT APPLIED {where}", flush=True)
        elif outcome == "error":
            tally.errors += 1
            print(f"  ERROR      {where}", flush=True)
        elif outcome in ("killed", "timeout"):
            tally.killed += 1
            if outcome == "timeout":
                tally.timeouts += 1
                print(f"  TIMEOUT    {where}", flush=True)
        elif (why := EQUIVALENT.get(m.key())) is not None:
            tally.equivalent += 1
            if verbose:
                print(f"  equivalent {where}  ({why})")
        else:
            tally.survived += 1
            print(f"  SURVIVED   {where}", flush=True)
    return tally


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--module", choices=sorted(TARGETS), action="append")
    ap.add_argument(
        "--before",
        metavar="REV",
        help="also score the tests as they were at this git revision, in the same run",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="list equivalents too")
    ap.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    ap.add_argument("--line", type=int, action="append", help="only the mutants on this line")
    opts = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mutation-before-") as tmp:
        before = _tests_at(opts.before, Path(tmp)) if opts.before else None
        for name in opts.module or list(TARGETS):
            target = TARGETS[name]
            if opts.list:
                for m in mutants(target):
                    print(f"{m.file}:{m.line} {m.scope}: {m.edit}: {m.src}")
                continue
            print(f"== {name}", flush=True)
            t0 = time.monotonic()
            tally = run_target(target, before, opts.verbose, opts.line)
            rows.append(_row(name, tally, time.monotonic() - t0, before is not None))
            print(rows[-1], flush=True)  # a long run's finished targets are not lost
    if rows:
        print(
            f"{'module':9} {'mutants':>7} {'not_appl':>8} {'equiv':>5} {'errors':>6} {'before%':>7}"
            f" {'killed':>6} {'timeout':>7} {'survived':>8} {'killed%':>7} {'time':>5}"
        )
        print("\n".join(rows))


def _row(name: str, t: Tally, took: float, before: bool) -> str:
    was = f"{t.rate(t.killed_before):7.1%}" if before else f"{'-':>7}"
    return (
        f"{name:9} {t.total:7d} {t.not_applied:8d} {t.equivalent:5d} {t.errors:6d}"
        f" {was} {t.killed:6d} {t.timeouts:7d} {t.survived:8d}"
        f" {t.rate(t.killed):7.1%} {took:4.0f}s"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))  # the test files' helper modules (builders)
    main()
