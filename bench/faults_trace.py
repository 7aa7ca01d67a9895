"""Every malformed trace through ``gpuwatchd run --trace F`` (the long form of
tests/test_faults_trace.py): one ``gpuwatchd: FILE:LINE: ...`` line on stderr, exit 2,
nothing started (no state directory created).

    python bench/faults_trace.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fault_cases import bad_traces, refused_in_one_line, run_daemon_on, write_case  # noqa: E402


def main() -> int:
    scratch = Path(tempfile.mkdtemp(prefix="gpuwatchd-faults-trace-"))
    cases = dict(bad_traces())
    ok = 0
    problems = []
    t0 = time.monotonic()
    for name, content in cases.items():
        path = write_case(scratch, name, content, ".jsonl")
        res = run_daemon_on(
            ["--trace", str(path)], scratch / "never", scratch / "never.sock", timeout=60
        )
        if refused_in_one_line(res, f"gpuwatchd: {path}"):
            ok += 1
        else:
            problems.append(f"{name}: exit {res.returncode}: {res.stderr.strip()[-300:]!r}")
    if (scratch / "never").exists():
        problems.append("a malformed trace got as far as creating the state directory")
    print(f"{len(cases)} malformed traces through `gpuwatchd run --trace`: {ok} one line + "
          f"exit 2 ({time.monotonic() - t0:.0f} s)")  # fmt: skip
    for p in problems:
        print("PROBLEM", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
