"""Fuzzing the HTTP request line and headers: any bytes are a request head or one
:class:`HttpError` (a 4xx/5xx answer), however they are split across reads; a well-formed
request reads back as it was written; a route is never reached through an encoded ``/``."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatchd.serve.http_wire import (
    KNOWN_METHODS,
    MAX_HEAD,
    HeadScanner,
    HttpError,
    RequestHead,
    parse_head,
)
from gpuwatchd.serve.routes import request_path

#: Bounded, and the same examples every run (CI stays green and fast); a failure prints
#: the example to keep as a plain test.
FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)

TOKEN = st.text(
    "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    min_size=1,
    max_size=12,
)
FIELD_VALUE = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E) | st.just(" "), max_size=20
).map(str.strip)
SEGMENT = st.lists(
    st.sampled_from(["a", "metrics", "api", "v1", "%2f", "%2F", "%41", "%", "%zz", ".", ":@~"]),
    max_size=3,
).map("".join)
PATH = st.lists(SEGMENT, max_size=4).map(lambda p: "/" + "/".join(p))
PIECES = [
    b"GET", b"HEAD", b"POST", b"/", b"/metrics", b" ", b"HTTP/1.1", b"HTTP/1.0", b"\r\n",
    b"\n", b"\r", b":", b"Host: x", b"Content-Length: ", b"Transfer-Encoding: ", b"chunked",
    b"xchunked", b"5", b"Connection: close", b"\t", b"\x00", b"%2f", b"\xff",
    b"Expect: 100-continue",
]  # fmt: skip


def _head_or_error(data: bytes) -> RequestHead | HttpError:
    try:
        return parse_head(data)
    except HttpError as exc:
        assert 400 <= exc.status < 600 and exc.message and "\n" not in exc.message
        return exc


def _scan(chunks: list[bytes]) -> int | HttpError | None:
    """Where the head ends, fed ``chunks`` one read at a time."""
    scanner, buf = HeadScanner(), bytearray()
    try:
        for chunk in chunks:
            buf += chunk
            end = scanner.end(buf)
            if end is not None:
                return end
    except HttpError as exc:
        return exc
    return None


raw_requests = st.binary(max_size=300) | st.lists(st.sampled_from(PIECES), max_size=25).map(
    b"".join
)


@FUZZ
@given(raw_requests)
def test_any_bytes_are_a_head_or_one_http_error(data: bytes) -> None:
    head = _head_or_error(data)
    if isinstance(head, RequestHead):
        assert head.method in KNOWN_METHODS and head.version[0] == 1
        assert head.body_length >= 0 and all(name == name.lower() for name, _ in head.headers)
        assert all(line.endswith(b"\r") for line in data.split(b"\n")[:-1]), "a bare LF"
        codings = [v for k, v in head.headers if k == "transfer-encoding"]
        assert codings in ([], ["chunked"]) or codings[0].lower() == "chunked", codings


@FUZZ
@given(raw_requests, st.lists(st.integers(1, 40), max_size=20))
def test_the_head_ends_in_the_same_place_however_it_is_split(data: bytes, cuts: list[int]) -> None:
    chunks, pos = [], 0
    for size in cuts:
        chunks.append(data[pos : pos + size])
        pos += size
    chunks.append(data[pos:])
    whole, split = _scan([data]), _scan(chunks)
    if isinstance(whole, HttpError):
        assert isinstance(split, HttpError) and split.status == whole.status
    else:
        assert split == whole


@FUZZ
@given(
    st.sampled_from(sorted(KNOWN_METHODS - {"CONNECT", "OPTIONS"})),
    PATH,
    st.sampled_from([(1, 0), (1, 1)]),
    st.lists(st.tuples(TOKEN, FIELD_VALUE), max_size=6),
)
def test_a_well_formed_request_reads_back_as_written(
    method: str, path: str, version: tuple[int, int], headers: list[tuple[str, str]]
) -> None:
    headers = [
        (k, v)
        for k, v in headers
        if k.lower() not in ("host", "content-length", "transfer-encoding", "expect")
    ]
    lines = [f"{method} {path} HTTP/{version[0]}.{version[1]}", "Host: x"]
    lines += [f"{k}: {v}" for k, v in headers]
    data = ("\r\n".join(lines) + "\r\n\r\n").encode()
    assert _scan([data]) == len(data) or len(data) > MAX_HEAD
    head = parse_head(data)
    assert (head.method, head.target, head.version) == (method, path, version)
    assert head.headers == (("host", "x"), *((k.lower(), v) for k, v in headers))
    assert head.body_length == 0


@FUZZ
@given(PATH, st.sampled_from(["", "?a=%2f", "#x"]))
def test_an_encoded_slash_never_separates_a_route(path: str, tail: str) -> None:
    routed = request_path(path + tail)
    if "%2f" in path.lower():
        assert routed == ""
    else:
        assert routed.count("/") == path.count("/")
