"""Every marked command of README.md and docs/*.md runs as written on the simulated GPU.

The marker convention is described in docs/contributing-docs.md: a fenced block preceded
by ``<!-- docs-test [mode=daemon] [expect="TEXT"] [file=NAME] -->`` is run (``sh``) or
written to NAME (any other language). The blocks of one document run in order in one
scratch directory holding a copy of what the documents use (:data:`COPIED`, never a link
into the checkout, so what a command writes stays in its document's copy); ``gpuwatchd`` on
PATH hands each command that takes ``--config`` a config with a free port and private
state and socket paths, so documents never share a daemon, a port or a store.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from builders import free_port

from gpuwatchd.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
BLOCK_TIMEOUT_S = 60.0
#: The README's first block makes a venv before its daemon starts.
DAEMON_START_S = 60.0
#: What the documents' commands read, copied into each document's scratch directory.
COPIED = (
    "README.md",
    "pyproject.toml",
    "docs",
    "examples",
    "prometheus",
    "grafana",
    "deploy",
    "systemd",
    "scripts",
    "tests/data",
)

_MARKER = re.compile(r"^<!-- docs-test(?P<opts>.*?)-->\s*$")
_FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
_OPTIONS = frozenset({"mode", "expect", "file"})
#: ``pip install .`` and ``pip install '.[extra]'``: the checkout under test is installed.
_PIP_SELF = re.compile(r"""pip install (?:\.|'\.\[[\w,-]+\]'|"\.\[[\w,-]+\]")(?=\s|$)""")
_DEFAULT_PORT = re.compile(r"\b(localhost|127\.0\.0\.1):9844\b")


@dataclass(frozen=True)
class Block:
    """One marked fenced block of a document."""

    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def marked_blocks(doc: Path) -> list[Block]:
    """The marked blocks of ``doc`` in order; ValueError for a marker without a block."""
    lines = doc.read_text().splitlines()
    blocks: list[Block] = []
    for i, line in enumerate(lines):
        marker = _MARKER.match(line)
        if marker is None:
            continue
        fence = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None:
            raise ValueError(f"{doc.name}:{i + 1}: a docs-test marker must precede a fence")
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        opts = dict(tok.split("=", 1) for tok in shlex.split(marker["opts"]))
        unknown = set(opts) - _OPTIONS
        if unknown:
            raise ValueError(f"{doc.name}:{i + 1}: unknown docs-test options {sorted(unknown)}")
        text = "\n".join(lines[i + 2 : end]) + "\n"
        blocks.append(Block(doc, i + 2, fence["lang"], text, opts))
    return blocks


def fenced_shell_blocks(doc: Path) -> int:
    """How many ``sh`` blocks ``doc`` has, marked or not."""
    return sum(1 for line in doc.read_text().splitlines() if line.rstrip() == "```sh")


class Scratch:
    """A document's scratch directory, its private daemon settings and its ``gpuwatchd``."""

    def __init__(self, base: Path) -> None:
        self.dir = base
        self.port = free_port()
        private = base / ".docs-test"
        (private / "bin").mkdir(parents=True)
        (private / "run").mkdir()
        for name in COPIED:
            src, dest = ROOT / name, base / name
            if src.is_dir():
                shutil.copytree(src, dest, symlinks=True)
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest)
        self.socket = private / "run" / "control.sock"
        self.config = private / "config.toml"
        self.config.write_text(
            "[daemon]\n"
            f'listen = "127.0.0.1:{self.port}"\n'
            f'state_dir = "{private / "state"}"\n'
            f'control_socket = "{self.socket}"\n'
        )
        takes_config = sorted(
            name
            for name, sub in _subcommands().items()
            if any("--config" in a.option_strings for a in sub._actions)
        )
        shim = private / "bin" / "gpuwatchd"
        shim.write_text(
            f"#!{sys.executable}\n"
            "import sys\n"
            "from gpuwatchd.cli.main import main\n"
            "argv = sys.argv[1:]\n"
            f"if argv and argv[0] in {takes_config!r} and not any(\n"
            "    a == '--config' or a.startswith('--config=') for a in argv\n"
            "):\n"
            f"    argv = [argv[0], '--config', {str(self.config)!r}, *argv[1:]]\n"
            "raise SystemExit(main(argv))\n"
        )
        shim.chmod(0o755)
        (private / "bin" / "python3").symlink_to(sys.executable)
        self.env = {
            **os.environ,
            "PATH": f"{private / 'bin'}:{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
            "PYTHONUNBUFFERED": "1",
            "GPUWATCHD_URL": f"http://127.0.0.1:{self.port}",
            "GPUWATCHD_CONTROL_SOCKET": str(self.socket),
            "MPLBACKEND": "Agg",
        }
        self.env.pop("GPUWATCHD_STORE", None)
        self.logs = private

    def script(self, block: Block) -> str:
        text = _PIP_SELF.sub("true", block.text)
        return _DEFAULT_PORT.sub(lambda m: f"{m[1]}:{self.port}", text)


def _subcommands() -> dict[str, object]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return dict(sub.choices)  # type: ignore[arg-type]


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM every process the block left, then SIGKILL what is still there after 10 s."""
    pgid = proc.pid  # the block's shell leads its own process group
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        proc.poll()  # reap the shell: a zombie would keep the group alive
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _serves(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _run(block: Block, scratch: Scratch, index: int) -> None:
    log = scratch.logs / f"block-{index}.log"
    script = scratch.logs / f"block-{index}.sh"
    script.write_text(scratch.script(block))
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "-e", str(script)],
            cwd=scratch.dir,
            env=scratch.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            if block.options.get("mode") == "daemon":
                deadline = time.monotonic() + DAEMON_START_S
                while not _serves(scratch.port) and proc.poll() is None:
                    assert time.monotonic() < deadline, f"{block.where}: never served /metrics"
                    time.sleep(0.1)
                rc = proc.poll()
                assert rc is None, f"{block.where}: exited {rc}:\n{log.read_text()[-3000:]}"
            else:
                try:
                    rc = proc.wait(timeout=BLOCK_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    raise AssertionError(
                        f"{block.where}: still running after {BLOCK_TIMEOUT_S:.0f} s"
                    ) from None
                output = log.read_text()
                assert rc == 0, f"{block.where}: exit {rc}:\n{output[-3000:]}"
                expect = block.options.get("expect")
                assert expect is None or expect in output, (
                    f"{block.where}: {expect!r} not in the output:\n{output[-3000:]}"
                )
        finally:
            _stop_group(proc)


def _documents_with_blocks() -> list[Path]:
    return [doc for doc in DOCUMENTS if marked_blocks(doc)]


def _run_document(doc: Path, scratch: Scratch) -> str | None:
    """Run ``doc``'s marked blocks in order; the first failure, or None."""
    try:
        for index, block in enumerate(marked_blocks(doc)):
            if block.lang == "sh":
                _run(block, scratch, index)
            else:
                name = block.options.get("file")
                assert name, (
                    f"{block.where}: a marked {block.lang or 'plain'} block needs file=NAME"
                )
                (scratch.dir / name).write_text(block.text)
    except AssertionError as exc:
        return str(exc)
    return None


def _top_level(root: Path) -> dict[str, int | None]:
    """The checkout's top-level entries, with each file's modification time."""
    return {e.name: e.stat().st_mtime_ns if e.is_file() else None for e in root.iterdir()}


@pytest.fixture(scope="module")
def checkout_before() -> dict[str, int | None]:
    return _top_level(ROOT)


@pytest.fixture(scope="module")
def document_runs(
    tmp_path_factory: pytest.TempPathFactory, checkout_before: dict[str, int | None]
) -> dict[Path, str | None]:
    """Every document's blocks, the documents side by side (each has its own port, state
    and socket; most of a block's time is spent waiting on a daemon)."""
    docs = _documents_with_blocks()
    # Every scratch copy, and its executable `gpuwatchd` shim, is written before any
    # document runs: a shim still open for writing in one thread while another thread
    # forks would make its exec fail with ETXTBSY ("Text file busy").
    scratches = {doc: Scratch(tmp_path_factory.mktemp(doc.stem)) for doc in docs}
    with ThreadPoolExecutor(max_workers=len(docs)) as pool:
        futures = {doc: pool.submit(_run_document, doc, scratches[doc]) for doc in docs}
        return {doc: future.result() for doc, future in futures.items()}


@pytest.mark.slow  # end to end: the README's test command runs it in its second step
@pytest.mark.parametrize("doc", _documents_with_blocks(), ids=lambda d: d.name)
def test_marked_blocks_run_as_written(doc: Path, document_runs: dict[Path, str | None]) -> None:
    failure = document_runs[doc]
    assert failure is None, failure


@pytest.mark.slow
def test_documents_leave_the_checkout_as_it_was(
    document_runs: dict[Path, str | None], checkout_before: dict[str, int | None]
) -> None:
    """The tour's run.jsonl, state.json and timeline.png land in each document's own copy:
    a user's own files of those names in the checkout are neither read nor written."""
    assert _top_level(ROOT) == checkout_before


def test_markers_are_well_formed_and_cover_the_readme() -> None:
    for doc in DOCUMENTS:
        for block in marked_blocks(doc):
            if block.lang == "sh":
                assert "file" not in block.options, block.where
                assert block.options.get("mode", "daemon") == "daemon", block.where
            else:
                assert set(block.options) == {"file"}, block.where
    readme = marked_blocks(ROOT / "README.md")
    assert any(b.options.get("mode") == "daemon" for b in readme)  # the first command


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def test_relative_links_and_anchors_resolve() -> None:
    for doc in DOCUMENTS:
        for match in _LINK.finditer(doc.read_text()):
            target = match["target"]
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            assert dest.exists(), f"{doc.name}: link to missing {target}"
            if anchor and dest.suffix == ".md":
                headings = [
                    _anchor(line.lstrip("#"))
                    for line in dest.read_text().splitlines()
                    if line.startswith("#")
                ]
                assert anchor in headings, f"{doc.name}: no heading for {target}"
