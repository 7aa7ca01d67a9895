"""bench/ stays readable: every script is in bench/README.md, and every current section of
bench/RESULTS.md names its command and the commit it measured.

RESULTS.md's convention: sections before the ``# History`` heading are current, one per
question; each holds a ``Command:`` line and a ``Commit:`` line naming a commit hash (or
"a commit after/before <hash>"). History sections each point at the current section that
answers their question now. No section heading names a branch or a "round"."""

from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPT_SUFFIXES = (".py", ".sh")
HASH = re.compile(r"\b[0-9a-f]{7,40}\b")
#: A script path in a README row's first cell: "| `decisions/x.py` | ...".
ROW = re.compile(r"^\| `([\w/.-]+)` \|", re.M)
SCRIPT_IN_TEXT = re.compile(r"\bbench/([\w/-]+\.(?:py|sh))\b")
BRANCHY = re.compile(r"\bh/\w|uncommitted|\bbranch\b|\bround \d|issue-\d+ work", re.I)


def scripts_on_disk() -> set[str]:
    return {
        p.relative_to(BENCH).as_posix()
        for p in BENCH.rglob("*")
        if p.suffix in SCRIPT_SUFFIXES and "data" not in p.relative_to(BENCH).parts
    }


def listed_scripts(readme: str) -> list[str]:
    return ROW.findall(readme)


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of every level-2 section of ``text``."""
    parts = re.split(r"^## (.*)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def current_and_history(results: str) -> tuple[str, str]:
    head, sep, history = results.partition("\n# History\n")
    assert sep, "RESULTS.md has no '# History' heading"
    return head, history


def section_problems(heading: str, body: str) -> list[str]:
    """What a current section lacks under the convention."""
    problems = []
    commands = [ln for ln in body.splitlines() if ln.startswith("Command: ")]
    commits = [ln for ln in body.splitlines() if ln.startswith("Commit: ")]
    if not commands:
        problems.append(f"{heading}: no 'Command:' line")
    if not commits or not HASH.search(commits[0]):
        problems.append(f"{heading}: no 'Commit:' line naming a commit hash")
    for line in commands:
        for script in SCRIPT_IN_TEXT.findall(line):
            if not (BENCH / script).is_file():
                problems.append(f"{heading}: its command names bench/{script}, which is gone")
    return problems


def test_every_bench_script_is_listed_in_the_readme_and_every_listed_one_exists() -> None:
    listed = listed_scripts((BENCH / "README.md").read_text())
    assert len(listed) == len(set(listed)), "a script is listed twice"
    on_disk = scripts_on_disk()
    assert sorted(on_disk - set(listed)) == [], "scripts missing from bench/README.md"
    assert sorted(set(listed) - on_disk) == [], "bench/README.md lists scripts that are gone"


def test_every_current_results_section_names_its_command_and_commit() -> None:
    current, _ = current_and_history((BENCH / "RESULTS.md").read_text())
    found = sections(current)
    assert found, "no current section"
    problems = [p for heading, body in found for p in section_problems(heading, body)]
    assert problems == []


def test_history_sections_point_at_a_current_section() -> None:
    current, history = current_and_history((BENCH / "RESULTS.md").read_text())
    titles = {heading for heading, _ in sections(current)}
    for heading, body in sections(history):
        pointer = re.search(r"Superseded by \[([^\]]+)\]", body)
        assert pointer, f"History section without a pointer: {heading}"
        assert pointer.group(1) in titles, f"{heading} points at no current section"


def test_no_heading_names_a_branch_or_a_round() -> None:
    results = (BENCH / "RESULTS.md").read_text()
    headings = [ln for ln in results.splitlines() if ln.startswith("#")]
    assert [h for h in headings if BRANCHY.search(h)] == []


def test_the_checks_catch_an_omission() -> None:
    """The section check fails a section without its lines, or with a gone script."""
    good = "Command: `python3 bench/daemon_cost.py`\n\nCommit: b544041\n"
    assert section_problems("s", good) == []
    assert len(section_problems("s", "Commit: b544041\n")) == 1
    assert len(section_problems("s", "Command: `x`\n\nCommit: uncommitted\n")) == 1
    assert len(section_problems("s", "Command: `python3 bench/nope.py`\n\nCommit: abcdef1\n")) == 1
    assert listed_scripts("| `a.py` | live | x |\n| `decisions/b.py` | decision | y |\n") == [
        "a.py",
        "decisions/b.py",
    ]


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_links_between_the_bench_documents_resolve() -> None:
    for name in ("README.md", "RESULTS.md"):
        text = (BENCH / name).read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path, _, anchor = target.partition("#")
            dest = BENCH / path if path else BENCH / name
            assert dest.is_file(), f"{name}: link to missing {target}"
            if anchor:
                headings = [
                    github_anchor(ln.lstrip("#"))
                    for ln in dest.read_text().splitlines()
                    if ln.startswith("#")
                ]
                assert anchor in headings, f"{name}: no heading for {target}"
