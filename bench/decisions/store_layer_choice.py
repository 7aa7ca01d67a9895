"""The store's hand-written SQL layer against SQLAlchemy Core: import time and memory.

Each arm runs in fresh interpreters: it imports its layer (timed; best of five), then
opens a SQLite file and a PostgreSQL database (a throwaway server, tests/pg_server.py)
and runs one query on each; RSS is read after the import and after both are open.

* ``python``: a bare interpreter.
* ``drivers``: sqlite3 and psycopg, one raw connection each: the floor both layers stand on.
* ``hand-written``: ``gpuwatchd.store`` and psycopg, opened through ``open_store`` (the
  whole store: engines, pool, schema and migrations, queries, row types).
* ``sqlalchemy``: SQLAlchemy Core and psycopg, two ``create_engine`` pools with one
  connection each: only the layer it would replace, none of the store's own code.

Needs ``pip install sqlalchemy`` (it is not a dependency of gpuwatchd).

    python bench/decisions/store_layer_choice.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from pg_server import start_server  # noqa: E402

_RSS = """
def rss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1])
"""

#: Each arm: the import (timed), then opening both databases given ``path`` and ``url``.
ARMS: dict[str, tuple[str, str]] = {
    "python": ("pass", "pass"),
    "drivers": (
        "import psycopg, sqlite3",
        """
sqlite3.connect(path).execute("SELECT 1").fetchone()
psycopg.connect(url).execute("SELECT 1").fetchone()
""",
    ),
    "hand-written": (
        "import psycopg, gpuwatchd.store",
        """
sqlite = gpuwatchd.store.open_store(path)
sqlite.schema_version()
pg = gpuwatchd.store.open_store(url)
pg.schema_version()
""",
    ),
    "sqlalchemy": (
        "import psycopg, sqlalchemy",
        """
for u in ("sqlite:///" + path, url.replace("postgresql://", "postgresql+psycopg://", 1)):
    engine = sqlalchemy.create_engine(u, pool_size=4)
    with engine.connect() as conn:
        conn.execute(sqlalchemy.text("SELECT 1")).scalar()
""",
    ),
}


def child(imports: str, opens: str, path: str, url: str) -> dict[str, float]:
    """One fresh interpreter: the import's seconds, RSS after it and after opening."""
    code = f"""{_RSS}
import json, time
t = time.perf_counter()
{imports}
import_s = time.perf_counter() - t
after_import = rss_kb()
path, url = {path!r}, {url!r}
{opens}
print(json.dumps({{"import_s": import_s, "import_kb": after_import, "open_kb": rss_kb()}}))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, env=env, capture_output=True, text=True
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    import sqlalchemy

    server = start_server()
    try:
        figures: dict[str, dict[str, float]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for arm, (imports, opens) in ARMS.items():
                runs = [
                    child(imports, opens, f"{tmp}/{arm}{n}.db", server.url(server.new_database()))
                    for n in range(5)
                ]
                figures[arm] = {
                    "import_s": min(r["import_s"] for r in runs),
                    "import_kb": min(r["import_kb"] for r in runs),
                    "open_kb": min(r["open_kb"] for r in runs),
                }
    finally:
        server.stop()
    base, drivers = figures["python"], figures["drivers"]
    print(f"SQLAlchemy {sqlalchemy.__version__}; best of 5 fresh interpreters per arm")
    print(f"{'arm':14} {'import s':>9} {'RSS import':>11} {'RSS open':>9}  (kB above bare python)")
    for arm, f in figures.items():
        print(f"{arm:14} {f['import_s']:9.3f} {f['import_kb'] - base['import_kb']:11.0f}"
              f" {f['open_kb'] - base['import_kb']:9.0f}")  # fmt: skip
    hand, sa = figures["hand-written"], figures["sqlalchemy"]
    for key, label in (("import_s", "import time"), ("import_kb", "RSS after import"),
                       ("open_kb", "RSS after opening both")):  # fmt: skip
        whole = (
            sa[key] / hand[key]
            if key == "import_s"
            else ((sa[key] - base["import_kb"]) / (hand[key] - base["import_kb"]))
        )
        layer = (sa[key] - drivers[key]) / (hand[key] - drivers[key])
        print(f"sqlalchemy / hand-written, {label}: {whole:.2f} above bare python,"
              f" {layer:.2f} above the drivers")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
