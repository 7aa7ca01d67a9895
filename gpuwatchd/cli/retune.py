"""``gpuwatchd retune``: ask the running daemon, over its control socket, to re-tune.

Exit codes: 0 queued, 1 the daemon cannot be reached, 2 the daemon rejected the request.
The request only queues work: the daemon starts it at the GPU's next open gate. The
daemon's socket module is imported when the command runs (see :mod:`gpuwatchd.cli.common`).
"""

from __future__ import annotations

import argparse
import json

from gpuwatchd.cli.common import (
    EXIT_CONFIG,
    CliError,
    Subparsers,
    add_command,
    ask_daemon,
)

EXIT_REJECTED = EXIT_CONFIG  # 2


def format_queued(queued: dict[str, list[str]]) -> str:
    """``queued W on GPU N`` lines, GPUs in numeric order."""
    return _per_gpu_lines("queued", queued) or "nothing queued"


def format_cancelled(cancelled: dict[str, list[str]], omitted: dict[str, int] | None = None) -> str:
    """``cancelled W on GPU N`` lines, GPUs in numeric order, then how many more the
    daemon cancelled without naming them."""
    more = [
        f"cancelled {n} more on GPU {gpu}"
        for gpu, n in sorted((omitted or {}).items(), key=lambda kv: int(kv[0]))
    ]
    lines = "\n".join(filter(None, [_per_gpu_lines("cancelled", cancelled), *more]))
    return lines or "nothing waiting to cancel"


def _per_gpu_lines(verb: str, by_gpu: dict[str, list[str]]) -> str:
    return "\n".join(
        f"{verb} {w} on GPU {gpu}"
        for gpu, names in sorted(by_gpu.items(), key=lambda kv: int(kv[0]))
        for w in names
    )


def format_pending(pending: dict[str, list[str]]) -> str:
    lines = [
        f"GPU {gpu}: {', '.join(names)}"
        for gpu, names in sorted(pending.items(), key=lambda kv: int(kv[0]))
    ]
    return "\n".join(lines) or "no tuning work pending"


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "retune",
        "ask the running daemon to re-tune at the next open gate",
        "Queue tuning work on the running daemon through its Unix control socket (no network\n"
        "endpoint ever starts GPU work); it runs when the GPU's gate next opens.\n"
        "--pending shows what is queued instead; --cancel takes waiting work off the queue\n"
        "(a running session finishes; work the daemon queues by itself comes back).",
        (
            "gpuwatchd retune --gpu 0 --workload sim-gemm",
            "gpuwatchd retune --pending",
            "gpuwatchd retune --cancel --gpu 0",
        ),
    )
    add_retune_args(p)
    p.set_defaults(func=run)
    return p


def add_retune_args(p: argparse.ArgumentParser) -> None:
    """The ``retune`` subcommand's options."""
    p.add_argument("--gpu", type=int, metavar="N", help="GPU index (default: every GPU)")
    p.add_argument(
        "--workload",
        action="append",
        metavar="W",
        help="workload name, repeatable (default: the daemon's tuning set)",
    )
    p.add_argument("--socket", metavar="PATH", help="control socket (default: the daemon's)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--pending", action="store_true", help="show queued work instead of adding")
    what.add_argument(
        "--cancel",
        action="store_true",
        help="take waiting work off the queue instead of adding (--gpu, --workload: only that)",
    )
    p.add_argument("--json", action="store_true", help="print the daemon's JSON response")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds to wait")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``gpuwatchd retune``; CliError(1) unreachable, CliError(2) rejected."""
    from gpuwatchd.control import wire

    if args.pending:
        request = wire.request(wire.STATUS)
    elif args.cancel:
        request = wire.request(wire.CANCEL_RETUNE, gpu=args.gpu, workloads=args.workload or None)
    else:
        request = wire.request(wire.RETUNE, gpu=args.gpu, workloads=args.workload or None)
    response = ask_daemon(args, request)
    if args.json:
        print(json.dumps(response, indent=2, sort_keys=True))
        return 0 if response["ok"] else EXIT_REJECTED
    if not response["ok"]:
        raise CliError(
            f"request rejected: {response.get('error', 'no reason given')}", EXIT_REJECTED
        )
    if args.pending:
        print(format_pending(response.get("pending") or {}))
    elif args.cancel:
        print(format_cancelled(response.get("cancelled") or {}, response.get("omitted")))
    else:
        print(format_queued(response.get("queued") or {}))
    return 0
