"""``remote_tier_id`` (issue 29): what ``/kv_event_sources`` tells a router about an engine's
shared tier. Equal ids must mean the same blocks: the id comes from the parsed URL (scheme,
hosts, port and db with their defaults, namespace), never from its spelling or credentials."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.serving.server import remote_tier_id
from kvoffload.tiers.redis.url import parse_redis_url


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("redis://h", "redis://h:6379/0"),
        ("redis://H:6379", "redis://h/0"),
        ("redis://:pw@h/0", "redis://user:other@h:6379"),
        ("redis+cluster://a:7000,b:7001", "redis+cluster://b:7001,a:7000"),
        ("redis://h/0?namespace=x", "redis://h:6379?namespace=x"),
        ("rediss://h/0?ssl_cert_reqs=none", "rediss://h:6379"),
    ],
)
def test_spellings_of_one_tier_share_an_id(a: str, b: str) -> None:
    assert remote_tier_id(a) == remote_tier_id(b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("redis://h", "redis://h?namespace=run1"),  # before: the same id, no block shared
        ("redis://h?namespace=run1", "redis://h?namespace=run2"),
        ("redis://h", "redis://h/1"),
        ("redis://h", "rediss://h"),
        ("redis://h", "redis://h:6380"),
        ("redis://h:7000", "redis+cluster://h:7000"),
    ],
)
def test_different_tiers_have_different_ids(a: str, b: str) -> None:
    assert remote_tier_id(a) != remote_tier_id(b)


def test_no_url_no_id_and_a_bad_one_is_redacted() -> None:
    assert remote_tier_id(None) is None
    assert remote_tier_id("") is None
    shown = remote_tier_id("redis://:s3cret@h:99999")
    assert shown is not None and "s3cret" not in shown


_hosts = st.sampled_from(["h", "H", "10.0.0.1", "cache.example"])
_ports = st.sampled_from([None, 6379, 6380])
_dbs = st.sampled_from([None, 0, 2])
_namespaces = st.sampled_from([None, "a", "b"])
_passwords = st.sampled_from([None, "pw1", "pw2"])


def _url(host: str, port: int | None, db: int | None, ns: str | None, pw: str | None) -> str:
    auth = f":{pw}@" if pw else ""
    where = f"{host}:{port}" if port else host
    path = f"/{db}" if db is not None else ""
    query = f"?namespace={ns}" if ns else ""
    return f"redis://{auth}{where}{path}{query}"


@given(
    st.tuples(_hosts, _ports, _dbs, _namespaces, _passwords),
    st.tuples(_hosts, _ports, _dbs, _namespaces, _passwords),
)
def test_ids_are_equal_exactly_when_the_tiers_are(a: tuple, b: tuple) -> None:
    """Equal ids <=> same host (any case), port, db and namespace; the password is never in it."""
    url_a, url_b = _url(*a), _url(*b)

    def tier(url: str) -> tuple:
        p = parse_redis_url(url, env={})
        return (p.nodes[0][0].lower(), p.nodes[0][1], p.db, p.namespace)

    assert (remote_tier_id(url_a) == remote_tier_id(url_b)) == (tier(url_a) == tier(url_b))
    for url, (*_, pw) in ((url_a, a), (url_b, b)):
        if pw:
            assert pw not in (remote_tier_id(url) or "")
