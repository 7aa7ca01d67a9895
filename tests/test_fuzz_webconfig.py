"""Fuzzing the web config (exporter-toolkit YAML): any text is a document or one line of
"invalid YAML", and any document is a config or one ValueError line naming the key."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatchd.serve.web import config as web
from gpuwatchd.serve.web.config import parse_go_duration, parse_web_config
from gpuwatchd.serve.web.strict_yaml import load_strict

#: Bounded, and the same examples every run (CI stays green and fast); a failure prints
#: the example to keep as a plain test.
FUZZ = settings(
    max_examples=100,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
HASH = "$2y$10$" + "a" * 53

#: Plain YAML scalars stay text with the strict loader; a document also holds lists,
#: mappings and nulls (and, written as such, other values).
scalars = (
    st.none()
    | st.sampled_from(["", "yes", "off", "0", "1s", "1m30s", "-1", "TLS12", "TLS13", HASH,
                       "RequireAndVerifyClientCert", "NoClientCert", "RequestClientCert",
                       "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256", "X25519", "server.crt",
                       "1e400h", "9" * 40 + "h", "9" * 400 + "h", "2562047h47m16.854775807s",
                       ".5ms", "DENY", "nosniff"])
    | st.text(max_size=20)
    | st.integers(-5, 10**20)
    | st.booleans()
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)


def section(keys: tuple[str, ...]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(keys) | st.text(max_size=6), values, max_size=len(keys))


documents = (
    st.none()
    | values
    | st.fixed_dictionaries(
        {},
        optional={
            "tls_server_config": section(web._TLS_KEYS),
            "http_server_config": section(web._HTTP_KEYS)
            | st.fixed_dictionaries(
                {"headers": st.dictionaries(st.sampled_from(sorted(web._HEADERS)), values)}
            ),
            "basic_auth_users": st.dictionaries(
                st.text(max_size=8), st.sampled_from([HASH]) | values, max_size=2
            ),
            "rate_limit": section(web._RATE_KEYS),
        },
    )
)


def _one_line(exc: Exception) -> None:
    assert str(exc) and "\n" not in str(exc), str(exc)


@FUZZ
@given(documents)
def test_any_document_is_a_config_or_one_line(doc: Any) -> None:
    try:
        config = parse_web_config(doc, Path("/etc/gpuwatchd"))
    except ValueError as exc:
        _one_line(exc)
        return
    if config.rate_limit is not None:
        assert math.isfinite(config.rate_limit.interval_s) and config.rate_limit.interval_s > 0
        assert config.rate_limit.burst >= 0
    for user, hashed in config.basic_auth_users.items():
        assert isinstance(user, str) and ":" not in user and web._BCRYPT_HASH.fullmatch(hashed)


yaml_text = st.text(max_size=200) | st.lists(
    st.sampled_from(
        ["tls_server_config:", "  cert_file: a", "  cert_file: b", "basic_auth_users:",
         "  u: x", "- a", "&a [1]", "*a", "<<: *a", "? [1]", ": x", "!!python/object:os.system",
         "'", '"\\x"', "\t", "key: {a: 1, a: 2}", "%YAML 1.1", "---", "..."]
    ),
    max_size=8,
).map("\n".join)  # fmt: skip


@FUZZ
@given(yaml_text)
def test_any_text_is_a_document_or_one_line(text: str) -> None:
    try:
        doc = load_strict(text)
    except ValueError as exc:
        _one_line(exc)
        assert str(exc).startswith("invalid YAML")
        return
    try:
        parse_web_config(doc, Path("/etc/gpuwatchd"))
    except ValueError as exc:
        _one_line(exc)


@FUZZ
@given(
    st.lists(
        st.tuples(st.integers(0, 10**5), st.sampled_from(sorted(web._GO_DURATION_UNITS))),
        min_size=1,
        max_size=4,
    )
)
def test_a_go_duration_is_the_sum_of_its_parts(parts: list[tuple[int, str]]) -> None:
    text = "".join(f"{n}{unit}" for n, unit in parts)
    expected = sum(n * web._GO_DURATION_UNITS[unit] for n, unit in parts)
    assert math.isclose(parse_go_duration(text, "d"), expected, rel_tol=1e-9, abs_tol=1e-12)


def test_a_duration_past_gos_longest_is_refused_not_infinite() -> None:
    """Found by this fuzzer: ``interval: 999...9h`` (400 digits) was an infinite interval."""
    with pytest.raises(ValueError, match="longer than Go's longest duration"):
        parse_web_config({"rate_limit": {"interval": "9" * 400 + "h"}}, Path("/"))
    assert parse_go_duration("2562047h47m16.854775807s", "d") > 9.2e9


@pytest.mark.parametrize(
    "doc",
    [
        {"tls\nserver_config": {}},
        {"tls_server_config": {"cert\nfile": "a"}},
        {"basic_auth_users": {"a\nb": "not a hash"}},
        {"http_server_config": {"headers": {"X-\nA": "1"}}},
    ],
)
def test_a_key_holding_a_newline_is_named_on_one_line(doc: dict[str, Any]) -> None:
    """Found by this fuzzer: an unknown key with a newline split the error in two."""
    with pytest.raises(ValueError) as caught:
        parse_web_config(doc, Path("/"))
    _one_line(caught.value)
