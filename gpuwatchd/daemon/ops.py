"""The control socket's operations: a table of named ops, each with its keys and handler.

A request names its operation in ``op``; the table checks the name and the keys the op
accepts (declared in :mod:`gpuwatchd.control.wire`), lets the op validate its values,
and calls its handler with the caller's credentials. A new operation is its declaration
in the wire module and one more :class:`Op` registered on the daemon's table; neither
the table nor :class:`~gpuwatchd.serve.control.ControlServer` changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpuwatchd.control.wire import UNKNOWN_OP, WireError, check_keys, op_keys
from gpuwatchd.serve.control import PeerCred, RequestError

Request = dict[str, Any]
Response = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Op:
    """One operation.

    ``keys``: what a request may carry besides ``op`` (None: what the wire declares for
    ``name``). ``parse`` turns the request (its
    keys already checked) into the validated form ``handle`` gets, raising RequestError
    naming the bad key; without one, every key is passed on, a missing one as None.
    ``handle`` gets the caller's :class:`PeerCred` for ops that care who asks.
    """

    name: str
    handle: Callable[[Request, PeerCred], Response]
    parse: Callable[[Request], Request] | None = None
    keys: frozenset[str] | None = None

    @property
    def accepts(self) -> frozenset[str]:
        """The keys a request may carry besides ``op``."""
        return op_keys(self.name) if self.keys is None else self.keys

    def validate(self, doc: Request) -> Request:
        """``doc`` with its keys checked, in the form :attr:`handle` takes."""
        try:
            check_keys(doc, self.name, self.accepts)
        except WireError as e:
            raise RequestError(str(e)) from None
        if self.parse is not None:
            return self.parse(doc)
        return {"op": self.name, **{key: doc.get(key) for key in sorted(self.accepts)}}


class OpTable:
    """Routes a decoded request to its :class:`Op`; a :data:`gpuwatchd.serve.control.Handler`."""

    def __init__(self, ops: Iterable[Op] = ()) -> None:
        self._ops: dict[str, Op] = {}
        for op in ops:
            self.register(op)

    def register(self, op: Op) -> None:
        """Add an operation; ValueError if one of that name exists."""
        if op.name in self._ops:
            raise ValueError(f"control op {op.name!r} is registered twice")
        self._ops[op.name] = op

    @property
    def names(self) -> tuple[str, ...]:
        """Registered operation names, in registration order."""
        return tuple(self._ops)

    def __call__(self, doc: Request, peer: PeerCred) -> Response:
        name = doc.get("op")
        known = ", ".join(self._ops)
        if name is None:
            raise RequestError(f"op: missing (known: {known})")
        if not isinstance(name, str) or name not in self._ops:
            raise RequestError(f"op: {UNKNOWN_OP} {name!r} (known: {known})")
        op = self._ops[name]
        return op.handle(op.validate(doc), peer)
