"""``gpuwatchd workloads add FILE | list | remove NAME...``: the daemon's extra workloads.

A job's captured shapes (``gpuwatchd.torch.capture()``, written with ``.write()``) or
any ``[[workload]]`` TOML file are handed to the running daemon over its control socket
(``add_workloads``); ``list`` shows what it tunes, ``remove`` takes added ones away.
Exit codes: 0 done, 1 no daemon (or one without these operations), 2 bad input: a bad
file, bad names, or the daemon refusing the request.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from gpuwatchd.cli.common import (
    EXIT_CONFIG,
    EXIT_RUNTIME,
    CliError,
    Subparsers,
    add_command,
    ask_daemon,
    control_socket,
)


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "workloads",
        "add, list or remove the workloads the running daemon tunes",
        "Hand the running daemon extra workloads over its control socket: a job's captured\n"
        "shapes (gpuwatchd.torch.capture(), written with .write()) or any [[workload]]\n"
        "TOML file. They are tuned behind the gate like the configured ones.",
        (
            "gpuwatchd workloads add shapes.json",
            "gpuwatchd workloads list",
            "gpuwatchd workloads remove my-gemm",
        ),
    )
    p.add_argument("--socket", metavar="PATH", help="control socket (default: the daemon's)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds to wait")
    p.add_argument("--json", action="store_true", help="print the daemon's JSON response")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    add = verbs.add_parser("add", help="add the workloads of a TOML or JSON file")
    add.add_argument("file", metavar="FILE", help="[[workload]] TOML, or a capture's JSON")
    verbs.add_parser("list", help="list the workloads the daemon tunes")
    remove = verbs.add_parser("remove", help="remove added workloads by name")
    remove.add_argument("names", nargs="+", metavar="NAME")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Build the request (exit 2 on bad input), send it (exit 1 on no daemon), print."""
    request = _request(args)
    response = _list_all(args) if args.verb == "list" else ask_daemon(args, request)
    if args.json:
        print(json.dumps(response, indent=2, sort_keys=True))
    if not response["ok"]:
        error = " ".join(str(response.get("error", "no reason given")).split())
        if "unknown operation" in error:
            raise CliError(
                f"the daemon at {control_socket(args)} does not support {request['op']} "
                "(upgrade it)",
                EXIT_RUNTIME,
            )
        raise CliError(f"request rejected: {error}", EXIT_CONFIG)
    if not args.json:
        print(format_response(args.verb, response))
    return 0


def _request(args: argparse.Namespace) -> dict[str, Any]:
    # Imported here: the workload registry (and its plugin entry points) is most of what
    # `gpuwatchd --help` would otherwise load.
    from gpuwatchd.tuning.intake.workload_requests import (
        add_request,
        check_workload_name,
        list_request,
        read_workloads_file,
        remove_request,
    )

    try:
        if args.verb == "add":
            return add_request(read_workloads_file(args.file), {"kind": "cli"})
        if args.verb == "remove":
            for i, name in enumerate(args.names):
                check_workload_name(name, f"NAME {i + 1}")
            return remove_request(args.names)
    except ValueError as exc:
        raise CliError(" ".join(str(exc).split()), EXIT_CONFIG) from None
    return list_request()


def _list_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every page of ``list_workloads``, as one answer (the first refusal as it came)."""
    from gpuwatchd.tuning.intake.workload_requests import list_request

    items: list[Any] = []
    cursor = 0
    while True:
        response = ask_daemon(args, list_request(cursor or None))
        if not response["ok"]:
            return response
        page = response.get("workloads")
        items += page if isinstance(page, list) else []
        after = response.get("next")
        if isinstance(after, bool) or not isinstance(after, int) or after <= cursor:
            return {"ok": True, "workloads": items}  # the last page, or an older daemon
        cursor = after


def format_response(verb: str, response: dict[str, Any]) -> str:
    """What the daemon did, one line per workload."""
    if verb == "add":
        added = _names(response.get("added"))
        replaced = _names(response.get("replaced"))
        lines = [f"added {n}" for n in added] + [f"replaced {n}" for n in replaced]
        return "\n".join(lines) or "nothing added"
    if verb == "remove":
        return (
            "\n".join(f"removed {n}" for n in _names(response.get("removed"))) or "nothing removed"
        )
    return format_list(response.get("workloads"))


def format_list(items: Any) -> str:
    """``name  op  dtype  families  origin`` rows, aligned."""
    if not isinstance(items, list) or not items:
        return "no workloads"
    rows = [("NAME", "OP", "DTYPE", "FAMILIES", "ORIGIN")]
    for w in items:
        if not isinstance(w, dict):
            continue
        fams = w.get("families")
        rows.append(
            (
                str(w.get("name", "?")),
                str(w.get("op", "?")),
                str(w.get("dtype", "?")),
                ",".join(map(str, fams)) if isinstance(fams, list) else "?",
                str(w.get("origin", "?")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip() for r in rows
    )


def _names(value: Any) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []
