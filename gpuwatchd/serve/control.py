"""A local Unix-socket server of JSON lines: the only way to ask the daemon for GPU work.

The HTTP endpoint is read-only by design; asking for GPU work needs this socket, which
authenticates callers without secrets: the file is mode 0660 in a 0750 directory, and
every connection's SO_PEERCRED is checked against root, the daemon's own uid and an
optional ``control_group``. One JSON object per line in, one per line out (the wire:
:mod:`gpuwatchd.control.wire`).

This module knows nothing of what the operations mean: it decodes the line into a JSON
object and hands it, with the caller's credentials, to a :data:`Handler` (in the daemon,
an :class:`~gpuwatchd.daemon.ops.OpTable`). Connections are held on the servers' event
loop (:class:`~gpuwatchd.serve.loop.ServeLoop`, shared with the HTTP server), at most
``max_clients`` at once, of which one user holds at most ``max_per_peer``, each with a
short deadline for its request line, so a silent, slow or garbage-sending client, or one
user's pile of idle connections, never holds up anybody else (they get ``busy`` and ask
again) and costs no thread. The handler runs on a daemon thread of its own, at most one
per connection: an operation may wait on a lock or the store, and the loop must not; one
still running when the daemon stops does not hold up its exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import grp
import json
import logging
import os
import pwd
import socket
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatchd.config.loader import resolve_control_socket
from gpuwatchd.control.wire import (
    CLIENT_TIMEOUT_S,
    MAX_CLIENTS,
    MAX_CLIENTS_PER_PEER,
    MAX_LINE,
    busy_answer,
    error_answer,
)
from gpuwatchd.serve.loop import Acceptor, ServeLoop
from gpuwatchd.validate import load_json

log = logging.getLogger(__name__)

SOCKET_MODE = 0o660
DIR_MODE = 0o750
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13; Python lacks the name
#: Connections the kernel holds for us while the loop is busy: a crowd of jobs starting at
#: once waits here (and clients ask again while it is full) instead of being refused.
BACKLOG = socket.SOMAXCONN
#: Connections turned away (busy) are logged once, then counted and logged at most once
#: per this many seconds while they go on, so a connect flood cannot flood the log.
TURNED_AWAY_LOG_S = 10.0


class ControlError(Exception):
    """The control socket cannot be set up (one line naming the path)."""


class RequestError(Exception):
    """A request is rejected; the message goes back to the client as ``error``."""


def default_socket_path() -> Path:
    """``$RUNTIME_DIRECTORY`` under systemd, else /run/gpuwatchd for root, else
    ``$XDG_RUNTIME_DIR/gpuwatchd`` (``/tmp/gpuwatchd-UID`` without one), plus control.sock:
    the rule of :func:`gpuwatchd.config.resolve_control_socket`, which jobs use too."""
    return resolve_control_socket("")


# -- who may connect ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PeerCred:
    """The connecting process as the kernel reports it (not as it claims)."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()  # supplementary groups, where the kernel says


def peer_credentials(conn: socket.socket) -> PeerCred:
    """SO_PEERCRED (pid, uid, gid) plus SO_PEERGROUPS when the kernel has it."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    groups: frozenset[int] = frozenset()
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 1024)
        groups = frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    except OSError:  # old kernel, or more than 256 groups: /etc/group membership still counts
        pass
    return PeerCred(pid=pid, uid=uid, gid=gid, groups=groups)


class PeerPolicy:
    """Root, the daemon's own uid, and members of ``group`` (resolved once, at start)."""

    def __init__(self, group: str | None = None, own_uid: int | None = None) -> None:
        self.own_uid = os.geteuid() if own_uid is None else own_uid
        self.group = group
        self.gid: int | None = None
        if group:
            try:
                self.gid = grp.getgrnam(group).gr_gid
            except KeyError:
                raise ControlError(f"control_group: no group named {group!r}") from None

    def at_once(self, peer: PeerCred) -> bool | None:
        """The verdict from the credentials alone, or None when it needs the group
        database (which may be a slow network service: not for the event loop)."""
        if peer.uid in (0, self.own_uid):
            return True
        if self.gid is None:
            return False
        if peer.gid == self.gid or self.gid in peer.groups:
            return True
        return None

    def __call__(self, peer: PeerCred) -> bool:
        verdict = self.at_once(peer)
        if verdict is not None or self.gid is None:
            return bool(verdict)
        try:  # listed in /etc/group but not (yet) in this process's groups
            name = pwd.getpwuid(peer.uid).pw_name
            return name in grp.getgrgid(self.gid).gr_mem
        except KeyError:
            return False

    def __str__(self) -> str:
        who = ["root", f"uid {self.own_uid}"]
        if self.group:
            who.append(f"members of group {self.group}")
        return ", ".join(who)


# -- request framing ---------------------------------------------------------------------


def decode_request(line: bytes) -> dict[str, Any]:
    """One request line -> the JSON object it holds; :class:`RequestError` otherwise."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError("request is not UTF-8 text") from None
    if not text.strip():
        raise RequestError("empty request line")
    doc = load_json(text, "request", error=RequestError)
    if not isinstance(doc, dict):
        raise RequestError("request must be a JSON object")
    return doc


#: Answers one decoded request from one peer; raises RequestError to refuse it.
Handler = Callable[[dict[str, Any], PeerCred], dict[str, Any]]


class _ClientGone(Exception):
    """The client closed or broke the connection before sending a request."""


# -- the server --------------------------------------------------------------------------


class ControlServer:
    """Serves ``handler`` on a Unix socket at ``path``; see the module docstring.

    ``allowed`` replaces the default :class:`PeerPolicy` (root, own uid, ``allowed_group``);
    ``serve_loop`` is the loop shared with the HTTP server (None: a loop of its own).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        handler: Handler,
        allowed_group: str | None = None,
        *,
        allowed: Callable[[PeerCred], bool] | None = None,
        max_clients: int = MAX_CLIENTS,
        max_per_peer: int = MAX_CLIENTS_PER_PEER,
        client_timeout_s: float = CLIENT_TIMEOUT_S,
        serve_loop: ServeLoop | None = None,
    ) -> None:
        self.path = Path(path)
        self.handler = handler
        self._policy = PeerPolicy(allowed_group)
        self._allowed = allowed if allowed is not None else self._policy
        self._who = str(self._policy) if allowed is None else None
        self.client_timeout_s = client_timeout_s
        self.max_clients = max_clients
        self.max_per_peer = max_per_peer
        self._given_loop = serve_loop
        self._serve_loop: ServeLoop | None = None
        #: uid -> its group lookup in flight and when it began; how many checks run (loop only)
        self._lookups: dict[int, tuple[asyncio.Future[Any], float]] = {}
        self._checks_running = 0
        # Touched on the loop's thread only:
        self._per_peer: dict[int, int] = {}  # open connections by uid
        self._active: set[socket.socket] = set()
        self._clients: set[asyncio.Task[None]] = set()
        self._sock: socket.socket | None = None
        self._acceptor: Acceptor | None = None
        self._turned_away: _TurnedAway | None = None
        self._ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we bound

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Create the directory and socket and start serving; ControlError if impossible."""
        if self._sock is not None:
            raise RuntimeError("control server already started")
        self._prepare_dir()
        self._clear_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._bind(sock)
            sock.listen(BACKLOG)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        st = os.lstat(self.path)
        self._ident = (st.st_dev, st.st_ino)
        serve_loop = self._given_loop or ServeLoop("gpuwatchd-control")
        serve_loop.acquire()
        self._serve_loop = serve_loop
        self._turned_away = _TurnedAway(serve_loop.loop)
        self._acceptor = Acceptor(
            serve_loop,
            sock,
            self._admit,
            name="control socket",
            batch=self.max_clients + 1,  # a burst, not an unbounded flood, per wake-up
            logger=log,
        )
        self._acceptor.start()
        group = f", group {self._policy.group}" if self._policy.group else ""
        log.info("control socket listening on %s (mode 0660%s)", self.path, group)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop accepting, cut open connections, and remove the socket file if still ours."""
        serve_loop = self._serve_loop
        sock, acceptor = self._sock, self._acceptor
        if sock is None or serve_loop is None or acceptor is None:
            return
        # What it needs is passed in: on a loop busy past ``timeout`` it runs later.
        shut = serve_loop.run(lambda: self._shutdown(acceptor), timeout)
        serve_loop.release(timeout)
        self._serve_loop = None
        if not shut:  # the loop did not get to it (yet): stop listening here
            sock.close()
        self._sock = None
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._ident:  # never remove a successor's socket
                os.unlink(self.path)
        except OSError:
            pass

    # -- setup -----------------------------------------------------------------------

    def _prepare_dir(self) -> None:
        """The socket's directory must be ours and closed to writers other than us.

        One we create (or the default runtime directory) is set to 0750 and given to
        ``control_group``; an existing directory named by the user keeps its mode.
        """
        d = self.path.parent
        created = False
        try:
            d.mkdir(mode=DIR_MODE, parents=True)
            created = True
            log.warning("created the missing directory %s for the control socket", d)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ControlError(f"{d}: cannot create the socket directory: {_why(exc)}") from None
        st = os.stat(d)
        if not stat.S_ISDIR(st.st_mode):
            raise ControlError(f"{d}: not a directory")
        euid = os.geteuid()
        if st.st_uid != euid:
            raise ControlError(
                f"{d}: owned by uid {st.st_uid}, not by this process (uid {euid}); "
                "refusing to put the control socket there"
            )
        if not created and st.st_mode & 0o022:
            raise ControlError(
                f"{d}: writable by group or others, who could replace the control socket; "
                "use a directory of its own"
            )
        if created or d == default_socket_path().parent:
            try:
                os.chmod(d, DIR_MODE)
                if self._policy.gid is not None:
                    os.chown(d, -1, self._policy.gid)
            except OSError as exc:
                raise ControlError(f"{d}: {self._chown_hint(exc)}") from None

    def _clear_stale(self) -> None:
        """Remove a socket file nobody listens on; a live one means another daemon."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ControlError(
                f"{self.path}: exists and is not a socket; remove it or pick another path"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(self.path))
        except ConnectionRefusedError:
            os.unlink(self.path)
            log.info("removed stale control socket %s", self.path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ControlError(
                f"{self.path}: cannot check the existing socket: {_why(exc)}"
            ) from None
        finally:
            probe.close()
        raise ControlError(f"{self.path}: another gpuwatchd is already listening on this socket")

    def _bind(self, sock: socket.socket) -> None:
        """Bind under a umask that only narrows the current one, so the file is born at
        most 0660 (the umask is process-wide: other threads' files only get stricter)."""
        old = os.umask(0o777)
        os.umask(old | 0o117)
        try:
            sock.bind(str(self.path))
        except OSError as exc:
            raise ControlError(
                f"{self.path}: cannot bind the control socket: {_why(exc)}"
            ) from None
        finally:
            os.umask(old)
        try:
            os.chmod(self.path, SOCKET_MODE)
            if self._policy.gid is not None:
                os.chown(self.path, -1, self._policy.gid)
        except OSError as exc:
            os.unlink(self.path)
            raise ControlError(f"{self.path}: {self._chown_hint(exc)}") from None

    def _chown_hint(self, exc: OSError) -> str:
        if self._policy.group and isinstance(exc, PermissionError):
            g = self._policy.group
            return (
                f"cannot give it to group {g}: {_why(exc)} (the daemon must be in group {g}: "
                f"SupplementaryGroups={g} in the unit)"
            )
        return f"cannot set its mode: {_why(exc)}"

    # -- serving ---------------------------------------------------------------------

    @property
    def turned_away(self) -> int:
        """Connections turned away busy since the server started."""
        return self._turned_away.total if self._turned_away is not None else 0

    def _shutdown(self, acceptor: Acceptor) -> bool:
        """On the loop: stop accepting, end every client's task and close every client
        connection (a task cancelled before it first ran never reaches its finally)."""
        acceptor.close()
        if self._turned_away is not None:
            self._turned_away.close()
        for task in list(self._clients):
            task.cancel()
        for conn in list(self._active):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        self._active.clear()
        self._per_peer.clear()
        return True

    def _loop(self) -> asyncio.AbstractEventLoop:
        assert self._serve_loop is not None
        return self._serve_loop.loop

    def _admit(self, conn: socket.socket, _address: Any = None) -> None:
        conn.setblocking(False)
        try:
            peer = peer_credentials(conn)
        except OSError:
            conn.close()
            return
        why = self._take_slot(conn, peer.uid)
        if why is not None:
            assert self._turned_away is not None
            self._turned_away.note(why, peer.uid)
            with contextlib.suppress(OSError):  # one short line into an empty socket buffer
                conn.send(_encode(busy_answer(why)))
            conn.close()
            return
        task = self._loop().create_task(self._serve_client(conn, peer))
        self._clients.add(task)
        task.add_done_callback(self._clients.discard)

    def _take_slot(self, conn: socket.socket, uid: int) -> str | None:
        """Count ``conn`` in, or say why not: all slots taken, or this user's share."""
        if len(self._active) >= self.max_clients:
            return "too many control connections"
        if self._per_peer.get(uid, 0) >= self.max_per_peer:
            return f"too many control connections from uid {uid}"
        self._active.add(conn)
        self._per_peer[uid] = self._per_peer.get(uid, 0) + 1
        return None

    async def _serve_client(self, conn: socket.socket, peer: PeerCred) -> None:
        deadline = self._loop().time() + self.client_timeout_s
        try:
            if not await self._permitted(peer, deadline):
                log.warning(
                    "control socket: refused uid %d gid %d (pid %d): not allowed to use it",
                    peer.uid,
                    peer.gid,
                    peer.pid,
                )
                allowed = f" (allowed: {self._who})" if self._who else ""
                denied = f"permission denied for uid {peer.uid}{allowed}"
                await self._reply(conn, error_answer(denied))
                return
            await self._reply(conn, await self._answer(conn, deadline, peer))
        except (_ClientGone, OSError):
            pass
        finally:
            self._active.discard(conn)
            left = self._per_peer.pop(peer.uid, 1) - 1
            if left:
                self._per_peer[peer.uid] = left
            conn.close()

    async def _permitted(self, peer: PeerCred, deadline: float) -> bool:
        """The peer policy's verdict; off the loop when it needs the group database.

        The database may be a network name service that hangs: the verdict is awaited
        until the connection's deadline at most (then the peer is refused). A peer's
        connections share its lookup while that lookup is younger than one connection's
        time limit, after which a fresh one starts (the service may be back); and no more
        lookups than ``max_clients`` run at once, so a hung service holds a bounded number
        of threads.
        """
        loop = self._loop()
        shared = self._allowed is self._policy
        if shared:
            verdict = self._policy.at_once(peer)
            if verdict is not None:
                return verdict
        entry = self._lookups.get(peer.uid) if shared else None
        if entry is not None and loop.time() - entry[1] < self.client_timeout_s:
            lookup = entry[0]
        elif self._checks_running >= self.max_clients:
            log.warning(
                "control socket: refused uid %d: %d permission checks already wait on the "
                "group database (is its name service answering?)",
                peer.uid,
                self._checks_running,
            )
            return False
        else:
            self._checks_running += 1
            lookup = asyncio.ensure_future(self._off_loop(self._allowed, peer))
            lookup.add_done_callback(functools.partial(self._lookup_done, peer.uid))
            if shared:
                self._lookups[peer.uid] = (lookup, loop.time())
        try:
            left = max(0.0, deadline - loop.time())
            return bool(await asyncio.wait_for(asyncio.shield(lookup), left))
        except TimeoutError:
            log.warning(
                "control socket: refused uid %d: deciding whether it may connect took over "
                "%g s (is the group database's name service answering?)",
                peer.uid,
                self.client_timeout_s,
            )
            return False

    def _lookup_done(self, uid: int, lookup: asyncio.Future[Any]) -> None:
        self._checks_running -= 1
        entry = self._lookups.get(uid)
        if entry is not None and entry[0] is lookup:
            del self._lookups[uid]

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a daemon thread of its own; its result or exception here."""
        loop = self._loop()
        done: asyncio.Future[Any] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if done.done():  # the connection's task was cancelled: the server stopped
                return
            if error is None:
                done.set_result(result)
            else:
                done.set_exception(error)

        def run() -> None:
            try:
                outcome: tuple[Any, BaseException | None] = (fn(*args), None)
            except BaseException as exc:  # handed to the awaiting task, which answers
                outcome = (None, exc)
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(settle, *outcome)

        threading.Thread(target=run, name="gpuwatchd-control-op", daemon=True).start()
        return await done

    async def _answer(self, conn: socket.socket, deadline: float, peer: PeerCred) -> dict[str, Any]:
        try:
            request = decode_request(await self._read_line(conn, deadline))
            log.debug("control socket: %s from uid %d (pid %d)", request, peer.uid, peer.pid)
            answer: dict[str, Any] = await self._off_loop(self.handler, request, peer)
            return answer
        except RequestError as exc:
            return error_answer(str(exc))
        except _ClientGone:
            raise
        except Exception as exc:  # a handler bug must not kill the channel
            log.exception("control socket: request handler failed")
            return error_answer(f"internal error: {type(exc).__name__}: {exc}")

    async def _read_line(self, conn: socket.socket, deadline: float) -> bytes:
        """One request line (or everything up to EOF), within the deadline and size cap."""
        loop = self._loop()
        buf = bytearray()
        while True:
            nl = buf.find(b"\n")
            if nl > MAX_LINE or (nl < 0 and len(buf) > MAX_LINE):
                raise RequestError(f"request line longer than {MAX_LINE} bytes")
            if nl >= 0:
                return bytes(buf[:nl])
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise RequestError(f"no complete request line within {self.client_timeout_s:g} s")
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(conn, 65536), remaining)
            except TimeoutError:
                continue  # the deadline check above answers
            except OSError:
                raise _ClientGone from None
            if not chunk:
                if buf:
                    return bytes(buf)
                raise _ClientGone
            buf += chunk

    async def _reply(self, conn: socket.socket, response: dict[str, Any]) -> None:
        """Write the answer; sent at once in the common case, so the client's slot is free
        before its next connection can be accepted (a wait here would hold it longer)."""
        data = _encode(response)
        try:
            sent = conn.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            log.debug("control socket: could not answer a client: %s", exc)
            return
        if sent == len(data):
            return
        try:
            await asyncio.wait_for(
                self._loop().sock_sendall(conn, data[sent:]), self.client_timeout_s
            )
        except (OSError, TimeoutError) as exc:
            log.debug("control socket: could not answer a client: %s", exc)


class _TurnedAway:
    """Counts connections turned away busy and logs them without flooding the log: the
    first of a burst at once, then every :data:`TURNED_AWAY_LOG_S` how many more (on the
    loop's thread only, timed by the loop's monotonic clock)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.total = 0
        self._unlogged = 0
        self._timer: asyncio.TimerHandle | None = None

    def note(self, why: str, uid: int) -> None:
        self.total += 1
        if self._timer is not None:  # within a burst already logged: count it
            self._unlogged += 1
            return
        log.warning(
            "control socket: %s, turning uid %d away (busy); more are counted, logged at most"
            " every %g s",
            why,
            uid,
            TURNED_AWAY_LOG_S,
        )
        self._timer = self._loop.call_later(TURNED_AWAY_LOG_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self._unlogged:  # the burst goes on: log its count, and keep counting
            self._log_count()
            self._timer = self._loop.call_later(TURNED_AWAY_LOG_S, self._tick)

    def close(self) -> None:
        """Log the count not yet logged; the server stops."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._log_count()

    def _log_count(self) -> None:
        if self._unlogged:
            log.warning(
                "control socket: turned away %d more connections (busy) since the last line",
                self._unlogged,
            )
            self._unlogged = 0


def _encode(response: dict[str, Any]) -> bytes:
    return (json.dumps(response, separators=(",", ":")) + "\n").encode()


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)
