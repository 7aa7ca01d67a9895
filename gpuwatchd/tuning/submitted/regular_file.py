"""Read a file someone else may have planted: a regular file only, never blocking, capped.

A FIFO named ``x.json`` would block an ordinary ``open`` until a writer comes, a device
could be read forever, a directory fails late and a symlink may point anywhere. This
opens with ``O_NONBLOCK`` (and ``O_NOFOLLOW`` unless told to follow links), relative to
a held directory descriptor when given one, checks ``fstat`` of what was opened says a
regular file within the cap, and reads at most ``max_bytes + 1`` bytes, so a file being
appended to while read is still refused as too large.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from gpuwatchd.validate import one_line

#: The largest workloads file read (a capture of a big model is tens of kilobytes).
MAX_FILE_BYTES = 4 * 2**20


class NotReadable(ValueError):
    """The file is not a readable regular file within the size cap: ``path: reason``."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.reason = reason


def read_regular_file(
    path: str | os.PathLike[str], max_bytes: int, *, follow_symlinks: bool = True
) -> bytes:
    """The whole content of ``path``; :class:`NotReadable` for anything but a regular file
    of at most ``max_bytes`` bytes (FileNotFoundError passes through: gone is not bad)."""
    return read_regular(path, max_bytes, follow_symlinks=follow_symlinks)[0]


def read_regular(
    path: str | os.PathLike[str],
    max_bytes: int,
    *,
    follow_symlinks: bool = True,
    dir_fd: int | None = None,
) -> tuple[bytes, os.stat_result]:
    """:func:`read_regular_file`, and the ``fstat`` of the file the bytes came from.

    ``dir_fd``: ``path`` is a name relative to that held directory descriptor.
    """
    p = Path(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(p, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:
            raise NotReadable(p, "a symbolic link, not a regular file") from None
        raise NotReadable(p, f"cannot read: {e.strerror or one_line(e)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotReadable(p, f"{_kind(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            raise NotReadable(p, f"larger than {max_bytes} bytes")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise NotReadable(p, f"cannot read: {e.strerror or one_line(e)}") from None
    finally:
        os.close(fd)
    if size > max_bytes:
        raise NotReadable(p, f"larger than {max_bytes} bytes")
    return b"".join(chunks), st


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "a special file"
