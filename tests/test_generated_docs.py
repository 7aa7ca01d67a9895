"""Every generated list in docs/ is what its declaration renders today.

The lists (metrics per collector, telemetry fields, control ops, workload ops and
families, CLI commands) sit between ``<!-- generated: NAME -->`` markers and are
rendered by scripts/docs_gen.py from the code; one added to the code without its doc
row fails here, naming the block and the command that regenerates it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_gen", ROOT / "scripts" / "docs_gen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_gen"] = module
    spec.loader.exec_module(module)
    return module


def test_every_generated_block_is_current() -> None:
    gen = _generator()
    stale = gen.stale()
    assert not stale, f"stale generated docs {stale}: run {gen.REGENERATE}"
