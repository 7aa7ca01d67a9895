"""The control operations of users' own work: kernel tuning requests and added workloads.

On the wire (framing in :mod:`gpuwatchd.serve.control`)::

    {"op": "tune_kernel", "request": {...gpuwatchd-kernel-request/1...}}
        -> {"ok": true, "workload": "triton.user:mod.kernel@1a2b3c4d/n=4096;float16",
            "queued": {"0": ["triton.user:..."]}, "persisted": true}
    {"op": "add_workloads", "workloads": [...], "source": {...}}
        -> {"ok": true, "added": [...], "replaced": [...]}
    {"op": "list_workloads", "cursor": 0, "limit": 256}
        -> {"ok": true, "workloads": [{..., "origin": "config"}, ...], "next": 256 | null}
    {"op": "remove_workloads", "names": [...]}  -> {"ok": true, "removed": [...]}

The request formats are :mod:`gpuwatchd.tuning.submitted.kernels` and
:mod:`gpuwatchd.tuning.intake.workload_requests`; what happens to accepted work is
:class:`~gpuwatchd.daemon.user_work.UserWork`. Only peers the socket authorizes get
here; a refusal is one line (a module outside ``allowed_modules``, a GPU model this host
lacks, a bad field). A request naming user code outside the trust rule
(:mod:`gpuwatchd.tuning.submitted.trust`) is also logged once, with the peer that sent it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpuwatchd.control.wire import (
    ADD_WORKLOADS,
    LIST_WORKLOADS,
    REMOVE_WORKLOADS,
    TUNE_KERNEL,
    WireError,
    check_page,
    page,
)
from gpuwatchd.daemon.ops import Op, Request, Response
from gpuwatchd.daemon.user_work import TrustRefused, UserWork, UserWorkError
from gpuwatchd.serve.control import PeerCred, RequestError
from gpuwatchd.tuning.intake.workload_requests import parse_add_request, parse_remove_request
from gpuwatchd.tuning.submitted.kernels import FAMILY, KernelRequest, KernelRequestError
from gpuwatchd.tuning.submitted.kernels import MAX_NAME_CHARS as MAX_KERNEL_NAME_CHARS
from gpuwatchd.tuning.types import Workload
from gpuwatchd.validate import fail, one_line

log = logging.getLogger(__name__)

USER_KERNEL_PREFIX = FAMILY + ":"


def parse_tune_kernel(doc: Request) -> Request:
    """``{"op": "tune_kernel", "request": {...}}`` with the request parsed and checked."""
    if doc.get("request") is None:
        raise RequestError("request: missing (a gpuwatchd-kernel-request/1 object)")
    try:
        return {"op": TUNE_KERNEL, "request": KernelRequest.from_json(doc["request"])}
    except KernelRequestError as e:
        raise RequestError(one_line(e)) from None


def parse_list(doc: Request) -> Request:
    """``{"op": "list_workloads", "cursor": int, "limit": int}``, both optional."""
    try:
        cursor, limit = check_page(doc)
    except WireError as e:
        raise RequestError(str(e)) from None
    return {"op": LIST_WORKLOADS, "cursor": cursor, "limit": limit}


def parse_remove(doc: Request) -> tuple[str, ...]:
    """``remove_workloads``'s names: added workloads' names, or user kernels' (whose key
    part may hold any character: they are only compared, never used as paths)."""
    names = doc.get("names")
    if isinstance(names, list) and names and all(isinstance(n, str) for n in names):
        kernels = [n for n in names if n.startswith(USER_KERNEL_PREFIX)]
        for i, n in enumerate(names):
            if n in kernels and len(n) > MAX_KERNEL_NAME_CHARS:
                raise fail(f"names[{i}]", f"expected at most {MAX_KERNEL_NAME_CHARS} chars", n)
        others = [n for n in names if n not in kernels]
        if others:
            parse_remove_request({**doc, "names": others})
        return tuple(dict.fromkeys(names))
    return parse_remove_request(doc)


def _parse_with(parse: Callable[[Request], object], key: str) -> Callable[[Request], Request]:
    def parse_op(doc: Request) -> Request:
        try:
            return {"op": doc["op"], key: parse(doc)}
        except ValueError as e:
            raise RequestError(one_line(e)) from None

    return parse_op


def user_ops(work: UserWork, runnable: Callable[[], tuple[Workload, ...]]) -> tuple[Op, ...]:
    """The four ops, to register on the daemon's op table.

    ``runnable`` is the daemon's configured tuning set, listed with origin ``config``.
    """

    def refusing(fn: Callable[[Request], Response]) -> Callable[[Request, PeerCred], Response]:
        def handle(request: Request, peer: PeerCred) -> Response:
            try:
                return {"ok": True, **fn(request)}
            except TrustRefused as e:
                log.warning("control socket: %s refused for uid %d (pid %d): %s",
                            request.get("op"), peer.uid, peer.pid, e)  # fmt: skip
                raise RequestError(str(e)) from None
            except UserWorkError as e:
                raise RequestError(str(e)) from None

        return handle

    def tune_kernel(request: Request) -> Response:
        return work.tune_kernel(request["request"])

    def add(request: Request) -> Response:
        return work.add(request["request"])

    def listing(request: Request) -> Response:
        added = work.added_names()
        configured = tuple(w for w in runnable() if w.name not in added)
        items, after = page(work.listing(configured), request["cursor"], request["limit"])
        return {"workloads": items, "next": after}

    def remove(request: Request) -> Response:
        return work.remove(list(request["names"]))

    return (
        Op(TUNE_KERNEL, refusing(tune_kernel), parse_tune_kernel),
        Op(ADD_WORKLOADS, refusing(add), _parse_with(parse_add_request, "request")),
        Op(LIST_WORKLOADS, refusing(listing), parse_list),
        Op(REMOVE_WORKLOADS, refusing(remove), _parse_with(parse_remove, "names")),
    )
